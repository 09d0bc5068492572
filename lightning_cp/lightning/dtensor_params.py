"""Tensor-parallel DTensor parameters under DDP: local shards for the reducer, full tensors for checkpoints."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, distribute_tensor


class LocalizedTensorParallelParameters:
    """DTensor parameters swapped for their local shards, so DDP can reduce them; DTensors again inside each forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._entries: list[tuple[torch.nn.Module, str, torch.nn.Parameter, Any]] = []
        for name, parameter in list(module.named_parameters()):
            if not isinstance(parameter, DTensor):
                continue
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            local = torch.nn.Parameter(parameter.to_local().detach(), requires_grad=parameter.requires_grad)
            local._st_info = parameter._spec  # type: ignore[attr-defined]
            if local.requires_grad:
                local.register_hook(_wait_for_gradient)
            owner._parameters[attribute] = local
            self._entries.append((owner, attribute, local, parameter._spec))
        self._handles = [
            module.register_forward_pre_hook(self._use_dtensors),
            module.register_forward_hook(self._use_local_shards),
        ]

    def __bool__(self) -> bool:
        """Return whether the module had any tensor-parallel parameters."""
        return bool(self._entries)

    def _use_dtensors(self, *_: Any) -> None:
        for owner, attribute, local, spec in self._entries:
            owner._parameters[attribute] = _dtensor_from_local(local, spec)

    def _use_local_shards(self, *_: Any) -> None:
        for owner, attribute, local, _spec in self._entries:
            owner._parameters[attribute] = local

    def restore(self) -> None:
        """Remove the hooks and make the parameters DTensors again (sharing the local shards' storage)."""
        for handle in self._handles:
            handle.remove()
        for owner, attribute, local, spec in self._entries:
            dtensor = _dtensor_from_local(local.detach(), spec)
            owner._parameters[attribute] = torch.nn.Parameter(dtensor, requires_grad=local.requires_grad)


def _wait_for_gradient(gradient: torch.Tensor) -> torch.Tensor:
    """Resolve a gradient still in flight from a functional collective before DDP reduces it."""
    return gradient.wait() if isinstance(gradient, AsyncCollectiveTensor) else gradient


def _dtensor_from_local(local: torch.Tensor, spec: Any) -> DTensor:
    """Wrap a local shard as the DTensor ``spec`` describes, without communication."""
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def _as_dtensor(parameter: torch.Tensor) -> DTensor | None:
    """Return a tensor-parallel parameter as a DTensor (also when localized for DDP), else ``None``."""
    if isinstance(parameter, DTensor):
        return parameter
    spec = getattr(parameter, "_st_info", None)
    return None if spec is None else _dtensor_from_local(parameter.detach(), spec)


def full_module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return ``module.state_dict()`` with tensor-parallel parameters gathered to full tensors (collective over TP)."""
    state = module.state_dict()
    for name, parameter in module.named_parameters():
        sharded = _as_dtensor(parameter)
        if sharded is not None:
            state[name] = sharded.full_tensor().detach()
    return state


def load_full_module_state(module: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors into ``module``, cutting each tensor-parallel parameter's shard (collective over TP)."""
    local_state = dict(state)
    for name, parameter in module.named_parameters():
        sharded = _as_dtensor(parameter)
        if sharded is None or name not in local_state:
            continue
        full = local_state[name].to(device=sharded.device, dtype=sharded.dtype)
        distributed = distribute_tensor(full, sharded.device_mesh, sharded.placements)
        local_state[name] = distributed if isinstance(parameter, DTensor) else distributed.to_local()
    module.load_state_dict(local_state, strict=strict)
