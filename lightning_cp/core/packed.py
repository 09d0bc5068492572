"""Metadata of a packed (THD) batch, with Megatron's field names so Megatron-style code ports unchanged."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class PackedSeqParams:
    """Describe the sequences packed along one flat token dimension.

    ``cu_seqlens_*`` are cumulative int32 offsets of the actual sequence lengths;
    ``cu_seqlens_*_padded`` are the physical offsets when sequences carry padding.
    """

    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    pad_between_seqs: bool = False


_HOST_COPIES: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor, list[int] | None]] = {}
_HOST_COPIES_LIMIT = 64


def _cached(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int] | None] | None:
    """Return the remembered host copy (and list) of ``tensor`` while it is the same, unmodified tensor object."""
    entry = _HOST_COPIES.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry[2], entry[3]
    return None


def remember_host_copy(tensor: torch.Tensor, host: torch.Tensor, values: list[int] | None = None) -> None:
    """Remember ``tensor``'s host copy (and its values as a list); a full cache first forgets dead tensors, then all."""
    if len(_HOST_COPIES) >= _HOST_COPIES_LIMIT:
        for key in [key for key, entry in _HOST_COPIES.items() if entry[0]() is None]:
            del _HOST_COPIES[key]
        if len(_HOST_COPIES) >= _HOST_COPIES_LIMIT:
            _HOST_COPIES.clear()
    _HOST_COPIES[id(tensor)] = (weakref.ref(tensor), tensor._version, host, values)


def host_copies(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Return host copies of per-batch metadata tensors, each copied once and all missing ones in one transfer.

    A copy is reused while the same tensor object is unchanged (same in-place version counter), so offsets on an
    accelerator, read by the layout plan, the attention and the metrics of a batch, cost one host synchronisation per
    batch. Host tensors are returned as they are.
    """
    copies: dict[int, torch.Tensor] = {}
    missing = []
    for tensor in tensors:
        if tensor is None or tensor.device.type == "cpu":
            continue
        cached = _cached(tensor)
        if cached is None:
            missing.append(tensor)
        else:
            copies[id(tensor)] = cached[0]
    if missing:
        host = torch.cat([t.reshape(-1) for t in missing]).cpu().split([t.numel() for t in missing])
        for tensor, copy in zip(missing, host, strict=True):  # one transfer; each copy back in its own dtype
            copies[id(tensor)] = copy.view(tensor.shape).to(tensor.dtype)
            remember_host_copy(tensor, copies[id(tensor)])
    return [t if t is None or t.device.type == "cpu" else copies[id(t)] for t in tensors]


def host_offsets(offsets: torch.Tensor) -> list[int]:
    """Return ``offsets.tolist()``, read once per tensor rather than once per attention layer (see ``host_copies``)."""
    cached = _cached(offsets)
    if cached is not None and cached[1] is not None:
        return cached[1]
    host = host_copies(offsets)[0]
    values = host.tolist()
    remember_host_copy(offsets, host, values)
    return values


def to_device_with_host_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move host metadata to ``device`` and remember the host copy, so reading it back later costs no transfer."""
    moved = host.to(device)
    if moved is not host:
        remember_host_copy(moved, host)
    return moved
