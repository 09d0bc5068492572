"""Pure batch preparation: labels shifted per document before sharding, global positions, padding, shard slicing."""

from __future__ import annotations

import pytest
import torch

from lightning_cp.core.sharding import (
    IGNORE_INDEX,
    document_position_ids,
    shard_replica_batch,
    shift_labels,
    validate_replica_batch,
)

X = IGNORE_INDEX


def packed_batch() -> dict[str, torch.Tensor]:
    """Three documents of lengths 3, 1 and 5 (tokens 10..18)."""
    return {"input_ids": torch.arange(10, 19).unsqueeze(0), "cu_seqlens": torch.tensor([0, 3, 4, 9], dtype=torch.int32)}


def test_labels_shift_within_documents_only() -> None:
    """No token predicts across a document edge; the last token of each document has no target."""
    batch = packed_batch()
    shifted = shift_labels(batch["input_ids"], batch["cu_seqlens"])
    assert shifted.tolist() == [[11, 12, X, X, 15, 16, 17, 18, X]]


def test_dense_labels_shift_per_row_and_keep_masked_labels() -> None:
    """Dense rows shift independently; ``-100`` in the given labels stays ignored."""
    labels = torch.tensor([[1, 2, X, 4], [5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, X, 4, X], [6, 7, 8, X]]


def test_position_ids_restart_at_each_document() -> None:
    """Positions count within each document; padding past the end gets 0."""
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert document_position_ids(cu_seqlens, 11).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_packed_shards_concatenate_to_the_padded_batch(cp: int) -> None:
    """Each rank's contiguous shard is its slice of the batch padded to a multiple of cp; no edge leaks a target."""
    batch = packed_batch()
    shards = [shard_replica_batch(batch, cp, rank) for rank in range(cp)]
    padded = -(-9 // cp) * cp
    input_ids = torch.cat([shard.input_ids for shard in shards], dim=1)
    labels = torch.cat([shard.labels for shard in shards], dim=1)
    positions = torch.cat([shard.position_ids for shard in shards], dim=1)
    padding = padded - 9
    assert input_ids.tolist() == [list(range(10, 19)) + [0] * padding]
    assert labels.tolist() == [[11, 12, X, X, 15, 16, 17, 18, X] + [X] * padding]
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4] + [0] * padding]
    for shard in shards:
        assert shard.loss_token_count == 6
        assert (shard.real_token_count, shard.padded_sequence_length, shard.padding_token_count) == (9, padded, padding)
        assert shard.cu_seqlens.tolist() == [0, 3, 4, 9]
        assert shard.cu_seqlens_padded.tolist() == [0, 3, 4, padded]
        assert shard.cu_seqlens.dtype == torch.int32


def test_dense_batches_pad_to_whole_zigzag_chunks() -> None:
    """Dense rows pad to a multiple of 2 x cp x tp (under CP); padding never counts in the loss."""
    batch = {"input_ids": torch.arange(1, 11).view(1, 10)}
    shards = [shard_replica_batch(batch, 2, rank) for rank in range(2)]
    assert [shard.input_ids.tolist() for shard in shards] == [[[1, 2, 3, 4, 5, 6]], [[7, 8, 9, 10, 0, 0]]]
    assert [shard.labels.tolist() for shard in shards] == [[[2, 3, 4, 5, 6, 7]], [[8, 9, 10, X, X, X]]]
    assert [shard.position_ids.tolist() for shard in shards] == [[[0, 1, 2, 3, 4, 5]], [[6, 7, 8, 9, 0, 0]]]
    assert shards[0].loss_token_count == 9
    assert shards[0].cu_seqlens is None


def test_sequence_parallel_shards_over_tp_x_cp_and_tp_ranks_otherwise_share() -> None:
    """With SP the shard is the (cp_rank * tp + tp_rank)-th of cp x tp; without SP every TP rank holds the CP shard."""
    batch = {"input_ids": torch.arange(16).view(1, 16)}
    with_sp = shard_replica_batch(batch, cp_size=2, cp_rank=1, tp_size=2, tp_rank=0, sequence_parallel=True)
    assert with_sp.input_ids.tolist() == [[8, 9, 10, 11]]
    without_sp = [shard_replica_batch(batch, 2, 1, 2, tp_rank) for tp_rank in range(2)]
    assert [shard.input_ids.tolist() for shard in without_sp] == [[list(range(8, 16))]] * 2


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"labels": torch.zeros(1, 3)}, "a batch needs 'input_ids'"),
        ({"input_ids": torch.zeros(3, dtype=torch.long)}, "input_ids must be [B, S]"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 3)}, "labels shape (1, 3)"),
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 4])},
            "a packed batch has batch size 1",
        ),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3])}, "end at the token"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3, 2, 4])}, "non-decr"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([0.0, 4.0])}, "integer"),
    ],
)
def test_bad_batches_are_rejected_with_what_is_wrong(batch: dict[str, torch.Tensor], message: str) -> None:
    """Contract violations raise ``ValueError`` naming the offending value."""
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate_replica_batch(batch)


def test_the_shard_holds_only_its_own_tokens() -> None:
    """The sharded tensors own storage of the shard's size: nothing keeps the replica-wide tensors alive."""
    batch = {"input_ids": torch.arange(64).view(2, 32)}
    sharded = shard_replica_batch(batch, cp_size=4, cp_rank=1)
    for tensor in (sharded.input_ids, sharded.labels, sharded.position_ids):
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
