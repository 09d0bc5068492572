"""Context-parallel sequence-layout conversion: contiguous <-> zigzag shards, dense and packed, with a layer manager.

Plans are built by the pure functions of ``plans`` (re-exported here) and data is moved by ``movers``
(one all-to-all-v per conversion, inside autograd functions whose backward is the inverse conversion); this module
checks inputs, resolves process groups and tracks layouts across a stack of layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from lightning_cp.core import comm
from lightning_cp.core.layout.movers import plan_on_device, redistribute_segments, redistribute_tokens
from lightning_cp.core.layout.plans import (
    THDCPLayoutPlan,
    _build_group_rank_by_logical_rank,
    _build_layout_redistribution_plan,
    _build_thd_cp_layout_plan_from_rank_order_indices,
    _build_thd_rank_order_indices,
    _LayoutRedistributionPlan,
)
from lightning_cp.core.packed import PackedSeqParams, host_copies
from lightning_cp.core.zigzag import CPLayout, as_layout, check_cu_seqlens_structure
from lightning_cp.core.zigzag import local_segment_ids as _local_segment_ids
from lightning_cp.core.zigzag import segment_owner as _segment_owner
from lightning_cp.core.zigzag import segments_per_rank as _segments_per_rank

__all__ = [
    "CPLayout",
    "ContextParallelLayoutManager",
    "ContextParallelLayoutState",
    "THDCPLayoutPlan",
    "build_thd_cp_layout_plan",
    "contiguous_to_zigzag",
    "zigzag_to_contiguous",
    "_LayoutParallelContext",
    "_LayoutRedistributionPlan",
    "_build_group_rank_by_logical_rank",
    "_build_layout_redistribution_plan",
    "_build_thd_cp_layout_plan_from_rank_order_indices",
    "_build_thd_rank_order_indices",
    "_get_group_rank_by_logical_rank",
    "_get_layout_parallel_context",
    "_local_segment_ids",
    "_redistribute_layout",
    "_redistribute_thd_layout",
    "_segment_owner",
    "_segments_per_rank",
]


@dataclass(frozen=True)
class _LayoutParallelContext:
    """Process-group coordinates used by a layout redistribution."""

    cp_size: int
    cp_rank: int
    tp_size: int
    tp_rank: int
    communication_group: ProcessGroup
    group_rank_by_logical_rank: tuple[int, ...]

    @property
    def group_size(self) -> int:
        """Return the number of ranks participating in the redistribution."""
        return self.cp_size * self.tp_size


def _get_group_rank_by_logical_rank(
    cp_group: ProcessGroup,
    tp_group: ProcessGroup,
    tp_cp_group: ProcessGroup,
) -> tuple[int, ...]:
    """Map logical ``cp_rank * tp_size + tp_rank`` coordinates to ranks of ``tp_cp_group``."""
    return _build_group_rank_by_logical_rank(
        comm.group_global_ranks(cp_group),
        comm.group_global_ranks(tp_group),
        comm.group_global_ranks(tp_cp_group),
        comm.global_rank(),
    )


def _get_layout_parallel_context(
    cp_group: ProcessGroup,
    sequence_parallel: bool,
    tp_group: ProcessGroup | None,
    tp_cp_group: ProcessGroup | None,
) -> _LayoutParallelContext:
    """Resolve the rank coordinates and process group for a layout redistribution."""
    if cp_group is None:
        raise ValueError("cp_group is None; a context-parallel process group is required")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if not sequence_parallel:
        return _LayoutParallelContext(cp_size, cp_rank, 1, 0, cp_group, tuple(range(cp_size)))
    if tp_group is None:
        raise ValueError("sequence_parallel=True requires tp_group, got None")
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    if tp_size == 1:
        return _LayoutParallelContext(cp_size, cp_rank, 1, 0, cp_group, tuple(range(cp_size)))
    if tp_cp_group is None:
        raise ValueError(f"sequence_parallel=True with a TP group of size {tp_size} requires tp_cp_group, got None")
    group_ranks = _get_group_rank_by_logical_rank(cp_group, tp_group, tp_cp_group)
    return _LayoutParallelContext(cp_size, cp_rank, tp_size, tp_rank, tp_cp_group, group_ranks)


def _normalize_seq_dim(input_: torch.Tensor, seq_dim: int) -> int:
    """Return ``seq_dim`` as a non-negative dimension of ``input_``."""
    if not -input_.dim() <= seq_dim < input_.dim():
        raise ValueError(f"seq_dim {seq_dim} is out of range for a tensor of shape {tuple(input_.shape)}")
    return seq_dim % input_.dim()


def _redistribute_layout(
    input_: torch.Tensor,
    cp_group: ProcessGroup,
    source_layout: CPLayout,
    target_layout: CPLayout,
    sequence_parallel: bool,
    tp_group: ProcessGroup | None,
    tp_cp_group: ProcessGroup | None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Redistribute local sequence segments with a differentiable all-to-all-v."""
    source_layout, target_layout = as_layout(source_layout), as_layout(target_layout)
    context = _get_layout_parallel_context(cp_group, sequence_parallel, tp_group, tp_cp_group)
    seq_dim = _normalize_seq_dim(input_, seq_dim)
    segment_count = _segments_per_rank(context.tp_size)
    local_length = input_.shape[seq_dim]
    if local_length % segment_count != 0:
        raise ValueError(
            f"local sequence length {local_length} (dim {seq_dim}) is not divisible by the {segment_count} "
            "segments each rank holds"
        )
    if source_layout is target_layout or context.group_size == 1:
        return input_
    plan = _build_layout_redistribution_plan(
        source_layout, target_layout, *_plan_coordinates(context), context.group_rank_by_logical_rank
    )
    reverse_plan = _build_layout_redistribution_plan(
        target_layout, source_layout, *_plan_coordinates(context), context.group_rank_by_logical_rank
    )
    own_rank = _own_group_rank(context)
    return redistribute_segments(input_, plan, reverse_plan, context.communication_group, seq_dim, own_rank)


def _own_group_rank(context: _LayoutParallelContext) -> int:
    """Return this rank's index in ``context.communication_group``."""
    return context.group_rank_by_logical_rank[context.cp_rank * context.tp_size + context.tp_rank]


def _plan_coordinates(context: _LayoutParallelContext) -> tuple[int, int, int, int]:
    """Return ``(cp_size, cp_rank, tp_size, tp_rank)`` of ``context`` for the plan builders."""
    return context.cp_size, context.cp_rank, context.tp_size, context.tp_rank


def _redistribute_thd_layout(
    input_: torch.Tensor,
    cp_group: ProcessGroup,
    plan: THDCPLayoutPlan,
    source_layout: CPLayout,
    target_layout: CPLayout,
    sequence_parallel: bool,
    tp_group: ProcessGroup | None,
    tp_cp_group: ProcessGroup | None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Apply a packed sequence layout plan with a differentiable all-to-all-v."""
    source_layout, target_layout = as_layout(source_layout), as_layout(target_layout)
    context = _get_layout_parallel_context(cp_group, sequence_parallel, tp_group, tp_cp_group)
    if plan.group_size != context.group_size:
        raise ValueError(
            f"THD plan was built for a group of {plan.group_size} ranks, but the conversion group has "
            f"{context.group_size} (cp {context.cp_size} x tp {context.tp_size})"
        )
    seq_dim = _normalize_seq_dim(input_, seq_dim)
    expected = {
        CPLayout.CONTIGUOUS: plan.contiguous_local_token_count,
        CPLayout.ZIGZAG: plan.zigzag_local_token_count,
    }[source_layout]
    if input_.shape[seq_dim] != expected:
        raise ValueError(
            f"input has {input_.shape[seq_dim]} tokens on dim {seq_dim}, but the THD plan expects {expected} "
            f"local tokens in the {source_layout.value} layout"
        )
    if source_layout is target_layout:
        return input_
    to_zigzag = target_layout is CPLayout.ZIGZAG
    own_rank = _own_group_rank(context)
    return redistribute_tokens(input_, plan, to_zigzag, context.communication_group, seq_dim, own_rank)


@comm.eager_under_compile
def build_thd_cp_layout_plan(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    cp_group: ProcessGroup,
    cu_seqlens_padded: torch.Tensor | None = None,
    sequence_parallel: bool = False,
    tp_group: ProcessGroup | None = None,
    tp_cp_group: ProcessGroup | None = None,
) -> THDCPLayoutPlan:
    """Build a reusable packed sequence layout plan for attention.

    Args:
        cu_seqlens: Global cumulative actual sequence lengths in torch.int32.
        total_tokens: Global token count in the contiguous residual stream.
        cp_group: Context-parallel process group.
        cu_seqlens_padded: Optional physical offsets already present in the input.
        sequence_parallel: Whether the residual stream is also sharded over TP ranks.
        tp_group: Tensor-parallel process group, required with sequence parallelism.
        tp_cp_group: Combined TP x CP process group, required when TP size is greater than one.

    Returns:
        A rank-local plan reusable for both directions of the layout conversion. The plan is built on the host
        after one transfer of the offsets and its index tensors are moved to the device of ``cu_seqlens``.
    """
    context = _get_layout_parallel_context(cp_group, sequence_parallel, tp_group, tp_cp_group)
    check_cu_seqlens_structure(cu_seqlens, cu_seqlens_padded)
    actual, padded = host_copies(cu_seqlens, cu_seqlens_padded)
    return _build_thd_plan_from_host_offsets(actual, padded, total_tokens, context, cu_seqlens.device)


def _build_thd_plan_from_host_offsets(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    total_tokens: int,
    context: _LayoutParallelContext,
    device: torch.device,
) -> THDCPLayoutPlan:
    """Build this rank's THD plan from host offsets, then move it to ``device``.

    The movers keep the host copy, so the data moves they derive from the plan at its first conversion need no
    device-to-host copy.
    """
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
        raise ValueError(f"total_tokens must be an int, got {total_tokens!r}")
    rank_order_indices, zigzag_offsets = _build_thd_rank_order_indices(
        cu_seqlens, cu_seqlens_padded, context.cp_size, context.tp_size, expected_source_token_count=total_tokens
    )
    plan = _build_thd_cp_layout_plan_from_rank_order_indices(
        rank_order_indices,
        total_tokens,
        zigzag_offsets,
        *_plan_coordinates(context),
        group_rank_by_logical_rank=context.group_rank_by_logical_rank,
        pad_between_seqs=not torch.equal(zigzag_offsets, cu_seqlens),
    )
    return plan_on_device(plan, device)


@comm.eager_under_compile
def contiguous_to_zigzag(
    input_: torch.Tensor,
    cp_group: ProcessGroup,
    sequence_parallel: bool = False,
    tp_group: ProcessGroup | None = None,
    tp_cp_group: ProcessGroup | None = None,
    thd_plan: THDCPLayoutPlan | None = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Convert contiguous CP sequence shards to Megatron's zigzag attention layout."""
    groups = (cp_group, sequence_parallel, tp_group, tp_cp_group)
    return _convert(input_, CPLayout.CONTIGUOUS, CPLayout.ZIGZAG, *groups, thd_plan, seq_dim)


@comm.eager_under_compile
def zigzag_to_contiguous(
    input_: torch.Tensor,
    cp_group: ProcessGroup,
    sequence_parallel: bool = False,
    tp_group: ProcessGroup | None = None,
    tp_cp_group: ProcessGroup | None = None,
    thd_plan: THDCPLayoutPlan | None = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Convert Megatron's zigzag attention shards back to contiguous CP shards."""
    groups = (cp_group, sequence_parallel, tp_group, tp_cp_group)
    return _convert(input_, CPLayout.ZIGZAG, CPLayout.CONTIGUOUS, *groups, thd_plan, seq_dim)


def _convert(
    input_: torch.Tensor,
    source_layout: CPLayout | str,
    target_layout: CPLayout | str,
    cp_group: ProcessGroup,
    sequence_parallel: bool,
    tp_group: ProcessGroup | None,
    tp_cp_group: ProcessGroup | None,
    thd_plan: THDCPLayoutPlan | None,
    seq_dim: int,
) -> torch.Tensor:
    """Dispatch a conversion to the packed path when a THD plan is given and to the dense path otherwise."""
    groups = (sequence_parallel, tp_group, tp_cp_group)
    if thd_plan is not None:
        return _redistribute_thd_layout(
            input_, cp_group, thd_plan, source_layout, target_layout, *groups, seq_dim=seq_dim
        )
    return _redistribute_layout(input_, cp_group, source_layout, target_layout, *groups, seq_dim=seq_dim)


@dataclass(eq=False)
class ContextParallelLayoutManager:
    """Manage CP layout transitions across a sequence of layers.

    Runs of layers with the same layout share one conversion; the boundary layout is what enters the first layer
    and leaves the last. ``seq_dim`` is the sequence dimension of every tensor it converts.
    """

    layer_layouts: tuple[CPLayout, ...]
    boundary_layout: CPLayout
    sequence_parallel: bool
    cp_group: ProcessGroup
    tp_group: ProcessGroup | None = None
    tp_cp_group: ProcessGroup | None = None
    requires_conversion: bool = field(init=False)
    seq_dim: int = 0

    def __post_init__(self) -> None:
        """Determine whether the layer sequence needs layout conversion."""
        self.layer_layouts = tuple(as_layout(layout) for layout in self.layer_layouts)
        self.boundary_layout = as_layout(self.boundary_layout)
        context = _get_layout_parallel_context(self.cp_group, self.sequence_parallel, self.tp_group, self.tp_cp_group)
        self.requires_conversion = context.cp_size > 1 and any(
            layout is not self.boundary_layout for layout in self.layer_layouts
        )

    def _check_layer_index(self, layer_index: int) -> None:
        """Reject a layer index outside the managed stack."""
        if not 0 <= layer_index < len(self.layer_layouts):
            raise ValueError(f"layer_index {layer_index} is outside [0, {len(self.layer_layouts)})")

    def layout_of_layer(self, layer_index: int) -> CPLayout:
        """Return the layout layer ``layer_index`` runs in; ``-1`` and ``len(layers)`` name the boundary."""
        if layer_index in (-1, len(self.layer_layouts)):
            return self.boundary_layout
        self._check_layer_index(layer_index)
        return self.layer_layouts[layer_index]

    def _convert_cp_layout(
        self,
        hidden_states: torch.Tensor,
        source_layout: CPLayout,
        target_layout: CPLayout,
        thd_plan: THDCPLayoutPlan | None = None,
    ) -> torch.Tensor:
        """Convert ``hidden_states`` between two layouts with this manager's groups and ``seq_dim``.

        The module-level ``contiguous_to_zigzag``/``zigzag_to_contiguous`` are looked up at call time, with the
        reference's argument shape, so patching them observes or replaces every conversion.
        """
        source_layout, target_layout = as_layout(source_layout), as_layout(target_layout)
        if source_layout is target_layout:
            return hidden_states
        convert = contiguous_to_zigzag if target_layout is CPLayout.ZIGZAG else zigzag_to_contiguous
        args = (hidden_states, self.cp_group, self.sequence_parallel, self.tp_group, self.tp_cp_group, thd_plan)
        return convert(*args) if self.seq_dim == 0 else convert(*args, seq_dim=self.seq_dim)

    @comm.eager_under_compile
    def prepare_layer_input(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
        thd_plan: THDCPLayoutPlan | None = None,
    ) -> torch.Tensor:
        """Convert when a layer requires a different layout than its predecessor."""
        self._check_layer_index(layer_index)
        source = self.layout_of_layer(layer_index - 1)
        target = self.layer_layouts[layer_index]
        if not self.requires_conversion or source is target:
            return hidden_states
        return self._convert_cp_layout(hidden_states, source, target, thd_plan)

    @comm.eager_under_compile
    def finalize_layer_output(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
        thd_plan: THDCPLayoutPlan | None = None,
    ) -> torch.Tensor:
        """Restore the boundary layout after the final layer."""
        self._check_layer_index(layer_index)
        source = self.layer_layouts[layer_index]
        is_last = layer_index == len(self.layer_layouts) - 1
        if not self.requires_conversion or not is_last or source is self.boundary_layout:
            return hidden_states
        return self._convert_cp_layout(hidden_states, source, self.boundary_layout, thd_plan)

    @comm.eager_under_compile
    def build_packed_zigzag_layout(
        self,
        packed_seq_params: PackedSeqParams,
    ) -> tuple[THDCPLayoutPlan, PackedSeqParams]:
        """Build one THD conversion plan and its zigzag-layout metadata."""
        cu_seqlens = packed_seq_params.cu_seqlens_q
        if cu_seqlens is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is None; packed layout conversion needs it")
        padded = packed_seq_params.cu_seqlens_q_padded
        check_cu_seqlens_structure(cu_seqlens, padded)
        cu_seqlens_kv = packed_seq_params.cu_seqlens_kv
        separate_kv = cu_seqlens_kv is not None and cu_seqlens_kv is not cu_seqlens
        if separate_kv and (
            not isinstance(cu_seqlens_kv, torch.Tensor)
            or (cu_seqlens_kv.shape, cu_seqlens_kv.dtype, cu_seqlens_kv.device)
            != (cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device)
        ):
            raise ValueError(
                "packed_seq_params.cu_seqlens_kv differs from cu_seqlens_q; expected self-attention offsets"
            )
        actual, padded_host, kv_host = host_copies(cu_seqlens, padded, cu_seqlens_kv if separate_kv else None)
        if separate_kv and not torch.equal(kv_host, actual):
            raise ValueError(
                "packed_seq_params.cu_seqlens_kv differs from cu_seqlens_q; expected self-attention offsets"
            )
        total_tokens = packed_seq_params.total_tokens
        if total_tokens is None:
            total_tokens = int((actual if padded_host is None else padded_host)[-1])
        plan = build_thd_cp_layout_plan(
            cu_seqlens, total_tokens, self.cp_group, padded, self.sequence_parallel, self.tp_group, self.tp_cp_group
        )
        zigzag_params = dataclasses.replace(
            packed_seq_params,
            qkv_format="thd",
            cu_seqlens_kv=cu_seqlens if cu_seqlens_kv is None else cu_seqlens_kv,
            cu_seqlens_q_padded=plan.cu_seqlens_padded,
            cu_seqlens_kv_padded=plan.cu_seqlens_padded,
            max_seqlen_q=plan.max_seqlen_padded,
            max_seqlen_kv=plan.max_seqlen_padded,
            total_tokens=None,
            seq_idx=None,
            pad_between_seqs=plan.pad_between_seqs,
        )
        return plan, zigzag_params

    @comm.eager_under_compile
    def build_conversion_state(
        self,
        packed_seq_params: PackedSeqParams | None,
    ) -> ContextParallelLayoutState | None:
        """Build the state of one batch whether or not a layer changes the layout (None only when cp == 1).

        Its plan converts any per-token tensor of the batch and it carries the zigzag metadata; where no layer changes
        the layout, its ``prepare_layer``/``finalize_layer`` return their input unchanged.
        """
        if self.cp_group.size() == 1:
            return None
        if packed_seq_params is None:
            return ContextParallelLayoutState(self, None, None, None)
        plan, zigzag_params = self.build_packed_zigzag_layout(packed_seq_params)
        return ContextParallelLayoutState(self, plan, packed_seq_params, zigzag_params)

    @comm.eager_under_compile
    def build_forward_state(
        self,
        packed_seq_params: PackedSeqParams | None,
    ) -> ContextParallelLayoutState | None:
        """Build the layout state for one forward pass (None when cp == 1 or no layer changes the layout)."""
        return self.build_conversion_state(packed_seq_params) if self.requires_conversion else None


@dataclass(eq=False)
class ContextParallelLayoutState:
    """Per-forward state for CP layout conversion."""

    manager: ContextParallelLayoutManager
    thd_plan: THDCPLayoutPlan | None
    contiguous_packed_seq_params: PackedSeqParams | None
    zigzag_packed_seq_params: PackedSeqParams | None

    def layout_of_layer(self, layer_index: int) -> CPLayout:
        """Return the layout layer ``layer_index`` runs in (``-1`` and ``len(layers)`` name the boundary)."""
        return self.manager.layout_of_layer(layer_index)

    def packed_seq_params_for(self, layout: CPLayout | str) -> PackedSeqParams | None:
        """Return the packed metadata describing tokens in ``layout`` (None for dense batches)."""
        if as_layout(layout) is CPLayout.ZIGZAG:
            return self.zigzag_packed_seq_params
        return self.contiguous_packed_seq_params

    @comm.eager_under_compile
    def prepare_layer(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, PackedSeqParams | None]:
        """Prepare a layer's input and matching packed metadata."""
        converted = self.manager.prepare_layer_input(layer_index, hidden_states, self.thd_plan)
        return converted, self.packed_seq_params_for(self.manager.layer_layouts[layer_index])

    @comm.eager_under_compile
    def finalize_layer(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Finalize a layer's output layout."""
        return self.manager.finalize_layer_output(layer_index, hidden_states, self.thd_plan)

    @comm.eager_under_compile
    def convert(
        self,
        tensor: torch.Tensor,
        source_layout: CPLayout | str,
        target_layout: CPLayout | str,
    ) -> torch.Tensor:
        """Convert another per-token tensor of this batch (ids, labels, masks; any dtype) between layouts."""
        source_layout, target_layout = as_layout(source_layout), as_layout(target_layout)
        if source_layout is target_layout or self.manager.cp_group.size() == 1:
            return tensor
        return self.manager._convert_cp_layout(tensor, source_layout, target_layout, self.thd_plan)
