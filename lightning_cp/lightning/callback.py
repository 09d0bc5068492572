"""``ContextParallelLayoutCallback``: connects Lightning's batch hooks to the core ``ContextParallelRuntime``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_cp.core.runtime import (
    DEFAULT_CONTIGUOUS_LAYERS,
    DEFAULT_SIDE_INPUTS,
    DEFAULT_ZIGZAG_LAYERS,
    ContextParallelRuntime,
    LayerPolicy,
    WrappedLayer,
)
from lightning_cp.core.step import ContextParallelSetting, active_step, step_metrics
from lightning_cp.core.zigzag import CPLayout


class ContextParallelLayoutCallback(Callback):
    """Shard every replica batch over the CP ranks and run the policy's layers in the layouts they need.

    Args:
        zigzag_layers: class-name or qualified-name glob patterns of residual blocks that need zigzag input
            (attention blocks).
        contiguous_layers: patterns of residual blocks that need contiguous input (recurrent, convolutional blocks).
        side_inputs: keyword arguments of wrapped layers that hold per-token tensors ``[B, S_local, ...]`` in the
            boundary layout (position ids, rotary tables, masks); they are converted with the same plan.
        log_metrics: log ``cp/tokens``, ``cp/padding_fraction``, ``cp/attention_imbalance`` and
            ``cp/layout_conversions`` (residual-stream conversions of the forward) every training step.
        check_consensus: compare every batch's metadata over the ranks of a replica first (one tiny all-reduce), so a
            batch that differs between them is the same ``ValueError`` everywhere, not a hang or wrong results.

    The groups and options come from a ``cp_zigzag`` strategy (any strategy with a ``cp_setting``); under any other
    strategy the batch is prepared as at cp=1.
    """

    def __init__(
        self,
        zigzag_layers: Sequence[str] = DEFAULT_ZIGZAG_LAYERS,
        contiguous_layers: Sequence[str] = DEFAULT_CONTIGUOUS_LAYERS,
        side_inputs: Sequence[str] = DEFAULT_SIDE_INPUTS,
        log_metrics: bool = True,
        check_consensus: bool = True,
    ) -> None:
        self.policy = LayerPolicy(tuple(zigzag_layers), tuple(contiguous_layers), tuple(side_inputs))
        self.log_metrics = log_metrics
        self.check_consensus = check_consensus
        self._runtime: ContextParallelRuntime | None = None

    @property
    def wrapped_layers(self) -> list[WrappedLayer]:
        """Return the layers the policy wrapped in the latest model."""
        return [] if self._runtime is None else self._runtime.wrapped_layers

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start a runtime over the strategy's setting (its groups may differ from a previous run's)."""
        self._release()
        setting = getattr(trainer.strategy, "cp_setting", None) or ContextParallelSetting()
        self._runtime = ContextParallelRuntime(setting, self.policy, self.check_consensus)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks and clear the active step."""
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Clear the active step so a failed run leaves no state behind."""
        if self._runtime is not None:
            self._runtime.end_step()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Shard the batch and activate its step state for forward and backward."""
        step, sharded = self._begin(pl_module, batch)
        if self.log_metrics:
            for name, value in step_metrics(step, sharded).items():
                pl_module.log(f"cp/{name}", value, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """Fail when cp > 1 and the forward never called ``cp_attention`` though the policy wraps attention blocks
        (``zigzag_layers``): the model bypassed it (wrong results). A stack of contiguous blocks alone calls none."""
        step = active_step()
        attention_blocks = any(layer.layout == CPLayout.ZIGZAG for layer in self.wrapped_layers)
        if step is not None and step.cp_size > 1 and attention_blocks and step.attention_calls == 0:
            raise RuntimeError(
                f"cp={step.cp_size} but the forward made no cp_attention call: the model's attention bypassed it and "
                "would attend within each rank's shard only (a Hugging Face model needs "
                "attn_implementation='lightning_cp', which HFCausalLM sets)"
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the forward's layer conversions and deactivate the step state."""
        step = active_step()
        if self.log_metrics and step is not None:
            conversions = float(step.layer_conversion_count)
            pl_module.log("cp/layout_conversions", conversions, on_step=True, on_epoch=False, batch_size=1)
        self._end()

    def _begin_evaluation_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Shard the batch and activate its step state."""
        self._begin(pl_module, batch)

    def _end_evaluation_step(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Deactivate the step state."""
        self._end()

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _begin_evaluation_step
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _end_evaluation_step

    def _begin(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        """Wrap the model's layers (once) and begin the batch's step."""
        if self._runtime is None:  # hooks called without Trainer.setup: no strategy, so cp=1
            self._runtime = ContextParallelRuntime(ContextParallelSetting(), self.policy)
        self._runtime.wrap(pl_module)
        return self._runtime.begin_step(batch)

    def _end(self) -> None:
        """End the current step."""
        if self._runtime is not None:
            self._runtime.end_step()

    def _release(self) -> None:
        """Remove the runtime's hooks and clear its step (``wrapped_layers`` still tells what was wrapped)."""
        if self._runtime is not None:
            self._runtime.end_step()
            self._runtime.unwrap()
