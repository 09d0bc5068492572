"""Build the datamodule, model and Trainer of a configuration and run ``fit`` or ``validate``."""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import environments
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_cp.core.mesh import default_context_parallel_size
from lightning_cp.lightning import state
from lightning_cp.lightning.callback import ContextParallelLayoutCallback
from lightning_cp.lightning.module import CausalLMModule, max_steps_alone
from lightning_cp.lightning.strategy import CPZigzagStrategy
from lightning_cp.train import runfolder
from lightning_cp.train.config import RUN_TIME_MODEL_KEYS, ConfigError, plain
from lightning_cp.train.data import ByteTokenizer, HFTokenizer, PackedTextDataModule
from lightning_cp.train.data.sources import EMBEDDED
from lightning_cp.train.data.tokenizer import Tokenizer
from lightning_cp.train.models import LlamaLM
from lightning_cp.train.models.llama import layer_kinds


def build_tokenizer(cfg: DictConfig) -> Tokenizer:
    """Return ``data.tokenizer`` or the pretrained model's tokenizer, else the byte tokeniser of the built-in model."""
    path = cfg.data.tokenizer or cfg.model.pretrained
    return ByteTokenizer() if path is None else HFTokenizer(path)


def check_vocabulary(cfg: DictConfig, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer with ids the model has no embedding row for (the first step would fail with a bare
    IndexError, on a GPU a device-side assert)."""
    ids = getattr(tokenizer, "vocab_size", None)
    if cfg.model.pretrained:
        from transformers import AutoConfig

        rows = AutoConfig.from_pretrained(cfg.model.pretrained).get_text_config().vocab_size
        fix = "give a tokenizer of model.pretrained's vocabulary"
    else:
        rows, fix = cfg.model.vocab_size, f"set model.vocab_size={ids} (or more)"
    if isinstance(ids, int) and isinstance(rows, int) and ids > rows:
        raise ConfigError(f"data.tokenizer has {ids} token ids, but the model's vocabulary has {rows}: {fix}")


def build_datamodule(cfg: DictConfig, tokenizer: Tokenizer | None = None) -> PackedTextDataModule:
    """Return the packed-text datamodule of ``cfg.data``."""
    data = cfg.data
    return PackedTextDataModule(
        sources=list(data.sources),
        val_sources=list(data.val_sources) if data.val_sources else None,
        val_fraction=data.val_fraction,
        split_seed=data.split_seed,
        tokens_per_sample=data.tokens_per_sample,
        samples_per_batch=data.samples_per_batch,
        packed=data.packed,
        shuffle=data.shuffle,
        seed=cfg.seed,
        num_workers=data.num_workers,
        tokenizer=tokenizer or build_tokenizer(cfg),
    )


def build_model(cfg: DictConfig) -> CausalLMModule:
    """Return the model of ``cfg.model`` (the built-in one, or ``pretrained``) with ``cfg.optim``, with weights from
    ``checkpoint.init_from``."""
    optim = plain(cfg.optim)
    optim["betas"] = tuple(optim["betas"])
    architecture = plain(cfg.model)
    pretrained = architecture.pop("pretrained")
    if pretrained:
        from lightning_cp.lightning.hf import HFCausalLM

        model: CausalLMModule = HFCausalLM(
            pretrained,
            gradient_checkpointing=architecture["activation_checkpointing"],
            loss_chunk_tokens=architecture["loss_chunk_tokens"],
            **optim,
        )
    else:
        model = LlamaLM(**architecture, **optim)
    if cfg.checkpoint.init_from and state.is_distributed_checkpoint(cfg.checkpoint.init_from):
        state.load_distributed_weights(model, cfg.checkpoint.init_from)
    elif cfg.checkpoint.init_from:
        load_fitting_weights(
            model, load_checkpoint_meta(cfg.checkpoint.init_from)["state_dict"], cfg.checkpoint.init_from
        )
    return model


def load_fitting_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str) -> None:
    """Load a checkpoint's ``weights`` into ``model``, or raise ``ConfigError`` in one line naming what does not
    fit: missing, unexpected or differently shaped entries, and entries the model ties together (one tensor) that
    the checkpoint holds as different tensors (the last loaded would silently win)."""
    own = model.state_dict()
    problems = [f"missing {name}" for name in sorted(own.keys() - weights.keys())]
    problems += [f"unexpected {name}" for name in sorted(weights.keys() - own.keys())]
    problems += [
        f"{name} is {list(weights[name].shape)} in the checkpoint but {list(own[name].shape)} in the model"
        for name in sorted(own.keys() & weights.keys())
        if own[name].shape != weights[name].shape
    ]
    if not problems:
        model.load_state_dict(weights)
        loaded = model.state_dict()
        problems = [
            f"{name} is tied to another weight in the model but not in the checkpoint"
            for name in sorted(weights)
            if not torch.equal(loaded[name], weights[name].to(loaded[name].dtype))
        ]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise ConfigError(f"checkpoint.init_from={path} does not fit the model: {shown}")


def build_strategy(cfg: DictConfig) -> CPZigzagStrategy:
    """Return the ``cp_zigzag`` strategy of ``cfg.strategy``."""
    kwargs: dict[str, Any] = plain(cfg.strategy)
    kwargs["timeout"] = timedelta(seconds=kwargs.pop("timeout_s"))
    return CPZigzagStrategy(**kwargs, save_distributed_checkpoint=cfg.checkpoint.distributed)


def has_validation(cfg: DictConfig) -> bool:
    """Whether the run has validation data (``data.val_fraction=0`` with no ``data.val_sources`` has none)."""
    return bool(cfg.data.val_sources) or cfg.data.val_fraction > 0


def validation_schedule(trainer_args: dict[str, Any]) -> dict[str, Any]:
    """Lightning's arguments for validating every ``val_check_interval`` optimizer steps (Lightning counts batches,
    ``accumulate_grad_batches`` of them per step). With ``max_steps`` alone (one epoch) they count over the run, a
    fraction being of ``max_steps``; with ``max_epochs``, within each epoch (each starts a fresh accumulation, so
    the count stays on step ends), a fraction being of the epoch, as in Lightning."""
    interval, max_steps = trainer_args["val_check_interval"], trainer_args["max_steps"]
    accumulate = trainer_args["accumulate_grad_batches"]
    if not max_steps_alone(max_steps, trainer_args.get("max_epochs")):
        return {} if isinstance(interval, float) else {"val_check_interval": interval * accumulate}
    if isinstance(interval, float):
        interval = max(1, round(interval * max_steps))
    return {"val_check_interval": min(interval, max_steps) * accumulate, "check_val_every_n_epoch": None}


_LONGER_THAN_AN_EPOCH = re.compile(r"`val_check_interval` \(\d+\) must be less than or equal to the number of the "
                                   r"training batches \((\d+)\)")  # fmt: skip


@contextmanager
def interval_errors_in_steps(trainer_args: dict[str, Any]) -> Iterator[None]:
    """Turn Lightning's refusal of a ``val_check_interval`` longer than an epoch, which names the batches
    ``validation_schedule`` made of it, into a ``ConfigError`` in the optimizer steps the configuration gave."""
    try:
        yield
    except ValueError as error:
        longer = _LONGER_THAN_AN_EPOCH.search(str(error))
        if longer is None:
            raise
        batches, accumulate = int(longer[1]), trainer_args["accumulate_grad_batches"]
        raise ConfigError(
            f"trainer.val_check_interval={trainer_args['val_check_interval']} optimizer steps does not fit in an epoch "
            f"(at most {batches // accumulate}: {batches} batches, accumulate_grad_batches={accumulate}); with "
            "trainer.max_epochs it counts within each epoch: give at most that, or a fraction of the epoch"
        ) from None


def build_trainer(cfg: DictConfig, run_dir: Path, *, log: bool = True) -> pl.Trainer:
    """Return a Trainer that logs ``metrics.csv`` (unless ``log`` is false) and checkpoints into ``run_dir``."""
    checkpoint = StepCheckpoint(
        dirpath=run_dir / runfolder.CHECKPOINT_DIR,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=cfg.checkpoint.every_n_steps,
        save_top_k=cfg.checkpoint.save_top_k,
        monitor="step" if cfg.checkpoint.save_top_k > 1 else None,  # a count keeps the newest steps
        mode="max",
        save_last=True,
    )
    trainer_args: dict[str, Any] = plain(cfg.trainer)
    trainer_args.update(validation_schedule(trainer_args))
    if not has_validation(cfg):
        rank_zero_info("lightning-cp: no validation data (data.val_fraction=0, no data.val_sources): training without")
        trainer_args["limit_val_batches"] = 0
    layout_callback = ContextParallelLayoutCallback(**plain(cfg.layout))
    progress = [StepsProgressBar()] if cfg.trainer.enable_progress_bar and _RICH_AVAILABLE else []  # else Lightning's
    finite = [StopOnNonFiniteLoss()] if cfg.run.stop_on_nonfinite_loss else []
    monitors = [StepLearningRateMonitor(logging_interval="step"), EndRanksOnFailure()]
    return pl.Trainer(
        **trainer_args,
        strategy=build_strategy(cfg),
        logger=runfolder.RunCSVLogger(run_dir) if log else False,
        callbacks=[TokenThroughput(), layout_callback, checkpoint, *monitors, *finite, *progress],
        plugins=[runfolder.AtomicCheckpointIO()],
        use_distributed_sampler=False,
        enable_checkpointing=True,
    )


class StepCheckpoint(ModelCheckpoint):
    """Lightning's step checkpoints, saved where a resumed run loses nothing: a checkpoint step that validation
    follows once that validation has ended (Lightning skips a validation it finds due at the step it resumes, so a run
    killed during it would never log that point), and the run's last step as it ends (``last.ckpt`` would otherwise
    keep the last multiple of ``every_n_train_steps``)."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        epoch_loop = trainer.fit_loop.epoch_loop  # Lightning's own test of whether validation follows this batch
        validates = due and epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        if validates and not self._should_skip_saving_checkpoint(trainer):
            self._defer_save_until_validation = True  # saved by ModelCheckpoint.on_validation_end
            return
        super().on_train_batch_end(trainer, pl_module, *args)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # the last step is not saved yet
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


class StepLearningRateMonitor(LearningRateMonitor):
    """Lightning's learning-rate monitor, one row per optimizer step (it logs as every batch starts: under gradient
    accumulation once per accumulated batch, all at the same step)."""

    _logged_step: int | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != self._logged_step:
            self._logged_step = trainer.global_step
            super().on_train_batch_start(trainer, *args, **kwargs)


class StepsProgressBar(RichProgressBar):
    """Lightning's rich progress bar, titled "Training" rather than "Epoch 0/-2" when ``max_steps`` alone bounds the
    run (Lightning then sets ``max_epochs=-1``, and the run is one epoch)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not max_steps_alone(self.trainer.max_steps, self.trainer.max_epochs):
            return super()._get_train_description(current_epoch)
        return f"{'Training':{len(self.validation_description)}}"


class TokenThroughput(pl.Callback):
    """Log ``tokens_per_second``: the tokens of every replica's batches (padding not counted) trained per second of
    wall time, from the end of one optimizer step to the end of the next (data loading included, validation not);
    one tiny all-reduce per step sums the replicas' counts.

    It reads each batch before the layout callback shards it in place, so it comes first in the callback list.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._tokens = 0
        self._since = clock()

    def _restart(self, *_: Any) -> None:
        """Start timing afresh (training starts or resumes, or validation has just run)."""
        self._tokens, self._since = 0, self.clock()

    on_train_start = on_validation_end = _restart

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        """Count the replica batch's tokens."""
        self._tokens += int(batch["input_ids"].numel())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """At the end of an optimizer step, log the tokens of every replica since the previous one per second."""
        if trainer.fit_loop._should_accumulate():
            return
        counted = torch.tensor(float(self._tokens), dtype=torch.float64, device=pl_module.device)
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        replicas = kwargs["num_replicas"] if kwargs else 1  # each replica's count comes from all of its ranks
        tokens = float(trainer.strategy.reduce(counted, reduce_op="sum")) * replicas / trainer.world_size
        now = self.clock()
        rate = tokens / max(now - self._since, 1e-9)
        pl_module.log("tokens_per_second", rate, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)
        self._tokens, self._since = 0, now


class StopOnNonFiniteLoss(pl.Callback):
    """Stop at the first step whose loss is not finite on any rank, before its backward (one tiny all-reduce)."""

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Agree over all ranks whether any rank's loss of this step is NaN or infinite; stop everywhere if so."""
        bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(())
        if float(trainer.strategy.reduce(bad, reduce_op="sum")) > 0:
            raise FloatingPointError(
                f"the training loss is not finite at step {trainer.global_step} (lower optim.lr, or set "
                "run.stop_on_nonfinite_loss=false); the last checkpoint is intact"
            )


RANKS_LEFT_BEHIND: list[subprocess.Popen] = []
END_RANKS_GRACE_S = 3.0


class EndRanksOnFailure(pl.Callback):
    """When a Trainer call fails in the process that launched the other ranks, keep those ranks for
    ``end_ranks_left_behind``: one waiting for this process (to start, or in a collective) would wait orphaned for
    ``strategy.timeout_s``."""

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Record the ranks this process's launcher started (none in the ranks it started)."""
        RANKS_LEFT_BEHIND.extend(getattr(trainer.strategy.launcher, "procs", []))


def end_ranks_left_behind(grace_s: float = END_RANKS_GRACE_S) -> None:
    """Give the ranks kept by ``EndRanksOnFailure`` ``grace_s`` seconds to end by themselves (printing their own
    error), then kill those still running: a stopped rank, or one waiting for this process, never would."""
    deadline = time.monotonic() + grace_s
    while RANKS_LEFT_BEHIND:
        process = RANKS_LEFT_BEHIND.pop()
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def launches_ranks() -> bool:
    """Whether Lightning's own launcher starts the ranks from this process, on the node that hosts the rendezvous
    (no external launcher or cluster manager started it: the same choice of environment the Trainer makes)."""
    if "LOCAL_RANK" in os.environ or os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) != "0":
        return False
    managed = (environments.TorchElasticEnvironment, environments.SLURMEnvironment, environments.LSFEnvironment,
               environments.MPIEnvironment)  # fmt: skip
    return not any(env.detect() for env in managed)


def check_main_port() -> None:
    """Refuse a ``MASTER_PORT`` that cannot be bound here, before any rank starts, in the process that will host the
    rendezvous on it: otherwise this process fails to listen and the ranks it started wait for it."""
    value = os.environ.get("MASTER_PORT")
    if value is None or not launches_ranks():
        return
    advice = "set MASTER_PORT to a free port, or unset it to let lightning-cp pick one"
    if not value.strip().isdigit() or not 1 <= int(value) <= 65535:
        raise ConfigError(f"MASTER_PORT={value}: expected a port number in 1..65535; {advice}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous server does
        try:
            probe.bind(("", int(value)))
        except OSError as error:
            raise ConfigError(f"MASTER_PORT={value} cannot be used ({error.strerror}); {advice}") from None


def load_checkpoint_meta(path: str) -> dict[str, Any]:
    """Return a Lightning checkpoint's contents, memory-mapped so only what is read is loaded (of a checkpoint folder:
    everything but the weights and optimizer state).

    Only tensors and plain values are unpickled (``weights_only=True``): opening a checkpoint never runs code in it.
    """
    if Path(path).is_dir() and not state.is_distributed_checkpoint(path):
        raise ConfigError(f"not a checkpoint (an incomplete folder, or not written by lightning-cp): {path}")
    folder = Path(path).is_dir()
    try:
        if folder:
            meta = torch.load(Path(path) / state.META_FILE, map_location="cpu", weights_only=True)
        else:
            meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ConfigError(
            f"refused to open {path}: it holds objects other than tensors and plain values (code could run)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError):
        raise ConfigError(f"not a checkpoint (truncated or not written by lightning-cp): {path}") from None
    needed = ("global_step",) if folder else ("global_step", "state_dict")  # a plain state dict, weights alone
    if not isinstance(meta, dict) or any(key not in meta for key in needed):
        raise ConfigError(f"not a checkpoint (truncated or not written by lightning-cp): {path}")
    return meta


def is_readable_checkpoint(path: str) -> bool:
    """Whether ``path`` opens as a checkpoint."""
    try:
        load_checkpoint_meta(path)
    except ConfigError:
        return False
    return True


def check_checkpoint_fits(cfg: DictConfig, path: str, key: str) -> dict[str, Any]:
    """Return the checkpoint; raise ``ConfigError`` naming each ``model.*`` value that differs from its own."""
    checkpoint = load_checkpoint_meta(path)
    saved = checkpoint.get("hyper_parameters", {})
    if cfg.model.pretrained and "hidden_size" in saved:  # the built-in model's architecture, not a pretrained one's
        raise ConfigError(f"{key}={path} holds the built-in model, but model.pretrained is set: leave it out")
    model = plain(cfg.model)
    if "layer_types" in saved:  # None and "attention" for every layer are one architecture
        spelled = layer_kinds(saved.get("num_layers", model["num_layers"]), saved["layer_types"])
        if spelled == layer_kinds(model["num_layers"], model["layer_types"]):
            saved = {**saved, "layer_types": model["layer_types"]}
    differing = [
        f"model.{name} is {saved[name]!r} in the checkpoint but {value!r} in the config"
        for name, value in model.items()
        if name in saved and saved[name] != value and name not in RUN_TIME_MODEL_KEYS
    ]
    if differing:
        raise ConfigError(f"{key}={path} does not fit the model: " + "; ".join(differing))
    return checkpoint


def _stream_changes(cfg: DictConfig, checkpoint: dict[str, Any]) -> list[str]:
    """The data settings a checkpoint's training stream was made with that the config changes, each as a phrase."""
    saved = checkpoint.get(PackedTextDataModule.__qualname__, {}).get("stream", {})
    if not saved:
        return []
    current = build_datamodule(cfg, ByteTokenizer()).stream_settings()  # the tokenizer makes no stream setting
    return [f"{key}={current[key]!r} (the checkpoint's: {value!r})" for key, value in saved.items()
            if key in current and current[key] != value]  # fmt: skip


def check_data_sources(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for a data source path that does not exist, or a model or tokenizer folder written as a
    path (not a hub name) that does not."""
    for key in ("sources", "val_sources"):
        for source in cfg.data[key] or []:
            if source != EMBEDDED and not Path(source).expanduser().exists():
                raise ConfigError(f"data.{key}: {source} does not exist (use files, folders, .jsonl or {EMBEDDED})")
    for key, folder in (("model.pretrained", cfg.model.pretrained), ("data.tokenizer", cfg.data.tokenizer)):
        if folder and folder.startswith(("/", "./", "../", "~")) and not Path(folder).expanduser().is_dir():
            raise ConfigError(f"{key}: no folder {folder}")


def data_parallel_replicas(cfg: DictConfig) -> int:
    """The number of data-parallel replicas the strategy will make (1 when the device count is only known later)."""
    if isinstance(cfg.strategy.data_parallel_size, int):
        return cfg.strategy.data_parallel_size
    devices = cfg.trainer.devices
    per_node = len(devices) if OmegaConf.is_list(devices) else devices
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        return 1
    tp = cfg.strategy.tensor_parallel_size
    cp = default_context_parallel_size(cfg.strategy.context_parallel_size, per_node, tp)
    return per_node * cfg.trainer.num_nodes // (cp * tp)


def prepare_data_first(cfg: DictConfig, datamodule: PackedTextDataModule, stage: str) -> None:
    """Prepare the data once per node, in its first process, before any other rank starts (they load it), and
    refuse a split too small for one batch as one line (the data sources were checked first, by the caller)."""
    if int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))) != 0:
        return
    datamodule.load()
    validating = (stage == "validate" or has_validation(cfg)) and cfg.trainer.limit_val_batches != 0
    problem = datamodule.size_problem(data_parallel_replicas(cfg), train=stage == "fit", val=validating)
    if problem:
        raise ConfigError(problem)


def prepare_run(cfg: DictConfig) -> tuple[Path, str | None]:
    """Resolve the run folder and checkpoints and check them; on rank 0 save the config and trim stale metrics."""
    run_dir = runfolder.resolve_run_dir(cfg)
    runfolder.check_fresh_or_resumed(run_dir, resuming=cfg.checkpoint.resume_from is not None)  # "auto" may resume
    resume = runfolder.resolve_checkpoint(cfg.checkpoint.resume_from, run_dir, is_readable_checkpoint)
    fresh_in_old_folder = resume is None and cfg.checkpoint.resume_from == "auto"  # left before its first checkpoint
    cfg.checkpoint.init_from = runfolder.resolve_checkpoint(cfg.checkpoint.init_from, run_dir)
    if cfg.checkpoint.init_from:
        check_checkpoint_fits(cfg, cfg.checkpoint.init_from, "checkpoint.init_from")
    resumed = check_checkpoint_fits(cfg, resume, "checkpoint.resume_from") if resume is not None else {}
    step = resumed.get("global_step", 0)
    for change in _stream_changes(cfg, resumed):
        rank_zero_info(
            f"lightning-cp: resuming with {change}: the run continues at the checkpoint's sample count in the "
            "stream these settings make, so samples may repeat or be skipped"
        )
    if (resume is not None or fresh_in_old_folder) and rank_zero_only.rank == 0:
        runfolder.truncate_metrics(run_dir / runfolder.METRICS_FILE, step)
    if rank_zero_only.rank == 0:
        runfolder.save_config(cfg, run_dir)
    return run_dir, resume


def fit(cfg: DictConfig) -> Path:
    """Train (from scratch, from ``init_from`` or resuming ``resume_from``); return the run folder.

    A pretrained model is saved with its tokenizer in ``<run folder>/hf`` at the end, loadable by ``transformers``.
    """
    check_main_port()
    check_data_sources(cfg)
    tokenizer = build_tokenizer(cfg)
    check_vocabulary(cfg, tokenizer)
    datamodule = build_datamodule(cfg, tokenizer)
    prepare_data_first(cfg, datamodule, "fit")
    run_dir, resume = prepare_run(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = build_model(cfg)
    trainer = build_trainer(cfg, run_dir)
    if resume is None and has_validation(cfg):
        trainer.validate(model, datamodule=datamodule, verbose=False)
    with interval_errors_in_steps(plain(cfg.trainer)):
        trainer.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    if cfg.model.pretrained:
        weights = state.model_state(model)  # full tensors on global rank 0, also when FSDP sharded them
        if trainer.is_global_zero:
            weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
            runfolder.save_pretrained(model.model, tokenizer, run_dir, weights)
    if trainer.is_global_zero:
        runfolder.plot_losses(run_dir, getattr(tokenizer, "unit", "token"))
        print(runfolder.summary(run_dir), flush=True)
    return run_dir


def validate(cfg: DictConfig) -> float:
    """Return the validation loss of the checkpoint named by ``resume_from`` or ``init_from``."""
    check_main_port()
    check_data_sources(cfg)
    if not has_validation(cfg):
        raise ConfigError("validate needs validation data: data.val_fraction > 0 or data.val_sources")
    run_dir = runfolder.resolve_run_dir(cfg)
    ckpt = runfolder.resolve_checkpoint(
        cfg.checkpoint.resume_from or cfg.checkpoint.init_from, run_dir, is_readable_checkpoint
    )
    if ckpt is None:
        raise ConfigError("validate needs checkpoint.init_from=PATH (or checkpoint.resume_from=last)")
    check_checkpoint_fits(cfg, ckpt, "checkpoint")
    cfg.checkpoint.init_from, cfg.checkpoint.resume_from = ckpt, None
    tokenizer = build_tokenizer(cfg)
    check_vocabulary(cfg, tokenizer)
    datamodule = build_datamodule(cfg, tokenizer)
    prepare_data_first(cfg, datamodule, "validate")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer = build_trainer(cfg, run_dir, log=False)
    results = trainer.validate(build_model(cfg), datamodule=datamodule, verbose=False)
    loss = float(results[0]["val_loss"])
    if trainer.is_global_zero:
        print(f"validation loss of {ckpt}: {loss:.6f}", flush=True)
    return loss
