"""The one module that calls ``torch.distributed``: group queries and differentiable collectives."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

_Function = TypeVar("_Function", bound=Callable)


def eager_under_compile(function: _Function) -> _Function:
    """Keep ``function`` out of compiled graphs: ``torch.compile`` runs it eagerly, a graph break around the call.

    For the library's calls that talk to other ranks or read per-step host state (process groups, the active step,
    plans cached per batch, staging buffers reused between calls, which inductor would save views of for the
    backward): outside the graph, the compiled code around them stays exact and does not recompile for each batch.
    """
    return torch.compiler.disable(function, recursive=True)


class SentBytes:
    """Bytes this rank sent to other ranks through the data-moving collectives below, while counting is on."""

    def __init__(self) -> None:
        self.total = 0


_counters: list[SentBytes] = []


@contextmanager
def counting_sent_bytes() -> Iterator[SentBytes]:
    """Count the bytes this rank sends to other ranks inside the block (all-to-all, all-gather, ring sends)."""
    counter = SentBytes()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _sent(byte_count: int) -> None:
    """Add ``byte_count`` to every active counter."""
    for counter in _counters:
        counter.total += byte_count


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
    return all_to_all_v_into(output, input_, output_split_sizes, input_split_sizes, group)


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
        """The inverse all-to-all-v, itself differentiable when the backward builds a graph (``create_graph``)."""
        grad_input = all_to_all_v(grad_output, ctx.input_split_sizes, ctx.output_split_sizes, ctx.group)
        return grad_input, None, None, None


def all_to_all_v(
    input_: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup,
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0: ``input_split_sizes[i]`` rows go to group rank ``i``."""
    return _AllToAllV.apply(input_, tuple(output_split_sizes), tuple(input_split_sizes), group)


def original_class_name(module: torch.nn.Module) -> str:
    """Return the module's class name as its author wrote it (``fully_shard`` swaps in a class named ``FSDP<name>``)."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)).__name__


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> DeviceMesh:
    """Build a ``DeviceMesh`` over all ranks of the default group, last dimension fastest."""
    return _init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)


def flattened_mesh_group(
    mesh: DeviceMesh, mesh_dim_names: tuple[str, ...], flattened_name: str | None = None
) -> ProcessGroup:
    """Return the process group spanning ``mesh_dim_names`` of ``mesh`` together, in row-major order (the flattened
    dimension is reachable as ``mesh[flattened_name]``)."""
    if len(mesh_dim_names) == 1:
        return mesh.get_group(mesh_dim_names[0])
    return mesh[mesh_dim_names]._flatten(flattened_name or "_x_".join(mesh_dim_names)).get_group()


def differing_fields(fingerprint: Sequence[int], group: ProcessGroup | None) -> list[int]:
    """Return the indices of ``fingerprint`` whose values differ between the ranks of ``group`` (one tiny all-reduce).

    Every rank gets the same answer, so every rank can raise the same error before any data collective.
    """
    if group is None or group.size() == 1:
        return []
    values = torch.tensor(list(fingerprint), dtype=torch.int64, device=_bookkeeping_device(group))
    extremes = torch.cat([values, -values])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = extremes[: len(values)], -extremes[len(values) :]
    return torch.nonzero(highest != lowest).flatten().tolist()


def _bookkeeping_device(group: ProcessGroup) -> torch.device:
    """Where a few integers go through ``group``: the host when one of its backends reaches it (gloo, MPI), else the
    current device of its accelerator (an NCCL-only group cannot reduce host tensors)."""
    backend = dist.get_backend(group)
    if ":" in backend:  # "cpu:gloo,cuda:nccl": a backend per device type
        device_types = [pair.split(":")[0] for pair in backend.split(",")]
    else:
        device_types = dist.Backend.backend_capability.get(backend, ["cpu"])
    return torch.device("cpu" if "cpu" in device_types else device_types[0])  # no index: the current device


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Return the sum of ``tensor`` over ``group`` (not differentiable; for metrics)."""
    reduced = tensor.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return reduced


def broadcast_module_states(
    module: torch.nn.Module, group: ProcessGroup, tensor_parallel_group: ProcessGroup | None = None
) -> None:
    """Copy the parameters and buffers of ``module`` from group rank 0 to every rank of ``group``.

    A tensor-parallel DTensor's local shard is copied within ``group`` (the ranks holding the same shard); a plain
    tensor is then also copied over ``tensor_parallel_group``, so every rank ends with global rank 0's values.
    """
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            dist.broadcast(local, group_src=0, group=group)
            if tensor_parallel_group is not None and tensor_parallel_group.size() > 1 and local is tensor:
                dist.broadcast(local, group_src=0, group=tensor_parallel_group)


class _AllGatherStack(torch.autograd.Function):
    """All-gather onto a new leading rank dim; backward returns each rank the sum of every rank's gradient slice."""

    @staticmethod
    def forward(ctx, input_, group):  # type: ignore[override]
        ctx.group = group
        input_ = input_.contiguous()
        parts = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
        _sent((len(parts) - 1) * input_.numel() * input_.element_size())
        dist.all_gather(parts, input_, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        """Each rank's slice of every rank's gradient, summed: differentiable again under ``create_graph``."""
        slices = [1] * grad_output.shape[0]
        return all_to_all_v(grad_output, slices, slices, ctx.group).sum(0), None


def all_gather_stack(input_: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather: ``out[i]`` is group rank ``i``'s tensor; gradients go back to owners, summed."""
    return _AllGatherStack.apply(input_, group)


class Transfer:
    """Pending asynchronous collectives or point-to-point operations; ``wait`` returns the tensor they fill.

    Until then it keeps the tensors being sent alive; after ``wait`` it holds nothing, so dropping the returned
    tensor frees it.
    """

    def __init__(self, works: list, sent: Sequence[torch.Tensor], received: torch.Tensor) -> None:
        self._works = works
        self._sent = list(sent)
        self._received: torch.Tensor | None = received

    def wait(self) -> torch.Tensor:
        """Block until every operation finished and return the received (or reduced) tensor."""
        for work in self._works:
            work.wait()
        received, self._works, self._sent, self._received = self._received, [], [], None
        if received is None:
            raise RuntimeError("Transfer.wait() called twice")
        return received


def ring_shift(
    tensor: torch.Tensor, group: ProcessGroup, tag: int = 0, received: torch.Tensor | None = None
) -> Transfer:
    """Start sending ``tensor`` to group rank ``rank + 1`` and receiving the same shape from ``rank - 1`` (cyclic),
    into ``received`` when given (a contiguous buffer of that shape), else into a new tensor."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    sent = tensor.contiguous()
    received = torch.empty_like(sent) if received is None else received
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    previous_rank = dist.get_global_rank(group, (rank - 1) % size)
    _sent(sent.numel() * sent.element_size())
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, sent, next_rank, group, tag),
            dist.P2POp(dist.irecv, received, previous_rank, group, tag),
        ]
    )
    return Transfer(works, [sent], received)


def broadcast_from(tensor: torch.Tensor, src: int, group: ProcessGroup) -> Transfer:
    """Start broadcasting group rank ``src``'s contiguous ``tensor`` into the same-shaped ``tensor`` of every rank."""
    size = dist.get_world_size(group)
    if dist.get_rank(group) == src:
        _sent((size - 1) * tensor.numel() * tensor.element_size())
    work = dist.broadcast(tensor, group_src=src, group=group, async_op=True)
    return Transfer([work], [tensor], tensor)


def reduce_sum_to(tensor: torch.Tensor, dst: int, group: ProcessGroup) -> Transfer:
    """Start summing every rank's contiguous ``tensor`` into group rank ``dst``'s (the others' become scratch)."""
    if dist.get_rank(group) != dst:
        _sent(tensor.numel() * tensor.element_size())
    work = dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Transfer([work], [tensor], tensor)


def all_to_all_v_into(
    output: torch.Tensor,
    input_: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup,
) -> torch.Tensor:
    """Uneven all-to-all along dim 0 into the caller's contiguous ``output`` (no allocation, not differentiable)."""
    row_bytes = input_.numel() // input_.shape[0] * input_.element_size() if input_.shape[0] else 0
    _sent((sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)]) * row_bytes)
    dist.all_to_all_single(
        output,
        input_.contiguous(),
        output_split_sizes=list(output_split_sizes),
        input_split_sizes=list(input_split_sizes),
        group=group,
    )
    return output
