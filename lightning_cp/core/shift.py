"""The pure plan of ``cp_causal_conv1d``'s exchange: which tokens before each of a rank's tokens, in its document,
lie on other ranks, and where every shifted token is found once they have arrived."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_cp.core.zigzag import RankTokens


@dataclass(frozen=True)
class TokenShiftPlan:
    """One rank's plan for reading, at each of its slots, the ``count`` tokens before it in its document.

    ``send_slots``: this rank's slots that other ranks need, grouped by destination group rank in rank order;
    ``send_counts`` / ``receive_counts``: rows to and from each group rank (received rows come sorted by their slot
    in the gathered order); ``sources`` ``[count, local]``: for the token ``k + 1`` places back of each local slot,
    its row in ``cat([local rows, received rows, one zero row])`` (the zero row before a document's start and for
    padding slots); ``exchanged_rows``: rows moved over the whole group (0: no rank needs the exchange).
    """

    send_slots: Tensor
    send_counts: tuple[int, ...]
    receive_counts: tuple[int, ...]
    sources: Tensor
    exchanged_rows: int


def build_token_shift_plan(tokens: RankTokens, ranks: int, rank: int, count: int) -> TokenShiftPlan:
    """Plan rank ``rank``'s shifts by 1 to ``count`` tokens from ``tokens``: every rank's shard described in local
    order and concatenated in group-rank order (``ZigzagGeometry.gathered_tokens`` or ``stream_tokens``). Every rank
    derives every rank's needs from the same description, so senders and receivers agree without asking."""
    doc, pos = tokens.doc, tokens.pos
    slots = doc.shape[0]
    local = slots // ranks
    real = doc >= 0
    lengths = torch.bincount(doc[real], minlength=int(doc.max()) + 1 if slots else 0)
    starts = torch.cumsum(lengths, 0) - lengths
    document_index = torch.where(real, starts[doc.clamp(min=0)] + pos, 0)  # each real token's place in doc order
    slot_of = torch.empty(int(lengths.sum()), dtype=torch.int64)
    slot_of[document_index[real]] = torch.nonzero(real).squeeze(1)
    shifts = torch.arange(1, count + 1).unsqueeze(1)
    reachable = real & (pos >= shifts)  # [count, slots]: the shifted token exists in the same document
    source = torch.where(reachable, slot_of[(document_index - shifts).clamp(min=0)], -1)
    owner = torch.div(source, local, rounding_mode="floor")
    requester = torch.div(torch.arange(slots), local, rounding_mode="floor").expand_as(source)
    remote = reachable & (owner != requester)
    pairs = torch.unique(requester[remote] * slots + source[remote])  # sorted by requester, then source slot
    wanted_by, wanted = torch.div(pairs, slots, rounding_mode="floor"), pairs % slots
    received = wanted[wanted_by == rank]
    received_from = torch.div(received, local, rounding_mode="floor")
    outgoing = torch.div(wanted, local, rounding_mode="floor") == rank
    own = source[:, rank * local : (rank + 1) * local]
    own_owner = owner[:, rank * local : (rank + 1) * local]
    zero_row = local + received.numel()
    rows = torch.where(own_owner == rank, own - rank * local, local + torch.searchsorted(received, own))
    return TokenShiftPlan(
        send_slots=wanted[outgoing] - rank * local,
        send_counts=tuple(torch.bincount(wanted_by[outgoing], minlength=ranks).tolist()),
        receive_counts=tuple(torch.bincount(received_from, minlength=ranks).tolist()),
        sources=torch.where(own >= 0, rows, zero_row),
        exchanged_rows=pairs.numel(),
    )
