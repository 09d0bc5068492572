"""``cp_causal_conv1d``: a short causal convolution per document, in zigzag or contiguous blocks, against the
convolution of each document alone on one device (float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp import cp_causal_conv1d
from lightning_cp.core.windows import build_causal_window_plan
from lightning_cp.core.zigzag import RankTokens, ZigzagGeometry, stream_tokens
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.shard_helpers import MIXED_DOCUMENTS, batch_length, step_over_the_world

CHANNELS = 3


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
    ulysses: int = 1,
) -> list[float]:
    """This rank's largest differences to one process: outputs, input gradients, and (summed over the ranks) weight
    and bias gradients, for the batch ``step_over_the_world`` makes of the arguments."""
    total = batch_length(lengths)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, total, CHANNELS, generator=generator, dtype=torch.float64)
    weight = torch.randn(CHANNELS, kernel, generator=generator, dtype=torch.float64)
    bias = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
    loss_weights = torch.randn(rows, total, CHANNELS, generator=generator, dtype=torch.float64)
    whole = x.clone().requires_grad_()
    whole_weight, whole_bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    expected = _per_document_convolution(whole, whole_weight, whole_bias, lengths or (total,))
    (expected * loss_weights).sum().backward()
    with step_over_the_world(boundary, lengths, rows, tensor_parallel, ulysses, drop_last) as slots:
        shard = slots.shard(x)
        shard_weight, shard_bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        output = cp_causal_conv1d(shard, shard_weight, shard_bias)
        (output * loss_weights[:, slots.taken] * slots.mask(output)).sum().backward()
    for grad in (shard_weight.grad, shard_bias.grad):
        dist.all_reduce(grad, group=slots.setting.loss_group)
    return [
        slots.error(output, expected),
        slots.error(shard.grad, whole.grad),
        (shard_weight.grad - whole_weight.grad).abs().max().item(),
        (shard_bias.grad - whole_bias.grad).abs().max().item(),
    ]


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


@pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "rows", "tensor_parallel", "ulysses"),
    [
        (4, "contiguous", MIXED_DOCUMENTS, 1, 2, 1),
        (4, "zigzag", MIXED_DOCUMENTS, 1, 2, 1),
        (6, "zigzag", None, 2, 3, 1),
        (4, "zigzag", MIXED_DOCUMENTS, 1, 1, 2),
        (4, "zigzag", None, 2, 1, 2),
    ],
    ids=["cp2xtp2-contiguous", "cp2xtp2-zigzag", "cp2xtp3-zigzag-dense", "hybrid-ring2xulysses2",
         "hybrid-ring2xulysses2-dense"],
)  # fmt: skip
def test_a_causal_convolution_on_shards_split_further(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, rows: int, tensor_parallel: int, ulysses: int
) -> None:
    """Shards split over TP ranks (sequence parallelism, also dense over an odd TP size) or over the Ulysses ranks of
    ``hybrid``: each holds a contiguous part of its CP rank's zigzag shard, and the tokens before each piece come
    from the ranks holding them, in the loss group's rank order (before, refused on zigzag shards)."""
    for errors in run_on_ranks(_convolution_error, ranks, boundary, lengths, 4, rows, tensor_parallel, ulysses=ulysses):
        assert max(errors) <= 1e-12, errors


def test_a_shard_that_is_not_the_batchs_is_refused() -> None:
    """On every rank (zigzag: documents padded to multiples of 4, 40 slots per rank, given 39; contiguous: 62 tokens,
    31 per rank, given 30; before, a contiguous shard that was too long or the whole batch gave wrong values)."""
    assert_same_error_on_every_rank(
        _convolution_error, 2, "zigzag", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 39 tokens in a zigzag block, where this batch puts 40 tokens on each rank",
    )  # fmt: skip
    assert_same_error_on_every_rank(
        _convolution_error, 2, "contiguous", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 30 tokens in a contiguous block, where this batch puts 31 tokens on each rank",
    )  # fmt: skip


def test_without_a_step_each_row_is_one_document() -> None:
    """Outside a step it is ``nn.Conv1d`` with causal padding on each row."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, CHANNELS, generator=generator, dtype=torch.float64)
    weight = torch.randn(CHANNELS, 4, generator=generator, dtype=torch.float64)
    bias = torch.randn(CHANNELS, generator=generator, dtype=torch.float64)
    expected = _per_document_convolution(x, weight, bias, (9,))
    torch.testing.assert_close(cp_causal_conv1d(x, weight, bias), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="expected x \\[B, S, D\\] and a weight \\[D, K >= 1\\]"):
        cp_causal_conv1d(x, weight.unsqueeze(1))
    with pytest.raises(ValueError, match="expected x \\[B, S, D\\] and a weight \\[D, K >= 1\\]"):
        cp_causal_conv1d(x, weight[:, :0])
    with pytest.raises(ValueError, match="bias \\(1,\\); expected \\[D\\] = \\(3,\\)"):
        cp_causal_conv1d(x, weight, bias[:1])


def test_the_window_plan_moves_only_what_a_piece_needs() -> None:
    """cp 2, one document of 8 tokens in zigzag pieces of 2 (rank 0: 0 1 | 6 7, rank 1: 2 3 | 4 5, one piece) and a
    kernel of 2: rank 0 needs token 5 from rank 1, rank 1 needs token 1 from rank 0; one row each way, the rest is
    local. Rows index cat([4 local rows, 1 received, the zero row])."""
    tokens = ZigzagGeometry.packed(2, (8,)).gathered_tokens("zigzag")
    first, second = (build_causal_window_plan(tokens, 2, rank, 1) for rank in (0, 1))
    assert first.send_counts == (0, 1) and first.receive_counts == (0, 1) and first.exchanged_rows == 2
    assert first.send_slots.tolist() == [1] and second.send_slots.tolist() == [3]  # token 1; token 5
    zero, received = 5, 4
    assert first.window_rows.tolist() == [zero, 0, 1, received, 2, 3]  # nothing before 0 1; token 5 before 6 7
    assert first.output_positions.tolist() == [0, 1, 3, 4]
    assert second.window_rows.tolist() == [received, 0, 1, 2, 3]  # token 1 before 2 3 4 5
    assert second.output_positions.tolist() == [0, 1, 2, 3]


def _simulated_ranks(tokens: RankTokens, ranks: int, kernel: int, values: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's convolution output (channel 0) from its plan, the exchange replayed in one process: rank ``r``
    receives, from each rank in order, that rank's ``send_slots`` meant for ``r``."""
    local = tokens.doc.numel() // ranks
    plans = [build_causal_window_plan(tokens, ranks, rank, kernel - 1) for rank in range(ranks)]
    shards = values.view(ranks, local)
    outgoing = [
        dict(enumerate(shard[plan.send_slots].split(plan.send_counts)))
        for shard, plan in zip(shards, plans, strict=True)
    ]
    weight = torch.arange(1.0, kernel + 1, dtype=torch.float64).view(1, 1, kernel)
    outputs = []
    for rank, (shard, plan) in enumerate(zip(shards, plans, strict=True)):
        received = torch.cat([outgoing[peer][rank] for peer in range(ranks)])
        assert received.numel() == sum(plan.receive_counts)
        extended = torch.cat([shard, received, shard.new_zeros(1)])
        windows = extended[plan.window_rows].view(1, 1, -1)
        outputs.append(F.conv1d(windows, weight)[0, 0, plan.output_positions])
    return outputs


def test_simulated_plans_convolve_every_document_alone() -> None:
    """200 random batches (documents of 1 to 40 tokens, dense rows, cp 1 to 5, kernels 2 to 12, zigzag and contiguous
    shards with padding), every rank's plan replayed in one process: each real token's output is its document's
    convolution alone (exact: small integers), and the ranks' sends match what the others expect."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        ranks, kernel = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in ((1, 6), (2, 13)))
        dense = bool(torch.randint(0, 5, (1,), generator=generator) == 0)
        count = int(torch.randint(1, 8, (1,), generator=generator))
        lengths = [int(n) for n in torch.randint(1, 41, (1 if dense else count,), generator=generator)]
        if bool(torch.randint(0, 2, (1,), generator=generator)):
            tokens = ZigzagGeometry.packed(ranks, lengths).gathered_tokens("zigzag")
        else:
            tokens = stream_tokens(lengths, -(-sum(lengths) // ranks) * ranks)
        real = tokens.doc >= 0
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        values = torch.where(real, (offsets[tokens.doc.clamp(min=0)] + tokens.pos + 1).double(), 99.0)
        whole = torch.arange(1.0, sum(lengths) + 1, dtype=torch.float64)
        weight = torch.arange(1.0, kernel + 1, dtype=torch.float64).view(1, 1, kernel)
        alone = torch.cat([
            F.conv1d(document.view(1, 1, -1), weight, padding=kernel - 1)[0, 0, : document.numel()]
            for document in whole.split(lengths)
        ])  # fmt: skip
        got = torch.cat(_simulated_ranks(tokens, ranks, kernel, values))
        expected = alone[(offsets[tokens.doc.clamp(min=0)] + tokens.pos)[real]]
        assert torch.equal(got[real], expected), (ranks, kernel, lengths)
