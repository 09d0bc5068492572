"""Data movers of context-parallel layout conversion: staging, segment and token moves, one all-to-all-v each.

Kept apart from ``layout`` (API, process groups, manager) so the hot copy/exchange code can be read, tuned and timed
on its own; the autograd functions here make each conversion differentiable (backward is the inverse conversion).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from lightning_cp.core import comm
from lightning_cp.core.layout.plans import THDCPLayoutPlan, _LayoutRedistributionPlan
from lightning_cp.core.packed import remember_host_copy


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
    ``send`` gathers the moving tokens into the send buffer unless ``send_run`` names them as one run of input rows;
    ``receive`` places arrivals unless ``receive_run`` names one run of output rows they land on in order.
    """

    kept: _RowMap
    zero_slots: torch.Tensor | None
    send: _RowMap
    send_count: int
    send_run: int | None
    receive: _RowMap
    receive_count: int
    receive_run: int | None
    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]

    def to(self, device: torch.device | str) -> _TokenMoves:
        """Return the moves with their index tensors on ``device``."""
        return dataclasses.replace(
            self,
            kept=self.kept.to(device),
            zero_slots=None if self.zero_slots is None else self.zero_slots.to(device),
            send=self.send.to(device),
            receive=self.receive.to(device),
        )


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
    send_indices: torch.Tensor,
    input_split_sizes: tuple[int, ...],
    output_split_sizes: tuple[int, ...],
    input_length: int,
    output_length: int,
    receive_indices: torch.Tensor | None,
    own_rank: int,
) -> _TokenMoves:
    """Split an all-to-all-v conversion (host index tensors) into kept tokens and the exchange of the others.

    ``send_indices`` are the input rows sent, grouped by destination; ``receive_indices`` gives the arrival each
    output slot takes (None: arrivals in order; the arrival count: a padding slot, left zero). Arrivals from
    ``own_rank`` are its own send rows in order, so they are copied instead of sent.
    """
    received = sum(output_split_sizes)
    kept_count = input_split_sizes[own_rank]
    send_start, receive_start = sum(input_split_sizes[:own_rank]), sum(output_split_sizes[:own_rank])
    slot_arrivals = torch.arange(output_length) if receive_indices is None else receive_indices
    used = slot_arrivals < received
    slot_of_arrival = torch.empty(received, dtype=torch.int64)
    slot_of_arrival[slot_arrivals[used]] = torch.nonzero(used).flatten()

    kept_slots = slot_of_arrival[receive_start : receive_start + kept_count]
    kept_sources = send_indices[send_start : send_start + kept_count]
    kept = _RowMap.build(kept_sources, kept_slots, input_length, output_length)
    zero_slots = torch.nonzero(~used).flatten()

    moving_sources = send_indices[_without(send_indices.numel(), send_start, kept_count)]
    send_count = moving_sources.numel()
    send = _RowMap.build(moving_sources, torch.arange(send_count), input_length, send_count)

    moving_slots = slot_of_arrival[_without(received, receive_start, kept_count)]
    receive_count = moving_slots.numel()
    receive = _RowMap.build(torch.arange(receive_count), moving_slots, receive_count, output_length)

    input_splits, output_splits = list(input_split_sizes), list(output_split_sizes)
    input_splits[own_rank] = output_splits[own_rank] = 0
    return _TokenMoves(
        kept=kept,
        zero_slots=zero_slots if zero_slots.numel() else None,
        send=send,
        send_count=send_count,
        send_run=_first_of_run(moving_sources),
        receive=receive,
        receive_count=receive_count,
        receive_run=_first_of_run(moving_slots),
        input_split_sizes=tuple(input_splits),
        output_split_sizes=tuple(output_splits),
    )


_HOST_PLANS: weakref.WeakKeyDictionary[THDCPLayoutPlan, THDCPLayoutPlan] = weakref.WeakKeyDictionary()
_TOKEN_MOVES: weakref.WeakKeyDictionary[THDCPLayoutPlan, dict[tuple[bool, int], _TokenMoves]] = (
    weakref.WeakKeyDictionary()
)


def plan_on_device(host_plan: THDCPLayoutPlan, device: torch.device) -> THDCPLayoutPlan:
    """Move a plan built on the host to ``device``, remembering the host copy so its moves derive without a sync."""
    plan = host_plan.to(device)
    if plan is not host_plan:
        _HOST_PLANS[plan] = host_plan
        remember_host_copy(plan.cu_seqlens_padded, host_plan.cu_seqlens_padded)
    return plan


def _arrival_of_slot(plan: THDCPLayoutPlan) -> torch.Tensor | None:
    """Each zigzag slot's arrival (the arrival count for padding); None when the arrivals fill the slots in order."""
    positions = plan.forward_receive_positions
    count = positions.numel()
    if count == plan.zigzag_local_token_count and bool(torch.equal(positions, torch.arange(count))):
        return None
    arrival = torch.full((plan.zigzag_local_token_count,), count, dtype=torch.int64)
    arrival[positions] = torch.arange(count)
    return arrival


def _token_moves(plan: THDCPLayoutPlan, to_zigzag: bool, own_rank: int) -> _TokenMoves:
    """This rank's moves for converting with ``plan`` in one direction, derived once per plan from its fields.

    They are derived on the host: from the host copy of a plan built by ``build_thd_cp_layout_plan``, or, for a plan
    made elsewhere on an accelerator, from one host copy of its index tensors.
    """
    moves_of_plan = _TOKEN_MOVES.setdefault(plan, {})
    key = (to_zigzag, own_rank)
    if key in moves_of_plan:
        return moves_of_plan[key]
    host = _HOST_PLANS.get(plan) or plan.to("cpu")
    if to_zigzag:
        moves = _build_token_moves(
            host.forward_send_indices,
            host.forward_input_split_sizes,
            host.forward_output_split_sizes,
            host.contiguous_local_token_count,
            host.zigzag_local_token_count,
            _arrival_of_slot(host),
            own_rank,
        )
    else:
        moves = _build_token_moves(
            host.reverse_send_indices,
            host.forward_output_split_sizes,
            host.forward_input_split_sizes,
            host.zigzag_local_token_count,
            host.contiguous_local_token_count,
            host.reverse_receive_indices,
            own_rank,
        )
    moves_of_plan[key] = moves = moves.to(plan.forward_send_indices.device)
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
