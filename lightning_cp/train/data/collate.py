"""Collators that build the replica batches of the batch contract (``docs/ARCHITECTURE.md``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_cp.train.data.packing import Pack


def collate_packed(packs: Sequence[Pack]) -> dict[str, torch.Tensor]:
    """Concatenate packs into one packed row: ``input_ids`` and ``labels`` ``[1, T]``, int32 ``cu_seqlens``."""
    offsets = [torch.zeros(1, dtype=torch.int32)]
    total = 0
    for pack in packs:
        offsets.append(pack.cu_seqlens[1:] + total)
        total += pack.num_tokens
    return {
        "input_ids": torch.cat([pack.input_ids for pack in packs]).unsqueeze(0),
        "labels": torch.cat([pack.labels for pack in packs]).unsqueeze(0),
        "cu_seqlens": torch.cat(offsets).to(torch.int32),
    }


def collate_dense(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length ``(ids, labels)`` rows into a dense ``[B, S]`` batch."""
    return {"input_ids": torch.stack([ids for ids, _ in rows]), "labels": torch.stack([labels for _, labels in rows])}
