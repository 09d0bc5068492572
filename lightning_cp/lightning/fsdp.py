"""FSDP2 under ``cp_zigzag``: weights sharded over the flattened data x context mesh, per wrapped block and at the root.

FSDP2 reads a 2-D mesh as HSDP and would shard over one axis only, so the module is sharded over the 1-D flattened
data x context dimension; tensor-parallel DTensor parameters (on the mesh's ``tensor_parallel`` dimension) become 2-D.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_cp.core.mesh import DATA_CONTEXT_PARALLEL

DataParallel = Literal["ddp", "fsdp"]
DATA_PARALLEL_MODES: tuple[str, ...] = ("ddp", "fsdp")
MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Return FSDP2's policy for a Trainer precision: ``*-mixed`` computes in the low dtype and reduces in float32;
    the ``*-true`` precisions keep the dtype the module was converted to."""
    dtype = MIXED_PRECISION_DTYPES.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def offload_policy(cpu_offload: bool) -> OffloadPolicy:
    """Return FSDP2's offload policy: parameters, gradients and optimizer state on the CPU when asked."""
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()


def check_wrapping(module: nn.Module, data_parallel: str, data_context_size: int) -> bool:
    """Check how ``configure_model`` left the module and return whether it is already sharded with FSDP2.

    Raise ``ValueError`` (the same on every rank: the module is built alike everywhere) for a module wrapped in DDP
    or FSDP1, FSDP2 under ``data_parallel="ddp"``, FSDP2 over another mesh than the flattened data x context one, or
    FSDP2 on some modules with trainable weights left plain (nothing would reduce their gradients).
    """
    for name, child in module.named_modules():
        if isinstance(child, (DistributedDataParallel, FSDP1)):
            raise ValueError(
                f"module {name or 'root'!r} is already wrapped in {type(child).__name__}: cp_zigzag applies "
                "data parallelism itself (data_parallel='ddp' or 'fsdp')"
            )
    sharded = [name for name, child in module.named_modules() if isinstance(child, FSDPModule)]
    if sharded and data_parallel != "fsdp":
        raise ValueError(
            f"configure_model applied fully_shard (to {sharded[0] or 'the root'!r}) but data_parallel="
            f"{data_parallel!r}: use data_parallel='fsdp'"
        )
    plain = [
        name
        for name, parameter in module.named_parameters()
        if parameter.requires_grad and not isinstance(parameter, DTensor)
    ]
    if sharded and plain:
        listed = ", ".join(repr(name) for name in plain[:3]) + (f" and {len(plain) - 3} more" if len(plain) > 3 else "")
        raise ValueError(
            f"configure_model applied fully_shard to some modules but left {listed} plain: their gradients would not "
            f"be reduced over the data x context ranks; also apply fully_shard(self, mesh=self.device_mesh"
            f"[{DATA_CONTEXT_PARALLEL!r}]) at the root, or leave the sharding to cp_zigzag"
        )
    for name, parameter in module.named_parameters():
        if not sharded or not isinstance(parameter, DTensor):
            continue
        mesh = parameter.device_mesh
        names = mesh.mesh_dim_names or ()
        if DATA_CONTEXT_PARALLEL not in names or mesh.size(names.index(DATA_CONTEXT_PARALLEL)) != data_context_size:
            raise ValueError(
                f"parameter {name!r} is sharded over mesh dimensions {names}: under cp_zigzag shard with "
                f"fully_shard(..., mesh=self.device_mesh[{DATA_CONTEXT_PARALLEL!r}]) (data x context ranks)"
            )
    return bool(sharded)


def shard_module(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload: OffloadPolicy,
) -> None:
    """Apply ``fully_shard`` to every block (one all-gather per block in forward and backward), then at the root."""
    options = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(module, reshard_after_forward=False, **options)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their total norm when they are DTensors on several meshes (FSDP's 1-D mesh for plain
    parameters, the 2-D data x context x tensor mesh for tensor-parallel ones), which one ``clip_grad_norm_`` cannot
    stack. Return the total norm."""
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            mesh = parameter.grad.device_mesh if isinstance(parameter.grad, DTensor) else None
            groups.setdefault(mesh, []).append(parameter)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
