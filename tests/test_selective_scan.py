"""``cp_selective_scan``: Mamba's selective scan per document, on contiguous or zigzag shards, against a step-by-step
scan of each document alone on one device (float64, 1e-12)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from lightning_cp import cp_selective_scan
from lightning_cp.core.scan import selective_scan
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.shard_helpers import MIXED_DOCUMENTS, SCAN_CASES, document_runs, saved_for_backward, selective_scan_errors

CHANNELS, STATE = 6, 4


def _stepwise_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token from ``state``: ``h = exp(dt A) * h + (dt x) B^T``, ``y = h C``."""
    outputs = []
    for t in range(x.shape[1]):
        state = torch.exp(dt[:, t, :, None] * A) * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        outputs.append(torch.einsum("bdn,bn->bd", state, C[:, t]))
    return torch.stack(outputs, dim=1), state


def _per_document_scan(inputs: tuple[torch.Tensor, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """Every document of every row scanned alone from a zero state."""
    x, dt, A, B, C = inputs
    zero = x.new_zeros(x.shape[0], CHANNELS, STATE)
    split = [tensor.split(list(lengths), dim=1) for tensor in (x, dt, B, C)]
    return torch.cat([_stepwise_scan(*parts[:2], A, *parts[2:], zero)[0] for parts in zip(*split, strict=True)], dim=1)


def _random_inputs(rows: int, total: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """x, dt (positive), A (negative), B, C in float64."""

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    dt = torch.rand(rows, total, CHANNELS, generator=generator, dtype=torch.float64) + 0.05
    A = -torch.rand(CHANNELS, STATE, generator=generator, dtype=torch.float64) * 2
    return normal(rows, total, CHANNELS), dt, A, normal(rows, total, STATE), normal(rows, total, STATE)


_scan_error = functools.partial(selective_scan_errors, cp_selective_scan, _per_document_scan, _random_inputs)
"""This rank's errors for a batch made of ``selective_scan_errors``' remaining arguments."""


@SCAN_CASES
def test_the_scan_matches_each_document_alone(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, chunk_size: int, rows: int
) -> None:
    """The batches of ``SCAN_CASES``: outputs and the gradients of every input equal each document scanned alone,
    token by token (float64, 1e-12)."""
    for errors in run_on_ranks(_scan_error, ranks, boundary, lengths, chunk_size, rows):
        assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "rows", "tensor_parallel", "ulysses"),
    [(4, "zigzag", MIXED_DOCUMENTS, 1, 2, 1), (4, "zigzag", MIXED_DOCUMENTS, 1, 1, 2)],
    ids=["cp2xtp2-zigzag", "hybrid-ring2xulysses2"],
)
def test_the_scan_on_shards_split_further(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, rows: int, tensor_parallel: int, ulysses: int
) -> None:
    """Shards split over TP ranks (sequence parallelism) or the Ulysses ranks of ``hybrid``: the state passes through
    the loss group's ranks in order (float64, 1e-12)."""
    for errors in run_on_ranks(_scan_error, ranks, boundary, lengths, 4, rows, tensor_parallel, ulysses):
        assert max(errors) <= 1e-12, errors


def test_step_sizes_keep_their_precision_through_a_conversion() -> None:
    """x, B, C in bf16 and dt in float32 (a Mamba layer under autocast) given zigzag at cp 2: the scan sees dt as
    given and computes in float32 (relative 1e-5 to the same rounded values scanned in float64)."""
    for errors in run_on_ranks(_scan_error, 2, "zigzag", MIXED_DOCUMENTS, 4, mixed=True):
        assert max(errors) <= 1e-5, errors


def test_a_shard_that_is_not_the_batchs_is_refused() -> None:
    """On every rank: a contiguous shard one token short (62 tokens, 31 per rank)."""
    assert_same_error_on_every_rank(
        _scan_error, 2, "contiguous", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 30 tokens in a contiguous block, where this batch puts 31 tokens on each rank",
    )  # fmt: skip


def test_without_a_step_each_row_is_one_document_and_shapes_are_checked() -> None:
    """Outside a step: each row scanned alone (float64, 1e-12); a float32 input computes and returns float32, also
    under a bf16 autocast, bit for bit; bad shapes name what was given and what is expected."""
    generator = torch.Generator().manual_seed(3)
    inputs = _random_inputs(2, 11, generator)
    expected = _per_document_scan(inputs, (11,))
    torch.testing.assert_close(cp_selective_scan(*inputs, chunk_size=4), expected, rtol=0, atol=1e-12)
    single = tuple(tensor.float() for tensor in inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = cp_selective_scan(*single, chunk_size=4)
    assert under_autocast.dtype == torch.float32
    assert torch.equal(under_autocast, cp_selective_scan(*single, chunk_size=4))
    x, dt, A, B, C = inputs
    for bad in ((x, dt[..., :1], A, B, C), (x, dt, A[:1], B, C), (x, dt, A, B, C[..., :1]), (x[0], dt, A, B, C)):
        with pytest.raises(ValueError, match="expected x and dt \\[b, S, channels\\], A \\[channels, state\\]"):
            cp_selective_scan(*bad)
    with pytest.raises(ValueError, match="chunk_size=0"):
        cp_selective_scan(*inputs, chunk_size=0)


def test_the_chunked_scan_restarts_at_document_starts_and_starts_from_the_entering_state() -> None:
    """``selective_scan`` on random starts and chunk sizes (float64): outputs and last state equal the token-by-token
    scan restarted at each start, from a zero state and from the state ``entering_state`` returns; that is given the
    last state from a zero state and the decay that carries a state entering the shard to its end."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        length, chunk_size = (
            int(torch.randint(1, 30, (1,), generator=generator)),
            int(torch.randint(1, 9, (1,), generator=generator)),
        )
        x, dt, A, B, C = _random_inputs(2, length, generator)
        starts = torch.rand(length, generator=generator) < 0.2
        entering = torch.randn(2, CHANNELS, STATE, generator=generator, dtype=torch.float64)
        given: list[torch.Tensor] = []
        for state, hook in ((torch.zeros_like(entering), None), (entering, _entering(entering, given))):
            expected_last, outputs = state, []
            for begin, end in document_runs(starts):
                kept = begin == 0 and not starts[0]  # the entering state reaches the first run if no start ends it
                dropped = expected_last if kept else torch.zeros_like(state)
                part, expected_last = _stepwise_scan(
                    x[:, begin:end], dt[:, begin:end], A, B[:, begin:end], C[:, begin:end], dropped
                )
                outputs.append(part)
            y, last = selective_scan(x, dt, A, B, C, starts, chunk_size, hook)
            torch.testing.assert_close(y, torch.cat(outputs, dim=1), rtol=0, atol=1e-12)
            torch.testing.assert_close(last, expected_last, rtol=0, atol=1e-12)
        torch.testing.assert_close(given[0], expected_last, rtol=0, atol=1e-12)


def test_the_backward_keeps_no_state_per_token() -> None:
    """Between forward and backward the scan keeps only what autograd saves outside its recomputed passes: under two
    ``channels x state`` states' worth per token in all (64 tokens, chunks of 8; 2,904 values, where keeping every
    token's state saved 18,152), none larger than ``x``, and the gradients still flow."""
    x, dt, A, B, C = (tensor.requires_grad_() for tensor in _random_inputs(1, 64, torch.Generator().manual_seed(2)))
    y, saved = saved_for_backward(lambda: cp_selective_scan(x, dt, A, B, C, chunk_size=8))
    assert sum(saved) < 2 * 64 * CHANNELS * STATE and max(saved) <= x.numel(), (sum(saved), max(saved))
    y.sum().backward()
    assert all(tensor.grad is not None for tensor in (x, dt, A, B, C))


def _entering(state: torch.Tensor, given: list[torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An ``entering_state`` that returns ``state``, recording in ``given`` the last state its arguments imply."""

    def entering_state(last: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        given.append(last + decay * state)
        return state

    return entering_state


def test_heavy_decay_keeps_float32_precision() -> None:
    """64 tokens of heavy decay (log decay down to -160 a token, so whole chunks' decays underflow to 0), then 32 of
    light: in float32 the scan stays within 1e-6 of float64 (relative), as decays are products of factors in [0, 1]
    and never quotients."""
    generator = torch.Generator().manual_seed(4)
    x, _, _, B, C = _random_inputs(1, 96, generator)
    dt = torch.full((1, 96, CHANNELS), 1e-3, dtype=torch.float64)
    dt[:, :64] = 20.0
    A = -torch.linspace(0.5, 8.0, CHANNELS * STATE, dtype=torch.float64).view(CHANNELS, STATE)
    starts = torch.zeros(96, dtype=torch.bool)
    expected = selective_scan(x, dt, A, B, C, starts, 4)[0]
    got = selective_scan(*(tensor.float() for tensor in (x, dt, A, B, C)), starts, 4)[0]
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
