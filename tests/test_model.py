"""The reference model on one device: shapes, tied weights, RoPE, the recurrent block's convolution and scan,
per-document isolation and the schedule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_cp.core.sharding import shard_replica_batch
from lightning_cp.core.step import ContextParallelStep, activated, contiguous_packed_seq_params
from lightning_cp.lightning.module import warmup_cosine
from lightning_cp.train.data import collate_packed, pack_documents
from lightning_cp.train.models import LlamaConfig, LlamaDecoder, LlamaLM
from lightning_cp.train.models.layers import apply_rotary, gated_scan, rotary_cos_sin
from tests.distributed_harness import run_on_ranks
from tests.model_helpers import linear_scan

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48}


def _model(**overrides) -> LlamaLM:
    torch.manual_seed(0)
    return LlamaLM(**{**TINY, **overrides}).double()


def test_forward_shapes_and_tied_or_untied_embeddings() -> None:
    model = _model()
    logits = model(torch.randint(0, 257, (2, 10)), torch.arange(10).expand(2, 10))
    assert logits.shape == (2, 10, 257)
    assert model.model.lm_head.weight is model.model.embed_tokens.weight
    untied = _model(tie_embeddings=False)
    assert untied.model.lm_head.weight is not untied.model.embed_tokens.weight
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in model.parameters()) + 257 * 32


def test_rotary_scores_depend_only_on_the_position_difference() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(i: int, j: int) -> float:
        cos_i, sin_i = rotary_cos_sin(torch.tensor([[i]]), 8, 10000.0, torch.float64)
        cos_j, sin_j = rotary_cos_sin(torch.tensor([[j]]), 8, 10000.0, torch.float64)
        return float((apply_rotary(q, cos_i, sin_i) * apply_rotary(k, cos_j, sin_j)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-6)
    cos, sin = rotary_cos_sin(torch.tensor([[5]]), 8, 10000.0, torch.float64)
    assert torch.linalg.norm(apply_rotary(q, cos, sin)) == pytest.approx(float(torch.linalg.norm(q)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_angles_of_far_positions_survive_half_precision(dtype: torch.dtype) -> None:
    """Far positions in a half precision: cos/sin are float32 values rounded once, not taken at a rounded position
    (bf16 holds 40001 as 39936; fp16 has no 65535)."""
    positions = torch.tensor([[1001, 40001, 65535]])
    cos, sin = rotary_cos_sin(positions, 64, 10000.0, dtype)
    exact_cos, exact_sin = rotary_cos_sin(positions, 64, 10000.0, torch.float64)
    assert cos.dtype == sin.dtype == dtype
    # one rounding to ``dtype`` (at most half its eps) after float32 angles (at most half an ulp of the largest)
    rounding = torch.finfo(dtype).eps / 2 + float(positions.max()) * 2.0**-24
    assert (cos.double() - exact_cos).abs().max() <= rounding
    assert (sin.double() - exact_sin).abs().max() <= rounding


@pytest.mark.parametrize(
    "layer_types",
    [None, ["recurrent", "attention"], ["convolution", "attention"], ["mamba", "attention"]],
    ids=["attention", "hybrid", "conv", "mamba"],
)
def test_packed_documents_do_not_see_each_other(layer_types: list[str] | None) -> None:
    model = _model(layer_types=layer_types)
    first, second = list(range(40, 53)), list(range(60, 69))
    packed = collate_packed(pack_documents([first, second], budget=32))
    assert packed["cu_seqlens"].tolist() == [0, 13, 22]
    loss_packed = model._loss(dict(packed))[0].mean
    losses = [model._loss({"input_ids": torch.tensor([doc])})[0] for doc in (first, second)]
    expected = (losses[0].mean * 12 + losses[1].mean * 8) / 20
    assert float(loss_packed) == pytest.approx(float(expected), rel=1e-12)
    alone = model(torch.tensor([second]), torch.arange(9).unsqueeze(0))
    sharded = shard_replica_batch(packed)
    assert sharded.position_ids.tolist() == [list(range(13)) + list(range(9))]
    step = ContextParallelStep(
        contiguous_packed_seq_params=contiguous_packed_seq_params(sharded), stream_length=sharded.padded_sequence_length
    )
    with activated(step):
        together = model(sharded.input_ids, sharded.position_ids)
    torch.testing.assert_close(together[:, 13:], alone, rtol=1e-12, atol=1e-12)


DOCUMENT_LENGTHS = (5, 17, 2, 1, 9, 14)


def _documents(generator: torch.Generator, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Values ``[1, 48, 3]`` and decays of packed documents, their positions and where each starts."""
    values = torch.randn(1, sum(DOCUMENT_LENGTHS), 3, generator=generator, dtype=dtype)
    log_decays = -torch.rand(1, sum(DOCUMENT_LENGTHS), 3, generator=generator, dtype=dtype)
    positions = torch.cat([torch.arange(length) for length in DOCUMENT_LENGTHS]).unsqueeze(0)
    return values, log_decays, positions, positions == 0


@pytest.mark.parametrize("chunk", [4, 5, 64])
def test_the_chunked_scan_equals_a_step_by_step_scan_per_document(chunk: int) -> None:
    """Documents start at chunk boundaries and inside chunks (starts 0, 5, 22, 24, 25, 34); each restarts from zero."""
    values, log_decays, _, starts = _documents(torch.Generator().manual_seed(0))
    pieces = zip(values.split(DOCUMENT_LENGTHS, 1), log_decays.exp().split(DOCUMENT_LENGTHS, 1), strict=True)
    expected = torch.cat([linear_scan(x, a) for x, a in pieces], 1)
    assert (gated_scan(values, log_decays, starts, chunk=chunk) - expected).abs().max() <= 1e-12


def test_the_chunked_scan_keeps_finite_gradients_for_extreme_decays() -> None:
    """Decays of exp(-100) and of almost 1 in float32: outputs and gradients finite (masked before the exponential)."""
    values, _, _, starts = _documents(torch.Generator().manual_seed(1), torch.float32)
    log_decays = torch.where(torch.arange(values.shape[1]) % 2 == 0, -100.0, -1e-6).view(1, -1, 1).expand_as(values)
    values, log_decays = values.requires_grad_(), log_decays.clone().requires_grad_()
    states = gated_scan(values, log_decays, starts, chunk=16)
    states.sum().backward()
    assert all(bool(tensor.isfinite().all()) for tensor in (states, values.grad, log_decays.grad))


def test_grouped_query_attention_matches_repeated_key_value_heads() -> None:
    grouped = _model(num_kv_heads=2)
    full = _model(num_kv_heads=4)
    with torch.no_grad():
        for g_layer, f_layer in zip(grouped.model.layers, full.model.layers, strict=True):
            for name in ("k_proj", "v_proj"):
                weight = getattr(g_layer.attention, name).weight.view(2, 8, 32)
                getattr(f_layer.attention, name).weight.copy_(weight.repeat_interleave(2, dim=0).reshape(32, 32))
        full_state = {k: v for k, v in grouped.state_dict().items() if "k_proj" not in k and "v_proj" not in k}
        full.load_state_dict(full_state, strict=False)
    ids, pos = torch.randint(0, 257, (1, 12)), torch.arange(12).unsqueeze(0)
    torch.testing.assert_close(grouped(ids, pos), full(ids, pos), rtol=1e-12, atol=1e-12)


def test_bad_head_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_heads .4. and num_heads by num_kv_heads .3."):
        LlamaDecoder(LlamaConfig(hidden_size=32, num_heads=4, num_kv_heads=3))


@pytest.mark.parametrize(
    "layer_types",
    [None, ["recurrent", "attention"], ["convolution", "attention"], ["mamba", "attention"]],
    ids=["attention", "hybrid", "conv", "mamba"],
)
def test_activation_checkpointing_gives_the_same_gradients(layer_types: list[str] | None) -> None:
    plain = _model(layer_types=layer_types)
    checkpointed = _model(activation_checkpointing=True, layer_types=layer_types)
    batch = collate_packed(pack_documents([list(range(30, 50)), list(range(70, 80))], budget=64))
    grads = []
    for model, runs_per_layer in ((plain, 1), (checkpointed, 2)):
        calls: list[int] = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1), with_kwargs=True)
        model._loss(dict(batch))[0].loss.backward()
        assert len(calls) == runs_per_layer * len(model.model.layers), "checkpointed layers recompute in backward"
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_warmup_cosine_schedule() -> None:
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 10, 100, 0.1) == pytest.approx(0.1)


def _tensor_parallel_model(layer_types: list[str]) -> str:
    """Apply the module's tensor-parallel plan over 2 ranks; return the error it raised, if any."""
    from lightning_cp.core.comm import init_device_mesh
    from lightning_cp.core.mesh import TENSOR_PARALLEL

    module = LlamaLM(**{**TINY, "layer_types": layer_types})
    module._device_mesh = init_device_mesh("cpu", (2,), (TENSOR_PARALLEL,))
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(sequence_parallel=False))  # what the hook reads
    try:
        module.configure_model()
    except ValueError as error:
        return str(error)
    return "sharded" if isinstance(module.model.layers[0].mlp.up_proj.weight, DTensor) else "not sharded"


def test_tensor_parallelism_refuses_recurrent_layers_and_shards_attention_ones() -> None:
    """Outside the CLI too (before, an AttributeError looking for the first layer's attention)."""
    for outcome in run_on_ranks(_tensor_parallel_model, 2, ["recurrent", "attention"]):
        assert "tensor parallelism has a plan for attention layers only" in outcome
    for outcome in run_on_ranks(_tensor_parallel_model, 2, ["convolution", "mamba"]):
        assert "with convolution and mamba layers in model.layer_types" in outcome
    assert run_on_ranks(_tensor_parallel_model, 2, ["attention", "attention"]) == ["sharded", "sharded"]
