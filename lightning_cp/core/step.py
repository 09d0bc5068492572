"""The active per-step context-parallel state and ``cp_attention``, the attention entry point for model code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from lightning_cp.core.attention.api import zigzag_attention
from lightning_cp.core.layout.api import ContextParallelLayoutState, CPLayout
from lightning_cp.core.packed import PackedSeqParams, host_offsets


@dataclass
class ContextParallelStep:
    """What one training/evaluation step shares with the model: groups, layout state and packed metadata.

    ``layout_state`` is the manager's state of the batch (``None`` only at cp=1): it converts the wrapped layers'
    residual stream where their layout changes (nothing without a layout transition) and any other per-token tensor.
    Wrapped layers push their layout on entry and pop it on exit, so ``cp_attention`` sees the layout of the layer it
    runs in; outside every wrapped layer it sees the boundary layout.
    """

    cp_size: int
    cp_group: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    tp_cp_group: ProcessGroup | None = None
    sequence_parallel: bool = False
    attention_mode: str = "allgather"
    boundary_layout: CPLayout = CPLayout.CONTIGUOUS
    layout_state: ContextParallelLayoutState | None = None
    contiguous_packed_seq_params: PackedSeqParams | None = None
    zigzag_packed_seq_params: PackedSeqParams | None = None
    dense_padding: int = 0
    layer_conversion_count: int = 0
    _entered_layouts: list[CPLayout] = field(default_factory=list)
    _side_input_cache: dict[tuple[int, CPLayout], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def is_packed(self) -> bool:
        """Return whether this step's batch is packed."""
        return self.contiguous_packed_seq_params is not None

    @property
    def current_layout(self) -> CPLayout:
        """Return the layout of the innermost wrapped layer running now, else the boundary layout."""
        return self._entered_layouts[-1] if self._entered_layouts else self.boundary_layout

    @property
    def loss_group(self) -> ProcessGroup | None:
        """Return the group whose ranks together hold the replica's tokens (TP x CP with sequence parallelism)."""
        return self.tp_cp_group if self.sequence_parallel else self.cp_group

    def enter_layer(self, layer_index: int, layout: CPLayout, hidden_states: torch.Tensor) -> torch.Tensor:
        """Convert a wrapped layer's input to its layout and make that layout current."""
        converted = hidden_states
        if self.layout_state is not None:
            converted, _ = self.layout_state.prepare_layer(layer_index, hidden_states)
        self.layer_conversion_count += converted is not hidden_states
        self._entered_layouts.append(layout)
        return converted

    def exit_layer(self, layer_index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Leave a wrapped layer, restoring the boundary layout after the last one."""
        self._entered_layouts.pop()
        if self.layout_state is None:
            return hidden_states
        restored = self.layout_state.finalize_layer(layer_index, hidden_states)
        self.layer_conversion_count += restored is not hidden_states
        return restored

    def convert(self, tensor: torch.Tensor, source: CPLayout, target: CPLayout) -> torch.Tensor:
        """Convert a batch-first per-token tensor between layouts with this step's plan."""
        if source == target or self.layout_state is None:
            return tensor
        return self.layout_state.convert(tensor, source, target)

    def convert_side_input(self, tensor: torch.Tensor, layout: CPLayout) -> torch.Tensor:
        """Convert a per-token side input from the boundary layout to ``layout``, once per step unless it needs grad."""
        if tensor.requires_grad:
            return self.convert(tensor, self.boundary_layout, layout)
        key = (id(tensor), layout)
        cached = self._side_input_cache.get(key)
        if cached is None or cached[0] is not tensor:
            cached = (tensor, self.convert(tensor, self.boundary_layout, layout))
            self._side_input_cache[key] = cached
        return cached[1]


_active_step: ContextParallelStep | None = None


def active_step() -> ContextParallelStep | None:
    """Return the step state set by ``ContextParallelLayoutCallback``, or ``None`` outside a CP step."""
    return _active_step


def set_active_step(step: ContextParallelStep | None) -> None:
    """Make ``step`` the active state (``None`` clears it); a module global so autograd threads see it too."""
    global _active_step
    _active_step = step


@contextmanager
def activated(step: ContextParallelStep) -> Iterator[ContextParallelStep]:
    """Make ``step`` active inside the block."""
    previous = _active_step
    set_active_step(step)
    try:
        yield step
    finally:
        set_active_step(previous)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-device attention on batch-first ``[B, S, H, D]``; with ``cu_seqlens`` tokens attend within documents.

    Packed rows run one fused attention call per document (tokens past ``cu_seqlens[-1]`` form one more segment).
    """
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]}")
    query, key, value = (tensor.transpose(1, 2) for tensor in (q, k, v))
    if cu_seqlens is None:
        segments = [(query, key, value)]
    else:
        offsets = host_offsets(cu_seqlens)
        lengths = [end - start for start, end in zip(offsets, offsets[1:], strict=False)] + [q.shape[1] - offsets[-1]]
        lengths = [length for length in lengths if length > 0]
        segments = list(zip(*(tensor.split(lengths, dim=2) for tensor in (query, key, value)), strict=True))
    outputs = [
        F.scaled_dot_product_attention(
            segment_q, segment_k, segment_v, is_causal=causal, scale=softmax_scale, enable_gqa=True
        )
        for segment_q, segment_k, segment_v in segments
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention for model code on batch-first ``[B, S_local, H, D]`` shards (packed: ``B == 1``).

    Under an active CP step it runs ``zigzag_attention`` over the CP group with the step's attention mode and the
    packed metadata of the layer it runs in, converting q/k/v to zigzag (and the output back) when that layer is not
    zigzag. Without CP it is single-device attention, masked per document for packed batches.
    """
    step = _active_step
    if step is None or step.cp_size == 1:
        cu_seqlens = step.contiguous_packed_seq_params.cu_seqlens_q if step is not None and step.is_packed else None
        return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    if not causal and not step.is_packed and step.dense_padding:
        raise ValueError(
            f"bidirectional dense attention would see {step.dense_padding} padding tokens per row: make the sequence "
            f"length divisible by 2 x cp x tp or use packed batches"
        )
    layout = step.current_layout
    if layout != CPLayout.ZIGZAG:
        q, k, v = (step.convert(tensor, layout, CPLayout.ZIGZAG) for tensor in (q, k, v))
    packed = step.is_packed  # packed: [1, T, H, D] -> [T, H, D]; dense: [B, S, H, D] -> [S, B, H, D]
    q, k, v = (tensor[0] if packed else tensor.transpose(0, 1) for tensor in (q, k, v))
    output = zigzag_attention(
        q,
        k,
        v,
        step.cp_group,
        packed_seq_params=step.zigzag_packed_seq_params if packed else None,
        causal=causal,
        softmax_scale=softmax_scale,
        mode=step.attention_mode,
    )
    output = output.unsqueeze(0) if packed else output.transpose(0, 1)
    if layout != CPLayout.ZIGZAG:
        output = step.convert(output, CPLayout.ZIGZAG, layout)
    return output
