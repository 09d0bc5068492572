"""Pure plan building for CP layout conversion: dense segment plans and packed (THD) plans, no process group."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from lightning_cp.core.zigzag import (
    CPLayout,
    as_layout,
    check_coordinates,
    check_cu_seqlens_structure,
    check_offsets,
    local_segment_ids,
    segment_owner,
    zigzag_padded_lengths,
    zigzag_source_indices,
)


@dataclass(frozen=True)
class _LayoutRedistributionPlan:
    """Rank-local all-to-all plan expressed in sequence-segment counts.

    ``send_slots`` lists local source slots in sending order (by destination group rank, then segment id);
    ``receive_permutation[j]`` is the received segment that becomes local target slot ``j``.
    """

    send_slots: tuple[int, ...]
    input_segment_counts: tuple[int, ...]
    output_segment_counts: tuple[int, ...]
    receive_permutation: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class THDCPLayoutPlan:
    """Rank-local all-to-all-v plan for packed sequence layout conversion.

    Forward fields describe contiguous-to-zigzag conversion. Reverse fields describe the inverse conversion.
    The plan is built once per packed batch and reused around every attention layer. Padding never travels:
    ``forward_send_indices`` are positions in this rank's contiguous input of the real tokens it sends, grouped by
    destination group rank; ``forward_receive_positions`` give each arrival's zigzag slot (the output starts as
    zeros); ``reverse_send_indices`` are zigzag positions of real tokens; ``reverse_receive_indices`` map each
    contiguous output position to its row in the received buffer (docs/layout.md).
    """

    contiguous_local_token_count: int
    zigzag_local_token_count: int
    cu_seqlens_padded: torch.Tensor
    max_seqlen_padded: int
    pad_between_seqs: bool
    forward_send_indices: torch.Tensor
    forward_receive_positions: torch.Tensor
    forward_input_split_sizes: tuple[int, ...]
    forward_output_split_sizes: tuple[int, ...]
    reverse_send_indices: torch.Tensor
    reverse_receive_indices: torch.Tensor

    @property
    def group_size(self) -> int:
        """Return the size of the TP x CP group the plan was built for."""
        return len(self.forward_input_split_sizes)

    def to(self, device: torch.device | str) -> THDCPLayoutPlan:
        """Return the plan with its index tensors on ``device`` (itself when already there)."""
        device = torch.device(device)
        if self.forward_send_indices.device == device:
            return self
        moved = {
            field.name: value.to(device, non_blocking=device.type != "cpu")
            for field in dataclasses.fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def _build_group_rank_by_logical_rank(
    cp_global_ranks: tuple[int, ...],
    tp_global_ranks: tuple[int, ...],
    tp_cp_global_ranks: tuple[int, ...],
    current_global_rank: int,
) -> tuple[int, ...]:
    """Map logical cp_rank * tp_size + tp_rank coordinates to group ranks."""
    expected = len(cp_global_ranks) * len(tp_global_ranks)
    if len(tp_cp_global_ranks) != expected:
        raise ValueError(
            f"TP x CP group of size {len(tp_cp_global_ranks)} is not the product of the CP group size "
            f"{len(cp_global_ranks)} and the TP group size {len(tp_global_ranks)} (expected {expected})"
        )
    group_rank_of_global = {global_rank: group_rank for group_rank, global_rank in enumerate(tp_cp_global_ranks)}
    group_ranks = tuple(
        group_rank_of_global.get(cp_peer + tp_peer - current_global_rank, -1)
        for cp_peer in cp_global_ranks
        for tp_peer in tp_global_ranks
    )
    if -1 in group_ranks or len(set(group_ranks)) != expected:
        raise ValueError(
            f"TP group (size {len(tp_global_ranks)}) and CP group (size {len(cp_global_ranks)}) do not form a "
            f"Cartesian product of the TP x CP group {tuple(tp_cp_global_ranks)}: expected every global rank "
            "cp_peer + tp_peer - current_rank to be a distinct member of it"
        )
    return group_ranks


@functools.lru_cache(maxsize=1024)
def _build_layout_redistribution_plan(
    source_layout: CPLayout,
    target_layout: CPLayout,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    group_rank_by_logical_rank: tuple[int, ...] | None = None,
) -> _LayoutRedistributionPlan:
    """Build the all-to-all-v plan for one rank of a CP layout conversion."""
    source_layout, target_layout = as_layout(source_layout), as_layout(target_layout)
    check_coordinates(cp_size, cp_rank, tp_size, tp_rank)
    group_size = cp_size * tp_size
    group_ranks = tuple(range(group_size)) if group_rank_by_logical_rank is None else group_rank_by_logical_rank
    if len(group_ranks) != group_size:
        raise ValueError(f"group_rank_by_logical_rank has {len(group_ranks)} entries, expected {group_size}")

    def group_rank_of(segment_id: int, layout: CPLayout) -> int:
        owner_cp_rank, owner_tp_rank = segment_owner(segment_id, layout, cp_size, tp_size)
        return group_ranks[owner_cp_rank * tp_size + owner_tp_rank]

    source_ids = local_segment_ids(source_layout, cp_size, cp_rank, tp_size, tp_rank)
    target_ids = local_segment_ids(target_layout, cp_size, cp_rank, tp_size, tp_rank)
    send_keys = [(group_rank_of(segment, target_layout), segment) for segment in source_ids]
    send_slots = tuple(sorted(range(len(source_ids)), key=send_keys.__getitem__))
    receive_keys = sorted((group_rank_of(segment, source_layout), segment) for segment in target_ids)
    received_segments = [segment for _, segment in receive_keys]
    input_counts = [0] * group_size
    for destination, _ in send_keys:
        input_counts[destination] += 1
    output_counts = [0] * group_size
    for origin, _ in receive_keys:
        output_counts[origin] += 1
    return _LayoutRedistributionPlan(
        send_slots=send_slots,
        input_segment_counts=tuple(input_counts),
        output_segment_counts=tuple(output_counts),
        receive_permutation=tuple(received_segments.index(segment) for segment in target_ids),
    )


def _build_thd_rank_order_indices(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    cp_size: int,
    tp_size: int,
    expected_source_token_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build padded dual-chunk attention order without Transformer Engine helpers.

    Returns the source index of every padded attention position grouped by target logical rank (``-1`` for
    padding) and the padded cumulative offsets of the zigzag side (int32).
    """
    check_cu_seqlens_structure(cu_seqlens, cu_seqlens_padded)
    if cp_size < 1 or tp_size < 1:
        raise ValueError(f"cp_size and tp_size must be at least 1, got {cp_size} and {tp_size}")
    offsets = cu_seqlens.to(torch.int64)
    lengths = check_offsets("cu_seqlens", offsets)
    if cu_seqlens_padded is None:
        physical_offsets, physical_lengths = offsets, lengths
    else:
        physical_offsets = cu_seqlens_padded.to(torch.int64)
        physical_lengths = check_offsets("cu_seqlens_padded", physical_offsets)
        too_short = physical_lengths < lengths
        if bool(too_short.any()):
            index = int(torch.nonzero(too_short)[0, 0])
            raise ValueError(
                f"cu_seqlens_padded gives sequence {index} a padded length of {int(physical_lengths[index])}, "
                f"shorter than its actual length {int(lengths[index])}"
            )
    token_count = int(physical_offsets[-1])
    if expected_source_token_count is not None and expected_source_token_count != token_count:
        raise ValueError(
            f"total_tokens is {expected_source_token_count}, but the physical token count of the packed "
            f"sequences is {token_count}"
        )
    group_size = cp_size * tp_size
    if token_count % group_size != 0:
        raise ValueError(
            f"packed token count {token_count} is not divisible by cp_size * tp_size = {cp_size} * {tp_size}"
        )
    padded_lengths = zigzag_padded_lengths(physical_lengths, cp_size, tp_size)
    padded_offsets = torch.zeros_like(offsets)
    torch.cumsum(padded_lengths, 0, out=padded_offsets[1:])
    rank_order_indices = zigzag_source_indices(physical_offsets, physical_lengths, padded_lengths, cp_size)
    return rank_order_indices, padded_offsets.to(torch.int32)


def _in_group_rank_order(
    values: torch.Tensor, logical_ranks: torch.Tensor, group_rank_table: torch.Tensor | None
) -> torch.Tensor:
    """Reorder ``values`` (in logical-rank order, ``logical_ranks`` each) by group rank, keeping order within a rank."""
    if group_rank_table is None:
        return values
    return values.index_select(0, torch.argsort(group_rank_table[logical_ranks], stable=True))


def _split_sizes(logical_ranks: torch.Tensor, group_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Count entries per group rank, given each entry's logical rank."""
    per_logical = torch.bincount(logical_ranks, minlength=len(group_ranks)).tolist()
    sizes = [0] * len(group_ranks)
    for logical, count in enumerate(per_logical):
        sizes[group_ranks[logical]] = count
    return tuple(sizes)


def _check_each_source_placed_once(indices: torch.Tensor, source_token_count: int) -> None:
    """Refuse a global order that does not place every source token exactly once (checked whole, so every rank
    holding the same order refuses it alike)."""
    placed = indices[indices >= 0]
    counts = torch.bincount(placed.clamp(max=source_token_count), minlength=source_token_count + 1)
    if placed.numel() != source_token_count or bool((counts[:source_token_count] != 1).any()):
        raise ValueError(
            f"rank_order_indices must place each of the {source_token_count} source tokens exactly once (and name "
            f"none past them); {int(counts[source_token_count])} entries are past them, "
            f"{int((counts[:source_token_count] == 0).sum())} tokens missing, "
            f"{int((counts[:source_token_count] > 1).sum())} placed more than once"
        )


def _build_thd_cp_layout_plan_from_rank_order_indices(
    rank_order_indices: torch.Tensor,
    source_token_count: int,
    cu_seqlens_padded: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    group_rank_by_logical_rank: tuple[int, ...] | None = None,
    pad_between_seqs: bool | torch.Tensor = False,
) -> THDCPLayoutPlan:
    """Build a packed layout plan from source indices grouped by target logical rank.

    rank_order_indices contains one entry for every padded attention position. Non-negative entries identify
    positions in the contiguous input; -1 entries are temporary padding, which never travels. Zigzag slots hold
    their tokens in increasing source order, so both directions come out grouped by rank without a sort when group
    ranks follow logical ranks.
    """
    check_coordinates(cp_size, cp_rank, tp_size, tp_rank)
    group_size = cp_size * tp_size
    padded_total = rank_order_indices.numel()
    if padded_total % group_size != 0:
        raise ValueError(f"rank_order_indices has {padded_total} entries, not divisible by {group_size} ranks")
    if source_token_count % group_size != 0:
        raise ValueError(f"source token count {source_token_count} is not divisible by {group_size} ranks")
    group_ranks = tuple(range(group_size)) if group_rank_by_logical_rank is None else group_rank_by_logical_rank
    if sorted(group_ranks) != list(range(group_size)):
        raise ValueError(f"group_rank_by_logical_rank {group_ranks} is not a permutation of {group_size} group ranks")
    device = rank_order_indices.device
    identity = group_ranks == tuple(range(group_size))
    group_rank_table = None if identity else torch.tensor(group_ranks, dtype=torch.int64, device=device)
    zigzag_count = padded_total // group_size
    contiguous_count = source_token_count // group_size
    logical_rank = cp_rank * tp_size + tp_rank
    indices = rank_order_indices.to(torch.int64)
    _check_each_source_placed_once(indices, source_token_count)
    first_source = logical_rank * contiguous_count

    # Forward send: every zigzag slot (of any receiver) that holds one of this rank's tokens, in slot order.
    local = indices - first_source
    sent_slots = torch.nonzero((local >= 0) & (local < contiguous_count)).flatten()  # all of them: checked above
    destinations = torch.div(sent_slots, zigzag_count, rounding_mode="floor")
    forward_send_indices = local.index_select(0, _in_group_rank_order(sent_slots, destinations, group_rank_table))

    # Forward receive: this rank's slots that hold a token, by sender (arrivals come in group-rank order).
    my_slots = indices[logical_rank * zigzag_count : (logical_rank + 1) * zigzag_count]
    filled = torch.nonzero(my_slots >= 0).flatten()
    senders = torch.div(my_slots.index_select(0, filled), contiguous_count, rounding_mode="floor")
    forward_receive_positions = _in_group_rank_order(filled, senders, group_rank_table)

    reverse_receive_indices = torch.full((contiguous_count,), -1, dtype=torch.int64, device=device)
    reverse_receive_indices[forward_send_indices] = torch.arange(contiguous_count, device=device)
    lengths = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    return THDCPLayoutPlan(
        contiguous_local_token_count=contiguous_count,
        zigzag_local_token_count=zigzag_count,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen_padded=int(lengths.max()) if lengths.numel() else 0,
        pad_between_seqs=bool(pad_between_seqs),
        forward_send_indices=forward_send_indices,
        forward_receive_positions=forward_receive_positions,
        forward_input_split_sizes=_split_sizes(destinations, group_ranks),
        forward_output_split_sizes=_split_sizes(senders, group_ranks),
        reverse_send_indices=forward_receive_positions,
        reverse_receive_indices=reverse_receive_indices,
    )
