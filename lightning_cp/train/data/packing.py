"""Greedy first-fit packing of documents into fixed token budgets, described by ``cu_seqlens``.

First-fit puts each piece into the lowest-numbered bin with room for it. A max-tree over the bins' free room finds
that bin in O(log bins), so packing n pieces takes O(n log n) and gives the same bins as scanning every bin. Packed
samples are served from flat token arrays (``PackedSamples``, ``DenseRows``): a pack is a few array slices.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_cp.train.data.tokenizer import IGNORE_INDEX

PROGRESS_EVERY = 1 << 16


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of document ``doc``."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        """Number of tokens in the piece."""
        return self.end - self.start


@dataclass(frozen=True)
class Pack:
    """One packed sample: flat token ids, their unshifted labels (``-100``: no target) and int32 offsets."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the pack."""
        return int(self.input_ids.numel())


def _check_budget(budget: int) -> None:
    if budget < 1:
        raise ValueError(f"token budget must be at least 1, got {budget}")


def split_document(doc: int, length: int, budget: int) -> list[Piece]:
    """Cut document ``doc`` of ``length`` tokens into pieces of at most ``budget`` tokens."""
    _check_budget(budget)
    return [Piece(doc, start, min(start + budget, length)) for start in range(0, length, budget)]


def piece_table(lengths: Sequence[int] | np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(doc, start, length)`` of every piece, in document order: each document cut every ``budget`` tokens
    (``split_document`` for all documents at once)."""
    _check_budget(budget)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    counts = -(-lengths // budget)
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    start = (np.arange(doc.size, dtype=np.int64) - np.repeat(first, counts)) * budget
    return doc, start, np.minimum(budget, lengths[doc] - start)


def assign_bins(
    piece_lengths: Sequence[int] | np.ndarray, budget: int, progress: Callable[[int], None] | None = None
) -> np.ndarray:
    """Return the first-fit bin of each piece (lengths in ``1..budget``, taken in order); ``progress(n)`` is told
    every ``PROGRESS_EVERY`` pieces.

    ``tree[1]`` is the largest free room of any open bin, ``tree[size + b]`` bin ``b``'s (0 until it opens): the
    leftmost bin with room is found by walking down from the root, and a change walks back up while it matters.
    """
    _check_budget(budget)
    lengths = np.asarray(piece_lengths, dtype=np.int64).reshape(-1)
    if lengths.size and (lengths.min() < 1 or lengths.max() > budget):
        raise ValueError(f"piece lengths must be in 1..{budget}, got {lengths.min()}..{lengths.max()}")
    size = 1 << max(0, int(lengths.size - 1).bit_length())
    tree = [0] * (2 * size)
    bins = [0] * lengths.size
    opened = 0
    values = lengths.tolist()
    for chunk in range(0, len(values), PROGRESS_EVERY):
        for index in range(chunk, min(chunk + PROGRESS_EVERY, len(values))):
            length = values[index]
            if tree[1] < length:
                bins[index] = opened
                room = budget - length
                node = size + opened
                opened += 1
                while node and tree[node] < room:
                    tree[node] = room
                    node >>= 1
                continue
            node = 1
            while node < size:
                node <<= 1
                if tree[node] < length:
                    node += 1
            bins[index] = node - size
            tree[node] -= length
            node >>= 1
            while node:
                best = max(tree[2 * node], tree[2 * node + 1])
                if tree[node] == best:
                    break
                tree[node] = best
                node >>= 1
        if progress is not None:
            progress(min(PROGRESS_EVERY, len(values) - chunk))
    return np.asarray(bins, dtype=np.int64)


@dataclass(frozen=True)
class PackPlan:
    """Pieces ``(doc, start, length)`` in pack order: pack ``i`` is pieces ``offsets[i]:offsets[i + 1]``."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return int(self.offsets.size - 1)


def plan_packs(
    lengths: Sequence[int] | np.ndarray, budget: int, progress: Callable[[int], None] | None = None
) -> PackPlan:
    """First-fit packing of documents of ``lengths`` tokens into bins of ``budget`` tokens (longer documents are
    split into pieces, each its own document); within a bin, pieces keep the order they were placed in."""
    return pack_pieces(*piece_table(lengths, budget), budget, progress)


def pack_pieces(
    doc: np.ndarray, start: np.ndarray, length: np.ndarray, budget: int, progress: Callable[[int], None] | None = None
) -> PackPlan:
    """First-fit packing of the pieces ``(doc, start, length)`` of ``piece_table`` (or some of them)."""
    bins = assign_bins(length, budget, progress)
    order = np.argsort(bins, kind="stable")
    counts = np.bincount(bins, minlength=int(bins.max()) + 1 if bins.size else 0)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return PackPlan(doc[order], start[order], length[order], offsets)


def first_fit(lengths: Sequence[int], budget: int) -> list[list[Piece]]:
    """Assign documents to bins of ``budget`` tokens: each piece goes into the first bin with room, in order."""
    plan = plan_packs(lengths, budget)
    table = zip(plan.doc.tolist(), plan.start.tolist(), plan.length.tolist(), strict=True)
    pieces = [Piece(d, s, s + n) for d, s, n in table]
    bounds = plan.offsets.tolist()
    return [pieces[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class _MappedFile:
    """Where a memory-mapped array lives, to map it again in another process."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, value: object) -> object:
        """The file of a whole memory-mapped array; any other value as it is."""
        if isinstance(value, np.memmap) and value.filename is not None and isinstance(value.base, mmap.mmap):
            return cls(value.filename, value.dtype.str, value.shape, value.offset)
        return value

    def open(self) -> np.memmap:
        """Map the array again, read-only."""
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=self.shape, offset=self.offset)


class _Segments:
    """A virtual token stream: segments ``tokens[src[k] : src[k] + cum[k + 1] - cum[k]]`` one after another.

    Labels are the ids themselves, except: ``labels`` (given for every token) replaces them, and ``ignored``,
    sorted ``(starts, ends)`` of token ranges, marks the ranges whose labels are ``-100``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        src: np.ndarray,
        cum: np.ndarray,
        labels: np.ndarray | None = None,
        ignored: np.ndarray | None = None,
    ) -> None:
        self.tokens, self.src, self.cum, self.labels, self.ignored = tokens, src, cum, labels, ignored

    def __getstate__(self) -> dict:
        """Pickle memory-mapped arrays as their file (a spawned DataLoader worker maps it again, copying nothing)."""
        return {name: _MappedFile.of(value) for name, value in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: v.open() if isinstance(v, _MappedFile) else v for k, v in state.items()})

    @property
    def num_tokens(self) -> int:
        """Length of the virtual stream."""
        return int(self.cum[-1])

    def read(self, begin: int, end: int, first: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Return the int64 ids and labels of virtual tokens ``[begin, end)`` (``first``: the segment holding
        ``begin``, when known)."""
        k = int(np.searchsorted(self.cum, begin, side="right")) - 1 if first is None else first
        slices = []
        while begin < end:
            take = min(end, int(self.cum[k + 1])) - begin
            if take > 0:
                offset = int(self.src[k]) + begin - int(self.cum[k])
                slices.append(slice(offset, offset + take))
                begin += take
            k += 1
        ids = np.concatenate([self.tokens[s] for s in slices] or [np.zeros(0, np.int64)]).astype(np.int64)
        if self.labels is not None:
            return ids, np.concatenate([self.labels[s] for s in slices] or [np.zeros(0, np.int64)]).astype(np.int64)
        labels = ids.copy()
        if self.ignored is not None:
            starts, ends = self.ignored
            position = 0
            for s in slices:
                lo, hi = int(np.searchsorted(ends, s.start, side="right")), int(np.searchsorted(starts, s.stop))
                for a, b in zip(starts[lo:hi].tolist(), ends[lo:hi].tolist(), strict=True):
                    labels[position + max(a, s.start) - s.start : position + min(b, s.stop) - s.start] = IGNORE_INDEX
                position += s.stop - s.start
        return ids, labels


def predicts_a_target(first: np.ndarray, length: np.ndarray, ignored: np.ndarray | None) -> np.ndarray:
    """Whether each span of ``length`` tokens from store position ``first`` (inside one document) has a target the
    model predicts: a token after the span's first (which nothing precedes) that no ``ignored`` range covers."""
    begin, end = first + 1, first + length
    spans = end > begin
    if ignored is None or ignored.shape[1] == 0:
        return spans
    starts, ends = ignored  # sorted, and within a document maximal: one range covers all the span's or not
    run = np.minimum(np.searchsorted(ends, begin, side="right"), ends.size - 1)
    covered = (starts[run] <= begin) & (ends[run] >= end)
    return spans & ~covered


def rows_predicting_a_target(src: np.ndarray, cum: np.ndarray, seq_len: int, ignored: np.ndarray | None) -> np.ndarray:
    """The dense rows of ``seq_len`` tokens, cut from the segments ``src``/``cum`` (whole documents, in store
    order), that have a target after their first token."""
    rows = np.arange(int(cum[-1]) // seq_len, dtype=np.int64)
    if seq_len < 2:
        return rows[:0]
    if ignored is None or ignored.shape[1] == 0 or src.size == 0:
        return rows
    starts, ends = ignored
    segment = np.searchsorted(src, starts, side="right") - 1  # the document holding each range, if it is a segment
    within = (segment >= 0) & (ends <= src[np.maximum(segment, 0)] + np.diff(cum)[np.maximum(segment, 0)])
    shift = cum[segment[within]] - src[segment[within]]
    begin, end = starts[within] + shift, ends[within] + shift  # the ranges in the rows' stream, sorted
    if begin.size == 0:
        return rows
    covered = cumulative(end - begin)

    def ignored_before(position: np.ndarray) -> np.ndarray:
        """How many ignored tokens of the stream lie before each ``position``."""
        whole = np.searchsorted(end, position, side="right")
        partial = np.clip(position - begin[np.minimum(whole, begin.size - 1)], 0, None) * (whole < begin.size)
        return covered[whole] + partial

    first = rows * seq_len + 1
    ignored_in_row = ignored_before(first + seq_len - 1) - ignored_before(first)
    return rows[ignored_in_row < seq_len - 1]


def ignored_ranges(targets: np.ndarray, offset: int = 0) -> np.ndarray:
    """Return ``(starts, ends)`` (shape ``[2, n]``, plus ``offset``) of the runs of false in a bool target mask."""
    edges = np.diff(np.concatenate([[0], (~targets).astype(np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)]).astype(np.int64) + offset


class PackedSamples(Dataset):
    """Packs served from a flat token array: pack ``i`` is segments ``bounds[i]:bounds[i + 1]`` (its documents);
    ``labels`` and ``ignored`` as in ``_Segments``."""

    def __init__(
        self,
        tokens: np.ndarray,
        src: np.ndarray,
        cum: np.ndarray,
        bounds: np.ndarray,
        labels: np.ndarray | None = None,
        ignored: np.ndarray | None = None,
    ) -> None:
        self.segments = _Segments(tokens, src, cum, labels, ignored)
        self.bounds = bounds

    def __len__(self) -> int:
        return int(self.bounds.size - 1)

    def __getitem__(self, index: int) -> Pack:
        if not 0 <= index < len(self):
            raise IndexError(f"pack {index} of {len(self)}")
        a, b = int(self.bounds[index]), int(self.bounds[index + 1])
        cum = self.segments.cum[a : b + 1].astype(np.int64)
        ids, labels = self.segments.read(int(cum[0]), int(cum[-1]), first=a)
        return Pack(torch.from_numpy(ids), torch.from_numpy((cum - cum[0]).astype(np.int32)), torch.from_numpy(labels))


class DenseRows(Dataset):
    """Rows of ``seq_len`` tokens cut from the documents' concatenated stream (the tail is dropped); ``rows``: the
    indices of the rows served (default: all)."""

    def __init__(
        self,
        tokens: np.ndarray,
        src: np.ndarray,
        cum: np.ndarray,
        seq_len: int,
        ignored: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> None:
        _check_budget(seq_len)
        self.segments = _Segments(tokens, src, cum, ignored=ignored)
        self.seq_len = seq_len
        self.rows = np.arange(self.segments.num_tokens // seq_len, dtype=np.int64) if rows is None else rows

    def __len__(self) -> int:
        return int(self.rows.size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        row = int(self.rows[index])
        ids, labels = self.segments.read(row * self.seq_len, (row + 1) * self.seq_len)
        return torch.from_numpy(ids), torch.from_numpy(labels)


def _flat(documents: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents into one int64 array; return it and each document's start (and the end)."""
    arrays = [np.asarray(doc, dtype=np.int64).reshape(-1) for doc in documents]
    offsets = np.concatenate([[0], np.cumsum([a.size for a in arrays], dtype=np.int64)]).astype(np.int64)
    return (np.concatenate(arrays) if arrays else np.zeros(0, np.int64)), offsets


def pack_documents(
    documents: Sequence[Sequence[int]], budget: int, labels: Sequence[Sequence[int]] | None = None
) -> list[Pack]:
    """Pack token-id documents (and their labels, default: the ids) into samples of at most ``budget`` tokens
    (greedy first-fit; a longer document is split into pieces, each its own document)."""
    tokens, offsets = _flat(documents)
    targets = None if labels is None else _flat(labels)[0]
    plan = plan_packs(np.diff(offsets), budget)
    samples = PackedSamples(tokens, offsets[plan.doc] + plan.start, cumulative(plan.length), plan.offsets, targets)
    return [samples[i] for i in range(len(samples))]


def cumulative(lengths: np.ndarray) -> np.ndarray:
    """``(0, l0, l0 + l1, ...)`` as int64."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
