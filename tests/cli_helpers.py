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
