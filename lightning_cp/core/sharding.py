"""Pure batch preparation: per-document label shift, global position ids, padding and contiguous shard slicing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_cp.core.packed import host_copies, to_device_with_host_copy
from lightning_cp.core.zigzag import check_offsets, contiguous_padding_multiple, contiguous_shard, padded_length

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's contiguous shard of one replica batch and the global metadata of that batch.

    ``cu_seqlens`` are the actual global document offsets; ``cu_seqlens_padded`` the physical ones, equal except that
    the last document also owns the trailing padding. Both are ``None`` for dense batches.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_token_count: int
    real_token_count: int
    sequence_length: int
    padded_sequence_length: int
    padding_token_count: int
    max_sequence_length: int
    cu_seqlens: torch.Tensor | None
    cu_seqlens_padded: torch.Tensor | None

    @property
    def is_packed(self) -> bool:
        """Return whether the batch is packed (one row of many documents)."""
        return self.cu_seqlens is not None


def shift_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``labels`` moved one token left within each document (``[B, S]``), ``IGNORE_INDEX`` at document ends."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        document_ends = cu_seqlens[1:].long() - 1
        shifted[:, document_ends[document_ends >= 0]] = IGNORE_INDEX
    return shifted


def document_position_ids(cu_seqlens: torch.Tensor, token_count: int) -> torch.Tensor:
    """Return each token's position inside its document for a packed row of ``token_count`` tokens (0 past the end)."""
    offsets = cu_seqlens.long()
    positions = torch.arange(token_count, dtype=torch.long, device=cu_seqlens.device)
    document_index = torch.searchsorted(offsets[1:], positions, right=True).clamp(max=offsets.numel() - 2)
    return (positions - offsets[document_index]).masked_fill(positions >= offsets[-1], 0)


def validate_replica_batch(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """Check a replica batch against the batch contract; return a packed batch's offsets on the host (int32).

    Documents come from ``cu_seqlens`` (or Hugging Face's ``cu_seq_lens_q``), else from ``position_ids`` restarting
    at 0 in a flattened row. Raises ``ValueError`` naming what is wrong. The offsets are read from the device once.
    """
    if "input_ids" not in batch:
        raise ValueError(f"a batch needs 'input_ids'; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [B, S], a tensor of at least one token; got {shape}")
    labels = batch.get("labels")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} differs from input_ids shape {tuple(input_ids.shape)}")
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "attention_mask masks some tokens out (padding); pack the documents into one row (cu_seqlens, or "
            "position_ids restarting per document) instead of padding them"
        )
    cu_seqlens = batch.get("cu_seqlens", batch.get("cu_seq_lens_q"))
    if cu_seqlens is None:
        return _documents_from_position_ids(batch.get("position_ids"), input_ids)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of n + 1 offsets; got a {type(cu_seqlens).__name__}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"a packed batch has batch size 1; got input_ids shape {tuple(input_ids.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of n + 1 offsets; got {cu_seqlens}")
    host = host_copies(cu_seqlens)[0].to(torch.int32)
    check_offsets("cu_seqlens", host)
    token_count = input_ids.shape[1]
    if int(host[-1]) != token_count:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {token_count}; got {host.tolist()}")
    return host


def _documents_from_position_ids(position_ids: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Offsets of the documents that ``position_ids`` restarting at 0 mark (Hugging Face's flattening collator).

    ``None`` for plain rows (no restart inside a row); an error when rows of a ``[B, S]`` batch hold several
    documents, which no offsets can describe.
    """
    if position_ids is None:
        return None
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
        )
    starts = host_copies(position_ids)[0] == 0
    restarts = starts[:, 1:].any(dim=1)
    if not bool(restarts.any()):
        return None
    if position_ids.shape[0] != 1:
        raise ValueError(
            f"position_ids restart inside rows of a [B, S] = {list(position_ids.shape)} batch, so several documents "
            "share a row: flatten them into one row ([1, T], e.g. DataCollatorWithFlattening) or pass cu_seqlens"
        )
    if not bool(starts[0, 0]):
        raise ValueError("position_ids of a flattened row must start at 0")
    document_starts = torch.nonzero(starts[0]).flatten()
    return torch.cat([document_starts, torch.tensor([position_ids.shape[1]])]).to(torch.int32)


def shard_replica_batch(
    batch: Mapping[str, torch.Tensor],
    cp_size: int = 1,
    cp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
) -> ShardedBatch:
    """Shift labels, compute position ids, pad and slice this rank's contiguous shard of a replica batch.

    Packed rows are padded so the token count divides by ``cp * tp``; dense rows by ``2 * cp * tp`` (whole zigzag
    chunks; without CP by ``tp``: ``contiguous_padding_multiple``). With sequence parallelism the shard is the
    ``cp_rank * tp + tp_rank``-th of ``cp * tp`` slices, else the ``cp_rank``-th of ``cp`` (every TP rank holds the
    CP rank's tokens).
    """
    host_offsets = validate_replica_batch(batch)
    input_ids = batch["input_ids"]
    labels = input_ids if batch.get("labels") is None else batch["labels"]
    batch_size, sequence_length = input_ids.shape
    multiple = contiguous_padding_multiple(cp_size, tp_size, packed=host_offsets is not None)
    padded_sequence_length = padded_length(sequence_length, multiple)
    padding = padded_sequence_length - sequence_length
    cu_seqlens = cu_seqlens_padded = None
    max_sequence_length = sequence_length
    if host_offsets is not None:
        host_padded = host_offsets.clone()
        host_padded[-1] = padded_sequence_length
        cu_seqlens = to_device_with_host_copy(host_offsets, input_ids.device)
        cu_seqlens_padded = to_device_with_host_copy(host_padded, input_ids.device)
        max_sequence_length = int((host_offsets[1:] - host_offsets[:-1]).max())
        position_ids = document_position_ids(cu_seqlens, padded_sequence_length).unsqueeze(0)
    else:
        position_ids = torch.arange(padded_sequence_length, device=input_ids.device).expand(batch_size, -1)
        position_ids = position_ids.masked_fill(position_ids >= sequence_length, 0)
    shifted_labels = shift_labels(labels, cu_seqlens)
    padded_input_ids = torch.nn.functional.pad(input_ids, (0, padding), value=0)
    padded_labels = torch.nn.functional.pad(shifted_labels, (0, padding), value=IGNORE_INDEX)
    shard_count, shard_index = contiguous_shard(cp_size, cp_rank, tp_size, tp_rank, sequence_parallel)
    shard_length = padded_sequence_length // shard_count
    shard = slice(shard_index * shard_length, (shard_index + 1) * shard_length)
    return ShardedBatch(  # copies of the shard, so the replica-wide tensors are freed once the batch is sharded
        input_ids=padded_input_ids[:, shard].clone(),
        labels=padded_labels[:, shard].clone(),
        position_ids=position_ids[:, shard].clone(),
        loss_token_count=int((shifted_labels != IGNORE_INDEX).sum()),
        real_token_count=batch_size * sequence_length,
        sequence_length=sequence_length,
        padded_sequence_length=padded_sequence_length,
        padding_token_count=batch_size * padding,
        max_sequence_length=max_sequence_length,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
    )
