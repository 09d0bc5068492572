"""Run any model's steps context-parallel in any training loop: a layer policy, its hooks, and the step's life.

``ContextParallelRuntime`` wraps the layers a ``LayerPolicy`` names with forward hooks (the state dict is
unchanged), and per batch shards it in place and activates its step state. Lightning uses it through
``ContextParallelLayoutCallback``; a plain loop uses ``with runtime.step(batch): ...`` around the forward (the
backward may run inside or after it).

Recomputation (activation checkpointing of whole layers or of parts of them) needs no model code: a gradient hook on
each wrapped layer's output re-activates the step and the layer's layout before autograd reaches the layer, and one on
its input restores them afterwards; a layer recomputed in backward without them (reentrant checkpointing) finds the
runtime's latest step.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_cp.core import comm
from lightning_cp.core.consensus import require_agreement, tensor_description, values_checksum
from lightning_cp.core.layout.api import ContextParallelLayoutManager
from lightning_cp.core.packed import host_copies
from lightning_cp.core.sharding import IGNORE_INDEX, ShardedBatch, shard_replica_batch
from lightning_cp.core.step import (
    ContextParallelSetting,
    ContextParallelStep,
    active_step,
    build_step,
    in_backward,
    set_active_step,
)
from lightning_cp.core.zigzag import CPLayout

DEFAULT_ZIGZAG_LAYERS = ("*DecoderBlock", "*DecoderLayer", "*TransformerBlock", "*AttentionBlock")
DEFAULT_CONTIGUOUS_LAYERS = ("*RecurrentBlock", "*MambaBlock", "*ConvBlock")
DEFAULT_SIDE_INPUTS = ("position_ids", "position_embeddings")
SEQUENCE_DIM = 1


@dataclass(frozen=True)
class LayerPolicy:
    """Which residual blocks run in which layout, and which of their keyword inputs are per-token tensors.

    ``zigzag_layers``/``contiguous_layers``: class-name or qualified-name glob patterns of blocks that need zigzag
    (attention) or contiguous (recurrent, convolutional) input; ``side_inputs``: keyword arguments of wrapped layers
    holding per-token tensors ``[B, S_local, ...]`` in the boundary layout, converted with the batch's plan.
    """

    zigzag_layers: tuple[str, ...] = DEFAULT_ZIGZAG_LAYERS
    contiguous_layers: tuple[str, ...] = DEFAULT_CONTIGUOUS_LAYERS
    side_inputs: tuple[str, ...] = DEFAULT_SIDE_INPUTS


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
        class_name = comm.original_class_name(module)
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


def _refuse_positional_token_inputs(
    layer_index: int, module: nn.Module, args: tuple[Any, ...], step: ContextParallelStep, inside: CPLayout
) -> None:
    """Raise for a per-token tensor (``[B, S, ...]`` as the hidden states are, in either layout) among a wrapped
    layer's positional arguments after the first: only keyword side inputs are converted, so it would meet the hidden
    states in another token order (Gemma 3n's and Gemma 4's per-layer inputs and rotary tables, a residual passed
    alongside). A ``[B, D]`` tensor with ``D`` equal to a shard's token count reads as per-token too."""
    outside = step.boundary_layout
    rows, lengths = args[0].shape[0], {args[0].shape[1]}
    plan = step.layout_state.thd_plan
    if plan is not None:
        lengths |= {plan.contiguous_local_token_count, plan.zigzag_local_token_count}

    def per_token(part: Any) -> bool:
        return isinstance(part, torch.Tensor) and part.dim() >= 2 and part.shape[0] == rows and part.shape[1] in lengths

    for position, arg in enumerate(args[1:], start=1):
        if any(per_token(part) for part in (arg if isinstance(arg, (tuple, list)) else (arg,))):
            raise ValueError(
                f"layer {layer_index} ({type(module).__name__}) takes a per-token tensor as positional argument "
                f"{position}; it would stay in the {outside.value} layout while the layer runs in {inside.value}: pass "
                f"it as a keyword named in side_inputs, or set boundary_layout={inside.value!r} so that nothing is "
                "converted"
            )


def _converted_side_input(step: ContextParallelStep, name: str, value: Any, layout: CPLayout) -> Any:
    """Convert a per-token side input: a tensor, or a tuple/list of them (Hugging Face's rotary ``(cos, sin)``)."""
    if isinstance(value, torch.Tensor):
        return step.convert_side_input(value, layout)
    if isinstance(value, tuple | list) and all(isinstance(item, torch.Tensor) for item in value):
        return type(value)(step.convert_side_input(item, layout) for item in value)
    raise TypeError(
        f"side input {name!r} is a {type(value).__name__}; expected a per-token tensor [B, S_local, ...] or a "
        "tuple/list of them (remove it from side_inputs if it is not per-token)"
    )


def _drop_abandoned_backward() -> None:
    """Deactivate a step left active by a backward that raised inside a recomputed layer (outside any backward now)."""
    step = active_step()
    if step is not None and step.recomputing and not in_backward():
        step.abandon_backward()


class ContextParallelRuntime:
    """Shard every replica batch over the CP ranks and run the policy's layers in the layouts they need.

    Wrapped layers take the residual stream as their first positional argument and return it (alone or first in a
    tuple); they run once per forward in module order. Outside them the residual stream is in the setting's boundary
    layout. Hooks act only on steps this runtime began, so several runtimes may wrap one model.
    """

    def __init__(
        self, setting: ContextParallelSetting, policy: LayerPolicy | None = None, check_consensus: bool = True
    ) -> None:
        self.setting = setting
        self.policy = policy or LayerPolicy()
        self.check_consensus = check_consensus
        self.wrapped_layers: list[WrappedLayer] = []
        self._wrapped_model: nn.Module | None = None
        self._hook_handles: list[RemovableHandle] = []
        self._manager: ContextParallelLayoutManager | None = None
        self._latest_step: ContextParallelStep | None = None

    def wrap(self, model: nn.Module) -> list[WrappedLayer]:
        """Install the forward hooks on the policy's layers of ``model`` (once per model) and return them."""
        if self._wrapped_model is model:
            return self.wrapped_layers
        self.unwrap()
        selected = select_layers(model, self.policy.zigzag_layers, self.policy.contiguous_layers)
        self.wrapped_layers = [wrapped for _, wrapped in selected]
        layouts = tuple(self.setting.layer_layout(wrapped.layout) for wrapped in self.wrapped_layers)
        for layer_index, ((module, _), layout) in enumerate(zip(selected, layouts, strict=True)):
            self._hook_handles.append(
                module.register_forward_pre_hook(self._pre_hook(layer_index, layout), with_kwargs=True)
            )
            self._hook_handles.append(module.register_forward_hook(self._post_hook(layer_index, layout)))
        self._wrapped_model = model
        if self.setting.mesh.cp_size > 1:
            self._manager = self.setting.layout_manager(layouts, seq_dim=SEQUENCE_DIM)
        return self.wrapped_layers

    def unwrap(self) -> None:
        """Remove the hooks."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._wrapped_model = None
        self._manager = None
        self._latest_step = None

    def begin_step(self, batch: MutableMapping[str, Any]) -> tuple[ContextParallelStep, ShardedBatch]:
        """Shard ``batch`` in place (this rank's contiguous shard, in the boundary layout), build its step, activate it.

        The batch then holds ``input_ids``, ``labels`` (shifted per document), ``position_ids`` and
        ``loss_token_count`` (the replica's number of valid targets).
        """
        if not isinstance(batch, MutableMapping):
            raise TypeError(f"{type(self).__name__} needs dict batches (see the batch contract); got {type(batch)}")
        _drop_abandoned_backward()
        mesh = self.setting.mesh
        if self.check_consensus and mesh.cp_size * mesh.tp_size > 1:
            self._require_same_batch(batch)
        sharded = shard_replica_batch(
            batch, mesh.cp_size, mesh.cp_rank, mesh.tp_size, mesh.tp_rank, self.setting.sequence_parallel
        )
        step = build_step(self.setting, sharded, self._manager, owner=self)
        batch.update(self._batch_fields(step, sharded))
        set_active_step(step)
        self._latest_step = step
        return step, sharded

    def _require_same_batch(self, batch: MutableMapping[str, Any]) -> None:
        """Every rank of a replica must get the same batch: compare its metadata (one tiny all-reduce)."""
        mesh = self.setting.mesh
        group = mesh.tp_cp_group if mesh.tp_size > 1 else mesh.cp_group
        fields: dict[str, Any] = {name: tensor_description(batch.get(name)) for name in ("input_ids", "labels")}
        for name in ("cu_seqlens", "cu_seq_lens_q", "position_ids"):
            value = batch.get(name)
            fields[name] = host_copies(value)[0] if isinstance(value, torch.Tensor) else repr(value)
        mask = batch.get("attention_mask")
        fields["attention_mask"] = (tensor_description(mask), isinstance(mask, torch.Tensor) and bool(mask.all()))
        fields["token and label values"] = values_checksum(batch.get("input_ids"), batch.get("labels"))
        require_agreement("the replica batch", fields, group)

    def end_step(self) -> None:
        """Deactivate this runtime's step (another runtime's active step is left alone)."""
        step = active_step()
        if step is not None and step.owner is self:
            set_active_step(None)

    @contextmanager
    def step(self, batch: MutableMapping[str, Any]) -> Iterator[ContextParallelStep]:
        """Shard ``batch`` and keep its step active inside the block: run forward and backward there. A step begun
        inside another's block (another runtime's, or this one's) ends with the outer step active again, and a backward
        after the outer block recomputes with the outer step."""
        _drop_abandoned_backward()
        outer = active_step()
        step, _ = self.begin_step(batch)
        try:
            yield step
        finally:
            self.end_step()
            if outer is not None:
                set_active_step(outer)
                if outer.owner is self:
                    self._latest_step = outer

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

    def _own_step(self) -> ContextParallelStep | None:
        """Return the active step when this runtime began it.

        In a backward pass with no step active (a layer recomputed by reentrant checkpointing after the step ended),
        its latest step is made active for that layer.
        """
        step = active_step()
        if step is not None and step.owner is self:
            return step
        if step is None and in_backward() and self._latest_step is not None:
            self._latest_step.resume_in_backward(None, None)
            return self._latest_step
        return None

    def _pre_hook(self, layer_index: int, layout: CPLayout) -> Any:
        """Return the hook converting a layer's residual input and side inputs to ``layout``."""
        side_inputs = self.policy.side_inputs

        @comm.eager_under_compile
        def convert_input(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            step = self._own_step()
            if step is None:
                return None
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(
                    f"layer {layer_index} ({type(module).__name__}) got no residual stream as its first positional "
                    "argument: wrapped blocks take the hidden states first, positionally (side inputs as keywords)"
                )
            hidden_states = args[0]
            if hidden_states.requires_grad and not in_backward():  # only a marked entry can close the exit's resume
                hidden_states.register_hook(lambda grad: step.leave_in_backward(layer_index))
                step.marked_layers.add(layer_index)
            hidden_states = step.enter_layer(layer_index, layout, hidden_states)
            if step.layout_state is not None and layout != step.boundary_layout:  # positional tensors stay unconverted
                _refuse_positional_token_inputs(layer_index, module, args, step, layout)
            converted = {
                name: _converted_side_input(step, name, kwargs[name], layout)
                for name in side_inputs
                if kwargs.get(name) is not None
            }
            return (hidden_states, *args[1:]), {**kwargs, **converted}

        return convert_input

    def _post_hook(self, layer_index: int, layout: CPLayout) -> Any:
        """Return the hook restoring the boundary layout after the last layer of a run."""

        @comm.eager_under_compile
        def convert_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            step = self._own_step()
            if step is None:
                return None
            hidden_states = output[0] if isinstance(output, tuple) else output
            hidden_states = step.exit_layer(layer_index, hidden_states)
            step.leave_in_backward(None)  # only when the pre-hook re-activated the step for a recomputation
            if layer_index in step.marked_layers and hidden_states.requires_grad and not in_backward():
                hidden_states.register_hook(lambda grad: step.resume_in_backward(layer_index, layout))
            return (hidden_states, *output[1:]) if isinstance(output, tuple) else hidden_states

        return convert_output
