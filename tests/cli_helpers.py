"""Test helper: run the ``lightning-cp`` console script in a subprocess and read a run folder's losses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lightning_cp.train.runfolder import RUN_DIR_ENV, loss_series, read_metrics

SCRIPT = str(Path(sys.executable).parent / "lightning-cp")
TIMEOUT = 240


def cli_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop(RUN_DIR_ENV, None)
    return env


def run_cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=cli_env(), check=False)


def run_losses(run_dir: Path) -> tuple[tuple[list[int], list[float]], tuple[list[int], list[float]]]:
    rows = read_metrics(run_dir / "metrics.csv")
    return loss_series(rows, "train_loss"), loss_series(rows, "val_loss", step_column="trained_steps")


def assert_same(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rel * abs(y), (x, y)


def assert_same_losses(run_dir: Path, reference_dir: Path, steps: int, val_steps: list[int]) -> list[float]:
    """Both runs logged training losses at steps ``0 .. steps - 1`` and validation losses after ``val_steps`` trained
    steps, equal to relative 1e-9 (float64 runs); returns the reference's validation losses."""
    (train_steps, train), (validated, val) = run_losses(run_dir)
    (reference_steps, reference_train), (reference_validated, reference_val) = run_losses(reference_dir)
    assert train_steps == reference_steps == list(range(steps)) and validated == reference_validated == val_steps
    assert_same(train, reference_train, rel=1e-9)
    assert_same(val, reference_val, rel=1e-9)
    return reference_val
