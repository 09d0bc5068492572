"""The ``DeviceMesh`` (data x context x tensor parallel, tensor fastest) and the process groups cut from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_cp.core import comm

DATA_CONTEXT_PARALLEL = "data_context_parallel"
"""The flattened data x context dimension of the mesh: what FSDP shards over and gradients are averaged over."""
TENSOR_PARALLEL = "tensor_parallel"
"""The tensor-parallel dimension of the mesh (``self.device_mesh[TENSOR_PARALLEL]`` in ``configure_model``)."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three mesh dimensions (their product is the world size) and the Ulysses part of CP (hybrid)."""

    data_parallel: int
    context_parallel: int
    tensor_parallel: int
    ulysses: int = 1

    @property
    def world_size(self) -> int:
        """Return the number of ranks the mesh spans."""
        return self.data_parallel * self.context_parallel * self.tensor_parallel


def resolve_parallel_dims(
    world_size: int,
    context_parallel_size: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int | Literal["auto"] = "auto",
    sequence_parallel: bool = False,
    ulysses_size: int = 1,
) -> ParallelDims:
    """Check the sizes against the world size and resolve ``"auto"``; raise ``ValueError`` naming the numbers."""
    validate_parallel_sizes(context_parallel_size, tensor_parallel_size, data_parallel_size, sequence_parallel)
    model_parallel = context_parallel_size * tensor_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by context_parallel_size x tensor_parallel_size = "
            f"{context_parallel_size} x {tensor_parallel_size} = {model_parallel}"
        )
    replicas = world_size // model_parallel
    if data_parallel_size != "auto" and data_parallel_size != replicas:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} does not fit world size {world_size}: it must be world size / "
            f"(context_parallel_size x tensor_parallel_size) = {world_size} / {model_parallel} = {replicas}"
        )
    check_ulysses_size(context_parallel_size, ulysses_size)
    return ParallelDims(replicas, context_parallel_size, tensor_parallel_size, ulysses_size)


def default_context_parallel_size(
    context_parallel_size: int | None, devices_per_node: int, tensor_parallel_size: int
) -> int:
    """``context_parallel_size``, or when it is None all of a node's devices divided by the tensor-parallel size."""
    return context_parallel_size or max(1, devices_per_node // tensor_parallel_size)


def check_ulysses_size(context_parallel_size: int, ulysses_size: int) -> None:
    """Check that a Ulysses part (above 1: hybrid attention) divides cp and leaves a ring of at least two."""
    if ulysses_size > 1 and (context_parallel_size % ulysses_size or ulysses_size == context_parallel_size):
        raise ValueError(
            f"ulysses_size={ulysses_size} must divide context_parallel_size={context_parallel_size} and be smaller "
            f"(hybrid needs ulysses_size x ring = cp with ring >= 2; use attention_mode='ulysses' for ulysses = cp)"
        )


def validate_parallel_sizes(
    context_parallel_size: int | None,
    tensor_parallel_size: int,
    data_parallel_size: int | Literal["auto"],
    sequence_parallel: bool,
) -> None:
    """Check what needs no world size: every size at least 1, sequence parallelism only with tp > 1."""
    sizes = {
        "context_parallel_size": context_parallel_size,
        "tensor_parallel_size": tensor_parallel_size,
        "data_parallel_size": data_parallel_size,
    }
    for name, size in sizes.items():
        if size is None or (name == "data_parallel_size" and size == "auto"):
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            allowed = "an integer >= 1 or 'auto'" if name == "data_parallel_size" else "an integer >= 1"
            raise ValueError(f"{name}={size!r} is invalid: expected {allowed}")
    if sequence_parallel and tensor_parallel_size == 1:
        raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1, got tensor_parallel_size=1")


@dataclass(frozen=True)
class ContextParallelMesh:
    """The one carrier of a run's parallel layout: sizes, this rank's coordinates and the process groups.

    Built once per run by ``build_context_parallel_mesh`` (or ``single_process()`` without CP: sizes 1, no groups);
    everything else that needs a group or a size takes this object.
    """

    dims: ParallelDims
    device_mesh: DeviceMesh | None = None
    cp_group: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    tp_cp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None
    ring_group: ProcessGroup | None = None
    cp_rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0

    @staticmethod
    def single_process() -> ContextParallelMesh:
        """Return the mesh of a run without context or tensor parallelism (no process group needed)."""
        return ContextParallelMesh(ParallelDims(1, 1, 1))

    @property
    def cp_size(self) -> int:
        """Return the number of ranks sharing one sequence."""
        return self.dims.context_parallel

    @property
    def tp_size(self) -> int:
        """Return the number of tensor-parallel ranks."""
        return self.dims.tensor_parallel

    @property
    def data_context_mesh(self) -> DeviceMesh:
        """Return the 1-D mesh of the flattened data x context ranks (FSDP shards over it, not over a 2-D mesh)."""
        if self.device_mesh is None:
            raise RuntimeError("a single-process mesh has no device mesh")
        return self.device_mesh[DATA_CONTEXT_PARALLEL]


def build_context_parallel_mesh(device_type: str, dims: ParallelDims) -> ContextParallelMesh:
    """Build the mesh over the default group (global rank = (dp * cp + cp_rank) * tp + tp_rank) and its groups.

    With ``dims.ulysses > 1`` the context dimension is built from two, ``context_parallel_ring`` (outer) and
    ``context_parallel_ulysses`` (inner, so its ranks are neighbours, inside a node), flattened into
    ``context_parallel``: CP rank = ring rank x ulysses + ulysses rank.
    """
    ring = dims.context_parallel // dims.ulysses
    cp_dims = ("context_parallel",) if dims.ulysses == 1 else ("context_parallel_ring", "context_parallel_ulysses")
    cp_shape = (dims.context_parallel,) if dims.ulysses == 1 else (ring, dims.ulysses)
    names = ("data_parallel", *cp_dims, TENSOR_PARALLEL)
    device_mesh = comm.init_device_mesh(device_type, (dims.data_parallel, *cp_shape, dims.tensor_parallel), names)
    cp_group = comm.flattened_mesh_group(device_mesh, cp_dims, "context_parallel")
    return ContextParallelMesh(
        dims=dims,
        device_mesh=device_mesh,
        cp_group=cp_group,
        tp_group=comm.flattened_mesh_group(device_mesh, (TENSOR_PARALLEL,)),
        tp_cp_group=comm.flattened_mesh_group(device_mesh, (*cp_dims, TENSOR_PARALLEL)),
        dp_group=comm.flattened_mesh_group(device_mesh, ("data_parallel",)),
        dp_cp_group=comm.flattened_mesh_group(device_mesh, ("data_parallel", *cp_dims), DATA_CONTEXT_PARALLEL),
        ulysses_group=None if dims.ulysses == 1 else device_mesh.get_group("context_parallel_ulysses"),
        ring_group=None if dims.ulysses == 1 else device_mesh.get_group("context_parallel_ring"),
        cp_rank=cp_group.rank(),
        tp_rank=device_mesh.get_local_rank("tensor_parallel"),
        dp_rank=device_mesh.get_local_rank("data_parallel"),
    )
