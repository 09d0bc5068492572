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


_EXCHANGED_AS_IS = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
    }
)
"""Dtypes that gloo and NCCL exchange and the CPU index kernels copy; the movers carry any other as its bytes."""


def _carried_as_bytes(move: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a data mover so a tensor of any other dtype (bool, int16, unsigned, float8) travels as its bytes, in one
    more trailing dimension, and comes back in its dtype; zeroed padding bytes read back as zero in every dtype."""

    @functools.wraps(move)
    def wrapper(input_: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if input_.dtype in _EXCHANGED_AS_IS:
            return move(input_, *args, **kwargs)
        moved = move(input_.unsqueeze(-1).view(torch.uint8), *args, **kwargs)
        return moved.view(input_.dtype).squeeze(-1)

    return wrapper


@dataclass(frozen=True)
class _SegmentMoves:
    """How one rank's segments move: kept runs copied locally, the rest through the all-to-all (self split 0).

    ``send_run``/``receive_run`` are the first sent/received slot when those slots are one run of adjacent slots (so
    the exchange sends from and lands in place), else None.
    """

    kept_runs: tuple[tuple[int, int, int], ...]
    sent_slots: tuple[int, ...]
    received_slots: tuple[int, ...]
    input_segment_counts: tuple[int, ...]
    output_segment_counts: tuple[int, ...]
    send_run: int | None
    receive_run: int | None


def _runs(pairs: list[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Merge ``(source, target)`` slot pairs into ``(source, target, count)`` runs that advance together."""
    runs: list[list[int]] = []
    for source, target in pairs:
        if runs and source == runs[-1][0] + runs[-1][2] and target == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([source, target, 1])
    return tuple((source, target, count) for source, target, count in runs)


def _run_start(slots: tuple[int, ...]) -> int | None:
    """The first of ``slots`` when they are one increasing run of adjacent slots (0 when empty), else None."""
    if all(b == a + 1 for a, b in zip(slots, slots[1:], strict=False)):
        return slots[0] if slots else 0
    return None


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
    sent_slots = plan.send_slots[:send_start] + plan.send_slots[send_start + kept :]
    received_slots = tuple(target_of_received[:receive_start] + target_of_received[receive_start + kept :])
    return _SegmentMoves(
        kept_runs=_runs(sorted(pairs)),
        sent_slots=sent_slots,
        received_slots=received_slots,
        input_segment_counts=tuple(input_counts),
        output_segment_counts=tuple(output_counts),
        send_run=_run_start(sent_slots),
        receive_run=_run_start(received_slots),
    )


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
    size = length // len(plan.send_slots)
    output = torch.empty(input_.shape, dtype=input_.dtype, device=input_.device)
    placed = output.view(before, length, after)
    for source, target, count in moves.kept_runs:
        placed.narrow(1, target * size, count * size).copy_(rows.narrow(1, source * size, count * size))
    sent, received_slots = moves.sent_slots, moves.received_slots
    if before == 1 and moves.send_run is not None:
        send = rows.view(length, after).narrow(0, moves.send_run * size, len(sent) * size)
    else:
        send = _staging.get("send", (len(sent), before, size, after), input_.dtype, input_.device)
        for position, slot in enumerate(sent):
            send[position].copy_(rows.narrow(1, slot * size, size))
        send = send.view(len(sent) * before * size, after)
    rows_per_segment = before * size
    output_splits = [count * rows_per_segment for count in moves.output_segment_counts]
    input_splits = [count * rows_per_segment for count in moves.input_segment_counts]
    if before == 1 and moves.receive_run is not None:
        landing = placed.view(length, after).narrow(0, moves.receive_run * size, len(received_slots) * size)
        comm.all_to_all_v_into(landing, send, output_splits, input_splits, group)
        return output
    received = _staging.get("receive", (len(received_slots), before, size, after), input_.dtype, input_.device)
    landing = received.view(len(received_slots) * before * size, after)
    comm.all_to_all_v_into(landing, send, output_splits, input_splits, group)
    for index, slot in enumerate(received_slots):
        placed.narrow(1, slot * size, size).copy_(received[index])
    return output


def _needs_graph(input_: torch.Tensor) -> bool:
    """Whether a conversion of ``input_`` must record its backward (grad mode on and ``input_`` requires grad)."""
    return input_.requires_grad and torch.is_grad_enabled()


def redistribute_segments(
    input_: torch.Tensor,
    plan: _LayoutRedistributionPlan,
    reverse_plan: _LayoutRedistributionPlan,
    group: ProcessGroup,
    seq_dim: int,
    own_rank: int,
) -> torch.Tensor:
    """Dense conversion: through the autograd function when a backward is needed, straight to the mover otherwise."""
    if _needs_graph(input_):
        return _SegmentRedistribution.apply(input_, plan, reverse_plan, group, seq_dim, own_rank)
    return _move_segments(input_, plan, group, seq_dim, own_rank)


class _SegmentRedistribution(torch.autograd.Function):
    """Dense layout conversion whose backward is the inverse conversion."""

    @staticmethod
    def forward(ctx, input_, plan, reverse_plan, group, seq_dim, own_rank):  # type: ignore[override]
        ctx.plans, ctx.group, ctx.seq_dim, ctx.own_rank = (reverse_plan, plan), group, seq_dim, own_rank
        return _move_segments(input_, plan, group, seq_dim, own_rank)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        """The inverse conversion, itself differentiable when the backward builds a graph (``create_graph``)."""
        grad_input = redistribute_segments(grad_output, *ctx.plans, ctx.group, ctx.seq_dim, ctx.own_rank)
        return grad_input, None, None, None, None, None


@dataclass(frozen=True)
class _CopyCosts:
    """Rough costs of the ways to move rows, in row copies: ``call`` per kernel call, ``gather`` and ``scatter`` per
    row moved by an index gather or an index copy (a slice copy costs 1 per row)."""

    call: float
    gather: float
    scatter: float


_HOST_COSTS = _CopyCosts(call=48, gather=1.5, scatter=5)
"""CPU (torch 2.13, one thread, rows of 2 KiB): a call costs about 3.5 us, as much as copying 36-64 rows; an index
gather 1.5-2x and ``index_copy_`` 4-6x a slice copy per row."""
_ACCELERATOR_COSTS = _CopyCosts(call=1024, gather=1, scatter=1)
"""Accelerators: kernel launches dominate, index kernels run at copy speed."""


@dataclass(frozen=True)
class _RowMap:
    """``destination[targets] = source[sources]`` along dim 0, as pieces or as one index copy.

    Each of ``pieces`` fills consecutive destination rows: ``(first_target, count, first_source)`` is a slice copy and
    ``(first_target, count, sources)`` with an index tensor one gather; ``scattered`` holds ``(sources, targets)``
    index tensors (``sources`` None: all of ``source`` in order) for one index copy instead. ``cost`` is the estimate
    that chose between them.
    """

    pieces: tuple[tuple[int, int, int | torch.Tensor], ...] = ()
    scattered: tuple[torch.Tensor | None, torch.Tensor] | None = None
    cost: float = 0.0

    @staticmethod
    def build(sources: torch.Tensor | None, targets: torch.Tensor | None, costs: _CopyCosts = _HOST_COSTS) -> _RowMap:
        """Map host int64 ``sources`` to ``targets`` (equally long; None stands for 0, 1, 2, ...), the cheapest way."""
        count = (sources if targets is None else targets).numel()
        if count == 0:
            return _RowMap()
        if targets is not None and count > 1 and not bool((targets[1:] > targets[:-1]).all()):
            order = torch.argsort(targets)
            sources = order if sources is None else sources.index_select(0, order)
            targets = targets.index_select(0, order)
        target_steps = None if targets is None else targets[1:] - targets[:-1] != 1
        source_steps = None if sources is None else sources[1:] - sources[:-1] != 1
        if target_steps is None:
            piece_breaks = torch.empty(0, dtype=torch.int64)
            slice_breaks = torch.nonzero(source_steps).flatten()
        else:
            piece_breaks = torch.nonzero(target_steps).flatten()
            both = target_steps if source_steps is None else target_steps | source_steps
            slice_breaks = piece_breaks if source_steps is None else torch.nonzero(both).flatten()
        options = [
            ((slice_breaks.numel() + 1) * costs.call + count, "slices"),
            ((piece_breaks.numel() + 1) * costs.call + count * costs.gather, "pieces"),
        ]
        if targets is not None:
            options.append((costs.call + count * costs.scatter, "scattered"))
        cost, form = min(options)
        if form == "scattered":
            return _RowMap(scattered=(sources, targets), cost=cost)
        starts = [0, *((slice_breaks if form == "slices" else piece_breaks) + 1).tolist()]
        ends = [*starts[1:], count]
        if form == "slices" or sources is None:
            single = [True] * len(starts)
        else:  # a piece is one slice when no slice break falls inside it (slice breaks include the piece breaks)
            inside = torch.searchsorted(slice_breaks, torch.tensor(ends) - 1)
            single = (inside == torch.searchsorted(slice_breaks, torch.tensor(starts))).tolist()
        target_firsts = starts if targets is None else targets[starts].tolist()
        source_firsts = starts if sources is None else sources[starts].tolist()
        pieces = tuple(
            (target, end - start, source if one else sources[start:end])
            for target, source, start, end, one in zip(target_firsts, source_firsts, starts, ends, single, strict=True)
        )
        return _RowMap(pieces=pieces, cost=cost)

    @staticmethod
    def run(first_source: int, first_target: int, count: int) -> _RowMap:
        """One slice copy: ``count`` rows from ``first_source`` on to ``first_target`` on."""
        return _RowMap(pieces=((first_target, count, first_source),) if count else (), cost=count)

    @staticmethod
    def gather(rows: torch.Tensor, costs: _CopyCosts = _HOST_COSTS) -> _RowMap:
        """``destination[i] = source[rows[i]]``."""
        return _RowMap.build(rows, None, costs)

    @staticmethod
    def scatter(slots: torch.Tensor, costs: _CopyCosts = _HOST_COSTS) -> _RowMap:
        """``destination[slots[i]] = source[i]``."""
        return _RowMap.build(None, slots, costs)

    def to(self, device: torch.device) -> _RowMap:
        """Return the map with its index tensors on ``device``."""
        pieces = tuple(
            (first, count, sources if isinstance(sources, int) else sources.to(device))
            for first, count, sources in self.pieces
        )
        scattered = None
        if self.scattered is not None:
            scattered = tuple(None if index is None else index.to(device) for index in self.scattered)
        return _RowMap(pieces, scattered, self.cost)

    def apply(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the mapped rows of ``source`` into ``destination``."""
        for first, count, sources in self.pieces:
            piece = destination.narrow(0, first, count)
            if isinstance(sources, int):
                piece.copy_(source.narrow(0, sources, count))
            elif piece.is_contiguous():
                torch.index_select(source, 0, sources, out=piece)
            else:
                piece.copy_(source.index_select(0, sources))
        if self.scattered is not None:
            sources, targets = self.scattered
            destination.index_copy_(0, targets, source if sources is None else source.index_select(0, sources))


@dataclass(frozen=True)
class _TokenMoves:
    """One rank's packed conversion in one direction: a local copy of kept tokens and one all-to-all-v.

    ``kept`` copies input tokens that stay on the rank straight into the output (empty when they travel through the
    all-to-all's own-rank part instead); ``send`` gathers the send buffer unless ``send_run`` names it as one run of
    input rows; ``receive`` places arrivals unless ``receive_run`` names one run of output rows they land on in order;
    ``zero_slots`` are output padding, zeroed (no padding travels).
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


def _first_of_run(rows: torch.Tensor, length: int) -> int | None:
    """The first entry of ``rows`` when they count up by one inside ``0 .. length - 1`` (0 when empty); else None."""
    count = rows.numel()
    if count == 0:
        return 0
    first, last = int(rows[0]), int(rows[-1])
    if last - first != count - 1 or last >= length:
        return None
    return first if count <= 2 or torch.equal(rows, torch.arange(first, last + 1)) else None


def _without(rows: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``rows`` without its entries ``start .. start + count - 1``."""
    return torch.cat([rows[:start], rows[start + count :]]) if count else rows


def _build_token_moves(
    send_rows: torch.Tensor,
    input_split_sizes: tuple[int, ...],
    receive_slots: torch.Tensor,
    output_split_sizes: tuple[int, ...],
    input_length: int,
    output_length: int,
    own_rank: int,
    zero_slots: torch.Tensor | None,
    costs: _CopyCosts = _HOST_COSTS,
) -> _TokenMoves:
    """Turn one rank's all-to-all-v of a conversion (host int64 tensors, rows grouped by group rank) into moves.

    ``send_rows[i]`` is the input row send-buffer row ``i`` carries and ``receive_slots[i]`` the output row received
    row ``i`` lands on. The own-rank part either travels inside the all-to-all or is copied directly, whichever costs
    less once runs that send from or land in place are counted free.
    """
    send_start, own_count = sum(input_split_sizes[:own_rank]), input_split_sizes[own_rank]
    receive_start = sum(output_split_sizes[:own_rank])
    own_sources = send_rows[send_start : send_start + own_count]
    kept = _RowMap.build(own_sources, receive_slots[receive_start : receive_start + own_count], costs)
    options = [(False, _without(send_rows, send_start, own_count), _without(receive_slots, receive_start, own_count))]
    if own_count:
        options.append((True, send_rows, receive_slots))
    built = []
    for travels, rows, slots in options:
        send_run, receive_run = _first_of_run(rows, input_length), _first_of_run(slots, output_length)
        send = _RowMap.gather(rows, costs) if send_run is None else _RowMap.run(send_run, 0, rows.numel())
        receive = _RowMap.scatter(slots, costs) if receive_run is None else _RowMap.run(0, receive_run, slots.numel())
        cost = (own_count if travels else kept.cost) + (send.cost if send_run is None else 0)
        cost += receive.cost if receive_run is None else 0
        built.append((cost, travels, rows, slots, send_run, receive_run, send, receive))
    _, travels, rows, slots, send_run, receive_run, send, receive = min(built, key=lambda option: option[0])
    input_splits, output_splits = list(input_split_sizes), list(output_split_sizes)
    if not travels:
        input_splits[own_rank] = output_splits[own_rank] = 0
    return _TokenMoves(
        kept=_RowMap() if travels else kept,
        zero_slots=zero_slots if zero_slots is not None and zero_slots.numel() else None,
        send=send,
        send_count=rows.numel(),
        send_run=send_run,
        receive=receive,
        receive_count=slots.numel(),
        receive_run=receive_run,
        input_split_sizes=tuple(input_splits),
        output_split_sizes=tuple(output_splits),
    )


_Exchange = tuple[torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...], torch.Tensor]
"""Send rows, input split sizes, receive slots, output split sizes and padding slots of a contiguous -> zigzag step."""


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


def _field_exchange(plan: THDCPLayoutPlan) -> _Exchange:
    """The contiguous -> zigzag exchange as the plan's fields give it: real tokens only, so every rank holding a plan
    with the same fields sends and receives the same counts."""
    positions = plan.forward_receive_positions
    padding = torch.ones(plan.zigzag_local_token_count, dtype=torch.bool)
    padding[positions] = False
    return (
        plan.forward_send_indices,
        plan.forward_input_split_sizes,
        positions,
        plan.forward_output_split_sizes,
        torch.nonzero(padding).flatten(),
    )


def _token_moves(plan: THDCPLayoutPlan, to_zigzag: bool, own_rank: int) -> _TokenMoves:
    """This rank's moves for converting with ``plan`` in one direction, derived once per plan and direction.

    They are derived on the host: from the host copy of a plan built by ``build_thd_cp_layout_plan``, or, for a plan
    made elsewhere on an accelerator, from one host copy of its index tensors.
    """
    moves_of_plan = _TOKEN_MOVES.setdefault(plan, {})
    key = (to_zigzag, own_rank)
    if key in moves_of_plan:
        return moves_of_plan[key]
    host = _HOST_PLANS.get(plan)
    if host is None:
        host = plan.to("cpu")
        if host is not plan:  # one device-to-host copy for both directions (a value holding its key would never go)
            _HOST_PLANS[plan] = host
    send_rows, input_sizes, receive_slots, output_sizes, padding = _field_exchange(host)
    contiguous_count, zigzag_count = host.contiguous_local_token_count, host.zigzag_local_token_count
    device = plan.forward_send_indices.device
    costs = _HOST_COSTS if device.type == "cpu" else _ACCELERATOR_COSTS
    if to_zigzag:
        exchange = (send_rows, input_sizes, receive_slots, output_sizes, contiguous_count, zigzag_count)
    else:
        exchange = (receive_slots, output_sizes, send_rows, input_sizes, zigzag_count, contiguous_count)
    moves = _build_token_moves(*exchange, own_rank, padding if to_zigzag else None, costs)
    moves_of_plan[key] = moves = moves if device.type == "cpu" else moves.to(device)
    return moves


@_carried_as_bytes
def _move_tokens(
    input_: torch.Tensor, moves: _TokenMoves, group: ProcessGroup, seq_dim: int, output_length: int
) -> torch.Tensor:
    """Copy the kept tokens into a fresh output and all-to-all-v the others, staging only where order changes."""
    rows = _as_rows(input_, seq_dim)
    before, _, after = rows.shape
    tokens = rows.view(rows.shape[1], after) if before == 1 else rows.transpose(0, 1)
    token_shape = tokens.shape[1:]
    dtype, device = input_.dtype, input_.device
    output = torch.empty(_resized(input_.shape, seq_dim, output_length), dtype=dtype, device=device)
    placed = output.view(before, output_length, after)
    placed = placed[0] if before == 1 else placed.transpose(0, 1)
    moves.kept.apply(placed, tokens)
    if before == 1 and moves.send_run is not None:
        send = tokens.narrow(0, moves.send_run, moves.send_count)
    else:
        send = _staging.get("send", (moves.send_count, *token_shape), dtype, device)
        moves.send.apply(send, tokens)
    splits = (moves.output_split_sizes, moves.input_split_sizes)
    if before == 1 and moves.receive_run is not None:
        landing = placed.narrow(0, moves.receive_run, moves.receive_count)
        comm.all_to_all_v_into(landing, send, *splits, group)
    else:
        received = _staging.get("receive", (moves.receive_count, *token_shape), dtype, device)
        comm.all_to_all_v_into(received, send, *splits, group)
        moves.receive.apply(placed, received)
    if moves.zero_slots is not None:
        placed.index_fill_(0, moves.zero_slots, 0)
    return output


class _THDRedistribution(torch.autograd.Function):
    """Packed layout conversion whose backward is the inverse conversion."""

    @staticmethod
    def forward(ctx, input_, plan, to_zigzag, group, seq_dim, own_rank):  # type: ignore[override]
        ctx.plan, ctx.to_zigzag, ctx.group, ctx.seq_dim, ctx.own_rank = plan, to_zigzag, group, seq_dim, own_rank
        return _convert_tokens(input_, plan, to_zigzag, group, seq_dim, own_rank)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        """The inverse conversion, itself differentiable when the backward builds a graph (``create_graph``)."""
        to_zigzag = not ctx.to_zigzag
        grad_input = redistribute_tokens(grad_output, ctx.plan, to_zigzag, ctx.group, ctx.seq_dim, ctx.own_rank)
        return grad_input, None, None, None, None, None


def redistribute_tokens(
    input_: torch.Tensor, plan: THDCPLayoutPlan, to_zigzag: bool, group: ProcessGroup, seq_dim: int, own_rank: int
) -> torch.Tensor:
    """Packed conversion: through the autograd function when a backward is needed, straight to the mover otherwise."""
    if _needs_graph(input_):
        return _THDRedistribution.apply(input_, plan, to_zigzag, group, seq_dim, own_rank)
    return _convert_tokens(input_, plan, to_zigzag, group, seq_dim, own_rank)


def _convert_tokens(
    input_: torch.Tensor, plan: THDCPLayoutPlan, to_zigzag: bool, group: ProcessGroup, seq_dim: int, own_rank: int
) -> torch.Tensor:
    """Move packed tokens to their zigzag (padding slots zero) or contiguous (padding dropped) positions."""
    output_length = plan.zigzag_local_token_count if to_zigzag else plan.contiguous_local_token_count
    return _move_tokens(input_, _token_moves(plan, to_zigzag, own_rank), group, seq_dim, output_length)
