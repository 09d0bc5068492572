"""The differentiable collectives stay differentiable in their backward: a backward that builds a graph
(``create_graph=True``) gives exact second-order gradients on real gloo ranks (float64, compared exactly)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_cp.core import comm
from tests.distributed_harness import run_on_ranks


def _same_on_every_rank(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _second_order_gradients() -> list[bool]:
    """For a linear collective y = A x, the gradient is A^T u, so d<A^T u, w>/du = A w: the forward applied to w."""
    size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    weights = _same_on_every_rank((size, 3, 2), 1)
    outcomes = []

    x = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    gathered = comm.all_gather_stack(x, group)
    upstream = torch.ones_like(gathered, requires_grad=True)
    (gradient,) = torch.autograd.grad(gathered, x, upstream, create_graph=True)
    (second,) = torch.autograd.grad((gradient * weights[rank]).sum(), upstream)
    outcomes.append(torch.equal(second, weights))  # every rank's weights, gathered

    splits = [rank + 1 + peer for peer in range(size)]  # uneven: rank r sends r + 1 + peer rows to each peer
    received = [peer + 1 + rank for peer in range(size)]
    x = torch.zeros(sum(splits), 2, dtype=torch.float64, requires_grad=True)
    exchanged = comm.all_to_all_v(x, received, splits, group)
    upstream = torch.ones_like(exchanged, requires_grad=True)
    (gradient,) = torch.autograd.grad(exchanged, x, upstream, create_graph=True)
    mine = _same_on_every_rank((sum(splits), 2), 2 + rank)
    (second,) = torch.autograd.grad((gradient * mine).sum(), upstream)
    outcomes.append(torch.equal(second, comm.all_to_all_v(mine, received, splits, group)))
    return outcomes


def test_collectives_are_differentiable_twice():
    assert run_on_ranks(_second_order_gradients, 3, timeout=120) == [[True, True]] * 3
