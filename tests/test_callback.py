"""``ContextParallelLayoutCallback``: layer policy, hooks that leave the state_dict alone, per-step metrics."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import ContextParallelLayoutCallback, CPZigzagStrategy, PackedSeqParams, cp_attention
from lightning_cp.core.layout.api import CPLayout
from lightning_cp.core.runtime import select_layers
from lightning_cp.core.sharding import shard_replica_batch
from lightning_cp.core.step import ContextParallelStep, activated
from tests.distributed_harness import run_on_ranks
from tests.model_helpers import (
    HYBRID,
    POLICY,
    TRAINER_OPTIONS,
    TinyTransformer,
    dense_batches,
    packed_batches,
    reference_run,
)

torch.set_num_threads(1)
METRICS = ("cp/tokens", "cp/padding_fraction", "cp/attention_imbalance", "cp/layout_conversions")


def test_policy_selects_outermost_matches_by_class_or_name_in_module_order() -> None:
    """Class-name and qualified-name globs both select; modules inside a selected one are not wrapped again."""
    selected = select_layers(TinyTransformer(HYBRID), ["*AttentionBlock"], ["blocks.[23]", "*.mix"])
    assert [(wrapped.name, wrapped.class_name, wrapped.layout) for _, wrapped in selected] == [
        ("blocks.0", "AttentionBlock", CPLayout.ZIGZAG),
        ("blocks.1", "AttentionBlock", CPLayout.ZIGZAG),
        ("blocks.2", "RecurrentBlock", CPLayout.CONTIGUOUS),
        ("blocks.3", "RecurrentBlock", CPLayout.CONTIGUOUS),
        ("blocks.4", "AttentionBlock", CPLayout.ZIGZAG),
    ]
    everything = select_layers(TinyTransformer(HYBRID), ["blocks.*"], [])
    assert [wrapped.name for _, wrapped in everything] == [f"blocks.{index}" for index in range(5)]


def test_a_layer_matching_both_layouts_is_an_error() -> None:
    """A module cannot be both zigzag and contiguous."""
    with pytest.raises(ValueError, match="layer 'blocks.2' \\(RecurrentBlock\\) matches both"):
        select_layers(TinyTransformer(HYBRID), ["blocks.*"], ["*RecurrentBlock"])


def fit_plain_lightning() -> dict[str, Any]:
    """Fit two steps on one device with the callback and no ``cp_zigzag``; report what changed."""
    model = TinyTransformer(HYBRID)
    keys_before = list(model.state_dict())
    callback = ContextParallelLayoutCallback(**POLICY)
    trainer = pl.Trainer(devices=1, callbacks=[callback], max_steps=2, **TRAINER_OPTIONS)
    trainer.fit(model, DataLoader(packed_batches(2), batch_size=None))
    return {
        "same_keys": list(model.state_dict()) == keys_before,
        "hooks_left": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "wrapped": [wrapped.name for wrapped in callback.wrapped_layers],
        "layouts": [layout for _, layout, _ in model.seen_layouts],
        "losses": model.train_losses,
        "indices": model.batch_indices,
    }


def test_plain_lightning_gets_the_batch_contract_and_an_unchanged_state_dict() -> None:
    """Without ``cp_zigzag`` the callback runs at cp=1: no conversions, hooks removed at teardown, metrics logged;
    the losses equal the independent reference, so labels, positions and the token count follow the batch contract."""
    (result,) = run_on_ranks(fit_plain_lightning, 1, init_process_group=False)
    assert result["indices"] == [0, 1]
    reference_losses, _ = reference_run(HYBRID, packed_batches(2), [[0], [1]])
    assert len(result["losses"]) == 2
    for actual, (expected,) in zip(result["losses"], reference_losses, strict=True):
        assert abs(actual - expected) <= 1e-9 * expected, f"{actual} != {expected}"
    assert result["same_keys"]
    assert result["hooks_left"] == 0
    assert result["wrapped"] == [f"blocks.{index}" for index in range(5)]
    assert result["layouts"] == ["zigzag", "zigzag", "contiguous", "contiguous", "zigzag"]
    assert set(METRICS) <= set(result["metrics"])
    assert result["metrics"]["cp/layout_conversions"] == 0.0
    assert result["metrics"]["cp/attention_imbalance"] == 1.0


def expected_metrics(batch: dict[str, torch.Tensor], cp: int) -> dict[str, float]:
    """Tokens, padding fraction and causal-pair imbalance of zigzag sharding, counted token by token."""
    rows, length = batch["input_ids"].shape
    offsets = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else [0, length]
    physical_end = -(-length // cp) * cp if "cu_seqlens" in batch else -(-length // (2 * cp)) * (2 * cp)
    physical = [*offsets[:-1], physical_end]
    slots = sum(-(-(end - start) // (2 * cp)) * 2 * cp for start, end in zip(physical, physical[1:], strict=False))
    pairs = [0] * cp
    for start, end in zip(offsets, offsets[1:], strict=False):
        size = end - start
        chunk = -(-size // (2 * cp))
        for position in range(size):
            chunk_index = position // chunk
            rank = chunk_index if chunk_index < cp else 2 * cp - 1 - chunk_index
            pairs[rank] += position + 1
    return {
        "cp/tokens": float(rows * length),
        "cp/padding_fraction": 1 - length / slots,
        "cp/attention_imbalance": max(pairs) / (sum(pairs) / cp),
        "cp/layout_conversions": 4.0,
    }


def metrics_at_cp2(world_size: int) -> list[dict[str, float]]:
    """Fit one step on a dense and one on a packed batch at cp=2 and return the logged metrics."""
    metrics = []
    for batches in (dense_batches(1, batch_size=1), packed_batches(1)):
        os.environ["WORLD_SIZE"] = str(world_size)
        trainer = pl.Trainer(
            devices=world_size,
            strategy=CPZigzagStrategy(),
            callbacks=[ContextParallelLayoutCallback(**POLICY)],
            max_steps=1,
            **TRAINER_OPTIONS,
        )
        trainer.fit(TinyTransformer(HYBRID), DataLoader(batches, batch_size=None))
        metrics.append({name: float(value) for name, value in trainer.callback_metrics.items()})
    return metrics


def test_metrics_report_tokens_padding_and_attention_imbalance() -> None:
    """Logged per step at cp=2: real tokens, padding share of the zigzag slots, max/mean causal work, conversions."""
    results = run_on_ranks(metrics_at_cp2, 2, 2, init_process_group=False)
    batches = (dense_batches(1, batch_size=1)[0], packed_batches(1)[0])
    for batch_number, batch in enumerate(batches):
        logged_by_rank = [rank_metrics[batch_number] for rank_metrics in results]
        expected = expected_metrics(batch, 2)
        for logged in logged_by_rank:
            for name, value in expected.items():
                assert abs(logged[name] - value) <= 1e-6, f"{name}: {logged[name]} != {value}"
        assert expected["cp/padding_fraction"] > 0


def test_a_batch_that_is_not_a_dict_is_refused() -> None:
    """The batch contract is a dict; anything else is a ``TypeError`` naming the type."""
    callback = ContextParallelLayoutCallback()
    with pytest.raises(TypeError, match="needs dict batches"):
        callback.on_train_batch_start(None, TinyTransformer(), [torch.zeros(1, 4)], 0)  # type: ignore[arg-type]


def test_bidirectional_dense_attention_without_cp_sees_no_padding() -> None:
    """cp=1: an odd dense row is not padded (no zigzag chunks), and a step whose rows were padded refuses a
    bidirectional layer instead of letting real tokens attend to the padding."""
    batch = {"input_ids": torch.arange(7).unsqueeze(0)}
    assert shard_replica_batch(batch).padding_token_count == 0
    q = torch.randn(1, 8, 2, 4)
    with activated(ContextParallelStep(dense_padding=1)):
        with pytest.raises(
            ValueError, match="would see the batch's 1 padding tokens: make the sequence length divisible"
        ):
            cp_attention(q, q, q, causal=False)
        assert cp_attention(q, q, q, causal=True).shape == q.shape


@pytest.mark.parametrize("causal", [True, False])
def test_cp_attention_without_cp_is_exact_per_document_attention(causal: bool) -> None:
    """cp=1 (or no step): packed rows attend within each document, GQA included; tokens past the end stay apart."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 13, 4, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 13, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    cu_seqlens = torch.tensor([0, 4, 5, 5, 11], dtype=torch.int32)
    documents = torch.tensor([0, 0, 0, 0, 1, 3, 3, 3, 3, 3, 3, 4, 4])
    visible = documents[:, None] == documents[None, :]
    if causal:
        visible &= torch.ones(13, 13, dtype=torch.bool).tril()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) / 8**0.5
    weights = scores.masked_fill(~visible, -torch.inf).softmax(-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", weights, v.repeat_interleave(2, dim=2))
    step = ContextParallelStep(contiguous_packed_seq_params=PackedSeqParams(cu_seqlens_q=cu_seqlens))
    with activated(step):
        actual = cp_attention(q, k, v, causal=causal)
    assert torch.allclose(actual, expected, rtol=0, atol=1e-12)
    dense = cp_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), causal=causal)
    dense_visible = torch.ones(13, 13, dtype=torch.bool).tril() if causal else torch.ones(13, 13, dtype=torch.bool)
    dense_weights = scores.masked_fill(~dense_visible, -torch.inf).softmax(-1)
    expected_dense = torch.einsum("bhqk,bkhd->bqhd", dense_weights, v.repeat_interleave(2, dim=2))
    assert torch.allclose(dense, expected_dense, rtol=0, atol=1e-12)


RECURRENT_ONLY = ("recurrent", "recurrent")


def fit_recurrent_only_at_cp2() -> list[float]:
    """Fit two steps of a stack of contiguous (token-shift) blocks alone at cp=2; return the losses."""
    os.environ["WORLD_SIZE"] = "2"
    model = TinyTransformer(RECURRENT_ONLY)
    callback = ContextParallelLayoutCallback(zigzag_layers=["*AttentionBlock"], contiguous_layers=["*RecurrentBlock"])
    trainer = pl.Trainer(devices=2, strategy=CPZigzagStrategy(), callbacks=[callback], max_steps=2, **TRAINER_OPTIONS)
    trainer.fit(model, DataLoader(packed_batches(2), batch_size=None))
    return model.train_losses


def test_a_stack_without_attention_blocks_trains_under_cp() -> None:
    """Only contiguous blocks (``cp_previous_tokens``, no attention): the forward calls no ``cp_attention`` and needs
    none, so it trains and matches one process (before, it was refused as a model bypassing its attention)."""
    reference_losses, _ = reference_run(RECURRENT_ONLY, packed_batches(2), [[0], [1]])
    for losses in run_on_ranks(fit_recurrent_only_at_cp2, 2, init_process_group=False):
        assert len(losses) == 2
        for actual, (expected,) in zip(losses, reference_losses, strict=True):
            assert abs(actual - expected) <= 1e-9 * expected, f"{actual} != {expected}"
