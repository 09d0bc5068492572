"""FSDP2 over DP x CP and DTensor tensor parallelism: training parity with one process, memory per rank, errors.

The model is the main job's Llama-style ``LlamaLM`` with its own tensor-parallel plan, trained with AdamW and gradient
clipping in float64. The reference is the same module on one device under plain Lightning (no ``cp_zigzag``), with
``accumulate_grad_batches`` standing in for data-parallel replicas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import CPZigzagStrategy
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.lm_helpers import FIT_OPTIONS, STEPS, RecordingLM, batches, local_bytes, whole_model_state_bytes

torch.set_num_threads(1)


@dataclass(frozen=True)
class Fit:
    """One ``trainer.fit`` under ``cp_zigzag``: batch kind and strategy arguments."""

    name: str
    world_size: int
    batch_kind: str
    strategy: dict[str, Any] = field(default_factory=dict)
    architecture: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1

    @property
    def replicas(self) -> int:
        """Return the data-parallel size."""
        cp = self.strategy.get("context_parallel_size", self.world_size)
        return self.world_size // (cp * self.strategy.get("tensor_parallel_size", 1))


FSDP = {"data_parallel": "fsdp"}
SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
FITS = [
    Fit("fsdp-cp2-dense", 2, "dense", FSDP),
    Fit("fsdp-cp2-packed-ring", 2, "packed", {**FSDP, "attention_mode": "ring"}),
    Fit("fsdp-cp2-packed-offload", 2, "packed", {**FSDP, "cpu_offload": True}),
    Fit("ddp-cp2-packed", 2, "packed"),
    Fit("fsdp-cp2-packed-accumulating", 2, "packed", FSDP, accumulate=2),
    Fit("fsdp-dp2cp2-packed", 4, "packed", {**FSDP, "context_parallel_size": 2}),
    Fit("fsdp-cp4-dense-no-reshard", 4, "dense", {**FSDP, "reshard_after_forward": False}),
    Fit("fsdp-cp2tp2-dense", 4, "dense", {**FSDP, "context_parallel_size": 2, "tensor_parallel_size": 2}),
    Fit(  # every rank builds different weights: all must start from global rank 0's (the reference's seed)
        "fsdp-cp2tp2-packed-rank-seeded",
        4,
        "packed",
        {**FSDP, "context_parallel_size": 2, "tensor_parallel_size": 2},
        {"seed_by_rank": True},
    ),
    Fit("fsdp-cp2tp2-packed-sp", 4, "packed", {**FSDP, "context_parallel_size": 2, **SP}),
    Fit("fsdp-cp2tp2-dense-sp", 4, "dense", {**FSDP, "context_parallel_size": 2, **SP}),
    Fit(
        "fsdp-cp2tp2-packed-sp-chunked-loss",
        4,
        "packed",
        {**FSDP, "context_parallel_size": 2, **SP},
        {"loss_chunk_tokens": 7},
    ),
    Fit("fsdp-cp2tp3-packed-sp", 6, "packed", {**FSDP, **SP, "context_parallel_size": 2, "tensor_parallel_size": 3}),
    Fit("fsdp-cp2tp3-dense-sp", 6, "dense", {**FSDP, **SP, "context_parallel_size": 2, "tensor_parallel_size": 3}),
]
FITS_BY_NAME = {fit.name: fit for fit in FITS}


def fit_on_rank(world_size: int, fits: list[Fit]) -> list[dict[str, Any]]:
    """Run each fit in turn; return losses, rank 0's gathered weights and the local model-state bytes."""
    results = []
    for run in fits:
        os.environ["WORLD_SIZE"] = str(world_size)  # Lightning's teardown removes it
        model = RecordingLM(**run.architecture)
        strategy = CPZigzagStrategy(**run.strategy)
        options = {**FIT_OPTIONS, "accumulate_grad_batches": run.accumulate}
        trainer = pl.Trainer(devices=world_size, strategy=strategy, **options)
        trainer.fit(model, DataLoader(batches(run.batch_kind), batch_size=None))
        optimizer_state = trainer.optimizers[0].state.values()
        state_bytes = sum(local_bytes(value) for entry in optimizer_state for value in entry.values() if value.dim())
        weights = trainer.strategy.lightning_module_state_dict()
        results.append(
            {
                "losses": model.losses,
                "indices": model.indices,
                "weights": {name: tensor.numpy().copy() for name, tensor in weights.items()},
                "model_state_bytes": model.parameter_and_gradient_bytes + state_bytes,
                "whole_block_bytes": whole_model_state_bytes(model.model.layers[0]),
                "whole_model_bytes": whole_model_state_bytes(model),
                "dp_rank": trainer.strategy.cp_mesh.dp_rank,
            }
        )
    return results


def reference(batch_kind: str, order: tuple[int, ...], accumulate: int) -> dict[str, Any]:
    """Train on one device under plain Lightning on the batches in ``order``; each step accumulates the batches the
    replicas took in that step (all their micro-batches)."""
    model = RecordingLM()
    options = {**FIT_OPTIONS, "accumulate_grad_batches": accumulate}
    trainer = pl.Trainer(devices=1, strategy="auto", use_distributed_sampler=False, **options)
    every = batches(batch_kind)
    trainer.fit(model, DataLoader([every[index] for index in order], batch_size=None))
    weights = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    return {"losses": model.losses, "weights": weights}  # numpy: tensors cannot leave a forked rank that exits


@cache
def launch(name: str) -> list[dict[str, Any]]:
    """Fork the ranks of one fit (once, whichever test asks first); one result per rank."""
    run = FITS_BY_NAME[name]
    per_rank = run_on_ranks(fit_on_rank, run.world_size, run.world_size, [run], init_process_group=False, timeout=240)
    return [results[0] for results in per_rank]


@cache
def reference_run(batch_kind: str, order: tuple[int, ...], accumulate: int) -> dict[str, Any]:
    """Return the one-device reference (in a forked process, so this one starts no thread pool)."""
    return run_on_ranks(reference, 1, batch_kind, order, accumulate, init_process_group=False, timeout=120)[0]


@pytest.mark.parametrize("name", list(FITS_BY_NAME))
def test_training_matches_one_device(name: str) -> None:
    """Losses of every rank and rank 0's gathered weights equal one device's (float64, relative 1e-9)."""
    run = FITS_BY_NAME[name]
    per_rank = launch(name)
    by_replica = {result["dp_rank"]: result["indices"] for result in per_rank}
    assert sorted(by_replica) == list(range(run.replicas))
    micro_batches = STEPS * run.accumulate
    order = tuple(by_replica[replica][micro] for micro in range(micro_batches) for replica in range(run.replicas))
    assert len(set(order)) == len(order), f"{name}: replicas shared a batch: {by_replica}"
    expected = reference_run(run.batch_kind, order, run.replicas * run.accumulate)
    for result in per_rank:
        assert result["indices"] == by_replica[result["dp_rank"]], f"{name}: ranks of a replica saw different data"
        losses = expected["losses"][result["dp_rank"] :: run.replicas]
        assert len(result["losses"]) == micro_batches == len(losses)
        for step, (actual, wanted) in enumerate(zip(result["losses"], losses, strict=True)):
            assert abs(actual - wanted) <= 1e-9 * abs(wanted), f"{name} step {step}: {actual!r} != {wanted!r}"
    weights = per_rank[0]["weights"]
    assert sorted(weights) == sorted(expected["weights"])
    for parameter, wanted in expected["weights"].items():
        error = abs(weights[parameter] - wanted).max()
        assert error <= 1e-9 * abs(wanted).max(), f"{name} {parameter}: max error {error}"


@pytest.mark.parametrize("name", ["fsdp-cp2-dense", "fsdp-cp2-packed-ring", "fsdp-dp2cp2-packed", "ddp-cp2-packed"])
def test_model_state_per_rank_is_the_whole_over_dp_times_cp(name: str) -> None:
    """Under fsdp, parameters + gradients + optimizer state per rank are 1/(dp x cp) of the whole, within one block
    (FSDP pads each parameter to a multiple of the ranks); under ddp every rank holds the whole."""
    run = FITS_BY_NAME[name]
    shards = run.world_size if run.strategy.get("data_parallel") == "fsdp" else 1
    for result in launch(name):
        whole, block = result["whole_model_bytes"], result["whole_block_bytes"]
        assert abs(result["model_state_bytes"] - whole / shards) <= block, (name, result["model_state_bytes"], whole)


def fit_with_bad_setup(world_size: int, case: str) -> None:
    """Fit a model set up wrongly for the case."""
    os.environ["WORLD_SIZE"] = str(world_size)
    strategy: dict[str, Any] = dict(FSDP)
    model = RecordingLM()
    if case == "tp does not divide the heads":
        model = RecordingLM(num_heads=4, num_kv_heads=4)
        strategy = {**FSDP, "context_parallel_size": 1, "tensor_parallel_size": 3}
    elif case == "sharded over the data-parallel axis only":
        from torch.distributed.fsdp import fully_shard

        def shard_over_data_parallel() -> None:
            fully_shard(model.model, mesh=model.device_mesh["data_parallel"])

        model.configure_model = shard_over_data_parallel  # type: ignore[method-assign]
    elif case == "a step that fails under fsdp":
        model = RecordingLM(num_heads=3, num_kv_heads=3)
        strategy = {**FSDP, "attention_mode": "ulysses"}
    elif case == "sequence parallel over plain parameters":
        model.configure_model = lambda: None  # type: ignore[method-assign]
        strategy = {**FSDP, "context_parallel_size": 1, "tensor_parallel_size": 2, "sequence_parallel": True}
    elif case == "blocks sharded, the rest left plain":
        from torch.distributed.fsdp import fully_shard

        def shard_blocks_only() -> None:
            for layer in model.model.layers:
                fully_shard(layer, mesh=model.device_mesh["data_context_parallel"])

        model.configure_model = shard_blocks_only  # type: ignore[method-assign]
    elif case == "fully_shard under ddp":
        from torch.distributed.fsdp import fully_shard

        strategy = {}
        model.configure_model = lambda: fully_shard(model.model)  # type: ignore[method-assign]
    trainer = pl.Trainer(devices=world_size, strategy=CPZigzagStrategy(**strategy), **FIT_OPTIONS)
    trainer.fit(model, DataLoader(batches("packed"), batch_size=None))


@pytest.mark.parametrize(
    ("case", "world_size", "match"),
    [
        ("tp does not divide the heads", 3, "tensor_parallel_size=3 does not divide model.num_heads=4"),
        ("sharded over the data-parallel axis only", 2, "is sharded over mesh dimensions ('data_parallel',)"),
        ("fully_shard under ddp", 2, "configure_model applied fully_shard (to 'model') but data_parallel='ddp'"),
        ("blocks sharded, the rest left plain", 2, "fully_shard to some modules but left 'model.embed_tokens.weight'"),
        ("a step that fails under fsdp", 2, "attention_mode='ulysses' splits the 3 query heads over 2 ranks"),
        ("sequence parallel over plain parameters", 2, "needs every parameter as a DTensor on the tensor-parallel"),
    ],
)
def test_bad_setups_give_the_same_error_on_every_rank(case: str, world_size: int, match: str) -> None:
    """A wrong TP size, a module sharded differently, in part (trainable weights left plain would get no gradient
    reduction: before, each rank trained its own copy) or left plain under sequence parallelism is one ``ValueError``
    on every rank, no hang; so is an error in a step under FSDP (not FSDP's own error from moving the module after
    it)."""
    assert_same_error_on_every_rank(
        fit_with_bad_setup, world_size, world_size, case, match=match, init_process_group=False, timeout=120
    )


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"data_parallel": "zero3"}, "data_parallel='zero3' is invalid: expected 'ddp' or 'fsdp'"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 needs data_parallel='fsdp'"),
        ({"data_parallel": "fsdp", "start_method": "spawn"}, "start_method='spawn' with data_parallel='fsdp'"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(arguments: dict[str, Any], match: str) -> None:
    """Arguments that can never work fail before any process starts."""
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        CPZigzagStrategy(**arguments)
