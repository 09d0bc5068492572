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


_HOST_OFFSETS: dict[int, tuple[weakref.ref[torch.Tensor], int, list[int]]] = {}
_HOST_OFFSETS_LIMIT = 64


def host_offsets(offsets: torch.Tensor) -> list[int]:
    """Return ``offsets.tolist()``, read once per tensor rather than once per attention layer.

    The list is reused while the same tensor object is unchanged (same in-place version counter), so per-batch
    metadata on an accelerator, read by every layer, costs one host synchronisation per batch instead of one per layer.
    """
    entry = _HOST_OFFSETS.get(id(offsets))
    if entry is not None and entry[0]() is offsets and entry[1] == offsets._version:
        return entry[2]
    if len(_HOST_OFFSETS) >= _HOST_OFFSETS_LIMIT:
        _HOST_OFFSETS.clear()
    values = offsets.tolist()
    _HOST_OFFSETS[id(offsets)] = (weakref.ref(offsets), offsets._version, values)
    return values
