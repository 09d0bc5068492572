"""``cp_causal_conv1d``: a short causal convolution per document, in zigzag or contiguous blocks, against the
convolution of each document alone on one device (float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp import ContextParallelRuntime, ContextParallelSetting, cp_causal_conv1d
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.core.shift import build_token_shift_plan
from lightning_cp.core.zigzag import ZigzagGeometry
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks

CHANNELS = 3
MIXED_DOCUMENTS = (1, 13, 2, 7, 30, 3, 1, 5)


def _per_document_convolution(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lengths: tuple[int, ...]
) -> torch.Tensor:
    """``nn.Conv1d``'s depthwise causal convolution of each document of every row of ``x`` ``[B, T, D]`` alone."""
    pieces = []
    for document in x.split(list(lengths), dim=1):
        full = F.conv1d(
            document.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=CHANNELS
        )
        pieces.append(full[..., : document.shape[1]].transpose(1, 2))
    return torch.cat(pieces, dim=1)


def _convolution_error(
    boundary: str,
    lengths: tuple[int, ...] | None,
    kernel: int,
    rows: int = 1,
    tensor_parallel: int = 1,
    drop_last: bool = False,
) -> list[float]:
    """This rank's largest differences to one process: outputs, input gradients, and (summed over the ranks) weight
    and bias gradients, for packed documents of ``lengths`` (None: ``rows`` dense rows of 22 tokens) in the
    ``boundary`` layout; ``drop_last``: the shard given without its last token."""
    world = dist.get_world_size()
    dims = ParallelDims(1, world // tensor_parallel, tensor_parallel)
    mesh = build_context_parallel_mesh("cpu", dims)
    setting = ContextParallelSetting(mesh, boundary_layout=boundary, sequence_parallel=tensor_parallel > 1)
    runtime = ContextParallelRuntime(setting)
    total = 22 if lengths is None else sum(lengths)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, total, CHANNELS, generator=generator, dtype=torch.float64)
    weight = torch.randn(CHANNELS, kernel, generator=generator, dtype=torch.float64)
    bias = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
    loss_weights = torch.randn(rows, total, CHANNELS, generator=generator, dtype=torch.float64)
    whole = x.clone().requires_grad_()
    whole_weight, whole_bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    expected = _per_document_convolution(whole, whole_weight, whole_bias, lengths or (total,))
    (expected * loss_weights).sum().backward()
    batch: dict[str, torch.Tensor] = {"input_ids": torch.arange(1, total + 1).repeat(rows, 1)}
    if lengths is not None:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with runtime.step(batch):
        positions = batch["input_ids"][0] - 1  # -1: a padding slot
        real = (positions >= 0).view(1, -1, 1)
        taken = positions.clamp(min=0)
        shard = torch.where(real, x[:, taken], 0)[:, : -1 if drop_last else None].requires_grad_()
        shard_weight, shard_bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        output = cp_causal_conv1d(shard, shard_weight, shard_bias)
        (output * loss_weights[:, taken] * real).sum().backward()
    for grad in (shard_weight.grad, shard_bias.grad):
        dist.all_reduce(grad, group=setting.loss_group)
    pairs = [
        (output * real, expected[:, taken] * real),
        (shard.grad * real, whole.grad[:, taken] * real),
        (shard_weight.grad, whole_weight.grad),
        (shard_bias.grad, whole_bias.grad),
    ]
    return [(actual - reference).abs().max().item() for actual, reference in pairs]


@pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "kernel"),
    [
        (3, "zigzag", MIXED_DOCUMENTS, 4),
        (3, "contiguous", MIXED_DOCUMENTS, 4),
        (2, "zigzag", MIXED_DOCUMENTS, 9),
        (3, "contiguous", MIXED_DOCUMENTS, 9),
        (2, "zigzag", None, 3),
        (1, "zigzag", MIXED_DOCUMENTS, 4),
    ],
    ids=["cp3-zigzag", "cp3-contiguous", "cp2-zigzag-longer-than-pieces", "cp3-contiguous-longer-than-shards",
         "cp2-dense", "cp1-packed"],
)  # fmt: skip
def test_a_causal_convolution_matches_each_document_alone(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, kernel: int
) -> None:
    """Documents of 1 to 30 tokens cut into zigzag pieces or contiguous shards (pieces shorter than the kernel
    reach back over several ranks), two dense rows, and packed documents on one rank: outputs and the gradients of
    inputs, weight and bias equal each document's convolution alone (float64, 1e-12)."""
    rows = 2 if lengths is None else 1
    for errors in run_on_ranks(_convolution_error, ranks, boundary, lengths, kernel, rows):
        assert max(errors) <= 1e-12, errors


def test_a_causal_convolution_under_sequence_parallelism_and_its_refusals() -> None:
    """Contiguous shards over TP x CP ranks (cp 2 x tp 2) read the tokens before them from the previous TP x CP rank;
    in a zigzag block the shards are split further, which the convolution refuses on every rank, as it refuses a
    shard that is not this batch's (documents padded to multiples of 4: 40 slots per rank, given 39)."""
    for errors in run_on_ranks(_convolution_error, 4, "contiguous", MIXED_DOCUMENTS, 4, 1, 2):
        assert max(errors) <= 1e-12, errors
    assert_same_error_on_every_rank(
        _convolution_error, 4, "zigzag", MIXED_DOCUMENTS, 4, 1, 2, match="name the block in contiguous_layers"
    )
    assert_same_error_on_every_rank(
        _convolution_error, 2, "zigzag", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 39 tokens in a zigzag block does not fit this batch's sharding",
    )  # fmt: skip


def test_without_a_step_each_row_is_one_document() -> None:
    """Outside a step it is ``nn.Conv1d`` with causal padding on each row."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, CHANNELS, generator=generator, dtype=torch.float64)
    weight = torch.randn(CHANNELS, 4, generator=generator, dtype=torch.float64)
    bias = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
    expected = _per_document_convolution(x, weight, bias, (9,))
    torch.testing.assert_close(cp_causal_conv1d(x, weight, bias), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="expected x \\[B, S, D\\] and a weight \\[D, K\\]"):
        cp_causal_conv1d(x, weight.unsqueeze(1))


def test_the_shift_plan_moves_only_what_a_piece_needs() -> None:
    """cp 2, one document of 8 tokens in zigzag pieces of 2 (rank 0: 0 1 | 6 7, rank 1: 2 3 | 4 5) and a kernel of 2:
    rank 0 needs token 5 from rank 1, rank 1 needs token 1 from rank 0; one row each way, and the rest is local."""
    tokens = ZigzagGeometry.packed(2, (8,)).gathered_tokens("zigzag")
    first, second = (build_token_shift_plan(tokens, 2, rank, 1) for rank in (0, 1))
    assert first.send_counts == (0, 1) and first.receive_counts == (0, 1) and first.exchanged_rows == 2
    assert first.send_slots.tolist() == [1] and second.send_slots.tolist() == [3]  # token 1; token 5
    zero, received = 5, 4  # rows of cat([4 local rows, 1 received, the zero row])
    assert first.sources.tolist() == [[zero, 0, received, 2]]  # before 0: none; before 6: token 5; before 7: 6
    assert second.sources.tolist() == [[received, 0, 1, 2]]  # before 2: token 1, then 2, 3, 4
