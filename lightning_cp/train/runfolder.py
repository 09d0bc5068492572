"""The run folder: its location, the saved configuration, ``metrics.csv`` bookkeeping and the loss plot."""

from __future__ import annotations

import csv
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_cp.train.config import ConfigError

RUN_DIR_ENV = "LIGHTNING_CP_RUN_DIR"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.csv"
PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"
HF_DIR = "hf"
LAST_CHECKPOINT = "last.ckpt"
VAL_STEP = "trained_steps"


def latest_run(root: Path) -> Path | None:
    """Return the most recently modified run folder under ``root`` that holds a last checkpoint."""
    runs = [p.parent.parent for p in root.glob(f"*/{CHECKPOINT_DIR}/{LAST_CHECKPOINT}")]
    return max(runs, key=lambda p: (p / CHECKPOINT_DIR / LAST_CHECKPOINT).stat().st_mtime) if runs else None


def default_run_name(root: Path) -> str:
    """Name a fresh run: the job id under SLURM or torchrun (every process must agree), else the start time, made
    unique under ``root`` with a ``-2``, ``-3``, ... suffix."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if job != "none":
        return f"job-{job}"
    if "LOCAL_RANK" in os.environ:
        raise ConfigError("set run.name when an external launcher starts the processes (they must share one folder)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return next(name for name in (stamp, *(f"{stamp}-{n}" for n in range(2, 10_000))) if not (root / name).exists())


def check_run_name(name: str) -> None:
    """Accept only a plain folder name: no separators, no ``..``, not absolute."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise ConfigError(f"run.name={name!r}: expected a plain folder name under run.root (no '/', no '..')")


def _launched_by_lightning() -> bool:
    """Whether this process is a rank Lightning's launcher started (it must use the folder its parent chose)."""
    return os.environ.get(RUN_DIR_ENV) is not None and "LOCAL_RANK" in os.environ


def resolve_run_dir(cfg: DictConfig) -> Path:
    """Return the run folder and pin it in the environment so ranks started later by Lightning agree on it.

    ``run.name`` names the folder under ``run.root``; without one a fresh run is named by its start time (or job id)
    and a run resumed with ``checkpoint.resume_from=last`` continues the latest run under the root.
    """
    if _launched_by_lightning():
        return Path(os.environ[RUN_DIR_ENV])
    root = Path(cfg.run.root).expanduser()
    if cfg.run.name:
        check_run_name(cfg.run.name)
        run_dir = root / cfg.run.name
    elif cfg.checkpoint.resume_from == "last" and (latest := latest_run(root)) is not None:
        run_dir = latest
    else:
        run_dir = root / default_run_name(root)
    os.environ[RUN_DIR_ENV] = str(run_dir.resolve())
    return run_dir.resolve()


def check_fresh_or_resumed(run_dir: Path, resuming: bool) -> None:
    """A new run never writes into an existing run's folder, and nothing in a run folder is a symbolic link.

    Checked by the process that starts the run (Lightning's launcher or global rank 0 of an external one): the others
    find the folder that one just created.
    """
    if _launched_by_lightning() or rank_zero_only.rank > 0 or int(os.environ.get("NODE_RANK", "0")) > 0:
        return
    if not resuming and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"run folder {run_dir} holds another run: continue it with checkpoint.resume_from=auto "
            f"run.name={run_dir.name} (from its newest checkpoint, or afresh when it saved none), or choose a new "
            "run.name"
        )
    linked = [path for path in (run_dir, *run_dir.glob("*"), *run_dir.glob(f"{CHECKPOINT_DIR}/*")) if path.is_symlink()]
    if linked:
        raise ConfigError(f"{linked[0]} is a symbolic link; run folders are never written through links")


def resolve_checkpoint(path: str | None, run_dir: Path, readable: Callable[[str], bool] | None = None) -> str | None:
    """Return the checkpoint (a file, or a folder of shards) ``path`` names; ``"last"`` is the run folder's
    ``checkpoints/last.ckpt``, or, when that one is missing or unreadable (``readable``), the newest readable step
    checkpoint (saying so); ``"auto"`` is the same, or None (a fresh start) when the run folder has none."""
    if path is None:
        return None
    if path not in ("last", "auto"):
        resolved = Path(path).expanduser()
        if not resolved.exists():
            raise FileNotFoundError(f"checkpoint {resolved} does not exist")
        return str(resolved)
    folder = run_dir / CHECKPOINT_DIR
    candidates = [folder / LAST_CHECKPOINT, *sorted(folder.glob("step*.ckpt"), reverse=True)]
    for candidate in candidates:
        if candidate.exists() and (readable is None or readable(str(candidate))):
            if candidate.name != LAST_CHECKPOINT:
                print(f"lightning-cp: {folder / LAST_CHECKPOINT} is missing or unreadable; resuming {candidate.name}")
            return str(candidate)
    if path == "auto":
        return None
    raise FileNotFoundError(f"no readable checkpoint in {folder}")


def write_atomically(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Write ``path`` through a temporary file in its own folder, synced, then renamed over it (all or nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open(mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_config(cfg: DictConfig, run_dir: Path) -> Path:
    """Write the merged configuration (with the resolved run name) into the run folder, atomically."""
    cfg = cfg.copy()
    cfg.run.name = run_dir.name
    path = run_dir / CONFIG_FILE
    write_atomically(path, lambda handle: handle.write(OmegaConf.to_yaml(cfg)))
    return path


def save_pretrained(model: Any, tokenizer: Any, run_dir: Path, weights: dict[str, Any]) -> Path:
    """Save a Hugging Face model's full ``weights`` (gathered: the model itself may hold FSDP shards) with its
    default attention, so plain ``transformers`` loads it, and the tokenizer."""
    path = run_dir / HF_DIR
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        model.save_pretrained(path, state_dict=weights)
    finally:
        model.set_attn_implementation(implementation)
    tokenizer.save_pretrained(str(path))
    return path


def read_metrics(path: Path) -> list[dict[str, str]]:
    """Return the rows of a ``metrics.csv`` (empty when it does not exist)."""
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def truncate_metrics(path: Path, first_dropped_step: int) -> None:
    """Drop rows logged at or after ``first_dropped_step`` (an interrupted run's steps past its checkpoint)."""
    rows = read_metrics(path)
    if rows:
        write_metrics(path, [row for row in rows if int(row["step"]) < first_dropped_step], list(rows[0]))


class _ContinuingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` (a resumed run's, trimmed) is continued."""

    @override
    def _check_log_dir_exists(self) -> None:
        rows = read_metrics(Path(self.metrics_file_path))
        self.metrics_keys = list(rows[0]) if rows else []  # the file's own column order


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing through a synced temporary file in the checkpoint's own folder and a
    rename, so a kill, a full disk or Ctrl-C never leaves a truncated checkpoint under the real name."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically; a checkpoint folder of that name (a run resumed with
        ``checkpoint.distributed`` switched off) is moved aside first and removed once the file is in place."""
        path = Path(path)
        aside = path.with_name(f"{path.name}.replaced")
        if path.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
        write_atomically(path, lambda handle: torch.save(checkpoint, handle), mode="wb")
        shutil.rmtree(aside, ignore_errors=True)


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` writing ``<run folder>/metrics.csv`` at every step and continuing it on resume."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """Return the writer, created on first use in the run folder."""
        if self._experiment is None:
            self._fs.makedirs(self.log_dir, exist_ok=True)
            self._experiment = _ContinuingExperimentWriter(log_dir=self.log_dir)
        return self._experiment


def write_metrics(path: Path, rows: list[dict[str, str]], fields: list[str]) -> None:
    """Write ``rows`` with the columns ``fields`` (missing cells empty), atomically."""

    def write(handle: Any) -> None:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)

    write_atomically(path, write)


def loss_series(rows: list[dict[str, str]], column: str, step_column: str = "step") -> tuple[list[int], list[float]]:
    """Return the ``(steps, values)`` of one metric column, skipping empty cells."""
    points = [(int(float(row[step_column])), float(row[column])) for row in rows if row.get(column) not in (None, "")]
    return [s for s, _ in points], [v for _, v in points]


def plot_losses(run_dir: Path, unit: str = "token") -> Path:
    """Plot train and validation loss (nats per ``unit``: what a token of the run's tokenizer is) against the step
    into ``loss.png`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / METRICS_FILE)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps, values = loss_series(rows, "train_loss")
    ax.plot(steps, values, "-", label="train loss", linewidth=0.8, alpha=0.8)
    steps, values = loss_series(rows, "val_loss", step_column=VAL_STEP)
    ax.plot(steps, values, "o-", label="validation loss", markersize=4, linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"cross-entropy (nats per {unit})")
    ax.set_title(f"lightning-cp fit: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(run_dir: Path) -> str:
    """Return a one-paragraph summary of the run: steps, first and last validation loss, median throughput."""
    rows = read_metrics(run_dir / METRICS_FILE)
    steps, train = loss_series(rows, "train_loss")
    val_steps, val = loss_series(rows, "val_loss", step_column=VAL_STEP)
    rates = sorted(loss_series(rows, "tokens_per_second")[1])
    parts = [f"run folder: {run_dir}"]
    if steps:
        trained = f"trained to step {steps[-1] + 1}, last train loss {train[-1]:.4f}"
        parts.append(trained + (f", median {rates[len(rates) // 2]:,.0f} tokens/s" if rates else ""))
    if val:
        ppl = math.exp(val[-1]) if val[-1] < 50 else float("inf")
        first, last = f"{val[0]:.4f} (step {val_steps[0]})", f"{val[-1]:.4f} (step {val_steps[-1]}, ppl {ppl:.2f})"
        parts.append(f"val loss {first} -> {last}")
    return "\n".join(parts)
