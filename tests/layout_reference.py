"""Test helper: an independent, deliberately plain reference of the CP layouts in token positions, and groups.

Written from the layout rules (docs/layout.md), not from the package; ``test_layout_reference`` pins it to the
documented examples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def dense_positions(layout: str, cp: int, tp: int, sequence_length: int) -> list[list[int]]:
    """Global token positions each logical rank ``cp_rank * tp + tp_rank`` holds, in local order."""
    ranks = cp * tp
    if layout == "contiguous":
        shard = sequence_length // ranks
        return [list(range(rank * shard, (rank + 1) * shard)) for rank in range(ranks)]
    chunk = sequence_length // (2 * cp)
    chunks = [list(range(index * chunk, (index + 1) * chunk)) for index in range(2 * cp)]
    positions = []
    for cp_rank in range(cp):
        cp_tokens = chunks[cp_rank] + chunks[2 * cp - 1 - cp_rank]
        part = len(cp_tokens) // tp
        for tp_rank in range(tp):
            positions.append(cp_tokens[tp_rank * part : (tp_rank + 1) * part])
    return positions


def padded_lengths(physical_lengths: list[int], cp: int, tp: int) -> list[int]:
    """Zigzag lengths: each sequence rounded up to ``2*cp``, the last grown until each CP rank's count divides by tp."""
    lengths = []
    for length in physical_lengths:
        while length % (2 * cp) != 0:
            length += 1
        lengths.append(length)
    while (sum(lengths) // cp) % tp != 0:
        lengths[-1] += 2 * cp
    return lengths


def thd_positions(
    cu_seqlens: list[int], cu_seqlens_padded: list[int] | None, cp: int, tp: int
) -> tuple[list[list[int]], list[int]]:
    """Source position (or -1 for padding) of every zigzag slot of each logical rank, and the zigzag offsets."""
    physical = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    starts = physical[:-1]
    physical_lengths = [physical[i + 1] - physical[i] for i in range(len(physical) - 1)]
    lengths = padded_lengths(physical_lengths, cp, tp)
    per_cp_rank: list[list[int]] = [[] for _ in range(cp)]
    for start, physical_length, length in zip(starts, physical_lengths, lengths, strict=True):
        slots = [start + offset if offset < physical_length else -1 for offset in range(length)]
        chunk = length // (2 * cp)
        for cp_rank in range(cp):
            back = 2 * cp - 1 - cp_rank
            per_cp_rank[cp_rank] += slots[cp_rank * chunk : (cp_rank + 1) * chunk]
            per_cp_rank[cp_rank] += slots[back * chunk : (back + 1) * chunk]
    positions = []
    for cp_tokens in per_cp_rank:
        part = len(cp_tokens) // tp
        for tp_rank in range(tp):
            positions.append(cp_tokens[tp_rank * part : (tp_rank + 1) * part])
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return positions, offsets


def take(values: torch.Tensor, positions: list[int], seq_dim: int = 0) -> torch.Tensor:
    """Rows of ``values`` at ``positions`` along ``seq_dim``, zeros where a position is -1."""
    moved = values.movedim(seq_dim, 0)
    rows = [moved[p] if p >= 0 else torch.zeros_like(moved[0]) for p in positions]
    stacked = torch.stack(rows) if rows else moved[:0]
    return stacked.movedim(0, seq_dim).contiguous()


def random_packed_case(
    generator: torch.Generator, cp: int, tp: int, with_padding: bool
) -> tuple[list[int], list[int] | None]:
    """Random offsets (1-token and shorter-than-2cp sequences included) whose physical total divides by cp*tp."""
    count = int(torch.randint(1, 10, (1,), generator=generator))
    lengths = [int(x) for x in torch.randint(1, 6 * cp + 2, (count,), generator=generator)]
    lengths[0] = 1
    if count > 1:
        lengths[1] = max(1, 2 * cp - 1)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    if not with_padding:
        while cu[-1] % (cp * tp) != 0:
            cu[-1] += 1
        return cu, None
    physical = []
    for index, length in enumerate(lengths):
        extra = int(torch.randint(0, 4, (1,), generator=generator))
        padded = length + extra
        if index % 3 == 0:
            padded = -(-padded // (2 * cp)) * (2 * cp)
        physical.append(padded)
    cu_padded = [0]
    for length in physical:
        cu_padded.append(cu_padded[-1] + length)
    while cu_padded[-1] % (cp * tp) != 0:
        cu_padded[-1] += 1
    return cu, cu_padded


def make_groups(cp: int, tp: int, tp_fastest: bool = True):
    """Build CP, TP and TP x CP groups over the world; return them with this rank's ``(cp_rank, tp_rank)``."""
    world = dist.get_world_size()
    assert world == cp * tp

    def coordinates(global_rank: int) -> tuple[int, int]:
        return divmod(global_rank, tp) if tp_fastest else (global_rank % cp, global_rank // cp)

    global_of = {coordinates(g): g for g in range(world)}
    cp_groups = [dist.new_group([global_of[(c, t)] for c in range(cp)]) for t in range(tp)]
    tp_groups = [dist.new_group([global_of[(c, t)] for t in range(tp)]) for c in range(cp)]
    tp_cp_group = dist.new_group(list(range(world)))
    cp_rank, tp_rank = coordinates(dist.get_rank())
    return cp_groups[tp_rank], tp_groups[cp_rank], tp_cp_group, cp_rank, tp_rank
