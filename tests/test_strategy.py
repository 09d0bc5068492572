"""``cp_zigzag`` end to end: training parity with one process, hybrid layouts, groups, sampler and weight sync."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import ContextParallelLayoutCallback, CPZigzagStrategy
from lightning_cp.core.layout.api import CPLayout
from tests.distributed_harness import run_on_ranks
from tests.layout_reference import dense_positions, thd_positions
from tests.model_helpers import (
    ATTENTION,
    HYBRID,
    POLICY,
    TRAINER_OPTIONS,
    TinyTransformer,
    dense_batches,
    packed_batches,
    reference_run,
    reference_targets,
)

# Forked ranks must not inherit a started OpenMP pool, so this process computes single-threaded.
torch.set_num_threads(1)

STEPS = 5
UNWRAPPED = {"zigzag_layers": [], "contiguous_layers": []}


@dataclass(frozen=True)
class FitRun:
    """One ``trainer.fit`` under ``cp_zigzag``: the model's blocks, the batches and the strategy arguments."""

    name: str
    kinds: tuple[str, ...]
    batch_kind: str
    strategy: dict[str, Any] = field(default_factory=dict)
    checkpoint_blocks: bool = False
    tensor_parallel: bool = False
    checkpoint_attention: bool = False
    policy: dict[str, list[str]] = field(default_factory=lambda: POLICY)

    @property
    def batches(self) -> list[dict[str, torch.Tensor]]:
        """Return enough batches for two replicas."""
        return (dense_batches if self.batch_kind == "dense" else packed_batches)(2 * STEPS)


def fit_on_rank(world_size: int, runs: list[FitRun]) -> list[dict[str, Any]]:
    """Run every fit in turn on this rank and return what each rank saw."""
    results = []
    for run in runs:
        os.environ["WORLD_SIZE"] = str(world_size)  # Lightning's teardown removes it
        model = TinyTransformer(
            run.kinds,
            checkpoint_blocks=run.checkpoint_blocks,
            tensor_parallel=run.tensor_parallel,
            checkpoint_attention=run.checkpoint_attention,
        )
        callback = ContextParallelLayoutCallback(**run.policy)
        trainer = pl.Trainer(
            devices=world_size,
            strategy=CPZigzagStrategy(**run.strategy),
            callbacks=[callback],
            max_steps=STEPS,
            **TRAINER_OPTIONS,
        )
        trainer.fit(model, DataLoader(run.batches, batch_size=None))
        mesh = trainer.strategy.cp_mesh
        weights = trainer.strategy.lightning_module_state_dict()
        results.append(
            {
                "losses": model.train_losses,
                "indices": model.batch_indices,
                "weights": {name: tensor.numpy().copy() for name, tensor in weights.items()},
                "layouts": model.seen_layouts,
                "conversions": model.forward_conversions,
                "dp_rank": mesh.dp_rank,
                "cp_rank": mesh.cp_rank,
                "dims": (mesh.dims.data_parallel, mesh.dims.context_parallel, mesh.dims.tensor_parallel),
            }
        )
    return results


WORLD_2_RUNS = [
    FitRun("cp2-dense-allgather", ATTENTION, "dense", {"context_parallel_size": 2}),
    FitRun("cp2-dense-ring", ATTENTION, "dense", {"context_parallel_size": 2, "attention_mode": "ring"}),
    FitRun("cp2-packed-allgather", ATTENTION, "packed", {"context_parallel_size": 2}),
    FitRun("cp2-packed-ring", ATTENTION, "packed", {"context_parallel_size": 2, "attention_mode": "ring"}),
    FitRun("cp2-packed-zigzag-boundary", ATTENTION, "packed", {"boundary_layout": "zigzag"}),
    FitRun("cp2-packed-unwrapped", ATTENTION, "packed", {}, policy=UNWRAPPED),
    FitRun("cp2-dense-unwrapped-zigzag-boundary", ATTENTION, "dense", {"boundary_layout": "zigzag"}, policy=UNWRAPPED),
    FitRun("cp2-hybrid-dense", HYBRID, "dense", {}),
    FitRun("cp2-hybrid-packed-ring", HYBRID, "packed", {"attention_mode": "ring"}),
    FitRun("cp2-hybrid-packed-zigzag-boundary", HYBRID, "packed", {"boundary_layout": "zigzag"}),
    FitRun("cp2-hybrid-packed-checkpointed", HYBRID, "packed", {}, checkpoint_blocks=True),
    FitRun("cp2-hybrid-dense-attention-checkpointed", HYBRID, "dense", {}, checkpoint_attention=True),
    FitRun("cp2-packed-ulysses", ATTENTION, "packed", {"attention_mode": "ulysses"}),
    FitRun("cp2-hybrid-packed-ulysses", HYBRID, "packed", {"attention_mode": "ulysses"}),
    FitRun(
        "cp2-hybrid-dense-ulysses-zigzag-boundary",
        HYBRID,
        "dense",
        {"attention_mode": "ulysses", "boundary_layout": "zigzag"},
    ),
]
HEAD_HYBRID = {"context_parallel_size": 4, "attention_mode": "hybrid", "ulysses_size": 2}
WORLD_4_RUNS = [
    FitRun("cp4-packed-hybrid-u2", ATTENTION, "packed", HEAD_HYBRID),
    FitRun("cp4-hybrid-dense-hybrid-u2", HYBRID, "dense", HEAD_HYBRID),
    FitRun(
        "cp4-hybrid-packed-hybrid-u2-zigzag-boundary", HYBRID, "packed", {**HEAD_HYBRID, "boundary_layout": "zigzag"}
    ),
    FitRun("cp4-dense-allgather", ATTENTION, "dense", {"context_parallel_size": 4}),
    FitRun("cp4-dense-ring", ATTENTION, "dense", {"context_parallel_size": 4, "attention_mode": "ring"}),
    FitRun("cp4-packed-allgather", ATTENTION, "packed", {"context_parallel_size": 4}),
    FitRun("cp4-packed-ring", ATTENTION, "packed", {"context_parallel_size": 4, "attention_mode": "ring"}),
    FitRun("dp2cp2-dense-allgather", ATTENTION, "dense", {"context_parallel_size": 2}),
    FitRun("dp2cp2-dense-ring", ATTENTION, "dense", {"context_parallel_size": 2, "attention_mode": "ring"}),
    FitRun("dp2cp2-packed-allgather", ATTENTION, "packed", {"context_parallel_size": 2}),
    FitRun("dp2cp2-packed-ring", ATTENTION, "packed", {"context_parallel_size": 2, "attention_mode": "ring"}),
    FitRun("cp4-hybrid-packed", HYBRID, "packed", {"context_parallel_size": 4}),
    FitRun("dp2cp2-hybrid-dense-ring", HYBRID, "dense", {"context_parallel_size": 2, "attention_mode": "ring"}),
    FitRun(
        "cp2tp2-dense",
        ATTENTION,
        "dense",
        {"context_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel": "fsdp"},
        tensor_parallel=True,
    ),
    FitRun(
        "cp2tp2-hybrid-packed-ring",
        HYBRID,
        "packed",
        {"context_parallel_size": 2, "tensor_parallel_size": 2, "attention_mode": "ring", "data_parallel": "fsdp"},
        tensor_parallel=True,
    ),
]
RUNS = {run.name: (2, run) for run in WORLD_2_RUNS} | {run.name: (4, run) for run in WORLD_4_RUNS}


@cache
def launch(world_size: int) -> list[list[dict[str, Any]]]:
    """Fork ``world_size`` ranks once and run all fits of that world size; indexed ``[rank][run]``."""
    runs = WORLD_2_RUNS if world_size == 2 else WORLD_4_RUNS
    return run_on_ranks(fit_on_rank, world_size, world_size, runs, init_process_group=False, timeout=240)


def expected_positions(
    batch: dict[str, torch.Tensor], cp: int, tp: int, cp_rank: int, layout: str, ulysses: int = 1
) -> list[int]:
    """Return the first row's position ids a block on ``cp_rank`` sees in ``layout``, derived from the raw batch.

    The batch is padded to a multiple of cp x tp (packed) or 2 x cp x tp (dense; tp without CP); TP ranks share their
    CP shard.
    Under ``hybrid`` (``ulysses > 1``) the zigzag layout spans cp / ulysses ring positions, each split over ulysses.
    """
    length = batch["input_ids"].shape[1]
    multiple = cp * tp if "cu_seqlens" in batch or cp == 1 else 2 * cp * tp
    padded = -(-length // multiple) * multiple
    _, positions, _ = reference_targets(batch)
    positions = positions[0].tolist() + [0] * (padded - length)
    if layout == "contiguous":
        return positions[cp_rank * padded // cp : (cp_rank + 1) * padded // cp]
    if ulysses > 1:
        offsets = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else [0, length]
        offsets[-1] = padded
        if "cu_seqlens" in batch:
            slots, _ = thd_positions(offsets, None, cp // ulysses, ulysses)
        else:
            slots = dense_positions("zigzag", cp // ulysses, ulysses, padded)
        return [positions[source] if source >= 0 else 0 for source in slots[cp_rank]]
    offsets = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else [0, length]
    offsets[-1] = padded
    seen = []
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        document = positions[start:end]
        chunk = -(-len(document) // (2 * cp))
        document += [0] * (2 * cp * chunk - len(document))
        front, back = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
        seen += document[front : front + chunk] + document[back : back + chunk]
    return seen


def expected_layouts(kinds: tuple[str, ...], run: FitRun | None = None) -> list[tuple[str, str]]:
    """Return the layout each block runs in: zigzag for attention, contiguous for recurrent under ``POLICY``;
    the boundary layout for every block when the run wraps no layers."""
    names = {"attention": ("AttentionBlock", "zigzag"), "recurrent": ("RecurrentBlock", "contiguous")}
    boundary = CPLayout.CONTIGUOUS.value if run is None else run.strategy.get("boundary_layout", "contiguous")
    if run is not None and run.policy == UNWRAPPED:
        return [(names[kind][0], boundary) for kind in kinds]
    if run is not None and run.strategy.get("attention_mode") == "ulysses":  # attends in any layout
        names["attention"] = ("AttentionBlock", boundary)
    return [names[kind] for kind in kinds]


def layout_changes(kinds: tuple[str, ...], boundary: str, run: FitRun | None = None) -> int:
    """Count the layout changes along boundary, blocks, boundary."""
    layouts = [boundary, *(layout for _, layout in expected_layouts(kinds, run)), boundary]
    return sum(before != after for before, after in zip(layouts, layouts[1:], strict=False))


def expected_dims(world_size: int, run: FitRun) -> tuple[int, int, int]:
    """Return the (dp, cp, tp) sizes the run's strategy arguments ask for (cp defaults to every device)."""
    cp = run.strategy.get("context_parallel_size", world_size)
    tp = run.strategy.get("tensor_parallel_size", 1)
    return world_size // (cp * tp), cp, tp


def assert_close(actual: float, expected: float, what: str) -> None:
    """Assert relative agreement to 1e-9."""
    assert abs(actual - expected) <= 1e-9 * abs(expected), f"{what}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("name", list(RUNS))
def test_training_matches_one_process(name: str) -> None:
    """Per-step losses and final weights equal a single-process run on the same batches (float64, rel 1e-9)."""
    world_size, run = RUNS[name]
    index = (WORLD_2_RUNS if world_size == 2 else WORLD_4_RUNS).index(run)
    per_rank = [rank_results[index] for rank_results in launch(world_size)]
    dims = expected_dims(world_size, run)
    assert all(result["dims"] == dims for result in per_rank), f"{name}: mesh {per_rank[0]['dims']}, not {dims}"
    replicas = sorted({result["dp_rank"] for result in per_rank})
    assert replicas == list(range(dims[0])), f"{name}: replicas {replicas}"
    indices_by_replica = {}
    for replica in replicas:
        members = [result for result in per_rank if result["dp_rank"] == replica]
        assert all(member["indices"] == members[0]["indices"] for member in members), "CP ranks saw different data"
        assert all(member["losses"] == members[0]["losses"] for member in members), "CP ranks logged different means"
        indices_by_replica[replica] = members[0]["indices"]
    assert len(indices_by_replica[replicas[0]]) == STEPS
    order = [[indices_by_replica[replica][step] for replica in replicas] for step in range(STEPS)]
    assert all(len(set(step_indices)) == len(replicas) for step_indices in order), "replicas shared a batch"
    reference_losses, reference_weights = reference_run(run.kinds, run.batches, order)
    for result in per_rank:
        assert len(result["losses"]) == STEPS, f"{name}: {len(result['losses'])} steps"
        for step in range(STEPS):
            expected = reference_losses[step][replicas.index(result["dp_rank"])]
            assert_close(result["losses"][step], expected, f"{name} step {step} loss")
    weights = per_rank[0]["weights"]  # the full state is gathered on global rank 0 (what a checkpoint writes)
    assert sorted(weights) == sorted(reference_weights), f"{name}: state keys {sorted(weights)}"
    for parameter, expected in reference_weights.items():
        actual = torch.from_numpy(weights[parameter])
        scale = expected.abs().max().item()
        error = (actual - expected).abs().max().item()
        assert error <= 1e-9 * scale, f"{name} {parameter}: max error {error} vs scale {scale}"


@pytest.mark.parametrize("name", list(RUNS))
def test_each_block_sees_its_layout_and_conversions_match_layout_changes(name: str) -> None:
    """Attention blocks get zigzag input, recurrent ones contiguous, unwrapped blocks the boundary layout (checked on
    the converted position ids, so every run is shown to shard); each forward converts once per layout change."""
    world_size, run = RUNS[name]
    index = (WORLD_2_RUNS if world_size == 2 else WORLD_4_RUNS).index(run)
    boundary = run.strategy.get("boundary_layout", CPLayout.CONTIGUOUS.value)
    _, cp, tp = expected_dims(world_size, run)
    changes = 0 if run.policy == UNWRAPPED else layout_changes(run.kinds, boundary, run)
    for rank_results in launch(world_size):
        result = rank_results[index]
        assert [(name, layout) for name, layout, _ in result["layouts"]] == expected_layouts(run.kinds, run)
        first_batch = run.batches[result["indices"][0]]
        for _, layout, positions in result["layouts"]:
            ulysses = run.strategy.get("ulysses_size", 1)
            assert positions == expected_positions(first_batch, cp, tp, result["cp_rank"], layout, ulysses)
        assert result["conversions"] == [changes] * STEPS
