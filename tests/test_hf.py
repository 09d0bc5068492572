"""Unmodified Hugging Face causal LMs under ``cp_zigzag`` through ``HFCausalLM``, against the unmodified model on one
device with Hugging Face's own attention, document by document (float64, relative 1e-9)."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader

from lightning_cp import ContextParallelLayoutCallback, CPZigzagStrategy
from lightning_cp.core.step import ContextParallelStep, activated
from lightning_cp.hf import HFCausalLM
from lightning_cp.lightning.hf import (
    _DELTA_RULE_ROUTES,
    _MAMBA2_ROUTES,
    _ROUTED_MIXERS,
    _no_mask,
    _RoutedUnderCP,
    _row_order_problems,
)
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.model_helpers import ATTENTION, POLICY, TRAINER_OPTIONS, TinyTransformer, packed_batches

# Forked ranks must not inherit a started OpenMP pool, so this process computes single-threaded.
torch.set_num_threads(1)

STEPS = 3
LEARNING_RATE = 0.1
VOCAB = 64
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
          "mamba_chunk_size": 4, "mamba_expand": 2}  # fmt: skip
MAMBA = {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4}
MAMBA_ONLY = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "conv_kernel": 4,
              "expand": 2, "time_step_rank": 4}  # fmt: skip
MLA = {"moe_intermediate_size": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "qk_nope_head_dim": 4,
       "num_experts_per_tok": 1, "num_local_experts": 2, "experts_implementation": "eager"}  # fmt: skip
"""Kimi Linear's and Bailing's latent attention and experts, small."""
GATED_DELTA_NET = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # fmt: skip
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "lfm2": lambda: transformers.Lfm2Config(
        **SMALL, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False
    ),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        **SMALL, layer_types=["full_attention", "conv"], num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        num_dense_layers=1, experts_implementation="eager",  # torch's grouped matmul takes no float64
    ),
    "lfm3": lambda: transformers.Lfm3Config(
        **SMALL, layer_types=["conv", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2
    ),
    "bamba": lambda: transformers.BambaConfig(**SMALL, **MAMBA2, attn_layer_indices=[1]),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **SMALL, **MAMBA2, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
        shared_intermediate_size=16, experts_implementation="eager",
    ),
    "falcon_h1": lambda: transformers.FalconH1Config(
        **SMALL, **MAMBA2, head_dim=8, mamba_d_ssm=64, mamba_rms_norm=True
    ),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **{**SMALL, "num_hidden_layers": 3}, hybrid_override_pattern="M*-", head_dim=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4, expand=2,
    ),
    "zamba2": lambda: transformers.Zamba2Config(
        **{**SMALL, "intermediate_size": None}, layers_block_type=["linear_attention", "hybrid"], n_mamba_heads=4,
        mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, chunk_size=4, mamba_expand=2, pad_token_id=0,
    ),
    "jamba": lambda: transformers.JambaConfig(
        **SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, **MAMBA, experts_implementation="eager",
    ),
    "mamba": lambda: transformers.MambaConfig(**MAMBA_ONLY),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(**MAMBA_ONLY),
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=2, state_size=8,
        conv_kernel=4, chunk_size=4, expand=2,
    ),
    "lara_mini": lambda: transformers.LaraMiniConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, **GATED_DELTA_NET, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        experts_implementation="eager", eos_token_id=2,
    ),
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **{**SMALL, "num_key_value_heads": 4}, **MLA, layer_types=["linear_attention", "full_attention"],
        linear_head_dim=8, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "bailing_hybrid": lambda: transformers.BailingHybridConfig(
        **{**SMALL, "num_key_value_heads": 4}, **MLA, head_dim=8, layer_types=["linear_attention", "full_attention"],
        first_k_dense_replace=0, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, **GATED_DELTA_NET
    ),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, **GATED_DELTA_NET, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        experts_implementation="eager",
    ),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, **GATED_DELTA_NET, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        experts_implementation="eager",
    ),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], **GATED_DELTA_NET, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
ATTENTION_FREE = frozenset({"mamba", "falcon_mamba", "mamba2"})
"""Families without attention layers, which take no attention implementation."""
TOLERANCES = dict.fromkeys(
    (
        "bamba",
        "granitemoehybrid",
        "falcon_h1",
        "nemotron_h",
        "zamba2",
        "jamba",
        "mamba",
        "falcon_mamba",
        "mamba2",
        "lara_mini",
        "kimi_linear",
        "bailing_hybrid",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "olmo_hybrid",
    ),
    1e-6,
)
"""Relative tolerances where the unmodified model is not float64 throughout: Hugging Face's Mamba and Mamba2 scans and
gated delta rule compute in float32 even in a float64 model (Nemotron-H also makes its logits in float32); the
library's compute in the inputs' float64 and are checked against token-by-token runs to 1e-12 in
``test_selective_scan.py``, ``test_ssd_scan.py`` and ``test_gated_delta_rule.py``."""


def tiny_model(family: str, attention: str = "sdpa", lora: bool = False) -> transformers.PreTrainedModel:
    """A float64 model of ``family`` with seeded weights (the same weights for every call); ``lora``: wrapped by PEFT
    with LoRA adapters on q and v (only they train)."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    if family not in ATTENTION_FREE:
        config._attn_implementation = attention
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    for module in model.modules():  # decays near 1 (Mamba, Mamba2, delta rules): states carry across documents, shards
        if hasattr(module, "A_log"):
            module.A_log.data.uniform_(-4.0, -2.0)
        if hasattr(module, "dt_bias"):
            module.dt_bias.data.fill_(-1.0)
    if lora:
        adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        model = get_peft_model(model, adapters).double()
    return model


ROUTES = {"bamba": _MAMBA2_ROUTES, "qwen3_5": _DELTA_RULE_ROUTES, "jamba": _ROUTED_MIXERS["JambaMambaMixer"],
          "mamba": _ROUTED_MIXERS["MambaMixer"], "kimi_linear": _ROUTED_MIXERS["KimiLinearDeltaAttention"]}  # fmt: skip


class SGDCausalLM(HFCausalLM):
    """``HFCausalLM`` with plain SGD, so the reference is a few lines."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)


def _documents(count: int, seed: int) -> list[list[list[int]]]:
    """``count`` batches of documents with lengths 1 to 13 (most not multiples of 2 x cp)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, 14, (4,), generator=generator).tolist()
        batches.append([torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths])
    return batches


def make_batches(kind: str, count: int = STEPS) -> tuple[list[dict[str, torch.Tensor]], list[list[list[int]]]]:
    """Replica batches of ``kind`` (packed, flattening, dense) and the documents each holds."""
    if kind == "dense":
        generator = torch.Generator().manual_seed(7)
        rows = [torch.randint(0, VOCAB, (2, 11), generator=generator) for _ in range(count)]
        return [{"input_ids": row} for row in rows], [row.tolist() for row in rows]
    documents = _documents(count, seed=3)
    if kind == "flattening":
        collator = transformers.DataCollatorWithFlattening(return_tensors="pt")
        return [collator([{"input_ids": doc} for doc in docs]) for docs in documents], documents
    batches = []
    for docs in documents:
        offsets = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
        batches.append({"input_ids": torch.tensor([sum(docs, [])]), "cu_seqlens": offsets})
    return batches, documents


def reference_losses(
    family: str, documents: list[list[list[int]]], lora: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unmodified model, HF's own attention, each document on its own; SGD on the batch's mean token loss."""
    model = tiny_model(family, lora=lora)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for docs in documents:
        total = sum(len(doc) - 1 for doc in docs)
        summed = sum(
            F.cross_entropy(model(torch.tensor([doc])).logits[0, :-1], torch.tensor(doc[1:]), reduction="sum")
            for doc in docs
            if len(doc) > 1
        )
        loss = summed / total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


class _Recorder(pl.Callback):
    """Each step's logged loss and the number of graphs dynamo has compiled since the recorder was made."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[int] = []
        self._graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # a forked rank inherits them

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - self._graphs_before)


def _fit(
    family: str,
    kind: str,
    world: int,
    strategy: dict[str, Any],
    checkpointing: bool,
    loss_chunk_tokens: int = 0,
    compiled: str = "",
    lora: bool = False,
    adapter_folder: str = "",
) -> dict[str, Any]:
    """Rank body: train ``STEPS`` steps of the unmodified model under ``cp_zigzag``; return losses and weights.
    ``compiled``: what is compiled in place (inductor): the ``model``, its ``decoder`` (``base_model``) or the
    LightningModule (``module``); the warnings of the fit are returned too. ``lora``: the model with PEFT's LoRA, whose
    adapters global rank 0 saves to ``adapter_folder`` from the gathered state (PEFT cannot read sharded weights)."""
    os.environ["WORLD_SIZE"] = str(world)
    batches, _ = make_batches(kind)
    module = SGDCausalLM(
        tiny_model(family, lora=lora), gradient_checkpointing=checkpointing, loss_chunk_tokens=loss_chunk_tokens
    )
    if compiled:
        {"model": module.model, "decoder": module.model.base_model, "module": module}[compiled].compile()
    head_tokens: list[int] = []  # tokens per call of the output projection (the probe's included)
    if loss_chunk_tokens:  # only then: traced in a compiled model, the hook would recompile it at every call
        module.model.get_output_embeddings().register_forward_hook(
            lambda head, args, output: head_tokens.append(args[0].shape[:-1].numel())
        )
    recorder = _Recorder()
    trainer = pl.Trainer(
        devices=world,
        strategy=CPZigzagStrategy(**strategy),
        max_steps=STEPS,
        callbacks=[recorder],
        use_distributed_sampler=False,
        **TRAINER_OPTIONS,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(batches, batch_size=None))
    state = trainer.strategy.lightning_module_state_dict()  # the whole state on global rank 0, empty elsewhere
    if adapter_folder and state:
        module.model.save_pretrained(adapter_folder, state_dict={k.removeprefix("model."): v for k, v in state.items()})
    weights = {k: v.numpy().copy() for k, v in state.items() if "model." in k}
    return {
        "losses": recorder.losses,
        "weights": weights,
        "head_tokens": head_tokens,
        "graphs": recorder.graphs,
        "warnings": [str(warning.message) for warning in caught],
    }


FSDP = {"data_parallel": "fsdp"}
RUNS = [
    ("llama", "packed", 2, {}, False),
    ("llama", "flattening", 2, {"attention_mode": "ring"}, True),
    ("llama", "dense", 2, {}, False),
    ("llama", "packed", 1, {}, False),
    ("qwen2", "packed", 2, {"attention_mode": "ring"}, False),
    ("qwen3", "flattening", 2, {}, True),
    ("mistral", "packed", 2, {}, False),
    ("qwen3", "packed", 4, {"attention_mode": "ring"}, False),
    ("qwen3", "dense", 2, {"attention_mode": "ring"}, False),
    ("llama", "packed", 4, {}, False),
    ("qwen2", "flattening", 4, {}, True),
    ("mistral", "packed", 4, {"attention_mode": "ring"}, False),
    ("llama", "flattening", 4, {"attention_mode": "ulysses"}, False),
    ("qwen2", "packed", 2, {"data_parallel": "fsdp"}, True),
    ("llama", "packed", 4, {"data_parallel": "fsdp", "context_parallel_size": 2, "attention_mode": "ring"}, False),
    ("lfm2", "packed", 2, {}, False),
    ("lfm2", "flattening", 4, {"attention_mode": "ring"}, True),
    ("lfm2", "dense", 2, {"attention_mode": "ulysses"}, False),
    ("lfm2", "packed", 1, {}, False),
    ("lfm2_moe", "packed", 4, {"data_parallel": "fsdp"}, True),
    ("lfm3", "packed", 2, {"attention_mode": "ring"}, False),
    ("lfm2", "packed", 4, {"attention_mode": "hybrid", "ulysses_size": 2}, False),
    ("bamba", "packed", 2, {}, False),
    ("bamba", "dense", 4, {"attention_mode": "ring"}, True),
    ("granitemoehybrid", "flattening", 2, {"data_parallel": "fsdp"}, False),
    ("falcon_h1", "packed", 4, {"attention_mode": "ulysses"}, False),
    ("nemotron_h", "packed", 2, {"attention_mode": "ring"}, False),
    ("zamba2", "packed", 2, {"boundary_layout": "zigzag"}, False),
    ("bamba", "packed", 1, {}, False),
    ("jamba", "packed", 2, {}, False),
    ("jamba", "dense", 4, {"attention_mode": "ring"}, True),
    ("mamba", "packed", 2, {}, False),
    ("falcon_mamba", "flattening", 2, {"data_parallel": "fsdp"}, False),
    ("mamba2", "packed", 2, {"boundary_layout": "zigzag"}, False),
    ("qwen3_5", "packed", 2, {}, False),
    ("qwen3_5", "dense", 4, {"attention_mode": "ring"}, True),
    ("qwen3_next", "flattening", 2, {"data_parallel": "fsdp"}, False),
    ("qwen3_5_moe", "packed", 2, {"attention_mode": "ring"}, False),
    ("olmo_hybrid", "packed", 2, {"attention_mode": "ulysses"}, False),
    ("qwen3_5", "packed", 1, {}, False),
    ("lara_mini", "packed", 2, {"attention_mode": "ring"}, False),
    ("kimi_linear", "packed", 2, {}, False),
    ("kimi_linear", "dense", 4, {"attention_mode": "ring"}, True),
    ("bailing_hybrid", "flattening", 2, {"data_parallel": "fsdp"}, False),
]


CHUNKED_LOSS_RUNS = [
    ("llama", "packed", 2, {}, False, 5),
    ("qwen2", "packed", 2, {"data_parallel": "fsdp"}, True, 4),
    ("qwen3", "dense", 2, {"attention_mode": "ring"}, False, 3),
]


@pytest.mark.parametrize(
    ("family", "kind", "world", "strategy", "checkpointing", "loss_chunk_tokens"),
    [(*run, 0) for run in RUNS] + CHUNKED_LOSS_RUNS,
)
def test_unmodified_models_match_one_device(family, kind, world, strategy, checkpointing, loss_chunk_tokens):
    """Also with the loss made a few tokens at a time (``loss_chunk_tokens``) from the decoder's hidden states."""
    results = run_on_ranks(
        _fit, world, family, kind, world, strategy, checkpointing, loss_chunk_tokens, init_process_group=False
    )
    expected = reference_losses(family, make_batches(kind)[1])
    _assert_matches(results, *expected, loss_chunk_tokens, tolerance=TOLERANCES.get(family, 1e-9))


COMPILED_RUNS = [
    ("packed", {}, 0, "model"),
    ("dense", {"attention_mode": "ring"}, 5, "decoder"),
    ("packed", {"attention_mode": "ring"}, 0, "module"),
    ("packed", {}, 4, "model"),
]


@pytest.mark.parametrize(("kind", "strategy", "loss_chunk_tokens", "compiled"), COMPILED_RUNS)
def test_a_compiled_model_matches_one_device(kind, strategy, loss_chunk_tokens, compiled):
    """The model, its decoder or the LightningModule compiled in place (inductor) trains under ``cp_zigzag`` as the
    unmodified model on one device, to relative 1e-7: inductor rounds Hugging Face's float32 rotary embedding
    differently from eager (3e-8 in the weights on one device alone). The library's collectives, conversions, plans
    and the module's loss logging run eagerly between the compiled parts: nothing compiles anew after the second step
    (before, a compiled module recompiled its training step at every step). The chunked loss calls the decoder
    directly, past a compiled model's own call: that warns, naming ``model.base_model.compile()``."""
    results = run_on_ranks(
        _fit, 2, "llama", kind, 2, strategy, False, loss_chunk_tokens, compiled, init_process_group=False, timeout=240
    )
    _assert_matches(results, *reference_losses("llama", make_batches(kind)[1]), loss_chunk_tokens, tolerance=1e-7)
    bypassed = compiled == "model" and loss_chunk_tokens > 0
    for result in results:
        graphs = result["graphs"]
        assert graphs[0] > 0 and graphs[2:] == graphs[1:-1], graphs
        warned = any("model.base_model.compile()" in message for message in result["warnings"])
        assert warned == (bypassed and result is results[0]), result["warnings"]  # Lightning warns on rank 0


@pytest.mark.parametrize(("strategy", "checkpointing", "loss_chunk_tokens"), [({}, False, 4), (FSDP, True, 0)])
def test_a_lora_model_matches_one_device(strategy, checkpointing, loss_chunk_tokens, tmp_path):
    """A PEFT LoRA model (adapters on q and v, the rest frozen) trains at cp=2 as on one device (float64, relative
    1e-9; the frozen weights are compared too): under DDP with the chunked loss, which finds the decoder inside the
    PEFT wrapper (before, it called the adapter wrapper, which makes logits, and failed with an AttributeError), and
    under FSDP, which shards frozen and trainable weights of one block together, with gradient checkpointing. The
    adapters saved from the gathered state load back into the base model as trained."""
    results = run_on_ranks(
        _fit, 2, "llama", "packed", 2, strategy, checkpointing, loss_chunk_tokens, lora=True,
        adapter_folder=str(tmp_path), init_process_group=False,
    )  # fmt: skip
    expected_losses, expected_weights = reference_losses("llama", make_batches("packed")[1], lora=True)
    _assert_matches(results, expected_losses, expected_weights, loss_chunk_tokens)
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path).state_dict()
    adapters = [name for name in expected_weights if "lora_" in name]
    assert adapters, sorted(expected_weights)
    for name in adapters:
        error = (loaded[name] - expected_weights[name]).abs().max().item()
        assert error <= 1e-9 * expected_weights[name].abs().max().item(), f"{name}: {error}"


def _assert_matches(
    results: list[dict[str, Any]],
    expected_losses: list[float],
    expected_weights: dict[str, torch.Tensor],
    loss_chunk_tokens: int,
    tolerance: float = 1e-9,
) -> None:
    """Every rank's losses and global rank 0's weights equal the reference's (relative ``tolerance``); a chunked loss
    never projected more than a chunk at a time."""
    for result in results:
        assert len(result["losses"]) == STEPS
        if loss_chunk_tokens:  # the probe's two calls on a few tokens, then no more than a chunk at a time
            head_tokens = result["head_tokens"]
            assert head_tokens[:2] == [8, 8] and max(head_tokens[2:]) <= loss_chunk_tokens, head_tokens
        for actual, expected in zip(result["losses"], expected_losses, strict=True):
            assert abs(actual - expected) <= tolerance * abs(expected), f"{actual} != {expected}"
    weights = results[0]["weights"]  # the full state is gathered on global rank 0 (what a checkpoint writes)
    for name, expected in expected_weights.items():
        actual = torch.from_numpy(weights[f"model.{name}"])
        error = (actual - expected).abs().max().item()
        assert error <= tolerance * expected.abs().max().item(), f"{name}: {error}"


def _fit_bf16_mixed(world: int, family: str) -> list[float]:
    """Rank body: a float32 model trained under ``bf16-mixed`` (autocast), the usual fine-tuning precision."""
    os.environ["WORLD_SIZE"] = str(world)
    batches, _ = make_batches("packed")
    recorder = _Recorder()
    trainer = pl.Trainer(
        devices=world, strategy=CPZigzagStrategy(), precision="bf16-mixed", max_steps=STEPS, callbacks=[recorder],
        use_distributed_sampler=False, **TRAINER_OPTIONS,
    )  # fmt: skip
    trainer.fit(SGDCausalLM(tiny_model(family).float()), DataLoader(batches, batch_size=None))
    return recorder.losses


@pytest.mark.parametrize(
    ("family", "tolerance"),
    [("llama", 2e-3), ("lfm2", 2e-3), ("bamba", 5e-4), ("jamba", 1e-4), ("qwen3_5", 1e-4), ("kimi_linear", 1e-4)],
)
def test_bf16_mixed_fine_tuning_under_cp_matches_one_device_within_bf16_rounding(family, tolerance):
    """Under autocast a Hugging Face layer hands the attention float32 q, k (rotated by float32 cos/sin) and a bf16
    v: ``cp_attention`` casts them to the autocast's dtype as SDPA does, and cp=2 trains like the float64 reference
    (relative 2e-3); LFM2's convolutions run in bf16 under autocast too. Bamba's scan and Qwen3.5's gated delta rule
    compute in float32 from bf16 projections (relative 5e-4 and 1e-4: a state leaking across documents or shards
    costs 2e-3 and 3e-4 in their first loss); so do Kimi Linear's rule with decays per key channel (relative 1e-4;
    4e-5 measured, a leak 2.6e-3) and Jamba's Mamba scan (relative 1e-4; 3e-5 measured, its one Mamba layer's leak
    hides in bf16 rounding, so only the float64 runs check the documents there)."""
    expected, _ = reference_losses(family, make_batches("packed")[1])
    for losses in run_on_ranks(_fit_bf16_mixed, 2, 2, family, init_process_group=False):
        assert len(losses) == STEPS
        for actual, reference in zip(losses, expected, strict=True):
            assert abs(actual - reference) <= tolerance * abs(reference), (actual, reference)


def _bypassed_attention() -> None:
    os.environ["WORLD_SIZE"] = "2"
    batches, _ = make_batches("packed", 1)
    module = SGDCausalLM(tiny_model("llama"))
    module.model.set_attn_implementation("sdpa")  # the model no longer calls cp_attention
    trainer = pl.Trainer(devices=2, strategy=CPZigzagStrategy(), max_steps=1, use_distributed_sampler=False,
                         **TRAINER_OPTIONS)  # fmt: skip
    trainer.fit(module, DataLoader(batches, batch_size=None))


def test_a_model_that_bypasses_cp_attention_fails_on_every_rank():
    assert_same_error_on_every_rank(
        _bypassed_attention, 2, match="no cp_attention call", error_type="RuntimeError", init_process_group=False
    )


def test_a_model_that_bypasses_cp_attention_refuses_a_packed_batch_on_one_device():
    """At cp=1 too: its own attention would attend across the packed documents (Bloom's, MPT's, RWKV's do)."""
    module = HFCausalLM(tiny_model("llama"))
    module.model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="a packed batch but the model's attn_implementation is 'sdpa'"):
        module._loss(dict(make_batches("packed", 1)[0][0]))
    module._loss(dict(make_batches("dense", 1)[0][0]))  # one document per row: its own attention is right


def _shard_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)


def _module_that_bypasses_cp_attention() -> None:
    os.environ["WORLD_SIZE"] = "2"
    model = TinyTransformer(ATTENTION)
    model.attention_fn = _shard_local_attention  # runs, but each rank attends within its own shard only
    callbacks = [ContextParallelLayoutCallback(**POLICY)]
    trainer = pl.Trainer(devices=2, strategy=CPZigzagStrategy(), max_steps=1, callbacks=callbacks, **TRAINER_OPTIONS)
    trainer.fit(model, DataLoader(packed_batches(2), batch_size=None))


def test_any_module_that_bypasses_cp_attention_fails_before_its_backward():
    assert_same_error_on_every_rank(
        _module_that_bypasses_cp_attention, 2, match="made no cp_attention call", error_type="RuntimeError",
        init_process_group=False,
    )  # fmt: skip


def test_a_sliding_window_no_document_outgrows_is_exact_and_a_binding_one_refused():
    """Mistral-style ``sliding_window``: documents no longer than it train as the unmodified model (HF's own sliding
    attention, each document alone) does; a longer one is refused, naming both."""
    batches, documents = make_batches("packed", 1)
    longest = max(len(doc) for doc in documents[0])
    model = tiny_model("mistral")
    model.config.sliding_window = longest
    reference = tiny_model("mistral")
    reference.config.sliding_window = longest
    summed = sum(
        F.cross_entropy(reference(torch.tensor([doc])).logits[0, :-1], torch.tensor(doc[1:]), reduction="sum")
        for doc in documents[0]
        if len(doc) > 1
    )
    expected = summed / sum(len(doc) - 1 for doc in documents[0])
    loss, _ = HFCausalLM(model)._loss(dict(batches[0]))
    torch.testing.assert_close(loss.mean, expected, rtol=1e-10, atol=0)
    model.config.sliding_window = longest - 1
    with pytest.raises(ValueError, match=f"window of {longest - 1} tokens .*over a document of {longest} tokens"):
        HFCausalLM(model)._loss(dict(batches[0]))


def test_what_cannot_be_exact_is_refused():
    padded = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]),
    }
    with pytest.raises(ValueError, match="attention_mask masks some tokens out"):
        HFCausalLM(tiny_model("llama"))._loss(padded)
    several = {"input_ids": torch.ones(2, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]] * 2)}
    with pytest.raises(ValueError, match="several documents share a row"):
        HFCausalLM(tiny_model("llama"))._loss(several)


def _minimax() -> transformers.PretrainedConfig:
    """A hybrid of lightning attention (linear attention the library has no CP form of) and attention layers."""
    return transformers.MiniMaxConfig(
        **SMALL, head_dim=8, num_local_experts=2, num_experts_per_tok=1, block_size=4,
        layer_types=["linear_attention", "full_attention"], experts_implementation="eager",
    )  # fmt: skip


def _llama4(**fields: Any) -> transformers.PretrainedConfig:
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=256, **fields,
    )  # fmt: skip


INEXACT = {  # a model feature the "lightning_cp" attention cannot reproduce on a packed or spread row, and its error
    "gpt_oss sinks": (
        lambda: transformers.GptOssConfig(
            **SMALL, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=256
        ),
        "attention sinks",
    ),
    "qwen2_moe mask-only window": (
        lambda: transformers.Qwen2MoeConfig(
            **SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
            use_sliding_window=True, sliding_window=4, max_window_layers=2,
        ),
        "local window of 4 tokens",
    ),
    "llama4 attention chunks": (
        lambda: _llama4(attention_chunk_size=4, attn_temperature_tuning=False, no_rope_layers=[1, 0]),
        "window of 4 tokens",
    ),
    "llama4 temperature": (
        lambda: _llama4(attention_chunk_size=None, attn_temperature_tuning=True, no_rope_layers=[1, 0]),
        "attn_temperature_tuning on NoPE layers",
    ),
    "longrope past its original length": (
        lambda: transformers.Phi3Config(
            **SMALL, pad_token_id=None, original_max_position_embeddings=4,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4,
                             "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 4.0, 8.0]},
        ),
        r"rope_type=longrope\) by the longest position of the row it is given, past 4 tokens",
    ),
    "dynamic rope past its length": (
        lambda: transformers.LlamaConfig(
            **{**SMALL, "max_position_embeddings": 4},
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        ),
        r"rope_type=dynamic\) .* past 4 tokens",
    ),
    "minimax lightning attention": (
        lambda: _minimax(),
        "layers of type linear_attention from its row's own token order, which a packed batch breaks",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INEXACT))
def test_a_model_feature_that_cannot_be_exact_is_refused(case):
    """Attention sinks, local windows only the mask carries, Llama 4's NoPE temperature and non-attention token
    mixers (hybrid models) would train silently wrong on a packed (or, at cp > 1, spread) row: each is refused."""
    config, named = INEXACT[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).double()
    with pytest.raises(ValueError, match=named):
        HFCausalLM(model)._loss(dict(make_batches("packed", 1)[0][0]))


def test_a_sliding_mask_no_layer_uses_is_no_refusal():
    """Qwen2-MoE as released (``use_sliding_window=False``, ``sliding_window=0``) and configs whose layers are all
    full attention still build a sliding mask; only a window some layer uses is refused."""
    unused = [
        transformers.Qwen2MoeConfig(**SMALL, use_sliding_window=False, sliding_window=4),
        transformers.Gemma3TextConfig(**SMALL, sliding_window=4, layer_types=["full_attention"] * 2),
    ]
    for config in unused:
        _no_mask(kv_length=12, local_size=4, config=config)
    _no_mask(kv_length=12, local_size=0, config=None)
    used = transformers.Gemma3TextConfig(**SMALL, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="local window of 4 tokens"):
        _no_mask(kv_length=12, local_size=4, config=used)


def _hybrid_model_at_cp2() -> None:
    os.environ["WORLD_SIZE"] = "2"
    batches, _ = make_batches("dense", 1)
    torch.manual_seed(0)
    module = SGDCausalLM(transformers.AutoModelForCausalLM.from_config(_minimax()).double())
    trainer = pl.Trainer(devices=2, strategy=CPZigzagStrategy(), max_steps=1, use_distributed_sampler=False,
                         **TRAINER_OPTIONS)  # fmt: skip
    trainer.fit(module, DataLoader(batches, batch_size=None))


def test_a_hybrid_model_at_cp2_fails_on_every_rank():
    assert_same_error_on_every_rank(
        _hybrid_model_at_cp2, 2, error_type="ValueError", init_process_group=False,
        match="layers of type linear_attention from its row's own token order, which cp=2 breaks",
    )  # fmt: skip


def test_what_hybrid_and_alibi_models_can_do_is_kept_and_the_rest_refused():
    """A hybrid model still trains one document per row at cp=1 (as the unmodified model does); ALiBi is refused at
    construction, and a soft-capped or scaled head with a chunked loss by its config, however small the logits."""
    torch.manual_seed(0)
    hybrid = transformers.AutoModelForCausalLM.from_config(_minimax()).double()
    document = make_batches("packed", 1)[1][0][0]
    reference = F.cross_entropy(hybrid(torch.tensor([document])).logits[0, :-1], torch.tensor(document[1:]))
    loss, _ = HFCausalLM(hybrid)._loss({"input_ids": torch.tensor([document])})
    torch.testing.assert_close(loss.mean, reference, rtol=1e-10, atol=0)
    falcon = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    falcon.alibi = True
    with pytest.raises(ValueError, match="FalconForCausalLM uses ALiBi"):
        HFCausalLM(transformers.AutoModelForCausalLM.from_config(falcon))
    capped = transformers.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=30.0, attn_logit_softcapping=None)
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0\), so logits made chunk by chunk"):
        HFCausalLM(transformers.AutoModelForCausalLM.from_config(capped), loss_chunk_tokens=4)._loss(
            dict(make_batches("packed", 1)[0][0])
        )


class _ScaledLogitsLlama(transformers.LlamaForCausalLM):
    """A model whose forward changes its logits after the output projection, as soft-capping models do."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 0.5
        return output


def test_a_chunked_loss_is_refused_for_a_model_that_changes_its_logits_after_the_projection():
    """The probe finds the change before any loss is computed; a plain model passes it and gives the same loss."""
    torch.manual_seed(0)
    scaled = _ScaledLogitsLlama(FAMILIES["llama"]()).double()
    batch = make_batches("packed", 1)[0][0]
    with pytest.raises(ValueError, match="_ScaledLogitsLlama's forward changes its logits .* loss_chunk_tokens=0"):
        HFCausalLM(scaled, loss_chunk_tokens=4)._loss(dict(batch))
    chunked, _ = HFCausalLM(tiny_model("llama"), loss_chunk_tokens=4)._loss(dict(batch))
    whole, _ = HFCausalLM(tiny_model("llama"))._loss(dict(batch))
    assert abs(chunked.mean.item() - whole.mean.item()) <= 1e-12 * abs(whole.mean.item())
    with pytest.raises(ValueError, match="loss_chunk_tokens=-1: expected 0"):
        HFCausalLM(tiny_model("llama"), loss_chunk_tokens=-1)


def test_auto_mode_reads_the_head_counts_of_a_wrapped_hf_model():
    from lightning_cp.core.attention.cost import model_head_counts

    assert model_head_counts(HFCausalLM(tiny_model("llama"))) == (4, 2)


def test_a_model_loaded_from_a_folder_trains_in_train_mode(tmp_path):
    """``from_pretrained`` returns a model in evaluation mode, which Lightning keeps: ``HFCausalLM`` switches it to
    training mode, as the Hugging Face Trainer does, so gradient checkpointing and the dropout refusal apply; a model
    given with some parts already in training mode keeps its frozen parts in evaluation mode."""
    tiny_model("llama").save_pretrained(tmp_path)
    from_folder = HFCausalLM(str(tmp_path), gradient_checkpointing=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not loaded.training
    for module in (from_folder, HFCausalLM(loaded)):
        assert all(part.training for part in module.model.modules())
    partly_frozen = tiny_model("llama")
    partly_frozen.model.embed_tokens.eval()
    assert not HFCausalLM(partly_frozen).model.model.embed_tokens.training
    with_dropout = HFCausalLM(str(tmp_path), attention_dropout=0.1)
    with pytest.raises(ValueError, match="cannot compute dropout=0.1"):
        with_dropout._loss(dict(make_batches("packed", 1)[0][0]))


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_outside_a_step_the_model_computes_what_hugging_face_sdpa_computes(family):
    """After training (no CP step active) the wrapped model is the unmodified one: cached generation, a left-padded
    batch and a plain forward equal the same weights under HF's own ``sdpa`` (LFM2: its convolutions' own forward,
    with their cached state)."""
    reference = tiny_model(family).eval()
    wrapped = HFCausalLM(tiny_model(family)).model.eval()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        for options in ({}, {"attention_mask": mask}):
            expected = reference.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **options)
            got = wrapped.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **options)
            assert torch.equal(got, expected)
        assert torch.allclose(wrapped(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", list(ROUTES))
def test_outside_a_step_a_routed_model_computes_with_its_own_functions(family, monkeypatch):
    """The routed convolution and scan (Bamba, Jamba, Mamba) or delta rule (Qwen3.5, Kimi Linear) are the modeling
    module's own outside a step: cached generation and a forward of the wrapped model equal those with the module's
    functions put back (bit for bit). Under a step a cache is refused, naming the fix."""
    wrapped = HFCausalLM(tiny_model(family)).model.eval()
    modeling = sys.modules[type(wrapped).__module__]
    routed = {name: getattr(modeling, name) for name in ROUTES[family]}
    assert all(isinstance(function, _RoutedUnderCP) for function in routed.values()), routed
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return wrapped.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), wrapped(ids).logits

    got = outputs()
    for name, function in routed.items():
        monkeypatch.setattr(modeling, name, function.original)
    expected = outputs()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    monkeypatch.undo()
    step = ContextParallelStep(stream_length=10, sequence_length=10)
    with activated(step), torch.no_grad(), pytest.raises(ValueError, match="pass use_cache=False"):
        wrapped(ids, use_cache=True)


class BambaMixer(torch.nn.Module):
    """A Mamba2 mixer by its class name, from a module without the functions the library routes (as in older
    transformers releases or remote code): a running sum along the row."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, hidden_size, dtype=torch.float64)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.proj(hidden_states).cumsum(dim=1)


def test_a_mixer_calling_kernels_bound_to_itself_stays_refused():
    """A Gated DeltaNet layer that calls the kernel it holds as an attribute (as older transformers releases bound
    ``chunk_gated_delta_rule`` in ``__init__``) would not run the routed module function: refused under CP."""
    model = tiny_model("qwen3_5")
    mixer = next(module for module in model.modules() if type(module).__name__ == "Qwen3_5GatedDeltaNet")
    mixer.chunk_gated_delta_rule = sys.modules[type(mixer).__module__].torch_chunk_gated_delta_rule
    assert _row_order_problems(HFCausalLM(model).model) == ["layers of type linear_attention"]


def test_a_mamba2_family_without_the_routed_functions_still_builds_and_stays_refused():
    """The model builds and trains at cp=1 on one document per row as before, and its Mamba2 layers stay refused
    under CP (before, an ``AttributeError`` when the module was built)."""
    model = tiny_model("bamba")
    layer = next(module for module in model.modules() if hasattr(module, "mamba"))
    layer.mamba = BambaMixer(model.config.hidden_size)
    module = HFCausalLM(model)
    assert _row_order_problems(module.model) == ["layers of type linear_attention"]
    document = make_batches("packed", 1)[1][0][0]
    loss, _ = module._loss({"input_ids": torch.tensor([document])})
    assert torch.isfinite(loss.mean)


def test_a_short_convolution_keeps_a_forward_its_instance_had_outside_a_step():
    """A forward installed on the mixer instance before (as accelerate's device hooks are) still runs outside a step,
    also when the model is wrapped twice; under a step the convolution is the library's."""
    model = tiny_model("lfm2")
    mixer = next(module for module in model.modules() if type(module).__name__ == "Lfm2ShortConv")
    calls = []

    def hooked(*args, **kwargs):
        calls.append(1)
        return type(mixer).forward(mixer, *args, **kwargs)

    mixer.forward = hooked
    HFCausalLM(HFCausalLM(model).model)
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        model(ids)
    assert len(calls) == 1
    HFCausalLM(model)._loss(dict(make_batches("packed", 1)[0][0]))
    assert len(calls) == 1
