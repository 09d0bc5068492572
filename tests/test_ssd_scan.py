"""``cp_ssd_scan``: Mamba2's selective scan per document, on contiguous or zigzag shards, against a step-by-step scan of
each document alone on one device (float64, 1e-12)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_cp import cp_ssd_scan
from lightning_cp.core.scan import ssd_scan
from lightning_cp.core.windows import shard_document_starts
from lightning_cp.core.zigzag import stream_tokens
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.shard_helpers import MIXED_DOCUMENTS, SCAN_CASES, document_runs, selective_scan_errors

HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5


def _stepwise_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token from ``state``: ``h = exp(dt A) h + dt x B^T``, ``y = h C`` (B, C per head)."""
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(outputs, dim=1), state


def _per_document_scan(inputs: tuple[torch.Tensor, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """Every document of every row scanned alone from a zero state (B, C repeated from groups to heads)."""
    x, dt, A, B, C = inputs
    B, C = (tensor.repeat_interleave(HEADS // GROUPS, dim=2) for tensor in (B, C))
    zero = x.new_zeros(x.shape[0], HEADS, HEAD_DIM, STATE)
    split = [tensor.split(list(lengths), dim=1) for tensor in (x, dt, B, C)]
    return torch.cat([_stepwise_scan(*parts[:2], A, *parts[2:], zero)[0] for parts in zip(*split, strict=True)], dim=1)


def _random_inputs(rows: int, total: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """x, dt (positive), A (negative), B, C in float64."""

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    dt = torch.rand(rows, total, HEADS, generator=generator, dtype=torch.float64) + 0.05
    A = -torch.rand(HEADS, generator=generator, dtype=torch.float64) * 2
    x = normal(rows, total, HEADS, HEAD_DIM)
    return x, dt, A, normal(rows, total, GROUPS, STATE), normal(rows, total, GROUPS, STATE)


_scan_error = functools.partial(selective_scan_errors, cp_ssd_scan, _per_document_scan, _random_inputs)
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
    [
        (4, "zigzag", MIXED_DOCUMENTS, 1, 2, 1),
        (4, "contiguous", None, 2, 2, 1),
        (4, "zigzag", MIXED_DOCUMENTS, 1, 1, 2),
    ],
    ids=["cp2xtp2-zigzag", "cp2xtp2-contiguous-dense", "hybrid-ring2xulysses2"],
)  # fmt: skip
def test_the_scan_on_shards_split_further(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, rows: int, tensor_parallel: int, ulysses: int
) -> None:
    """Shards split over TP ranks (sequence parallelism) or the Ulysses ranks of ``hybrid``: the state passes through
    the loss group's ranks in order (float64, 1e-12)."""
    for errors in run_on_ranks(_scan_error, ranks, boundary, lengths, 4, rows, tensor_parallel, ulysses):
        assert max(errors) <= 1e-12, errors


def test_step_sizes_keep_their_precision_through_a_conversion() -> None:
    """x, B, C in bf16 and dt in float32 (a Mamba2 layer under autocast) given zigzag at cp 2: the scan sees dt as
    given and computes in float32 (relative 1e-5 to the same rounded values scanned in float64; before, dt was
    converted to the shards in bf16 next to x and off by 1e-3)."""
    for errors in run_on_ranks(_scan_error, 2, "zigzag", MIXED_DOCUMENTS, 4, mixed=True):
        assert max(errors) <= 1e-5, errors


def test_a_shard_that_is_not_the_batchs_is_refused() -> None:
    """On every rank: a contiguous shard one token short (62 tokens, 31 per rank)."""
    assert_same_error_on_every_rank(
        _scan_error, 2, "contiguous", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 30 tokens in a contiguous block, where this batch puts 31 tokens on each rank",
    )  # fmt: skip


def test_without_a_step_each_row_is_one_document_and_shapes_are_checked() -> None:
    """Outside a step: each row scanned alone (float64, 1e-12); a float32 input computes and returns float32; bad
    shapes name what was given and what is expected."""
    generator = torch.Generator().manual_seed(3)
    inputs = _random_inputs(2, 11, generator)
    expected = _per_document_scan(inputs, (11,))
    torch.testing.assert_close(cp_ssd_scan(*inputs, chunk_size=4), expected, rtol=0, atol=1e-12)
    assert cp_ssd_scan(*(tensor.float() for tensor in inputs)).dtype == torch.float32
    x, dt, A, B, C = inputs
    for bad in ((x, dt[..., :1], A, B, C), (x, dt, A, B[:, :, :1].expand(-1, -1, 3, -1), C), (x[0], dt, A, B, C)):
        with pytest.raises(ValueError, match="expected x \\[b, S, heads, head_dim\\], dt \\[b, S, heads\\]"):
            cp_ssd_scan(*bad)
    with pytest.raises(ValueError, match="chunk_size=0"):
        cp_ssd_scan(*inputs, chunk_size=0)


def test_the_chunked_scan_restarts_at_document_starts_and_composes_with_an_entering_state() -> None:
    """``ssd_scan`` on random starts and chunk sizes (float64): outputs and last state equal the token-by-token scan
    restarted at each start; adding ``entry_decay`` times a state's read-out gives the scan from that state, and the
    last ``entry_decay`` carries it to the end."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        length, chunk_size = (
            int(torch.randint(1, 30, (1,), generator=generator)),
            int(torch.randint(1, 9, (1,), generator=generator)),
        )
        x, dt, A, B, C = _random_inputs(2, length, generator)
        B, C = (tensor.repeat_interleave(HEADS // GROUPS, dim=2) for tensor in (B, C))
        starts = torch.rand(length, generator=generator) < 0.2
        entering = torch.randn(2, HEADS, HEAD_DIM, STATE, generator=generator, dtype=torch.float64)
        y, last, entry_decay = ssd_scan(x, dt, A, B, C, starts, chunk_size)
        for state, scanned, final in ((torch.zeros_like(entering), y, last), (entering, None, None)):
            expected, expected_last, outputs = [], state, []
            for begin, end in document_runs(starts):
                kept = begin == 0 and not starts[0]  # the entering state reaches the first run if no start ends it
                dropped = expected_last if kept else torch.zeros_like(state)
                part, expected_last = _stepwise_scan(
                    x[:, begin:end], dt[:, begin:end], A, B[:, begin:end], C[:, begin:end], dropped
                )
                outputs.append(part)
            expected = torch.cat(outputs, dim=1)
            if scanned is None:
                readout = torch.einsum("bhpn,bshn->bshp", state, C)
                scanned = y + entry_decay.unsqueeze(-1) * readout
                final = last + entry_decay[:, -1, :, None, None] * state
            torch.testing.assert_close(scanned, expected, rtol=0, atol=1e-12)
            torch.testing.assert_close(final, expected_last, rtol=0, atol=1e-12)


def test_long_shards_with_heavy_then_light_decay_keep_float32_precision() -> None:
    """64 tokens of heavy decay (log decay -160 and -40 a token), then 32 of light: in float32 the scan stays within
    1e-6 of float64 (relative), as the decays between chunks are summed over those chunks alone (before, differences
    of sums over the whole shard lost 2e-4)."""
    generator = torch.Generator().manual_seed(4)
    x, _, _, B, C = _random_inputs(1, 96, generator)
    B, C = (tensor.repeat_interleave(HEADS // GROUPS, dim=2) for tensor in (B, C))
    dt = torch.full((1, 96, HEADS), 1e-3, dtype=torch.float64)
    dt[:, :64] = 20.0
    A = torch.tensor([-8.0, -2.0, -1.0, -0.5], dtype=torch.float64)
    starts = torch.zeros(96, dtype=torch.bool)
    expected = ssd_scan(x, dt, A, B, C, starts, 4)[0]
    got = ssd_scan(*(tensor.float() for tensor in (x, dt, A, B, C)), starts, 4)[0]
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_under_autocast_the_scan_computes_in_float32() -> None:
    """A bf16 autocast changes nothing: the products and sums stay in float32 (before, its einsums ran in bf16)."""
    inputs = tuple(tensor.float() for tensor in _random_inputs(1, 40, torch.Generator().manual_seed(6)))
    expected = cp_ssd_scan(*inputs, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cp_ssd_scan(*inputs, chunk_size=8)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_document_starts_of_a_shard() -> None:
    """Documents of 3, 5 and 2 tokens and 2 padding slots over 3 ranks of 4: starts at stream slots 0, 3, 8 and the
    first padding slot 10; each rank gets its own four."""
    tokens = stream_tokens((3, 5, 2), 12)
    shards = [shard_document_starts(tokens, 3, rank).tolist() for rank in range(3)]
    assert shards == [[True, False, False, True], [False, False, False, False], [True, False, True, False]]
