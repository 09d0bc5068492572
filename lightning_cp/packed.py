"""Metadata of a packed (THD) batch, with Megatron's field names so Megatron-style code ports unchanged."""

from __future__ import annotations

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
