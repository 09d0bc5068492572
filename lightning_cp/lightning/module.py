"""``CausalLMModule``: the Lightning side every causal LM here shares — CP-aware loss, logging, predictions (the
whole batch's logits), AdamW + schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_cp.core import comm
from lightning_cp.core.functional import cp_gather_sequence
from lightning_cp.core.loss import CPLoss, cp_cross_entropy
from lightning_cp.core.runtime import ContextParallelRuntime
from lightning_cp.core.step import ContextParallelSetting


def max_steps_alone(max_steps: int, max_epochs: int | None) -> bool:
    """Whether a run is bounded by ``max_steps`` alone (Lightning's ``max_epochs`` is then None or -1)."""
    return max_steps > 0 and max_epochs in (None, -1)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int | Callable[[], int], min_lr_ratio: float) -> float:
    """Return the learning-rate multiplier: linear warm-up, then cosine decay to ``min_lr_ratio``. ``total_steps``
    may be a function, called only once the decay has begun (at the warm-up's end the multiplier is 1 whatever the
    total)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step == warmup_steps:
        return 1.0
    total = total_steps() if callable(total_steps) else total_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLMModule(pl.LightningModule):
    """A causal LM over packed or dense batches, under ``cp_zigzag`` at any cp or on one device.

    Subclasses define ``logits(input_ids, position_ids)`` and save the hyperparameters ``lr``, ``weight_decay``,
    ``betas``, ``warmup_steps`` and ``min_lr_ratio``. Batches sharded by the layout callback carry ``position_ids``;
    raw ones (no callback, e.g. a plain Lightning strategy) are prepared as the callback would at cp=1.
    """

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the logits ``[B, S_local, vocab]`` of this rank's tokens."""
        raise NotImplementedError

    def token_loss(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, loss_token_count: int
    ) -> CPLoss:
        """Return the CP-aware loss of this rank's tokens (a subclass may avoid materialising all logits)."""
        return cp_cross_entropy(self.logits(input_ids, position_ids), labels, loss_token_count)

    def _loss(self, batch: dict[str, Any]) -> tuple[CPLoss, int]:
        """Return the CP-aware loss of a sharded batch (or of a raw batch on one device) and its target count."""

        def loss(prepared: dict[str, Any]) -> tuple[CPLoss, int]:
            count = int(prepared["loss_token_count"])
            return self.token_loss(prepared["input_ids"], prepared["position_ids"], prepared["labels"], count), count

        return self._with_prepared_batch(batch, loss)

    def _with_prepared_batch(self, batch: dict[str, Any], work: Callable[[dict[str, Any]], Any]) -> Any:
        """Run ``work`` on a batch the layout callback prepared, or on a raw replica batch prepared here as the
        callback would at cp=1 (no callback: e.g. a plain Lightning strategy)."""
        if "position_ids" in batch and "loss_token_count" in batch:
            return work(batch)
        runtime = self.__dict__.get("_single_device_runtime")
        if runtime is None:  # a plain attribute, not a submodule: it holds hooks, no state
            runtime = self.__dict__["_single_device_runtime"] = ContextParallelRuntime(ContextParallelSetting())
        runtime.wrap(self)
        batch = dict(batch)
        with runtime.step(batch):
            return work(batch)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Return the scaled loss; log the replica-wide mean loss per optimizer step: under gradient accumulation
        the mean of its batches' losses, as its gradient is (Lightning keeps the last value logged in a step). A batch
        without targets trains nothing and logs nothing (its loss, 0, would read as a perfect fit)."""
        out, count = self._loss(batch)
        self._log_step_loss(out.mean, count)
        return out.loss

    @comm.eager_under_compile
    def _log_step_loss(self, mean: torch.Tensor, count: int) -> None:
        """Log the mean of this optimizer step's losses so far (per-step host state: a compiled module would
        otherwise recompile its training step for each new step number and loss count)."""
        step, losses = self.__dict__.get("_losses_of_step", (None, []))
        if step != self.trainer.global_step:
            step, losses = self.trainer.global_step, []
            self.__dict__["_losses_of_step"] = (step, losses)
        if count:
            losses.append(mean.detach())
            step_loss = torch.stack(losses).mean()
            self.log("train_loss", step_loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Log the validation loss, weighted by each batch's number of target tokens."""
        out, count = self._loss(batch)
        # a float count: Lightning syncs the summed batch sizes with a mean, which would truncate an integer sum
        self.log("val_loss", out.mean, prog_bar=True, sync_dist=True, batch_size=float(count))

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Return the logits ``[B, S, vocab]`` of the whole replica batch, on every rank sharing it (as one device
        computes them)."""
        return self._with_prepared_batch(
            batch, lambda prepared: cp_gather_sequence(self.logits(prepared["input_ids"], prepared["position_ids"]))
        )

    @override
    def on_validation_epoch_end(self) -> None:
        """Log after how many optimizer steps this validation ran (the x of the validation curve)."""
        self.log("trained_steps", float(self.trainer.global_step), sync_dist=True)

    def _total_steps(self) -> int:
        """The run's optimizer steps: ``max_steps``, or with ``max_epochs`` Lightning's estimate (the fewer), asked
        for once training runs: estimated earlier, it would build the training loader before a checkpoint is
        restored."""
        trainer = self.trainer
        if max_steps_alone(trainer.max_steps, trainer.max_epochs):  # Lightning estimates only with epochs
            return trainer.max_steps
        return int(trainer.estimated_stepping_batches)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (no decay on norms and biases) with linear warm-up and cosine decay over the run's steps (the fewer of
        ``max_steps`` and those of ``max_epochs``)."""
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        total: list[int] = []  # worked out once, when the decay first needs it

        def total_steps() -> int:
            if not total:
                total.append(self._total_steps())
            return total[0]

        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
