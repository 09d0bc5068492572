"""Head-parallel ("Ulysses") attention: one all-to-all trades each rank's sequence shard of all heads for the whole
sequence of ``H / u`` heads, attention runs there, one all-to-all trades back; the backward is the inverse.

Inside the head exchange, ``ulysses`` attends over the whole gathered sequence on each rank; ``hybrid`` (the USP
scheme) gathers only within groups of ``u`` ranks and runs ring or all-gather attention across the ``r = cp / u``
groups on zigzag shards of the gathered sequence, so cp can exceed the number of heads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_cp.core import comm
from lightning_cp.core.attention.kernels import BlockPlan, PlanProfile, build_block_plan
from lightning_cp.core.zigzag import RankTokens

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
logger = logging.getLogger("lightning_cp.attention")


def kv_replication(query_heads: int, kv_heads: int, ulysses_size: int, mode: str) -> int:
    """Return by how much K/V heads are repeated so ``ulysses_size`` ranks each get whole query and K/V head groups.

    Raises ``ValueError`` naming both numbers when the query heads do not divide by the Ulysses degree.
    """
    if query_heads % ulysses_size:
        raise ValueError(
            f"attention_mode={mode!r} splits the {query_heads} query heads over {ulysses_size} ranks, but "
            f"{query_heads} is not divisible by {ulysses_size}: use 'allgather' or 'ring', or 'hybrid' with a "
            "ulysses_size that divides the query heads"
        )
    return next(
        factor
        for factor in range(1, ulysses_size + 1)
        if (kv_heads * factor) % ulysses_size == 0 and query_heads % (kv_heads * factor) == 0
    )


@functools.cache
def _log_replication_once(kv_heads: int, factor: int, size: int, mode: str) -> None:
    """Say once per shape what splitting too few K/V heads costs."""
    logger.info(
        "%s: %d key/value heads do not split over %d ranks; each is repeated %d times, so K/V send %dx the bytes "
        "(and their gradients are summed back)",
        mode, kv_heads, size, factor, factor,
    )  # fmt: skip


def _scatter_heads(x: Tensor, group: ProcessGroup, size: int) -> Tensor:
    """``[T, ..., H, D]`` sequence shard of all heads -> ``[size * T, ..., H / size, D]``: the group's tokens, in rank
    order, of this rank's head group."""
    tokens, *middle, heads, dim = x.shape
    parts = x.reshape(tokens, *middle, size, heads // size, dim).movedim(-3, 0).contiguous()
    rows = parts.reshape(size * tokens, *middle, heads // size, dim)
    return comm.all_to_all_v(rows, [tokens] * size, [tokens] * size, group)


def _gather_heads(x: Tensor, group: ProcessGroup, size: int) -> Tensor:
    """Inverse of ``_scatter_heads``: ``[size * T, ..., H / size, D]`` -> ``[T, ..., H, D]``."""
    rows, *middle, heads, dim = x.shape
    tokens = rows // size
    exchanged = comm.all_to_all_v(x, [tokens] * size, [tokens] * size, group)
    parts = exchanged.reshape(size, tokens, *middle, heads, dim).movedim(0, -3)
    return parts.reshape(tokens, *middle, size * heads, dim)


def head_parallel(q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, mode: str, attend: Attend) -> Tensor:
    """Exchange heads for sequence over ``group``, run ``attend`` on the gathered sequence, exchange back.

    K/V heads are repeated first when there are too few to split (GQA/MQA); autograd sums their gradients back.
    """
    size = group.size()
    factor = kv_replication(q.shape[-2], k.shape[-2], size, mode)
    if factor > 1:
        _log_replication_once(k.shape[-2], factor, size, mode)
        k, v = (x.repeat_interleave(factor, dim=-2) for x in (k, v))
    gathered_q, gathered_k, gathered_v = (_scatter_heads(x, group, size) for x in (q, k, v))
    return _gather_heads(attend(gathered_q, gathered_k, gathered_v), group, size)


@functools.lru_cache(maxsize=2)
def natural_order_plan(
    tokens: RankTokens, causal: bool, device: torch.device, profile: PlanProfile
) -> tuple[BlockPlan, RankTokens, Tensor | None, Tensor | None]:
    """Block plan (cut as ``profile`` says) of a whole gathered sequence put in natural order (documents in order,
    padding last).

    Returns the one-rank plan, the tokens in natural order, the gathered-to-natural permutation and its inverse
    (``None`` when already natural).
    """
    doc, pos = tokens.doc, tokens.pos
    document_key = doc.masked_fill(doc < 0, int(doc.max()) + 1)
    order = torch.argsort(document_key * (int(pos.max()) + 1) + pos, stable=True)
    if torch.equal(order, torch.arange(order.numel())):
        natural, to_natural, from_natural = tokens, None, None
    else:
        natural = RankTokens(doc[order], pos[order], None)
        to_natural, from_natural = order.to(device), torch.argsort(order).to(device)
    return build_block_plan([natural], 0, causal, device, profile=profile), natural, to_natural, from_natural
