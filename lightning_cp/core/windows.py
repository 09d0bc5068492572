"""The pure plans of per-document sequence mixing: for ``cp_causal_conv1d``, which tokens before the pieces of
documents on a rank lie on other ranks, and how every piece is laid out behind them for one convolution without
padding; for the scans (``cp_ssd_scan``, ``cp_selective_scan``, ``cp_gated_delta_rule``), where documents start in a
rank's shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_cp.core.zigzag import RankTokens


@dataclass(frozen=True)
class CausalWindowPlan:
    """One rank's plan for a causal convolution that reads, at each of its slots, the ``count`` tokens before it in
    its document.

    ``send_slots``: this rank's slots that other ranks need, grouped by destination group rank in rank order;
    ``send_counts`` / ``receive_counts``: rows to and from each group rank (received rows come sorted by their slot
    in the gathered order); ``window_rows``: the convolution's input, as rows of ``cat([local rows, received rows, one
    zero row])``: every piece of a document on this rank (a run of consecutive tokens) preceded by the ``count``
    tokens before it (the zero row before the document's start; padding slots form pieces preceded by zeros);
    ``output_positions``: for each local slot, its position in the output of a convolution without padding of
    ``window_rows``; ``exchanged_rows``: rows moved over the whole group (0: no rank needs the exchange).
    """

    send_slots: Tensor
    send_counts: tuple[int, ...]
    receive_counts: tuple[int, ...]
    window_rows: Tensor
    output_positions: Tensor
    exchanged_rows: int


def build_causal_window_plan(tokens: RankTokens, ranks: int, rank: int, count: int) -> CausalWindowPlan:
    """Plan rank ``rank``'s convolution over ``count`` tokens back from ``tokens``: every rank's shard described in
    local order and concatenated in group-rank order (``ZigzagGeometry.gathered_tokens`` or ``stream_tokens``). Every
    rank derives every rank's needs from the same description, so senders and receivers agree without asking."""
    doc, pos = tokens.doc, tokens.pos
    slots = doc.shape[0]
    local = slots // ranks
    real = doc >= 0
    lengths = torch.bincount(doc[real], minlength=int(doc.max()) + 1 if slots else 0)
    starts = torch.cumsum(lengths, 0) - lengths
    document_index = torch.where(real, starts[doc.clamp(min=0)] + pos, 0)  # each real token's place in doc order
    slot_of = torch.empty(int(lengths.sum()), dtype=torch.int64)
    slot_of[document_index[real]] = torch.nonzero(real).squeeze(1)
    follows = torch.zeros(slots, dtype=torch.bool)  # a slot continues the piece its predecessor slot is in
    follows[1:] = (doc[1:] == doc[:-1]) & ((pos[1:] == pos[:-1] + 1) | ~real[1:])
    follows[::local] = False  # every rank's first slot begins a piece
    shifts = torch.arange(count, 0, -1).unsqueeze(1)  # the oldest token first, as a convolution window reads them
    reachable = real & ~follows & (pos >= shifts)  # [count, slots]: a piece's earlier tokens in its document
    source = torch.where(reachable, slot_of[(document_index - shifts).clamp(min=0)], -1)
    owner = torch.div(source, local, rounding_mode="floor")
    requester = torch.div(torch.arange(slots), local, rounding_mode="floor").expand_as(source)
    remote = reachable & (owner != requester)
    pairs = torch.unique(requester[remote] * slots + source[remote])  # sorted by requester, then source slot
    wanted_by, wanted = torch.div(pairs, slots, rounding_mode="floor"), pairs % slots
    received = wanted[wanted_by == rank]
    received_from = torch.div(received, local, rounding_mode="floor")
    outgoing = torch.div(wanted, local, rounding_mode="floor") == rank
    mine = slice(rank * local, (rank + 1) * local)
    own, own_owner, begins = source[:, mine].contiguous(), owner[:, mine], ~follows[mine]
    rows = torch.where(own_owner == rank, own - rank * local, local + torch.searchsorted(received, own))
    rows = torch.where(own >= 0, rows, local + received.numel())  # the zero row
    # each piece's first slot gets its ``count`` earlier tokens in front of it
    position = torch.arange(local) + count * torch.cumsum(begins.long(), 0)
    window_rows = torch.empty(local + count * int(begins.sum()), dtype=torch.int64)
    window_rows[position] = torch.arange(local)
    window_rows[(position[begins] - shifts).flatten()] = rows[:, begins].flatten()
    return CausalWindowPlan(
        send_slots=wanted[outgoing] - rank * local,
        send_counts=tuple(torch.bincount(wanted_by[outgoing], minlength=ranks).tolist()),
        receive_counts=tuple(torch.bincount(received_from, minlength=ranks).tolist()),
        window_rows=window_rows,
        output_positions=position - count,
        exchanged_rows=pairs.numel(),
    )


def shard_document_starts(tokens: RankTokens, ranks: int, rank: int) -> Tensor:
    """``[local]`` booleans: a document (or the padding after the last) starts at each slot of rank ``rank``'s shard,
    from ``tokens``: every rank's shard described in local order and concatenated in group-rank order."""
    doc, pos = tokens.doc, tokens.pos
    local = doc.shape[0] // ranks
    starts = (doc >= 0) & (pos == 0)
    starts[1:] |= doc[1:] != doc[:-1]
    return starts[rank * local : (rank + 1) * local]
