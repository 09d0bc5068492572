"""``ContextParallelLayoutCallback``: shards each replica batch, builds its layout state and wraps layers by policy."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_cp.core.attention.api import attention_work_per_rank
from lightning_cp.core.layout.api import ContextParallelLayoutManager, CPLayout
from lightning_cp.core.packed import PackedSeqParams
from lightning_cp.core.sharding import IGNORE_INDEX, ShardedBatch, shard_replica_batch
from lightning_cp.core.step import ContextParallelStep, active_step, set_active_step

DEFAULT_ZIGZAG_LAYERS = ("*DecoderBlock", "*DecoderLayer", "*TransformerBlock", "*AttentionBlock")
DEFAULT_CONTIGUOUS_LAYERS = ("*RecurrentBlock", "*MambaBlock", "*ConvBlock")
SEQUENCE_DIM = 1


@dataclass(frozen=True)
class WrappedLayer:
    """One layer the policy wraps: its qualified name, class name and layout."""

    name: str
    class_name: str
    layout: CPLayout


def select_layers(
    model: nn.Module, zigzag_layers: Sequence[str], contiguous_layers: Sequence[str]
) -> list[tuple[nn.Module, WrappedLayer]]:
    """Return the outermost modules whose class name or qualified name matches a policy pattern, in module order."""
    selected: list[tuple[nn.Module, WrappedLayer]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{wrapped.name}.") for _, wrapped in selected if wrapped.name):
            continue
        class_name = type(module).__name__
        matches = {
            layout
            for layout, patterns in ((CPLayout.ZIGZAG, zigzag_layers), (CPLayout.CONTIGUOUS, contiguous_layers))
            if any(fnmatch.fnmatchcase(class_name, p) or fnmatch.fnmatchcase(name, p) for p in patterns)
        }
        if len(matches) > 1:
            raise ValueError(
                f"layer {name!r} ({class_name}) matches both zigzag_layers {list(zigzag_layers)} and "
                f"contiguous_layers {list(contiguous_layers)}"
            )
        if matches:
            selected.append((module, WrappedLayer(name, class_name, matches.pop())))
    return selected


@dataclass(frozen=True)
class ParallelSetting:
    """The groups and options of the running strategy that the callback needs (cp=1 without ``cp_zigzag``)."""

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    cp_group: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    tp_cp_group: ProcessGroup | None = None
    sequence_parallel: bool = False
    boundary_layout: CPLayout = CPLayout.CONTIGUOUS
    attention_mode: str = "allgather"


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

    Wrapped layers take the residual stream as their first positional argument and return it (alone or first in a
    tuple); they run once per forward in module order. Forward pre/post hooks do the conversions, so the
    state_dict is unchanged. Outside the wrapped layers the residual stream is in the strategy's boundary layout.
    """

    def __init__(
        self,
        zigzag_layers: Sequence[str] = DEFAULT_ZIGZAG_LAYERS,
        contiguous_layers: Sequence[str] = DEFAULT_CONTIGUOUS_LAYERS,
        side_inputs: Sequence[str] = ("position_ids",),
        log_metrics: bool = True,
    ) -> None:
        self.zigzag_layers = tuple(zigzag_layers)
        self.contiguous_layers = tuple(contiguous_layers)
        self.side_inputs = tuple(side_inputs)
        self.log_metrics = log_metrics
        self.wrapped_layers: list[WrappedLayer] = []
        self._wrapped_model: nn.Module | None = None
        self._hook_handles: list[RemovableHandle] = []
        self._manager: ContextParallelLayoutManager | None = None
        self._setting: ParallelSetting | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Forget the manager of a previous run: the strategy's groups may have changed."""
        self._manager = self._setting = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks and clear the active step."""
        set_active_step(None)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._wrapped_model = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Clear the active step so a failed run leaves no state behind."""
        set_active_step(None)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Shard the batch and activate its step state for forward and backward."""
        step, sharded = self._begin_step(trainer, pl_module, batch)
        if self.log_metrics:
            self._log_metrics(pl_module, step, sharded)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the forward's layer conversions and deactivate the step state."""
        step = active_step()
        if self.log_metrics and step is not None:
            conversions = float(step.layer_conversion_count)
            pl_module.log("cp/layout_conversions", conversions, on_step=True, on_epoch=False, batch_size=1)
        set_active_step(None)

    def _begin_evaluation_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Shard the batch and activate its step state."""
        self._begin_step(trainer, pl_module, batch)

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
        set_active_step(None)

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _begin_evaluation_step
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _end_evaluation_step

    def _begin_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any
    ) -> tuple[ContextParallelStep, ShardedBatch]:
        """Shard ``batch`` in place, build the step state and make it active."""
        if not isinstance(batch, MutableMapping):
            raise TypeError(f"{type(self).__name__} needs dict batches (see the batch contract); got {type(batch)}")
        self._wrap(pl_module)
        setting = self._parallel_setting(trainer)
        sharded = shard_replica_batch(
            batch, setting.cp_size, setting.cp_rank, setting.tp_size, setting.tp_rank, setting.sequence_parallel
        )
        step = self._build_step(setting, sharded)
        batch.update(self._batch_fields(step, sharded))
        set_active_step(step)
        return step, sharded

    def _wrap(self, pl_module: pl.LightningModule) -> None:
        """Install the forward hooks on the policy's layers once per model."""
        if self._wrapped_model is pl_module:
            return
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        selected = select_layers(pl_module, self.zigzag_layers, self.contiguous_layers)
        self.wrapped_layers = [wrapped for _, wrapped in selected]
        self._manager = None
        for layer_index, (module, wrapped) in enumerate(selected):
            self._hook_handles.append(
                module.register_forward_pre_hook(self._pre_hook(layer_index, wrapped.layout), with_kwargs=True)
            )
            self._hook_handles.append(module.register_forward_hook(self._post_hook(layer_index)))
        self._wrapped_model = pl_module

    def _pre_hook(self, layer_index: int, layout: CPLayout) -> Any:
        """Return the hook converting a layer's residual input and side inputs to ``layout``."""
        side_inputs = self.side_inputs

        def convert_input(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            step = active_step()
            if step is None:
                return None
            hidden_states = step.enter_layer(layer_index, layout, args[0])
            converted = {
                name: step.convert_side_input(kwargs[name], layout)
                for name in side_inputs
                if isinstance(kwargs.get(name), torch.Tensor)
            }
            return (hidden_states, *args[1:]), {**kwargs, **converted}

        return convert_input

    def _post_hook(self, layer_index: int) -> Any:
        """Return the hook restoring the boundary layout after the last layer of a run."""

        def convert_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            step = active_step()
            if step is None:
                return None
            if isinstance(output, tuple):
                return (step.exit_layer(layer_index, output[0]), *output[1:])
            return step.exit_layer(layer_index, output)

        return convert_output

    def _parallel_setting(self, trainer: pl.Trainer) -> ParallelSetting:
        """Read CP/TP groups and options from a ``cp_zigzag`` strategy; cp=1 for any other strategy."""
        if self._setting is None:
            from lightning_cp.lightning.strategy import CPZigzagStrategy

            strategy = trainer.strategy
            if isinstance(strategy, CPZigzagStrategy):
                mesh = strategy.cp_mesh
                self._setting = ParallelSetting(
                    cp_size=mesh.dims.context_parallel,
                    cp_rank=mesh.cp_rank,
                    tp_size=mesh.dims.tensor_parallel,
                    tp_rank=mesh.tp_rank,
                    cp_group=mesh.cp_group,
                    tp_group=mesh.tp_group,
                    tp_cp_group=mesh.tp_cp_group,
                    sequence_parallel=strategy.sequence_parallel,
                    boundary_layout=CPLayout(strategy.boundary_layout),
                    attention_mode=strategy.attention_mode,
                )
            else:
                self._setting = ParallelSetting()
        return self._setting

    def _layout_manager(self, setting: ParallelSetting) -> ContextParallelLayoutManager:
        """Return the manager of the wrapped layers, built once per model and strategy."""
        if self._manager is None:
            self._manager = ContextParallelLayoutManager(
                tuple(wrapped.layout for wrapped in self.wrapped_layers),
                setting.boundary_layout,
                setting.sequence_parallel,
                setting.cp_group,
                setting.tp_group,
                setting.tp_cp_group,
                seq_dim=SEQUENCE_DIM,
            )
        return self._manager

    def _build_step(self, setting: ParallelSetting, sharded: ShardedBatch) -> ContextParallelStep:
        """Build the step state: one layout state whose plan serves the wrapped layers and every other conversion."""
        packed_seq_params = contiguous_packed_seq_params(sharded)
        step = ContextParallelStep(
            cp_size=setting.cp_size,
            cp_group=setting.cp_group,
            tp_group=setting.tp_group,
            tp_cp_group=setting.tp_cp_group,
            sequence_parallel=setting.sequence_parallel,
            attention_mode=setting.attention_mode,
            boundary_layout=setting.boundary_layout,
            contiguous_packed_seq_params=packed_seq_params,
            dense_padding=0 if sharded.is_packed else sharded.padding_token_count,
        )
        if setting.cp_group is None:
            return step
        step.layout_state = self._layout_manager(setting).build_conversion_state(packed_seq_params)
        if step.layout_state is not None:
            step.zigzag_packed_seq_params = step.layout_state.zigzag_packed_seq_params
        return step

    def _batch_fields(self, step: ContextParallelStep, sharded: ShardedBatch) -> dict[str, Any]:
        """Return the batch entries the step sees, in the boundary layout."""
        labels = sharded.labels
        fields: dict[str, Any] = {"input_ids": sharded.input_ids, "position_ids": sharded.position_ids}
        if step.boundary_layout != CPLayout.CONTIGUOUS:
            fields = {
                name: step.convert(tensor, CPLayout.CONTIGUOUS, step.boundary_layout) for name, tensor in fields.items()
            }
            # padding slots arrive as zeros: shift so that they become IGNORE_INDEX
            labels = step.convert(labels - IGNORE_INDEX, CPLayout.CONTIGUOUS, step.boundary_layout) + IGNORE_INDEX
        return {**fields, "labels": labels, "loss_token_count": sharded.loss_token_count}

    def _log_metrics(self, pl_module: pl.LightningModule, step: ContextParallelStep, sharded: ShardedBatch) -> None:
        """Log tokens, padding fraction, attention work imbalance and layout conversions of the replica batch."""
        metrics = batch_metrics(step, sharded)
        for name, value in metrics.items():
            pl_module.log(f"cp/{name}", value, on_step=True, on_epoch=False, batch_size=1)


def contiguous_packed_seq_params(sharded: ShardedBatch) -> PackedSeqParams | None:
    """Return the metadata of a packed replica batch as the contiguous residual stream holds it."""
    if sharded.cu_seqlens is None or sharded.cu_seqlens_padded is None:
        return None
    lengths = sharded.cu_seqlens[1:] - sharded.cu_seqlens[:-1]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=sharded.cu_seqlens,
        cu_seqlens_kv=sharded.cu_seqlens,
        cu_seqlens_q_padded=sharded.cu_seqlens_padded,
        cu_seqlens_kv_padded=sharded.cu_seqlens_padded,
        max_seqlen_q=int(lengths.max()),
        max_seqlen_kv=int(lengths.max()),
        total_tokens=sharded.padded_sequence_length,
        pad_between_seqs=sharded.padding_token_count > 0,
    )


def batch_metrics(step: ContextParallelStep, sharded: ShardedBatch) -> Mapping[str, float]:
    """Return tokens, padding fraction, attention work imbalance (max/mean over CP ranks) of one replica batch."""
    batch_size = sharded.input_ids.shape[0]
    if sharded.is_packed and step.zigzag_packed_seq_params is not None:
        slots = int(step.zigzag_packed_seq_params.cu_seqlens_q_padded[-1])
    else:
        slots = batch_size * sharded.padded_sequence_length
    if sharded.is_packed:
        work = attention_work_per_rank(step.cp_size, cu_seqlens=sharded.cu_seqlens.cpu(), causal=True)
    else:
        work = attention_work_per_rank(step.cp_size, seq_len=sharded.sequence_length, causal=True)
    mean_work = sum(work) / len(work)
    return {
        "tokens": float(sharded.real_token_count),
        "padding_fraction": 1.0 - sharded.real_token_count / max(slots, 1),
        "attention_imbalance": max(work) / mean_work if mean_work > 0 else 1.0,
    }
