"""Checkpoints written under fsdp cp2 x tp2 (sequence parallel) resume under other layouts and modes exactly.

Both formats: one full-state file (rank 0) and a folder of shards written by every rank (torch distributed
checkpoint, resharded on load). After resuming, the losses equal an uninterrupted one-device run (float64, relative
1e-9), and the optimizer state, tensor-parallel parameters' included, comes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import CPZigzagStrategy
from lightning_cp.lightning import state
from tests.distributed_harness import run_on_ranks
from tests.lm_helpers import FIT_OPTIONS, STEPS, RecordingLM, batches

torch.set_num_threads(1)

SAVED_AT = 3
SAVER = {"data_parallel": "fsdp", "context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}
LOADERS = {
    "ddp cp1": (1, {}),
    "fsdp cp4": (4, {"data_parallel": "fsdp"}),
    "ddp cp2": (2, {}),
    "fsdp cp2 x tp2 without SP": (4, {"data_parallel": "fsdp", "context_parallel_size": 2, "tensor_parallel_size": 2}),
}
OPTIONS = {**FIT_OPTIONS, "use_distributed_sampler": False}  # dp = 1 everywhere: every rank takes every batch


def as_numpy(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Return a full optimizer state with its tensors as numpy arrays (they must leave a forked rank)."""
    tensors = {
        f"{name}/{key}": value.numpy().copy()
        for name, entry in optimizer_state.get("state", {}).items()
        for key, value in entry.items()
    }
    groups = [
        {key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}
        for group in optimizer_state.get("param_groups", [])
    ]  # a saved tuple (betas) may load as a list
    return {"tensors": tensors, "param_groups": groups}


def full_optimizer_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Return the gathered optimizer state as numpy (on global rank 0; empty elsewhere)."""
    return as_numpy(state.optimizer_state(trainer.lightning_module, trainer.optimizers[0], full=True))


class FromGlobalStep(torch.utils.data.Sampler[int]):
    """Batch ``s`` at step ``s``, also after a resume (Lightning restarts a plain loader from its first batch)."""

    def __init__(self, model: pl.LightningModule) -> None:
        self.model = model

    def __len__(self) -> int:
        return STEPS

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.model.trainer.global_step, STEPS))


def loader(model: pl.LightningModule) -> DataLoader:
    """Return the dense batches, served from the model's current step."""
    return DataLoader(batches("dense")[:STEPS], batch_size=None, sampler=FromGlobalStep(model))


class SaveAndStop(pl.Callback):
    """Checkpoint to ``path`` after ``SAVED_AT`` steps and stop (the schedule still spans ``STEPS``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Save and stop once the step is reached."""
        if trainer.global_step == SAVED_AT:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def train_and_save(world_size: int, path: str, distributed: bool) -> dict[str, Any]:
    """Train ``SAVED_AT`` steps under the saver's layout, save, and return the full optimizer state (rank 0)."""
    os.environ["WORLD_SIZE"] = str(world_size)
    model = RecordingLM()
    strategy = CPZigzagStrategy(**SAVER, save_distributed_checkpoint=distributed)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=[SaveAndStop(path)], **OPTIONS)
    trainer.fit(model, loader(model))
    return {"losses": model.losses, "optimizer": full_optimizer_state(trainer)}


class RestoredOptimizerState(pl.Callback):
    """Gathers the optimizer state as restored from the checkpoint, before the first resumed step."""

    def __init__(self) -> None:
        self.restored: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gather the full state (on global rank 0)."""
        self.restored = full_optimizer_state(trainer)


def resume(world_size: int, path: str, strategy: dict[str, Any]) -> dict[str, Any]:
    """Resume from the checkpoint to ``STEPS`` under ``strategy``; return the losses and the restored state."""
    os.environ["WORLD_SIZE"] = str(world_size)
    model = RecordingLM()
    restored = RestoredOptimizerState()
    trainer = pl.Trainer(devices=world_size, strategy=CPZigzagStrategy(**strategy), callbacks=[restored], **OPTIONS)
    trainer.fit(model, loader(model), ckpt_path=path)
    return {"losses": model.losses, "optimizer": restored.restored, "step": trainer.global_step}


def uninterrupted() -> list[float]:
    """Return the losses of ``STEPS`` steps on one device under plain Lightning."""
    model = RecordingLM()
    trainer = pl.Trainer(devices=1, strategy="auto", **OPTIONS)
    trainer.fit(model, loader(model))
    return model.losses


def assert_losses_close(actual: list[float], expected: list[float], what: str) -> None:
    """Assert equal length and relative agreement to 1e-9."""
    assert len(actual) == len(expected), f"{what}: {actual} vs {expected}"
    for step, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - b) <= 1e-9 * abs(b), f"{what} step {step}: {a!r} != {b!r}"


@pytest.mark.parametrize("distributed", [False, True], ids=["full-state file", "sharded folder"])
def test_fsdp_tp_checkpoint_resumes_under_other_layouts(tmp_path: Path, distributed: bool) -> None:
    """Save under fsdp cp2 x tp2 with SP; resume under ddp cp1, fsdp cp4, ddp cp2 and fsdp cp2 x tp2 without SP."""
    path = str(tmp_path / "saved.ckpt")
    reference = run_on_ranks(uninterrupted, 1, init_process_group=False)[0]
    saved = run_on_ranks(train_and_save, 4, 4, path, distributed, init_process_group=False, timeout=180)
    assert_losses_close(saved[0]["losses"], reference[:SAVED_AT], "before saving")
    assert state.is_distributed_checkpoint(path) == distributed
    written = saved[0]["optimizer"]
    assert any("q_proj" in name for name in written["tensors"]), "the saved state lacks tensor-parallel parameters"
    for where, (world_size, strategy) in LOADERS.items():
        per_rank = run_on_ranks(resume, world_size, world_size, path, strategy, init_process_group=False, timeout=180)
        restored = per_rank[0]["optimizer"]
        assert restored["param_groups"] == written["param_groups"], where
        assert sorted(restored["tensors"]) == sorted(written["tensors"]), where
        for name, value in written["tensors"].items():
            assert np.array_equal(restored["tensors"][name], value), f"{where}: {name} changed in the round trip"
        for result in per_rank:
            assert result["step"] == STEPS, where
            assert_losses_close(result["losses"], reference[SAVED_AT:], where)


def validate_on_one_device(path: str) -> dict[str, Any]:
    """Load the checkpoint's weights under plain Lightning on one device; return them. (Plain Lightning restores
    before converting to the Trainer's precision, so the module starts in float64.)"""
    model = RecordingLM().double()
    trainer = pl.Trainer(devices=1, strategy="auto", **OPTIONS)
    trainer.validate(model, DataLoader(batches("dense")[:1], batch_size=None), ckpt_path=path, verbose=False)
    return {name: tensor.numpy().copy() for name, tensor in model.state_dict().items()}


def test_fsdp_tp_checkpoint_weights_load_under_plain_lightning(tmp_path: Path) -> None:
    """The full-state file written under fsdp cp2 x tp2 holds plain full tensors that plain Lightning loads."""
    path = str(tmp_path / "saved.ckpt")
    run_on_ranks(train_and_save, 4, 4, path, False, init_process_group=False, timeout=180)
    saved = torch.load(path, weights_only=True)["state_dict"]
    loaded = run_on_ranks(validate_on_one_device, 1, path, init_process_group=False)[0]
    assert sorted(loaded) == sorted(saved)
    for name, value in saved.items():
        assert np.array_equal(loaded[name], value.numpy()), name
