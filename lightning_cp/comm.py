"""The one module that calls ``torch.distributed``: group queries and differentiable collectives."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup) -> int:
    """Return the number of ranks in ``group``."""
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """Return this process's rank inside ``group``."""
    return dist.get_rank(group)


def group_global_ranks(group: ProcessGroup) -> tuple[int, ...]:
    """Return the global ranks of ``group`` in group-rank order."""
    return tuple(dist.get_process_group_ranks(group))


def global_rank() -> int:
    """Return this process's rank in the default group."""
    return dist.get_rank()


def _all_to_all_v(
    input_: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup,
) -> torch.Tensor:
    """Run one uneven all-to-all along dim 0 into a fresh output tensor."""
    output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
    dist.all_to_all_single(
        output,
        input_.contiguous(),
        output_split_sizes=list(output_split_sizes),
        input_split_sizes=list(input_split_sizes),
        group=group,
    )
    return output


class _AllToAllV(torch.autograd.Function):
    """All-to-all-v whose backward is the inverse all-to-all-v."""

    @staticmethod
    def forward(ctx, input_, output_split_sizes, input_split_sizes, group):  # type: ignore[override]
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        ctx.group = group
        return _all_to_all_v(input_, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_input = _all_to_all_v(grad_output, ctx.input_split_sizes, ctx.output_split_sizes, ctx.group)
        return grad_input, None, None, None


def all_to_all_v(
    input_: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup,
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0: ``input_split_sizes[i]`` rows go to group rank ``i``."""
    return _AllToAllV.apply(input_, tuple(output_split_sizes), tuple(input_split_sizes), group)
