"""Greedy first-fit packing of documents into fixed token budgets, described by ``cu_seqlens``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


def split_document(doc: int, length: int, budget: int) -> list[Piece]:
    """Cut document ``doc`` of ``length`` tokens into pieces of at most ``budget`` tokens."""
    if budget < 1:
        raise ValueError(f"token budget must be at least 1, got {budget}")
    return [Piece(doc, start, min(start + budget, length)) for start in range(0, length, budget)]


def first_fit(lengths: Sequence[int], budget: int) -> list[list[Piece]]:
    """Assign documents to bins of ``budget`` tokens: each piece goes into the first bin with room, in order."""
    bins: list[list[Piece]] = []
    room: list[int] = []
    for doc, length in enumerate(lengths):
        for piece in split_document(doc, length, budget):
            target = next((i for i, free in enumerate(room) if free >= piece.length), None)
            if target is None:
                bins.append([])
                room.append(budget)
                target = len(bins) - 1
            bins[target].append(piece)
            room[target] -= piece.length
    return bins


def cu_seqlens_of(lengths: Sequence[int]) -> torch.Tensor:
    """Return the int32 cumulative offsets ``(0, l0, l0 + l1, ...)`` of ``lengths``."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32)


def pack_documents(
    documents: Sequence[Sequence[int]], budget: int, labels: Sequence[Sequence[int]] | None = None
) -> list[Pack]:
    """Pack token-id documents (and their labels, default: the ids) into samples of at most ``budget`` tokens
    (greedy first-fit; a longer document is split into pieces, each its own document)."""
    labels = documents if labels is None else labels
    packs = []
    for pieces in first_fit([len(doc) for doc in documents], budget):
        ids = [token for p in pieces for token in documents[p.doc][p.start : p.end]]
        targets = [label for p in pieces for label in labels[p.doc][p.start : p.end]]
        packs.append(
            Pack(
                torch.tensor(ids, dtype=torch.long),
                cu_seqlens_of([p.length for p in pieces]),
                torch.tensor(targets, dtype=torch.long),
            )
        )
    return packs
