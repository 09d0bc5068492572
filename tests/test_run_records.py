"""What the main job records: a run killed during the validation of a checkpoint step resumes without losing that
validation, a run whose last step is no multiple of ``checkpoint.every_n_steps`` saves it, and under gradient
accumulation each optimizer step's loss and learning rate are one row, and a batch without targets logs no loss."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_cp.train.data.collate import collate_dense
from lightning_cp.train.models import LlamaLM
from lightning_cp.train.runfolder import read_metrics
from tests.cli_helpers import TIMEOUT, assert_same, cli_env, run_losses

TINY = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "checkpoint.every_n_steps=2",
    "data.tokens_per_sample=128",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.intermediate_size=64",
    "trainer.devices=1",
    "strategy.context_parallel_size=1",
    "trainer.enable_progress_bar=false",
]
KILLED_AT_VALIDATION = """
import sys
from lightning_cp.train.cli import main
from lightning_cp.train.models import LlamaLM

def killed(self):
    if self.trainer.state.fn == "fit" and self.trainer.global_step == int(sys.argv[1]):
        raise KeyboardInterrupt  # as a kill would stop it: in the middle of this validation
LlamaLM.on_validation_start = killed
sys.exit(main(sys.argv[2:]))
"""


def _fit(root: Path, name: str, *args: str, killed_at: int = -1) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", KILLED_AT_VALIDATION, str(killed_at), "fit", *TINY, f"run.root={root}"]
    return subprocess.run(
        [*command, f"run.name={name}", *args], capture_output=True, text=True, timeout=TIMEOUT, env=cli_env()
    )


def test_a_run_killed_in_a_checkpoint_steps_validation_resumes_with_every_validation(tmp_path: Path) -> None:
    """Killed while validating at step 4 (a checkpoint step), then resumed: the same train and validation losses at
    the same steps as the uninterrupted run (a checkpoint saved before that validation would skip it on resume)."""
    assert _fit(tmp_path, "full").returncode == 0
    assert _fit(tmp_path, "killed", killed_at=4).returncode != 0
    resumed = _fit(tmp_path, "killed", "checkpoint.resume_from=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (steps, train), (val_steps, val) = run_losses(tmp_path / "killed")
    (full_steps, full_train), (full_val_steps, full_val) = run_losses(tmp_path / "full")
    assert val_steps == full_val_steps == [0, 2, 4] and steps == full_steps == [0, 1, 2, 3]
    assert_same(train, full_train, rel=1e-6)
    assert_same(val, full_val, rel=1e-6)


def test_the_last_step_is_saved_when_the_checkpoint_interval_does_not_reach_it(tmp_path: Path) -> None:
    """``max_steps=5`` with checkpoints every 2 steps: ``last.ckpt`` and the newest step checkpoint hold step 5."""
    assert _fit(tmp_path, "run", "trainer.max_steps=5").returncode == 0
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step000005.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True, mmap=True)["global_step"] == 5


def test_under_accumulation_a_step_logs_the_mean_loss_of_its_batches_and_one_learning_rate(tmp_path: Path) -> None:
    """With a learning rate of 1e-300 the weights stay put, so two steps of two accumulated batches log the means of
    the losses a run without accumulation logs for those four batches (Lightning would keep each step's last)."""
    fixed = ["optim.lr=1e-300", "trainer.precision=64-true", "trainer.val_check_interval=100"]
    fixed.append("trainer.limit_val_batches=1")
    assert _fit(tmp_path, "single", *fixed).returncode == 0
    assert (
        _fit(tmp_path, "accumulated", *fixed, "trainer.max_steps=2", "trainer.accumulate_grad_batches=2").returncode
        == 0
    )
    (_, single), _ = run_losses(tmp_path / "single")
    (steps, accumulated), _ = run_losses(tmp_path / "accumulated")
    assert steps == [0, 1] and len(set(single)) == 4
    assert_same(accumulated, [(single[0] + single[1]) / 2, (single[2] + single[3]) / 2], rel=1e-12)
    rows = read_metrics(tmp_path / "accumulated" / "metrics.csv")
    learning_rates = [row["step"] for row in rows if any(key.startswith("lr-") and row[key] for key in row)]
    assert sorted(learning_rates) == ["0", "1"]


def test_a_batch_without_targets_logs_no_loss(tmp_path: Path) -> None:
    """A step whose batch has no target trains nothing; logging its loss, 0, would read as a perfect fit."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    rows = [(ids[0], torch.full((16,), -100)), (ids[1], ids[1])]  # the first batch scores nothing
    loader = torch.utils.data.DataLoader(rows, batch_size=1, collate_fn=collate_dense)
    model = LlamaLM(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(tmp_path, name="", version=""),
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows if row.get("train_loss")] == ["1"]
