"""The training schedule on real Lightning trainers and the real datamodule: a resumed fit continues its data stream
with the next unseen sample (under gradient accumulation across epochs, at another data-parallel size; sample order
compared exactly), validation runs every ``val_check_interval`` optimizer steps, ``max_epochs`` bounds a run that
also has ``max_steps`` and its learning-rate schedule, and the throughput is logged per optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_cp import CPZigzagStrategy
from lightning_cp.train.config import ConfigError
from lightning_cp.train.data import PackedTextDataModule
from lightning_cp.train.data.datamodule import CACHE_ENV
from lightning_cp.train.models.module import LlamaLM
from lightning_cp.train.runfolder import read_metrics
from lightning_cp.train.runner import TokenThroughput, interval_errors_in_steps, validation_schedule
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch) -> None:
    """Prepared data goes to the test's own folder (forked ranks inherit the variable)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "data-cache"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of 33 small text files of different lengths: a few dozen packed samples of 128 tokens."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for index in range(33):
        words = (f"w{index}.{position}" for position in range(3 + 11 * index % 50))
        (folder / f"{index:02d}.txt").write_text(" ".join(words), encoding="utf-8")
    return folder


class SampleRecorder(pl.LightningModule):
    """Records each training batch's samples (their token rows, as tuples) in order, and trains nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list[tuple[int, ...]] = []
        self.validated_at: list[int] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(tuple(batch["input_ids"][0].tolist()))
        return self.weight * batch["input_ids"].float().mean()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if batch_idx == 0:
            self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_recording(corpus: Path, folder: Path, resume: str | None = None, **args: Any) -> list[tuple[int, ...]]:
    """Fit a recorder on ``corpus`` (one sample per batch), a checkpoint after every step into ``folder`` (named by
    the step); return the samples it saw."""
    return fit_recorder(corpus, folder, resume, **args).seen


def fit_recorder(
    corpus: Path,
    folder: Path,
    resume: str | None = None,
    num_workers: int = 0,
    module: SampleRecorder | None = None,
    **trainer_args: Any,
) -> SampleRecorder:
    """``fit_recording``, returning the recorder (validation off unless ``trainer_args`` ask for it)."""
    module = module or SampleRecorder()
    every_step = ModelCheckpoint(folder, "{step}", auto_insert_metric_name=False, every_n_train_steps=1, save_top_k=-1)
    callbacks = [*trainer_args.pop("callbacks", []), every_step]
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=trainer_args.pop("logger", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **{"limit_val_batches": 0, **trainer_args},
    )
    data = PackedTextDataModule([str(corpus)], val_fraction=0.2, tokens_per_sample=128, seed=7, num_workers=num_workers)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return module


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resume_under_accumulation_across_epochs_continues_the_stream(
    corpus: Path, tmp_path: Path, num_workers: int
) -> None:
    """Two epochs whose batch count accumulation does not divide (the last step of an epoch takes fewer batches):
    resumed in the second epoch, or from the first epoch's last step, the run sees exactly the batches the
    uninterrupted run saw after that step (also when worker processes, which draw indices early, load them)."""
    args = {"devices": 1, "max_epochs": 2, "max_steps": -1, "accumulate_grad_batches": 3, "num_workers": num_workers}
    full = fit_recording(corpus, tmp_path / "full", **args)
    per_epoch = len(full) // 2
    assert len(full) == 2 * per_epoch and per_epoch % 3, "an epoch the accumulation does not divide"
    last = per_epoch // 3 + 1  # the first epoch's last step
    for step, seen in ((last + 2, per_epoch + 2 * 3), (last, per_epoch)):  # two steps into the second epoch; its start
        resumed = fit_recording(corpus, tmp_path / f"resumed{step}", str(tmp_path / "full" / f"{step}.ckpt"), **args)
        assert resumed == full[seen:], f"resumed at step {step}"


def test_loaders_rebuilt_every_epoch_serve_whole_epochs(corpus: Path, tmp_path: Path) -> None:
    """``reload_dataloaders_every_n_epochs=1``: every epoch is a whole pass (a rebuilt loader is no resume)."""
    once = fit_recording(corpus, tmp_path / "once", devices=1, max_epochs=1, max_steps=-1)
    args = {"max_epochs": 3, "max_steps": -1, "reload_dataloaders_every_n_epochs": 1}
    reloaded = fit_recording(corpus, tmp_path / "reloaded", devices=1, **args)
    assert len(reloaded) == 3 * len(once)
    for epoch in range(3):  # each epoch one whole pass: every sample once
        assert sorted(reloaded[epoch * len(once) : (epoch + 1) * len(once)]) == sorted(once), f"epoch {epoch}"


def _fit_on_ranks(corpus: Path, folder: Path, resume: str | None, max_steps: int) -> list[tuple[int, ...]]:
    """One data-parallel rank of a recording fit under ``cp_zigzag`` at cp=1 (each rank a replica)."""
    strategy = CPZigzagStrategy(context_parallel_size=1)
    return fit_recording(corpus, folder, resume, devices=2, max_steps=max_steps, strategy=strategy)


@pytest.mark.timeout(120)
def test_a_resume_at_another_data_parallel_size_serves_each_sample_once(corpus: Path, tmp_path: Path) -> None:
    """dp=2 for 3 steps, then resumed at dp=1 (and the reverse): the samples seen, in stream order, are exactly those
    a dp=1 run sees, none repeated or left out."""
    single = fit_recording(corpus, tmp_path / "single", devices=1, max_steps=12)
    ranks = run_on_ranks(_fit_on_ranks, 2, corpus, tmp_path / "dp2", None, 3, init_process_group=False)
    assert [sample for batch in zip(*ranks, strict=True) for sample in batch] == single[:6]
    shrunk = fit_recording(corpus, tmp_path / "dp1", str(tmp_path / "dp2" / "3.ckpt"), devices=1, max_steps=9)
    assert shrunk == single[6:12]
    resume = str(tmp_path / "single" / "4.ckpt")
    grown = run_on_ranks(_fit_on_ranks, 2, corpus, tmp_path / "dp2b", resume, 7, init_process_group=False)
    assert [sample for batch in zip(*grown, strict=True) for sample in batch] == single[4:10]


def _fit_epochs_on_ranks(corpus: Path, folder: Path, resume: str) -> None:
    strategy = CPZigzagStrategy(context_parallel_size=1)
    fit_recording(corpus, folder, resume, devices=2, max_epochs=2, max_steps=-1, strategy=strategy)


@pytest.mark.timeout(120)
def test_with_epochs_a_run_resumes_on_its_data_parallel_size(corpus: Path, tmp_path: Path) -> None:
    """Lightning keeps one length for every epoch of a loader, so with ``max_epochs`` the epochs cannot be split
    anew: the same clear error on every rank."""
    fit_recording(corpus, tmp_path / "dp1", devices=1, max_epochs=1, max_steps=3)
    assert_same_error_on_every_rank(
        _fit_epochs_on_ranks, 2, corpus, tmp_path / "dp2", str(tmp_path / "dp1" / "3.ckpt"),
        match="saved on 1 data-parallel replicas; with max_epochs a run resumes on as many", init_process_group=False,
    )  # fmt: skip


@pytest.mark.parametrize(("interval", "expected"), [(3, [3, 6]), (0.5, [3, 6]), (4, [4])])
def test_validation_runs_every_interval_optimizer_steps_under_accumulation(
    corpus: Path, tmp_path: Path, interval: float, expected: list[int]
) -> None:
    """``val_check_interval`` counts optimizer steps (a fraction: of ``max_steps``), not the batches accumulated."""
    args = {"max_steps": 6, "accumulate_grad_batches": 2, "val_check_interval": interval}
    module = fit_recorder(corpus, tmp_path, devices=1, max_steps=6, accumulate_grad_batches=2,
                          limit_val_batches=1, **validation_schedule(args))  # fmt: skip
    assert module.validated_at == expected


def test_with_epochs_validation_runs_at_the_same_steps_of_every_epoch(corpus: Path, tmp_path: Path) -> None:
    """With ``max_epochs`` the interval counts within each epoch, so it stays on optimizer steps although the
    accumulation does not divide an epoch's batches."""
    args = {"max_epochs": 2, "max_steps": -1, "accumulate_grad_batches": 3, "val_check_interval": 5}
    per_epoch = len(fit_recording(corpus, tmp_path / "once", devices=1, max_epochs=1, max_steps=-1))
    assert per_epoch % 3 and per_epoch >= 30
    module = fit_recorder(corpus, tmp_path / "validated", devices=1, limit_val_batches=1,
                          **{**args, **validation_schedule(args)})  # fmt: skip
    steps_per_epoch = -(-per_epoch // 3)
    expected = [epoch * steps_per_epoch + step for epoch in range(2) for step in range(5, per_epoch // 3 + 1, 5)]
    assert module.validated_at == expected


def test_an_interval_longer_than_an_epoch_is_refused_in_optimizer_steps(corpus: Path, tmp_path: Path) -> None:
    """With ``max_epochs`` an interval of more optimizer steps than end inside an epoch's batches is refused naming
    the steps given and the most that fit, not the batches Lightning counts; the most that fit is accepted."""
    per_epoch = len(fit_recording(corpus, tmp_path / "once", devices=1, max_epochs=1, max_steps=-1))
    assert per_epoch % 3
    most, steps_per_epoch = per_epoch // 3, -(-per_epoch // 3)
    args = {"max_epochs": 2, "max_steps": -1, "accumulate_grad_batches": 3, "val_check_interval": most + 1}
    refusal = rf"val_check_interval={most + 1} optimizer steps .*\(at most {most}:"
    with pytest.raises(ConfigError, match=refusal), interval_errors_in_steps(args):
        fit_recorder(corpus, tmp_path / "long", devices=1, limit_val_batches=1, **{**args, **validation_schedule(args)})
    args["val_check_interval"] = most
    module = fit_recorder(corpus, tmp_path / "fits", devices=1, limit_val_batches=1,
                          **{**args, **validation_schedule(args)})  # fmt: skip
    assert module.validated_at == [most, steps_per_epoch + most]


def test_max_epochs_ends_a_run_that_has_max_steps_left(corpus: Path, tmp_path: Path) -> None:
    """As in Lightning, training stops at whichever of ``max_epochs`` and ``max_steps`` comes first: one epoch is one
    pass over the training samples."""
    once = fit_recording(corpus, tmp_path / "once", devices=1, max_epochs=1, max_steps=-1)
    assert fit_recording(corpus, tmp_path / "bounded", devices=1, max_epochs=1, max_steps=500) == once
    assert len(once) == len(set(once)) < 500


def test_the_learning_rate_schedule_ends_with_the_epochs_that_end_the_run(corpus: Path, tmp_path: Path) -> None:
    """With ``max_epochs`` ending the run before ``max_steps``, the cosine decay reaches its floor at that end."""
    module = LlamaLM(lr=1e-3, warmup_steps=2, min_lr_ratio=0.1, hidden_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, intermediate_size=64)  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=10_000, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, use_distributed_sampler=False)  # fmt: skip
    data = PackedTextDataModule([str(corpus)], val_fraction=0.2, tokens_per_sample=128, seed=7)
    trainer.fit(module, datamodule=data)
    assert 10 < trainer.global_step < 10_000
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-3)


def test_the_throughput_is_the_tokens_of_each_optimizer_step_per_second(corpus: Path, tmp_path: Path) -> None:
    """``tokens_per_second`` (the main job's) counts every batch accumulated into a step, over the step's time."""
    ticks = iter(range(1000))
    throughput = TokenThroughput(clock=lambda: float(next(ticks)))  # every reading one second after the last
    logger = CSVLogger(tmp_path, name="log")
    module = fit_recorder(corpus, tmp_path / "checkpoints", devices=1, max_steps=4, accumulate_grad_batches=2,
                          callbacks=[throughput], logger=logger, log_every_n_steps=1)  # fmt: skip
    logged = [float(row["tokens_per_second"]) for row in read_metrics(tmp_path / "log" / "version_0" / "metrics.csv")
              if row.get("tokens_per_second")]  # fmt: skip
    lengths = [len(sample) for sample in module.seen]
    assert logged == [float(lengths[2 * step] + lengths[2 * step + 1]) for step in range(4)]


class EstimatingRecorder(SampleRecorder):
    """Reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, as one-cycle schedules do: Lightning
    then builds the training loader before it restores a checkpoint."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.trainer.estimated_stepping_batches > 0
        return super().configure_optimizers()


def _fit_estimating(corpus: Path, folder: Path, resume: str | None, strategy: Any) -> list[tuple[int, ...]]:
    args = {"devices": 1, "max_epochs": 2, "max_steps": -1, "strategy": strategy}
    return fit_recorder(corpus, folder, resume, module=EstimatingRecorder(), **args).seen


def _fit_estimating_under_cp(corpus: Path, folder: Path, resume: str | None) -> list[tuple[int, ...]]:
    return _fit_estimating(corpus, folder, resume, CPZigzagStrategy(context_parallel_size=1))


@pytest.mark.timeout(120)
def test_a_loader_built_before_the_restore_is_rebuilt_or_refused(corpus: Path, tmp_path: Path) -> None:
    """``cp_zigzag`` restores after its setup, so a loader built there is dropped and built anew: the resumed run
    continues exactly; a strategy restoring before its setup gets the loader's request too early: a clear error."""
    (full,) = run_on_ranks(_fit_estimating_under_cp, 1, corpus, tmp_path / "full", None, init_process_group=False)
    resume = str(tmp_path / "full" / "10.ckpt")
    (resumed,) = run_on_ranks(_fit_estimating_under_cp, 1, corpus, tmp_path / "cp", resume, init_process_group=False)
    assert resumed == full[10:]
    with pytest.raises(RuntimeError, match="asked for before the checkpoint's loop state was restored"):
        _fit_estimating(corpus, tmp_path / "plain", resume, "auto")


class _LoggedRates(pl.Callback):
    """Keeps each step's logged ``tokens_per_second`` (placed after the throughput callback)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.rates.append(float(trainer.callback_metrics["tokens_per_second"]))


def _rates_and_samples_on_ranks(corpus: Path, folder: Path) -> tuple[list[float], list[tuple[int, ...]]]:
    ticks = iter(range(1000))
    rates = _LoggedRates()
    callbacks = [TokenThroughput(clock=lambda: float(next(ticks))), rates]
    seen = fit_recording(corpus, folder, devices=2, max_steps=3, callbacks=callbacks,
                         strategy=CPZigzagStrategy(context_parallel_size=1))  # fmt: skip
    return rates.rates, seen


@pytest.mark.timeout(120)
def test_the_throughput_sums_the_tokens_of_every_replica(corpus: Path, tmp_path: Path) -> None:
    """dp=2: each step's rate is both replicas' tokens (their packed rows differ in length), on every rank."""
    ranks = run_on_ranks(_rates_and_samples_on_ranks, 2, corpus, tmp_path, init_process_group=False)
    expected = [float(len(a) + len(b)) for a, b in zip(ranks[0][1], ranks[1][1], strict=True)]
    assert ranks[0][0] == ranks[1][0] == expected and len(set(expected)) > 1


def test_a_checkpoint_validated_first_leaves_a_fresh_fit_of_the_datamodule_fresh(corpus: Path, tmp_path: Path) -> None:
    """``validate(ckpt_path=...)`` restores the datamodule's state too; a fit without a checkpoint then starts the
    data at its beginning."""
    full = fit_recording(corpus, tmp_path / "full", devices=1, max_steps=6)
    data = PackedTextDataModule([str(corpus)], val_fraction=0.2, tokens_per_sample=128, seed=7)
    options = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
               "enable_model_summary": False, "enable_checkpointing": False}  # fmt: skip
    pl.Trainer(**options).validate(SampleRecorder(), datamodule=data, ckpt_path=str(tmp_path / "full" / "4.ckpt"))
    fresh = SampleRecorder()
    pl.Trainer(max_steps=6, limit_val_batches=0, use_distributed_sampler=False, **options).fit(fresh, datamodule=data)
    assert fresh.seen == full


def test_a_run_extended_past_the_end_of_its_data_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    """``max_steps`` ending exactly where the data does, then resumed with more steps: the run goes on as an
    uninterrupted one with those steps would, and a second resume inside the extension continues it exactly."""
    per_epoch = len(fit_recording(corpus, tmp_path / "ended", devices=1, max_steps=-1, max_epochs=1))
    uninterrupted = fit_recording(corpus, tmp_path / "full", devices=1, max_steps=per_epoch + 9)
    fit_recording(corpus, tmp_path / "a", devices=1, max_steps=per_epoch)
    extended = fit_recording(corpus, tmp_path / "b", str(tmp_path / "a" / f"{per_epoch}.ckpt"), devices=1,
                             max_steps=per_epoch + 9)  # fmt: skip
    assert extended == uninterrupted[per_epoch:]
    resume = str(tmp_path / "b" / f"{per_epoch + 4}.ckpt")
    assert fit_recording(corpus, tmp_path / "c", resume, devices=1, max_steps=per_epoch + 9) == extended[4:]


def fit_saving_at_the_end(corpus: Path, path: Path, resume: str | None = None, **trainer_args: Any) -> list:
    """Fit a recorder without step checkpoints and save one as the fit ends (as ``last.ckpt`` is written when no
    step checkpoint came first, or ``trainer.save_checkpoint`` after ``fit``); return the samples it saw."""
    module = SampleRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                         limit_val_batches=0, **trainer_args)  # fmt: skip
    data = PackedTextDataModule([str(corpus)], val_fraction=0.2, tokens_per_sample=128, seed=7)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    trainer.save_checkpoint(path)
    return module.seen


@pytest.mark.parametrize(
    ("first", "then", "max_epochs"),
    [(5, 12, None), ("epoch+2", "2epochs+5", None), (5, 60, 3), ("epoch", 60, 3), ("epoch+4", 60, 3)],
)
def test_a_finished_run_extended_with_more_steps_trains_the_samples_it_should(
    corpus: Path, tmp_path: Path, first: Any, then: Any, max_epochs: int | None
) -> None:
    """A run that ``max_steps`` ended, saved as it ends (Lightning has then counted its epoch done), resumed with
    more steps: with ``max_steps`` alone it trains what one uninterrupted run of those steps would (also past the
    data's end, over more passes); with ``max_epochs`` it goes on with the next epoch, from its first sample, as
    Lightning counts epochs."""
    per_epoch = len(fit_recording(corpus, tmp_path / "ended", devices=1, max_steps=-1, max_epochs=1))
    steps = {"epoch": per_epoch, "epoch+2": per_epoch + 2, "epoch+4": per_epoch + 4, "2epochs+5": 2 * per_epoch + 5}
    first, then = steps.get(first, first), steps.get(then, then)
    ended = tmp_path / "ended.ckpt"
    if max_epochs is None:
        expected = fit_saving_at_the_end(corpus, tmp_path / "full.ckpt", max_steps=then)[first:]
    else:
        epochs = fit_saving_at_the_end(corpus, tmp_path / "full.ckpt", max_steps=-1, max_epochs=max_epochs)
        start = -(-first // per_epoch) * per_epoch
        expected = epochs[start : start + then - first]
    fit_saving_at_the_end(corpus, ended, max_steps=first, max_epochs=max_epochs)
    extended = fit_saving_at_the_end(corpus, tmp_path / "extended.ckpt", str(ended), max_steps=then,
                                     max_epochs=max_epochs)  # fmt: skip
    assert len(extended) == then - first and extended == expected
