"""Context-parallel sequence-layout conversion: contiguous <-> zigzag shards, dense and packed, with a layer manager.

Plans are built by the pure functions of ``layout_plans`` (re-exported here); this module resolves process groups,
moves data with one all-to-all-v per conversion (``comm.all_to_all_v_into``, inside autograd functions whose backward
is the inverse conversion) and tracks layouts across a stack of layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from lightning_cp import comm
from lightning_cp.layout_plans import (
    CPLayout,
    THDCPLayoutPlan,
    _as_layout,
    _build_group_rank_by_logical_rank,
    _build_layout_redistribution_plan,
    _build_thd_cp_layout_plan_from_rank_order_indices,
    _build_thd_rank_order_indices,
    _check_cu_seqlens_structure,
    _LayoutRedistributionPlan,
    _local_segment_ids,
    _segment_owner,
    _segments_per_rank,
)
from lightning_cp.packed import PackedSeqParams

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
    cp_size, cp_rank = comm.group_size(cp_group), comm.group_rank(cp_group)
    if not sequence_parallel:
        return _LayoutParallelContext(cp_size, cp_rank, 1, 0, cp_group, tuple(range(cp_size)))
    if tp_group is None:
        raise ValueError("sequence_parallel=True requires tp_group, got None")
    tp_size, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
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


def _as_rows(input_: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """View ``input_`` as ``[before, sequence, after]`` (a copy only when it is not contiguous)."""
    shape = input_.shape
    return input_.reshape(math.prod(shape[:seq_dim]), shape[seq_dim], math.prod(shape[seq_dim + 1 :]))


def _resized(shape: torch.Size, seq_dim: int, length: int) -> tuple[int, ...]:
    """Return ``shape`` with its sequence dimension set to ``length``."""
    return (*shape[:seq_dim], length, *shape[seq_dim + 1 :])


class _StagingBuffers(threading.local):
    """Per-thread reusable host buffers for send and receive staging.

    Fresh large host allocations page-fault on every call, which costs more than the copies themselves, so CPU
    conversions stage through buffers that stay mapped; other devices allocate (their caching allocators reuse).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return an uninitialised ``shape`` tensor for ``role`` ("send" or "receive") on ``device``."""
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        byte_count = math.prod(shape) * dtype.itemsize
        buffer = self.buffers.get((role, device))
        if buffer is None or buffer.numel() < byte_count:
            buffer = torch.empty(byte_count, dtype=torch.uint8, device=device)
            self.buffers[(role, device)] = buffer
        return buffer[:byte_count].view(dtype).view(shape)


_staging = _StagingBuffers()


def _carried_as_bytes(move: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a data mover so bool tensors travel as uint8 (gloo has no bool type) and come back as bool."""

    @functools.wraps(move)
    def wrapper(input_: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if input_.dtype != torch.bool:
            return move(input_, *args, **kwargs)
        return move(input_.view(torch.uint8), *args, **kwargs).view(torch.bool)

    return wrapper


@dataclass(frozen=True)
class _SegmentMoves:
    """How one rank's segments move: kept runs copied locally, the rest through the all-to-all (self split 0)."""

    kept_runs: tuple[tuple[int, int, int], ...]
    sent_slots: tuple[int, ...]
    received_slots: tuple[int, ...]
    input_segment_counts: tuple[int, ...]
    output_segment_counts: tuple[int, ...]


def _runs(pairs: list[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Merge ``(source, target)`` slot pairs into ``(source, target, count)`` runs that advance together."""
    runs: list[list[int]] = []
    for source, target in pairs:
        if runs and source == runs[-1][0] + runs[-1][2] and target == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([source, target, 1])
    return tuple((source, target, count) for source, target, count in runs)


@functools.lru_cache(maxsize=1024)
def _segment_moves(plan: _LayoutRedistributionPlan, own_rank: int) -> _SegmentMoves:
    """Split ``plan`` into the segments ``own_rank`` keeps and those it exchanges, in all-to-all order."""
    send_start = sum(plan.input_segment_counts[:own_rank])
    receive_start = sum(plan.output_segment_counts[:own_rank])
    kept = plan.input_segment_counts[own_rank]
    target_of_received = [0] * len(plan.receive_permutation)
    for slot, index in enumerate(plan.receive_permutation):
        target_of_received[index] = slot
    pairs = [(plan.send_slots[send_start + k], target_of_received[receive_start + k]) for k in range(kept)]
    input_counts, output_counts = list(plan.input_segment_counts), list(plan.output_segment_counts)
    input_counts[own_rank] = output_counts[own_rank] = 0
    return _SegmentMoves(
        kept_runs=_runs(sorted(pairs)),
        sent_slots=plan.send_slots[:send_start] + plan.send_slots[send_start + kept :],
        received_slots=tuple(target_of_received[:receive_start] + target_of_received[receive_start + kept :]),
        input_segment_counts=tuple(input_counts),
        output_segment_counts=tuple(output_counts),
    )


def _consecutive(slots: tuple[int, ...]) -> bool:
    """Whether ``slots`` is one increasing run of adjacent slots (or empty)."""
    return all(b == a + 1 for a, b in zip(slots, slots[1:], strict=False))


@_carried_as_bytes
def _move_segments(
    input_: torch.Tensor, plan: _LayoutRedistributionPlan, group: ProcessGroup, seq_dim: int, own_rank: int
) -> torch.Tensor:
    """Send whole sequence segments per ``plan``; one fresh output, staging copies only where order changes.

    Segments that stay on this rank never enter the all-to-all: they are copied straight into the output. The moving
    segments travel as a view of the input and arrive in place in the output when they form one run in rank order.
    """
    moves = _segment_moves(plan, own_rank)
    rows = _as_rows(input_, seq_dim)
    before, length, after = rows.shape
    segment_count = len(plan.send_slots)
    segment_length = length // segment_count
    segments = rows.view(before, segment_count, segment_length, after)
    output = torch.empty(input_.shape, dtype=input_.dtype, device=input_.device)
    placed = output.view(before, segment_count, segment_length, after)
    for source, target, count in moves.kept_runs:
        placed[:, target : target + count].copy_(segments[:, source : source + count])
    sent, received_slots = moves.sent_slots, moves.received_slots
    if before == 1 and _consecutive(sent):
        first = sent[0] if sent else 0
        send = segments[0, first : first + len(sent)].reshape(-1, after)
    else:
        send = _staging.get("send", (len(sent), before, segment_length, after), input_.dtype, input_.device)
        for position, slot in enumerate(sent):
            send[position].copy_(segments[:, slot])
        send = send.view(-1, after)
    rows_per_segment = before * segment_length
    output_splits = [count * rows_per_segment for count in moves.output_segment_counts]
    input_splits = [count * rows_per_segment for count in moves.input_segment_counts]
    if before == 1 and _consecutive(received_slots):
        first = received_slots[0] if received_slots else 0
        landing = placed[0, first : first + len(received_slots)].view(-1, after)
        comm.all_to_all_v_into(landing, send, output_splits, input_splits, group)
        return output
    shape = (len(received_slots), before, segment_length, after)
    received = _staging.get("receive", shape, input_.dtype, input_.device)
    comm.all_to_all_v_into(received.view(-1, after), send, output_splits, input_splits, group)
    for index, slot in enumerate(received_slots):
        placed[:, slot].copy_(received[index])
    return output


class _SegmentRedistribution(torch.autograd.Function):
    """Dense layout conversion whose backward is the inverse conversion."""

    @staticmethod
    def forward(ctx, input_, plan, reverse_plan, group, seq_dim, own_rank):  # type: ignore[override]
        ctx.reverse_plan, ctx.group, ctx.seq_dim, ctx.own_rank = reverse_plan, group, seq_dim, own_rank
        return _move_segments(input_, plan, group, seq_dim, own_rank)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_input = _move_segments(grad_output, ctx.reverse_plan, ctx.group, ctx.seq_dim, ctx.own_rank)
        return grad_input, None, None, None, None, None


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
    source_layout, target_layout = _as_layout(source_layout), _as_layout(target_layout)
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
    own_rank = context.group_rank_by_logical_rank[context.cp_rank * context.tp_size + context.tp_rank]
    return _SegmentRedistribution.apply(input_, plan, reverse_plan, context.communication_group, seq_dim, own_rank)


def _plan_coordinates(context: _LayoutParallelContext) -> tuple[int, int, int, int]:
    """Return ``(cp_size, cp_rank, tp_size, tp_rank)`` of ``context`` for the plan builders."""
    return context.cp_size, context.cp_rank, context.tp_size, context.tp_rank


def _zigzag_gather_indices(plan: THDCPLayoutPlan) -> torch.Tensor | None:
    """For each zigzag slot, the arrival it takes (the count of arrivals for padding); None when arrivals fit as-is."""
    if plan.forward_receive_is_identity:
        return None
    received_count = plan.forward_receive_positions.numel()
    indices = torch.full(
        (plan.zigzag_local_token_count,),
        received_count,
        dtype=torch.int64,
        device=plan.forward_receive_positions.device,
    )
    indices[plan.forward_receive_positions] = torch.arange(received_count, device=indices.device)
    return indices


def _forward_send_padding_rows(plan: THDCPLayoutPlan) -> torch.Tensor:
    """Rows of the forward send buffer that carry padding (taken from the plan when it lists them)."""
    if plan.forward_send_padding_rows is not None:
        return plan.forward_send_padding_rows
    return torch.nonzero(plan.forward_send_indices < 0).flatten()


_MIN_RUN_ROWS = 64
"""A row map copies slice by slice when its runs average at least this many rows, and with index kernels otherwise."""


@dataclass(frozen=True)
class _RowMap:
    """``destination[targets] = source[sources]`` along dim 0, as slice runs or as index tensors.

    ``sources`` None reads all of ``source`` in order; ``targets`` None writes all of ``destination`` in order.
    """

    runs: tuple[tuple[int, int, int], ...] | None = None
    sources: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    @staticmethod
    def build(sources: torch.Tensor, targets: torch.Tensor, source_rows: int, destination_rows: int) -> _RowMap:
        """Map host int64 ``sources`` to ``targets`` (equally long); slice runs when they are long enough."""
        count = sources.numel()
        if count == 0:
            return _RowMap(runs=())
        breaks = torch.nonzero((sources[1:] - sources[:-1] != 1) | (targets[1:] - targets[:-1] != 1)).flatten()
        if (breaks.numel() + 1) * _MIN_RUN_ROWS <= count:
            starts = [0, *(breaks + 1).tolist()]
            ends = [*starts[1:], count]
            firsts = zip(sources[starts].tolist(), targets[starts].tolist(), strict=True)
            return _RowMap(
                runs=tuple((s, t, end - start) for (s, t), start, end in zip(firsts, starts, ends, strict=True))
            )
        every_source = count == source_rows and bool(torch.equal(sources, torch.arange(count)))
        every_target = count == destination_rows and bool(torch.equal(targets, torch.arange(count)))
        return _RowMap(sources=None if every_source else sources, targets=None if every_target else targets)

    def to(self, device: torch.device) -> _RowMap:
        """Return the map with its index tensors on ``device``."""
        return _RowMap(
            self.runs,
            None if self.sources is None else self.sources.to(device),
            None if self.targets is None else self.targets.to(device),
        )

    def apply(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the mapped rows of ``source`` into ``destination``."""
        if self.runs is not None:
            for first_source, first_target, count in self.runs:
                destination[first_target : first_target + count].copy_(source[first_source : first_source + count])
        elif self.sources is None and self.targets is None:
            destination.copy_(source)
        elif self.targets is None and destination.is_contiguous():
            torch.index_select(source, 0, self.sources, out=destination)
        elif self.targets is None:
            destination.copy_(source.index_select(0, self.sources))
        elif self.sources is None:
            destination.index_copy_(0, self.targets, source)
        else:
            destination.index_copy_(0, self.targets, source.index_select(0, self.sources))


@dataclass(frozen=True)
class _TokenMoves:
    """One rank's packed conversion in one direction, with the tokens it keeps outside the all-to-all.

    ``kept`` copies input tokens that stay on the rank straight into the output and ``zero_slots`` are output padding;
    ``send`` gathers the moving tokens into the send buffer (``send_padding_rows`` zero) unless ``send_run`` names
    them as one run of input rows; ``receive`` places arrivals unless ``receive_run`` names one run of output rows
    they land on in order.
    """

    kept: _RowMap
    zero_slots: torch.Tensor | None
    send: _RowMap
    send_padding_rows: torch.Tensor | None
    send_count: int
    send_run: int | None
    receive: _RowMap
    receive_count: int
    receive_run: int | None
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]


def _first_of_run(indices: torch.Tensor) -> int | None:
    """The first entry of ``indices`` when they count up by one (0 when empty); None otherwise."""
    if indices.numel() == 0:
        return 0
    if indices.numel() > 1 and not bool((indices[1:] - indices[:-1] == 1).all()):
        return None
    return int(indices[0])


def _without(length: int, start: int, count: int) -> torch.Tensor:
    """``0 .. length - 1`` without ``start .. start + count - 1``."""
    return torch.cat([torch.arange(start), torch.arange(start + count, length)])


def _build_token_moves(
    send_indices: torch.Tensor | None,
    send_padding_rows: torch.Tensor | None,
    input_split_sizes: tuple[int, ...],
    output_split_sizes: tuple[int, ...],
    input_length: int,
    output_length: int,
    receive_indices: torch.Tensor | None,
    own_rank: int,
) -> _TokenMoves:
    """Split an all-to-all-v conversion (host index tensors) into kept tokens and the exchange of the others.

    ``send_indices`` None sends the input as it is and ``send_padding_rows`` lists send rows that carry zeros;
    ``receive_indices`` gives the arrival each output slot takes (None: arrivals in order; the arrival count:
    padding). Arrivals from ``own_rank`` are its own send rows in order, so they are copied instead of sent.
    """
    sent, received = sum(input_split_sizes), sum(output_split_sizes)
    kept_count = input_split_sizes[own_rank]
    send_start, receive_start = sum(input_split_sizes[:own_rank]), sum(output_split_sizes[:own_rank])
    sources = torch.arange(sent) if send_indices is None else send_indices
    is_padding = torch.zeros(sent, dtype=torch.bool)
    if send_padding_rows is not None:
        is_padding[send_padding_rows] = True
    slot_arrivals = torch.arange(output_length) if receive_indices is None else receive_indices
    used = slot_arrivals < received
    slot_of_arrival = torch.full((received,), -1, dtype=torch.int64)
    slot_of_arrival[slot_arrivals[used]] = torch.nonzero(used).flatten()

    kept_slots = slot_of_arrival[receive_start : receive_start + kept_count]
    kept_sources = sources[send_start : send_start + kept_count]
    kept_padding = is_padding[send_start : send_start + kept_count]
    keep = (kept_slots >= 0) & ~kept_padding
    kept = _RowMap.build(kept_sources[keep], kept_slots[keep], input_length, output_length)
    zero_slots = torch.cat([torch.nonzero(~used).flatten(), kept_slots[(kept_slots >= 0) & kept_padding]])

    moving_sources = sources[_without(sent, send_start, kept_count)]
    moving_padding = is_padding[_without(sent, send_start, kept_count)]
    send_count = moving_sources.numel()
    token_rows = torch.nonzero(~moving_padding).flatten()
    send = _RowMap.build(moving_sources[token_rows], token_rows, input_length, send_count)
    has_padding = bool(moving_padding.any())
    send_run = None if has_padding else _first_of_run(moving_sources)

    moving_slots = slot_of_arrival[_without(received, receive_start, kept_count)]
    receive_count = moving_slots.numel()
    arrived = torch.nonzero(moving_slots >= 0).flatten()
    receive = _RowMap.build(arrived, moving_slots[arrived], receive_count, output_length)
    receive_run = _first_of_run(moving_slots) if arrived.numel() == receive_count else None

    input_splits, output_splits = list(input_split_sizes), list(output_split_sizes)
    input_splits[own_rank] = output_splits[own_rank] = 0
    return _TokenMoves(
        kept=kept,
        zero_slots=zero_slots if zero_slots.numel() else None,
        send=send,
        send_padding_rows=torch.nonzero(moving_padding).flatten() if has_padding else None,
        send_count=send_count,
        send_run=send_run,
        receive=receive,
        receive_count=receive_count,
        receive_run=receive_run,
        input_split_sizes=tuple(input_splits),
        output_split_sizes=tuple(output_splits),
    )


def _on_device(moves: _TokenMoves, device: torch.device) -> _TokenMoves:
    """Return ``moves`` with its index tensors on ``device``."""
    if device.type == "cpu":
        return moves
    return dataclasses.replace(
        moves,
        kept=moves.kept.to(device),
        zero_slots=None if moves.zero_slots is None else moves.zero_slots.to(device),
        send=moves.send.to(device),
        send_padding_rows=None if moves.send_padding_rows is None else moves.send_padding_rows.to(device),
        receive=moves.receive.to(device),
    )


def _token_moves(plan: THDCPLayoutPlan, to_zigzag: bool, own_rank: int) -> _TokenMoves:
    """This rank's moves for converting with ``plan`` in one direction, built once per plan and kept on it."""
    cache = plan.__dict__.setdefault("_token_moves", {})
    key = (to_zigzag, own_rank)
    if key in cache:
        return cache[key]
    host = {
        name: getattr(plan, name).cpu()
        for name in ("forward_send_indices", "reverse_send_indices", "reverse_receive_indices")
    }
    if to_zigzag:
        gather = None if plan.forward_receive_is_identity else _zigzag_gather_indices(plan)
        moves = _build_token_moves(
            None if plan.forward_send_is_identity else host["forward_send_indices"],
            _forward_send_padding_rows(plan).cpu(),
            plan.forward_input_split_sizes,
            plan.forward_output_split_sizes,
            plan.contiguous_local_token_count,
            plan.zigzag_local_token_count,
            None if gather is None else gather.cpu(),
            own_rank,
        )
    else:
        moves = _build_token_moves(
            None if plan.forward_receive_is_identity else host["reverse_send_indices"],
            None,
            plan.forward_output_split_sizes,
            plan.forward_input_split_sizes,
            plan.zigzag_local_token_count,
            plan.contiguous_local_token_count,
            None if plan.forward_send_is_identity else host["reverse_receive_indices"],
            own_rank,
        )
    cache[key] = moves = _on_device(moves, plan.forward_send_indices.device)
    return moves


@_carried_as_bytes
def _move_tokens(
    input_: torch.Tensor, moves: _TokenMoves, group: ProcessGroup, seq_dim: int, output_length: int
) -> torch.Tensor:
    """Copy the kept tokens into a fresh output and all-to-all-v the others, staging only where order changes."""
    rows = _as_rows(input_, seq_dim)
    before, _, after = rows.shape
    tokens = rows.view(-1, after) if before == 1 else rows.transpose(0, 1)
    token_shape = tokens.shape[1:]
    dtype, device = input_.dtype, input_.device
    output = torch.empty(_resized(input_.shape, seq_dim, output_length), dtype=dtype, device=device)
    placed = output.view(-1, after) if before == 1 else output.view(before, output_length, after).transpose(0, 1)
    moves.kept.apply(placed, tokens)
    if moves.zero_slots is not None:
        placed.index_fill_(0, moves.zero_slots, 0)
    if before == 1 and moves.send_run is not None:
        send = tokens[moves.send_run : moves.send_run + moves.send_count]
    else:
        send = _staging.get("send", (moves.send_count, *token_shape), dtype, device)
        moves.send.apply(send, tokens)
        if moves.send_padding_rows is not None:
            send.index_fill_(0, moves.send_padding_rows, 0)
    splits = (moves.output_split_sizes, moves.input_split_sizes)
    if before == 1 and moves.receive_run is not None:
        landing = placed[moves.receive_run : moves.receive_run + moves.receive_count]
        comm.all_to_all_v_into(landing, send, *splits, group)
        return output
    received = _staging.get("receive", (moves.receive_count, *token_shape), dtype, device)
    comm.all_to_all_v_into(received, send, *splits, group)
    moves.receive.apply(placed, received)
    return output


class _THDRedistribution(torch.autograd.Function):
    """Packed layout conversion whose backward is the inverse conversion."""

    @staticmethod
    def forward(ctx, input_, plan, to_zigzag, group, seq_dim, own_rank):  # type: ignore[override]
        ctx.plan, ctx.to_zigzag, ctx.group, ctx.seq_dim, ctx.own_rank = plan, to_zigzag, group, seq_dim, own_rank
        return _convert_tokens(input_, plan, to_zigzag, group, seq_dim, own_rank)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_input = _convert_tokens(grad_output, ctx.plan, not ctx.to_zigzag, ctx.group, ctx.seq_dim, ctx.own_rank)
        return grad_input, None, None, None, None, None


def _convert_tokens(
    input_: torch.Tensor, plan: THDCPLayoutPlan, to_zigzag: bool, group: ProcessGroup, seq_dim: int, own_rank: int
) -> torch.Tensor:
    """Move packed tokens to their zigzag (padding slots zero) or contiguous (padding dropped) positions."""
    output_length = plan.zigzag_local_token_count if to_zigzag else plan.contiguous_local_token_count
    return _move_tokens(input_, _token_moves(plan, to_zigzag, own_rank), group, seq_dim, output_length)


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
    source_layout, target_layout = _as_layout(source_layout), _as_layout(target_layout)
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
    own_rank = context.group_rank_by_logical_rank[context.cp_rank * context.tp_size + context.tp_rank]
    return _THDRedistribution.apply(input_, plan, to_zigzag, context.communication_group, seq_dim, own_rank)


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
    _check_cu_seqlens_structure(cu_seqlens, cu_seqlens_padded)
    actual, padded = _offsets_on_host(cu_seqlens, cu_seqlens_padded)
    return _build_thd_plan_from_host_offsets(actual, padded, total_tokens, context, cu_seqlens.device)


def _offsets_on_host(*offsets: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Copy checked int32 offset tensors to the host in one transfer, the one host synchronisation of a batch."""
    present = [tensor for tensor in offsets if tensor is not None]
    if all(tensor.device.type == "cpu" for tensor in present):
        return list(offsets)
    host = iter(torch.cat(present).cpu().split([tensor.numel() for tensor in present]))
    return [None if tensor is None else next(host) for tensor in offsets]


def _build_thd_plan_from_host_offsets(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    total_tokens: int,
    context: _LayoutParallelContext,
    device: torch.device,
) -> THDCPLayoutPlan:
    """Build this rank's THD plan from host offsets and move its index tensors to ``device``."""
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
    return plan.to(device)


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


@dataclass
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
        self.layer_layouts = tuple(_as_layout(layout) for layout in self.layer_layouts)
        self.boundary_layout = _as_layout(self.boundary_layout)
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
        """Convert ``hidden_states`` between two layouts with this manager's groups and ``seq_dim``."""
        groups = (self.cp_group, self.sequence_parallel, self.tp_group, self.tp_cp_group)
        return _convert(hidden_states, source_layout, target_layout, *groups, thd_plan, self.seq_dim)

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

    def build_packed_zigzag_layout(
        self,
        packed_seq_params: PackedSeqParams,
    ) -> tuple[THDCPLayoutPlan, PackedSeqParams]:
        """Build one THD conversion plan and its zigzag-layout metadata."""
        cu_seqlens = packed_seq_params.cu_seqlens_q
        if cu_seqlens is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is None; packed layout conversion needs it")
        padded = packed_seq_params.cu_seqlens_q_padded
        _check_cu_seqlens_structure(cu_seqlens, padded)
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
        actual, padded_host, kv_host = _offsets_on_host(cu_seqlens, padded, cu_seqlens_kv if separate_kv else None)
        if separate_kv and not torch.equal(kv_host, actual):
            raise ValueError(
                "packed_seq_params.cu_seqlens_kv differs from cu_seqlens_q; expected self-attention offsets"
            )
        total_tokens = packed_seq_params.total_tokens
        if total_tokens is None:
            total_tokens = int((actual if padded_host is None else padded_host)[-1])
        context = _get_layout_parallel_context(self.cp_group, self.sequence_parallel, self.tp_group, self.tp_cp_group)
        plan = _build_thd_plan_from_host_offsets(actual, padded_host, total_tokens, context, cu_seqlens.device)
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

    def build_conversion_state(
        self,
        packed_seq_params: PackedSeqParams | None,
    ) -> ContextParallelLayoutState | None:
        """Build the state of one batch whether or not a layer changes the layout (None only when cp == 1).

        Its plan converts any per-token tensor of the batch and it carries the zigzag metadata; where no layer changes
        the layout, its ``prepare_layer``/``finalize_layer`` return their input unchanged.
        """
        if comm.group_size(self.cp_group) == 1:
            return None
        if packed_seq_params is None:
            return ContextParallelLayoutState(self, None, None, None)
        plan, zigzag_params = self.build_packed_zigzag_layout(packed_seq_params)
        return ContextParallelLayoutState(self, plan, packed_seq_params, zigzag_params)

    def build_forward_state(
        self,
        packed_seq_params: PackedSeqParams | None,
    ) -> ContextParallelLayoutState | None:
        """Build the layout state for one forward pass (None when cp == 1 or no layer changes the layout)."""
        return self.build_conversion_state(packed_seq_params) if self.requires_conversion else None


@dataclass(frozen=True)
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
        if _as_layout(layout) is CPLayout.ZIGZAG:
            return self.zigzag_packed_seq_params
        return self.contiguous_packed_seq_params

    def prepare_layer(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, PackedSeqParams | None]:
        """Prepare a layer's input and matching packed metadata."""
        converted = self.manager.prepare_layer_input(layer_index, hidden_states, self.thd_plan)
        return converted, self.packed_seq_params_for(self.manager.layer_layouts[layer_index])

    def finalize_layer(
        self,
        layer_index: int,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Finalize a layer's output layout."""
        return self.manager.finalize_layer_output(layer_index, hidden_states, self.thd_plan)

    def convert(
        self,
        tensor: torch.Tensor,
        source_layout: CPLayout | str,
        target_layout: CPLayout | str,
    ) -> torch.Tensor:
        """Convert another per-token tensor of this batch (ids, labels, masks; any dtype) between layouts."""
        source_layout, target_layout = _as_layout(source_layout), _as_layout(target_layout)
        if source_layout is target_layout or comm.group_size(self.manager.cp_group) == 1:
            return tensor
        return self.manager._convert_cp_layout(tensor, source_layout, target_layout, self.thd_plan)
