"""Checkpoints written under ``cp_zigzag`` load at any cp and under plain Lightning; evaluation syncs over DP x CP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import ContextParallelLayoutCallback, CPZigzagStrategy
from lightning_cp.lightning.state import is_distributed_checkpoint
from tests.distributed_harness import run_on_ranks
from tests.model_helpers import ATTENTION, HYBRID, POLICY, TRAINER_OPTIONS, TinyTransformer, packed_batches

torch.set_num_threads(1)


def validation_batches() -> list[dict[str, torch.Tensor]]:
    """Return two packed batches to validate on."""
    return packed_batches(2)


def train_and_save(world_size: int, path: str, strategy: dict[str, Any], tensor_parallel: bool) -> list[float]:
    """Fit two steps under ``cp_zigzag(**strategy)``, save a checkpoint, return the saved weights' validation losses."""
    model = TinyTransformer(HYBRID, tensor_parallel=tensor_parallel)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=CPZigzagStrategy(**strategy),
        callbacks=[ContextParallelLayoutCallback(**POLICY)],
        max_steps=2,
        **TRAINER_OPTIONS,
    )
    trainer.fit(model, DataLoader(packed_batches(4), batch_size=None))
    trainer.save_checkpoint(path)
    os.environ["WORLD_SIZE"] = str(world_size)
    trainer.validate(model, DataLoader(validation_batches(), batch_size=None), verbose=False)
    return model.val_losses


def validate_checkpoint(
    world_size: int, path: str, strategy: dict[str, Any] | None, tensor_parallel: bool
) -> dict[str, Any]:
    """Load the checkpoint into a fresh model; return its validation losses and the mesh sizes (``None`` for plain
    Lightning, which ``strategy=None`` selects).

    ``cp_zigzag`` adds its default callback, whose default policy also fits the hybrid model.
    """
    model = TinyTransformer(HYBRID, tensor_parallel=tensor_parallel)
    plain = strategy is None
    trainer = pl.Trainer(
        devices=world_size,
        strategy="auto" if plain else CPZigzagStrategy(**strategy),
        callbacks=[ContextParallelLayoutCallback(**POLICY)] if plain else [],
        **TRAINER_OPTIONS,
    )
    trainer.validate(model, DataLoader(validation_batches(), batch_size=None), ckpt_path=path, verbose=False)
    if plain:
        return {"losses": model.val_losses, "dims": None}
    dims = trainer.strategy.cp_mesh.dims
    return {"losses": model.val_losses, "dims": (dims.data_parallel, dims.context_parallel, dims.tensor_parallel)}


LOADERS = {  # name -> (world size, strategy arguments or None for plain Lightning, tensor parallel, (dp, cp, tp))
    "plain Lightning, one device": (1, None, False, None),
    "cp_zigzag cp=1": (1, {}, False, (1, 1, 1)),
    "cp_zigzag cp=4": (4, {}, False, (1, 4, 1)),
    "cp_zigzag cp2 x tp2, tensor parallel": (
        4,
        {"context_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel": "fsdp"},
        True,
        (1, 2, 2),
    ),
}


def assert_loads_everywhere(path: str, expected: list[float], loaders: list[str]) -> None:
    """Validate the checkpoint under each named loader and compare with the losses measured when it was saved."""
    assert len(expected) == 2
    for where in loaders:
        world_size, strategy, tensor_parallel, dims = LOADERS[where]
        per_rank = run_on_ranks(
            validate_checkpoint, world_size, world_size, path, strategy, tensor_parallel, init_process_group=False
        )
        for result in per_rank:
            assert result["dims"] == dims, f"{where}: mesh {result['dims']}"
            losses = result["losses"]
            assert len(losses) == len(expected), where
            for actual, reference in zip(losses, expected, strict=True):
                assert abs(actual - reference) <= 1e-9 * reference, f"{where}: {actual} != {reference}"


def assert_single_plain_checkpoint(directory: Path, path: str) -> None:
    """One file holding exactly the plain module's state, full-sized."""
    assert [entry.name for entry in directory.iterdir()] == [Path(path).name]
    state = torch.load(path, weights_only=False)["state_dict"]
    plain = TinyTransformer(HYBRID).state_dict()
    assert {name: tuple(tensor.shape) for name, tensor in state.items()} == {
        name: tuple(tensor.shape) for name, tensor in plain.items()
    }


def test_checkpoint_from_cp2_loads_at_cp1_cp4_tp2_and_plain_lightning(tmp_path: Path) -> None:
    """The cp=2 checkpoint gives the same validation loss under every loader."""
    path = str(tmp_path / "cp2.ckpt")
    saved_losses = run_on_ranks(train_and_save, 2, 2, path, {}, False, init_process_group=False)
    assert saved_losses[0] == saved_losses[1]
    assert_single_plain_checkpoint(tmp_path, path)
    assert_loads_everywhere(path, saved_losses[0], list(LOADERS))


def test_tensor_parallel_checkpoint_is_gathered_and_loads_on_one_device(tmp_path: Path) -> None:
    """A cp2 x tp2 run with sharded MLPs writes full weights that load at cp=1 without tensor parallelism."""
    path = str(tmp_path / "cp2tp2.ckpt")
    strategy = {"context_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel": "fsdp"}
    saved_losses = run_on_ranks(train_and_save, 4, 4, path, strategy, True, init_process_group=False)
    assert all(losses == saved_losses[0] for losses in saved_losses)
    assert_single_plain_checkpoint(tmp_path, path)
    assert_loads_everywhere(path, saved_losses[0], ["plain Lightning, one device"])


class RankStampedModel(TinyTransformer):
    """Stamps, in ``configure_model``, its head bias and its tensor-parallel MLP bias shard with the global rank."""

    def __init__(self) -> None:
        super().__init__(ATTENTION, tensor_parallel=True)
        self.mesh_seen: dict[str, Any] = {}
        self.stamps_at_evaluation: tuple[float, float] | None = None

    def configure_model(self) -> None:
        """Record the mesh handed over by the strategy, apply tensor parallelism and stamp this rank's weights."""
        mesh = self.device_mesh
        self.mesh_seen = {"names": mesh.mesh_dim_names, "shape": tuple(mesh.shape)}
        super().configure_model()
        with torch.no_grad():
            self.head.bias.fill_(float(self.global_rank))
            self.blocks[0].mlp[0].bias.to_local().fill_(float(self.global_rank))

    def on_validation_start(self) -> None:
        """Record the weights evaluation starts from: the plain bias and this rank's part of the TP shard."""
        plain, shard = self.head.bias, self.blocks[0].mlp[0].bias
        plain = plain.full_tensor() if isinstance(plain, DTensor) else plain
        self.stamps_at_evaluation = (plain[0].item(), shard.to_local()[0].item())

    on_test_start = on_validation_start

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Evaluate like ``validation_step``."""
        self.validation_step(batch, batch_idx)


def evaluate_rank_stamped(world_size: int) -> dict[str, dict[str, Any]]:
    """Validate, then test, a fresh stamped model at cp2 x tp2; report the mesh and weights each stage saw."""
    results = {}
    for stage in ("validate", "test"):
        os.environ["WORLD_SIZE"] = str(world_size)  # Lightning's teardown removes it
        model = RankStampedModel()
        trainer = pl.Trainer(
            devices=world_size,
            strategy=CPZigzagStrategy(context_parallel_size=2, tensor_parallel_size=2, data_parallel="fsdp"),
            **TRAINER_OPTIONS,
        )
        getattr(trainer, stage)(model, DataLoader(validation_batches(), batch_size=None), verbose=False)
        results[stage] = {"mesh": model.mesh_seen, "stamps": model.stamps_at_evaluation}
    return results


def test_evaluation_starts_from_rank_0_weights_and_the_module_gets_the_mesh() -> None:
    """cp2 x tp2 (TP fastest): every rank takes rank 0's plain weights; a TP shard comes from the DP x CP rank 0
    holding the same shard (ranks 0, 2 take rank 0's, ranks 1, 3 rank 1's)."""
    results = run_on_ranks(evaluate_rank_stamped, 4, 4, init_process_group=False)
    for stage in ("validate", "test"):
        for result in results:
            mesh = {"names": ("data_parallel", "context_parallel", "tensor_parallel"), "shape": (1, 2, 2)}
            assert result[stage]["mesh"] == mesh, stage
        assert [result[stage]["stamps"] for result in results] == [(0.0, 0.0), (0.0, 1.0)] * 2, stage


class SchedulerStepped(TinyTransformer):
    """Plain SGD (no per-parameter state) whose learning rate a scheduler halves every step; records the rates."""

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.rates = [*getattr(self, "rates", []), self.trainer.optimizers[0].param_groups[0]["lr"]]


def learning_rates_after_resume(strategy: dict[str, Any], directory: str) -> tuple[list[float], list[float]]:
    """The rates of a two-epoch run's second epoch, uninterrupted and resumed from the first epoch's checkpoint."""
    os.environ["WORLD_SIZE"] = "2"

    def fit(name: str, ckpt_path: str | None) -> list[float]:
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=f"{directory}/{name}", save_top_k=-1, filename="{epoch}")
        options = {**TRAINER_OPTIONS, "enable_checkpointing": True}
        trainer = pl.Trainer(devices=2, strategy=CPZigzagStrategy(**strategy), max_epochs=2,
                             callbacks=[ContextParallelLayoutCallback(**POLICY), checkpoint], **options)  # fmt: skip
        model = SchedulerStepped(ATTENTION)
        trainer.fit(model, DataLoader(packed_batches(3), batch_size=None), ckpt_path=ckpt_path)
        return model.rates

    uninterrupted = fit("first", None)[3:]
    return uninterrupted, fit("resumed", f"{directory}/first/epoch=0.ckpt")


def test_a_stateless_optimizer_resumes_with_its_scheduled_learning_rate(tmp_path: Path) -> None:
    """Plain SGD has no per-parameter state, so its checkpoint holds only its groups: their learning rate, which the
    scheduler set, comes back (before, the resumed epoch ran at the initial rate, 8x too large)."""
    for index, strategy in enumerate([{}, {"data_parallel": "fsdp", "save_distributed_checkpoint": True}]):
        uninterrupted, resumed = run_on_ranks(learning_rates_after_resume, 2, strategy, str(tmp_path / str(index)),
                                              init_process_group=False, timeout=180)[0]  # fmt: skip
        assert uninterrupted == resumed == [0.2 * 0.5**step for step in (3, 4, 5)], (strategy, resumed)


def save_in_both_formats(path: str, order: str) -> list[str]:
    """After one fsdp step at cp=2, save ``path`` as a folder and then as a file (or the other way round); return
    the kind of checkpoint left after each save and the step the last one holds."""
    os.environ["WORLD_SIZE"] = "2"
    strategy = CPZigzagStrategy(data_parallel="fsdp")
    trainer = pl.Trainer(
        devices=2, strategy=strategy, callbacks=[ContextParallelLayoutCallback(**POLICY)], max_steps=1,
        **TRAINER_OPTIONS,
    )  # fmt: skip
    trainer.fit(TinyTransformer(HYBRID), DataLoader(packed_batches(2), batch_size=None))
    kinds = []
    for distributed in (True, False) if order == "folder, then file" else (False, True):
        strategy.save_distributed_checkpoint = distributed
        trainer.save_checkpoint(path)
        kinds.append("folder" if is_distributed_checkpoint(path) else "file" if Path(path).is_file() else "neither")
    return kinds


def test_a_checkpoint_saved_over_one_of_the_other_format_replaces_it(tmp_path: Path) -> None:
    """``last.ckpt`` after switching ``save_distributed_checkpoint``: the new save replaces the old one in either
    direction (before, a file saved over a folder vanished into it and the folder stayed, an older step)."""
    for order in ("folder, then file", "file, then folder"):
        path = str(tmp_path / f"{order}.ckpt")
        expected = ["folder", "file"] if order == "folder, then file" else ["file", "folder"]
        assert run_on_ranks(save_in_both_formats, 2, path, order, init_process_group=False) == [expected] * 2
        assert sorted(entry.name for entry in tmp_path.iterdir() if entry.name.startswith(order)) == [Path(path).name]
