"""The main job under FSDP2, tensor and sequence parallelism, and with sharded checkpoint folders, from the CLI."""

from __future__ import annotations

from pathlib import Path

from lightning_cp.lightning.state import is_distributed_checkpoint
from lightning_cp.train.data import PackedTextDataModule
from tests.cli_helpers import assert_same, run_cli, run_losses

PARITY = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=4",
    "trainer.precision=64-true",
    "checkpoint.every_n_steps=3",
    "checkpoint.save_top_k=-1",
    "data.tokens_per_sample=256",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.intermediate_size=176",
    "optim.warmup_steps=2",
]


def fit(root: Path, name: str, *overrides: str) -> Path:
    """Run ``lightning-cp fit`` with the parity settings; return the run folder."""
    result = run_cli("fit", *PARITY, *overrides, f"run.root={root}", f"run.name={name}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / name


def test_fsdp_and_tensor_parallel_runs_match_ddp_at_cp1(tmp_path: Path) -> None:
    """fsdp cp2, fsdp tp2 with sequence parallelism, and fsdp cp2 x tp2 without it, all match ddp cp1 in float64."""
    single = fit(tmp_path, "ddp-cp1", "trainer.devices=1", "strategy.context_parallel_size=1")
    (steps, train), (val_steps, val) = run_losses(single)
    assert steps == list(range(6)) and val_steps == [0, 3, 6] and train[0] != train[-1]
    runs = {
        "fsdp-cp2": ["trainer.devices=2", "strategy.context_parallel_size=2"],
        "fsdp-tp2-sp": [
            "trainer.devices=2",
            "strategy.context_parallel_size=1",
            "strategy.tensor_parallel_size=2",
            "strategy.sequence_parallel=true",
        ],
        "fsdp-cp2tp2": ["trainer.devices=4", "strategy.context_parallel_size=2", "strategy.tensor_parallel_size=2"],
    }
    for name, overrides in runs.items():
        (other_steps, other_train), (other_val_steps, other_val) = run_losses(
            fit(tmp_path, name, "strategy.data_parallel=fsdp", *overrides)
        )
        assert other_steps == steps and other_val_steps == val_steps, name
        assert_same(other_train, train, rel=1e-9)
        assert_same(other_val, val, rel=1e-9)


def test_validation_scores_every_sample_on_any_number_of_replicas(tmp_path: Path) -> None:
    """89 validation samples: on 2 data-parallel replicas the last round is one sample (the other replica runs a
    filler that scores nothing), and the step-0 validation loss is that of 1 replica, which scores each (float64)."""
    small = [*PARITY, "trainer.max_steps=1", "trainer.limit_val_batches=1.0", "data.tokens_per_sample=512"]
    small += ["data.samples_per_batch=1", "strategy.context_parallel_size=1"]
    held_out = PackedTextDataModule(tokens_per_sample=512)
    held_out.setup("validate")
    assert len(held_out.val_samples) % 2, "an odd count, so one replica runs a filler"
    losses = []
    for devices in (1, 2):
        name = f"dp{devices}"
        result = run_cli("fit", *small, f"trainer.devices={devices}", f"run.root={tmp_path}", f"run.name={name}")
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(run_losses(tmp_path / name)[1][1][0])
    assert_same([losses[1]], [losses[0]], rel=1e-12)


def test_sharded_checkpoint_folder_resumes_under_another_layout(tmp_path: Path) -> None:
    """``checkpoint.distributed=true`` under fsdp cp2 writes folders; ddp cp1 resumes the step-3 one exactly."""
    saved = fit(tmp_path, "sharded", "trainer.devices=2", "strategy.data_parallel=fsdp", "checkpoint.distributed=true")
    checkpoints = saved / "checkpoints"
    assert is_distributed_checkpoint(checkpoints / "last.ckpt")
    assert is_distributed_checkpoint(checkpoints / "step000003.ckpt")
    assert not list(checkpoints.glob("*.partial"))
    resumed = fit(
        tmp_path,
        "resumed",
        "trainer.devices=1",
        "strategy.context_parallel_size=1",
        f"checkpoint.resume_from={checkpoints / 'step000003.ckpt'}",
    )
    (steps, train), (val_steps, val) = run_losses(saved)
    (resumed_steps, resumed_train), (resumed_val_steps, resumed_val) = run_losses(resumed)
    assert resumed_steps == steps[3:] and resumed_val_steps[-1] == 6
    assert_same(resumed_train, train[3:], rel=1e-9)
    saved_val = dict(zip(val_steps, val, strict=True))
    assert_same(resumed_val, [saved_val[step] for step in resumed_val_steps], rel=1e-9)


def test_tensor_parallel_without_fsdp_or_with_a_bad_size_is_one_line(tmp_path: Path) -> None:
    """What cannot run stops before any process starts, with exit code 2."""
    cases = {
        "needs strategy.data_parallel=fsdp": ["strategy.tensor_parallel_size=2", "strategy.context_parallel_size=1"],
        "does not divide model.num_kv_heads=2": [
            "strategy.tensor_parallel_size=4",
            "strategy.context_parallel_size=1",
            "trainer.devices=4",
            "strategy.data_parallel=fsdp",
        ],
    }
    for message, overrides in cases.items():
        result = run_cli("fit", *overrides, f"run.root={tmp_path}")
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
