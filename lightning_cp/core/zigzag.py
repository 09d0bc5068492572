"""The zigzag geometry, in one place: which rank holds which part of a sequence in each layout, and the padding rules.

A CP group cuts every sequence into ``2 * cp`` chunks. In the contiguous layout rank ``r`` holds chunks ``2r, 2r+1``;
in the zigzag layout chunks ``r`` and ``2cp-1-r``. The layout plans, the attention block plan, the batch sharding
and the metrics all derive what they need from the functions here (docs/layout.md describes the rules).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor


class CPLayout(str, Enum):
    """Sequence layout of CP shards: contiguous slices or load-balanced zigzag chunks."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


LAYOUT_NAMES = tuple(layout.value for layout in CPLayout)


def as_layout(layout: CPLayout | str) -> CPLayout:
    """Return ``layout`` as a ``CPLayout``, so plain strings work wherever a layout is taken."""
    if isinstance(layout, CPLayout):
        return layout
    try:
        return CPLayout(layout)
    except ValueError:
        allowed = ", ".join(repr(name) for name in LAYOUT_NAMES)
        raise ValueError(f"unknown CP layout {layout!r}; expected one of {allowed}") from None


def zigzag_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Return the two chunks (of ``2 * cp_size``) CP rank ``cp_rank`` holds in the zigzag layout, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


# Dense tensors: segments (whole chunks, or parts of chunks with sequence parallelism).


def check_coordinates(cp_size: int, cp_rank: int, tp_size: int, tp_rank: int) -> None:
    """Reject group sizes below one and ranks outside their group."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be at least 1, got {cp_size}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")


def segments_per_rank(tp_size: int) -> int:
    """Return two segments per rank for CP-only and odd-TP conversion, one for even-TP sequence parallelism."""
    return 1 if tp_size % 2 == 0 else 2


def segments_per_chunk(tp_size: int) -> int:
    """Return how many segments make one of the ``2 * cp`` chunks."""
    return tp_size * segments_per_rank(tp_size) // 2


def local_segment_ids(
    layout: CPLayout | str, cp_size: int, cp_rank: int, tp_size: int = 1, tp_rank: int = 0
) -> tuple[int, ...]:
    """Return the atomic sequence segments owned by one TP x CP rank (logical rank ``cp_rank * tp + tp_rank``)."""
    layout = as_layout(layout)
    check_coordinates(cp_size, cp_rank, tp_size, tp_rank)
    per_rank = segments_per_rank(tp_size)
    if layout is CPLayout.CONTIGUOUS:
        logical_rank = cp_rank * tp_size + tp_rank
        return tuple(range(logical_rank * per_rank, (logical_rank + 1) * per_rank))
    per_chunk = segments_per_chunk(tp_size)
    cp_rank_segments = [
        segment
        for chunk in zigzag_chunk_ids(cp_size, cp_rank)
        for segment in range(chunk * per_chunk, (chunk + 1) * per_chunk)
    ]
    return tuple(cp_rank_segments[tp_rank * per_rank : (tp_rank + 1) * per_rank])


def segment_owner(segment_id: int, layout: CPLayout | str, cp_size: int, tp_size: int) -> tuple[int, int]:
    """Return the ``(cp_rank, tp_rank)`` that holds ``segment_id`` in ``layout``."""
    layout = as_layout(layout)
    per_rank = segments_per_rank(tp_size)
    if not 0 <= segment_id < cp_size * tp_size * per_rank:
        raise ValueError(f"segment_id {segment_id} is outside [0, {cp_size * tp_size * per_rank})")
    if layout is CPLayout.CONTIGUOUS:
        return divmod(segment_id // per_rank, tp_size)
    per_chunk = segments_per_chunk(tp_size)
    chunk, offset = divmod(segment_id, per_chunk)
    is_back = chunk >= cp_size
    cp_rank = 2 * cp_size - 1 - chunk if is_back else chunk
    position_in_cp_rank = offset + (per_chunk if is_back else 0)
    return cp_rank, position_in_cp_rank // per_rank


# Packed sequences: offsets and padding.


def _shown(values: Sequence[int]) -> str:
    """Render offsets for an error message, eliding the middle of long ones."""
    values = list(values)
    if len(values) <= 16:
        return str(values)
    return f"[{', '.join(map(str, values[:8]))}, ..., {', '.join(map(str, values[-4:]))}] ({len(values)} entries)"


def check_offsets(name: str, offsets: Tensor | Sequence[int]) -> Tensor:
    """Return the int64 lengths of cumulative ``offsets`` after checking they start at 0 and never decrease."""
    offsets = torch.as_tensor(offsets, dtype=torch.int64)
    problem = None
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        problem = f"it must start at 0, got {int(offsets[0]) if offsets.numel() else 'nothing'}"
    lengths = offsets[1:] - offsets[:-1]
    if problem is None and bool((lengths < 0).any()):
        index = int(torch.nonzero(lengths < 0)[0, 0])
        problem = f"entry {index + 1} ({int(offsets[index + 1])}) is smaller than entry {index} ({int(offsets[index])})"
    if problem is not None:
        shown = _shown(offsets.tolist())
        raise ValueError(f"{name}={shown}; expected non-decreasing cumulative offsets starting at 0, but {problem}")
    return lengths


def check_cu_seqlens_structure(cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None) -> None:
    """Reject offsets of the wrong type, dtype, rank or size, and padded offsets that do not match them."""
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries, got {cu_seqlens.numel()}")
    if cu_seqlens_padded is None:
        return
    if not isinstance(cu_seqlens_padded, Tensor):
        raise ValueError(f"cu_seqlens_padded must be a torch.Tensor, got {type(cu_seqlens_padded).__name__}")
    if cu_seqlens_padded.shape != cu_seqlens.shape:
        raise ValueError(
            f"cu_seqlens_padded has shape {tuple(cu_seqlens_padded.shape)}, expected the shape of cu_seqlens "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens_padded.dtype != cu_seqlens.dtype:
        raise ValueError(f"cu_seqlens_padded has dtype {cu_seqlens_padded.dtype}, expected {cu_seqlens.dtype}")
    if cu_seqlens_padded.device != cu_seqlens.device:
        raise ValueError(f"cu_seqlens_padded is on {cu_seqlens_padded.device}, expected {cu_seqlens.device}")


def padded_length(length: int, multiple: int) -> int:
    """Return the smallest multiple of ``multiple`` that is at least ``length``."""
    return -(-length // multiple) * multiple


def contiguous_padding_multiple(cp_size: int, tp_size: int, packed: bool) -> int:
    """What a replica batch's sequence length is padded to: ``cp * tp`` tokens packed, whole zigzag chunks dense
    (without CP, ``tp``: there are no zigzag chunks; a bidirectional layer refuses any padding)."""
    return cp_size * tp_size if packed or cp_size == 1 else 2 * cp_size * tp_size


def contiguous_shard(
    cp_size: int, cp_rank: int, tp_size: int = 1, tp_rank: int = 0, sequence_parallel: bool = False
) -> tuple[int, int]:
    """Return ``(count, index)`` of a rank's slice of the contiguous token stream: the ``cp_rank * tp + tp_rank``-th
    of ``cp * tp`` with sequence parallelism, else the ``cp_rank``-th of ``cp`` (TP ranks share it)."""
    if sequence_parallel:
        return cp_size * tp_size, cp_rank * tp_size + tp_rank
    return cp_size, cp_rank


def zigzag_padded_lengths(physical_lengths: Tensor, cp_size: int, tp_size: int = 1) -> Tensor:
    """Pad every sequence to a multiple of ``2 * cp``; with ``tp > 1`` the last one further, by the fewest ``2 * cp``
    blocks that make each CP rank's zigzag token count divide by ``tp``."""
    two_cp = 2 * cp_size
    padded = (physical_lengths + two_cp - 1) // two_cp * two_cp
    if tp_size > 1 and padded.numel():
        per_cp_rank = int(padded.sum()) // cp_size
        padded[-1] += two_cp * next(extra for extra in range(tp_size) if (per_cp_rank + 2 * extra) % tp_size == 0)
    return padded


def zigzag_source_indices(
    physical_offsets: Tensor, physical_lengths: Tensor, padded_lengths: Tensor, cp_size: int
) -> Tensor:
    """For every zigzag slot, grouped by CP rank (its chunk ``r`` then chunk ``2cp-1-r`` of every sequence), the
    position of its token in the whole contiguous stream, or ``-1`` for a padding slot."""
    two_cp = 2 * cp_size
    device = physical_offsets.device
    padded_total = int(padded_lengths.sum())
    # One run per (CP rank, sequence, front/back chunk), in rank order; each run is a range of source positions whose
    # tail past the sequence's physical length is padding.
    chunk_length = (padded_lengths // two_cp).view(1, -1, 1)
    chunk_index = torch.tensor([zigzag_chunk_ids(cp_size, rank) for rank in range(cp_size)], device=device)
    chunk_offset = chunk_index.view(cp_size, 1, 2) * chunk_length
    run_length = chunk_length.expand(cp_size, -1, 2).reshape(-1)
    run_source = (physical_offsets[:-1].view(1, -1, 1) + chunk_offset).reshape(-1)
    run_tokens = (physical_lengths.view(1, -1, 1) - chunk_offset).clamp(min=0).minimum(chunk_length).reshape(-1)
    run_start = torch.cumsum(run_length, 0) - run_length
    source_shift = torch.repeat_interleave(run_source - run_start, run_length, output_size=padded_total)
    token_limit = torch.repeat_interleave(run_start + run_tokens, run_length, output_size=padded_total)
    position = torch.arange(padded_total, device=device)
    return torch.where(position < token_limit, position + source_shift, -1)


# Per-token descriptions of one rank's tokens, for attention masks and work counts.


@dataclass(frozen=True)
class RankTokens:
    """Document id (``-1`` for padding) and in-document position of one rank's tokens in half-major order.

    ``perm`` maps half-major order to the rank's local order (``half_major = local[perm]``); ``None`` if they agree.
    """

    doc: Tensor
    pos: Tensor
    perm: Tensor | None


def zigzag_rank_tokens(lengths: Sequence[int], padded: Sequence[int], cp_size: int, rank: int) -> RankTokens:
    """Describe the tokens CP rank ``rank`` holds in the zigzag layout: its two chunks of every sequence."""
    actual = torch.tensor(list(lengths), dtype=torch.int64)
    chunk = torch.tensor(list(padded), dtype=torch.int64) // (2 * cp_size)
    seq = torch.repeat_interleave(torch.arange(len(actual)), chunk)
    starts = torch.cumsum(chunk, 0) - chunk
    offset = torch.arange(int(chunk.sum())) - starts[seq]
    docs, positions = [], []
    for chunk_id in zigzag_chunk_ids(cp_size, rank):
        pos = chunk_id * chunk[seq] + offset
        docs.append(torch.where(pos < actual[seq], seq, -1))
        positions.append(pos)
    front_local = 2 * starts[seq] + offset
    perm = torch.cat([front_local, front_local + chunk[seq]]) if len(actual) > 1 else None
    return RankTokens(torch.cat(docs), torch.cat(positions), perm)


def in_local_order(tokens: RankTokens) -> RankTokens:
    """Return ``tokens`` re-ordered from half-major to the rank's local order (``perm`` ``None``)."""
    if tokens.perm is None:
        return tokens
    doc, pos = torch.empty_like(tokens.doc), torch.empty_like(tokens.pos)
    doc[tokens.perm], pos[tokens.perm] = tokens.doc, tokens.pos
    return RankTokens(doc, pos, None)


def stream_tokens(lengths: Sequence[int], total: int) -> RankTokens:
    """Describe a whole contiguous token stream of ``total`` slots: documents of ``lengths``, then padding."""
    actual = torch.tensor(list(lengths), dtype=torch.int64)
    real = int(actual.sum())
    doc = torch.full((total,), -1, dtype=torch.int64)
    pos = torch.zeros(total, dtype=torch.int64)
    doc[:real] = torch.repeat_interleave(torch.arange(len(actual)), actual)
    pos[:real] = torch.arange(real) - (torch.cumsum(actual, 0) - actual)[doc[:real]]
    return RankTokens(doc, pos, None)


def contiguous_rank_tokens(lengths: Sequence[int], cp_size: int, rank: int) -> RankTokens:
    """Describe rank ``rank``'s tokens when the token stream (padded at the end) is split evenly into ``cp`` slices."""
    actual = torch.tensor(list(lengths), dtype=torch.int64)
    total = int(actual.sum())
    per_rank = padded_length(total, 2 * cp_size) // cp_size
    doc = torch.full((cp_size * per_rank,), -1, dtype=torch.int64)
    pos = torch.zeros(cp_size * per_rank, dtype=torch.int64)
    doc[:total] = torch.repeat_interleave(torch.arange(len(actual)), actual)
    pos[:total] = torch.arange(total) - (torch.cumsum(actual, 0) - actual)[doc[:total]]
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    return RankTokens(doc[local], pos[local], None)


def _pair_count(tokens: RankTokens, lengths: Tensor, causal: bool) -> int:
    """Sum, over the valid queries of one rank, the number of keys each one sees."""
    valid = tokens.doc >= 0
    seen = tokens.pos.masked_select(valid) + 1 if causal else lengths[tokens.doc.masked_select(valid)]
    return int(seen.sum())


@dataclass(frozen=True)
class ZigzagGeometry:
    """The global geometry of one batch over ``cp_size`` ranks: actual and zigzag-padded sequence lengths.

    Built once per batch (from host offsets); every rank's token description is derived from it on first use and
    serves the attention block plan and the work-balance metrics alike.
    """

    cp_size: int
    lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def dense(cp_size: int, sequence_length: int, padded_sequence_length: int | None = None) -> ZigzagGeometry:
        """One dense sequence of ``sequence_length`` real tokens, padded to ``padded_sequence_length``."""
        padded = (
            padded_length(sequence_length, 2 * cp_size) if padded_sequence_length is None else padded_sequence_length
        )
        return ZigzagGeometry(cp_size, (sequence_length,), (padded,))

    @staticmethod
    def packed(cp_size: int, lengths: Sequence[int], padded_lengths: Sequence[int] | None = None) -> ZigzagGeometry:
        """Packed sequences of ``lengths``, zigzag-padded to ``padded_lengths`` (default: multiples of ``2 * cp``)."""
        if padded_lengths is None:
            padded_lengths = zigzag_padded_lengths(torch.tensor(list(lengths), dtype=torch.int64), cp_size).tolist()
        return ZigzagGeometry(cp_size, tuple(int(n) for n in lengths), tuple(int(n) for n in padded_lengths))

    @property
    def zigzag_local_token_count(self) -> int:
        """Return the number of zigzag slots each CP rank holds."""
        return sum(self.padded_lengths) // self.cp_size

    @functools.cached_property
    def rank_tokens(self) -> tuple[RankTokens, ...]:
        """Return every CP rank's zigzag token description."""
        return tuple(
            zigzag_rank_tokens(self.lengths, self.padded_lengths, self.cp_size, r) for r in range(self.cp_size)
        )

    def gathered_tokens(self, layout: CPLayout | str, stream_length: int | None = None) -> RankTokens:
        """Describe every rank's shard in ``layout``, concatenated in rank order (what a head exchange gathers).

        ``stream_length`` is the contiguous stream's padded length (default: the zigzag total). Built once per
        batch and layout, so every layer shares its attention plan.
        """
        layout = as_layout(layout)
        key = (layout, stream_length)
        if key not in self._derived:
            if layout is CPLayout.CONTIGUOUS:
                total = sum(self.padded_lengths) if stream_length is None else stream_length
                self._derived[key] = stream_tokens(self.lengths, total)
            else:
                local = [in_local_order(tokens) for tokens in self.rank_tokens]
                doc, pos = torch.cat([t.doc for t in local]), torch.cat([t.pos for t in local])
                self._derived[key] = RankTokens(doc, pos, None)
        return self._derived[key]

    def work_per_rank(self, causal: bool = True, layout: CPLayout | str = CPLayout.ZIGZAG) -> list[int]:
        """Count the unmasked query-key pairs each CP rank computes (padding excluded), in ``layout``."""
        if as_layout(layout) is CPLayout.ZIGZAG:
            tokens: Sequence[RankTokens] = self.rank_tokens
        else:
            tokens = [contiguous_rank_tokens(self.lengths, self.cp_size, rank) for rank in range(self.cp_size)]
        actual = torch.tensor(self.lengths, dtype=torch.int64)
        return [_pair_count(rank_tokens, actual, causal) for rank_tokens in tokens]

    def imbalance(self, causal: bool = True) -> float:
        """Return max / mean of the attention work over the CP ranks (1.0 when there is none)."""
        work = self.work_per_rank(causal)
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0
