"""A cheap agreement check before collectives: ranks compare a fingerprint of what they are about to exchange.

Inputs that differ between ranks (shapes, dtypes, document offsets, modes) would otherwise crash one rank inside a
collective, hang its peers, or return uninitialised memory. One all-reduce of a few integers turns that into the same
``ValueError`` on every rank, naming what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_cp.core import comm


def _code(value: Any) -> int:
    """The same integer on every process for the same value: a host tensor by its content, else by its text."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + str(value.dtype).encode()
    else:
        data = repr(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def tensor_description(tensor: Any) -> str:
    """Shape, dtype and whether it needs gradients, or the type of what is not a tensor."""
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    return f"{tuple(tensor.shape)} {tensor.dtype} grad={tensor.requires_grad}"


def values_checksum(*tensors: Any) -> int:
    """One integer of the tensors' values, weighted by position, so that ranks given tensors of the same shapes but
    other values (token ids, labels) disagree; one device reduction and one host read per tensor."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            values = tensor.reshape(-1).long()
            weights = torch.arange(values.numel(), device=values.device).remainder_(65521).add_(1)
            total = total * 1_000_003 + int(((values + 101) * weights).sum())
    return total


def require_agreement(what: str, fields: Mapping[str, Any], group: ProcessGroup | None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` when ``fields`` differ between them."""
    names = list(fields)
    differing = comm.differing_fields([_code(fields[name]) for name in names], group)
    if differing:
        listed = ", ".join(names[index] for index in differing)
        raise ValueError(
            f"{what}: the ranks of the group were given different {listed}; every rank of a context-parallel "
            "group must get the same batch metadata and call attention with matching tensors"
        )
