"""``cp_gated_delta_rule``: the gated delta rule per document, on contiguous or zigzag shards, against a token-by-token
run of each document alone on one device (float64, 1e-12)."""

from __future__ import annotations

import pytest
import torch

from lightning_cp import cp_gated_delta_rule
from lightning_cp.core import functional
from lightning_cp.core.scan import gated_delta_scan
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.shard_helpers import MIXED_DOCUMENTS, SCAN_CASES, batch_length, saved_for_backward, step_over_the_world

HEADS, KEY_DIM, VALUE_DIM = 3, 4, 5


def _stepwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token from ``state``: decay (per head, or per key channel when ``g`` has one), read what the
    state predicts for ``k``, write the difference."""
    outputs = []
    for t in range(q.shape[1]):
        decay = g[:, t].exp()  # [b, h] or [b, h, dk]
        state = state * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + k[:, t, :, :, None] * ((v[:, t] - predicted) * beta[:, t, :, None])[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def _per_document(inputs: tuple[torch.Tensor, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """Every document of every row run alone from a zero state."""
    zero = inputs[0].new_zeros(inputs[0].shape[0], HEADS, KEY_DIM, VALUE_DIM)
    split = [tensor.split(list(lengths), dim=1) for tensor in inputs]
    return torch.cat([_stepwise(*parts, zero)[0] for parts in zip(*split, strict=True)], dim=1)


def _random_inputs(
    rows: int, total: int, generator: torch.Generator, per_channel: bool = False
) -> tuple[torch.Tensor, ...]:
    """q, k (unit length), v, g (log decays in (-1, 0), per head or ``per_channel``), beta (in (0, 1)) in float64."""

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(normal(rows, total, HEADS, KEY_DIM), dim=-1) for _ in range(2))
    g = -uniform(rows, total, HEADS, *([KEY_DIM] if per_channel else []))
    return q, k, normal(rows, total, HEADS, VALUE_DIM), g, uniform(rows, total, HEADS)


def _by_hand(tensor: torch.Tensor) -> torch.Tensor:
    """One key head repeated for every value head and L2-normalised as documented: ``x / sqrt(|x|^2 + 1e-6)``."""
    tensor = tensor.repeat_interleave(HEADS // tensor.shape[2], dim=2)
    return tensor / torch.sqrt((tensor * tensor).sum(-1, keepdim=True) + 1e-6)


def _rule_error(
    boundary: str,
    lengths: tuple[int, ...] | None,
    chunk_size: int,
    rows: int = 1,
    tensor_parallel: int = 1,
    ulysses: int = 1,
    drop_last: bool = False,
    mixed: bool = False,
    grouped: bool = False,
    per_channel: bool = False,
) -> list[float]:
    """This rank's largest differences to one process: outputs and the gradients of every input, for the batch
    ``step_over_the_world`` makes of the arguments; ``mixed``: q, k, v in bf16 and the gates in float32, as under
    autocast (the reference: the same rounded values in float64), and only the output's relative error;
    ``grouped``: one raw key head for all value heads, L2-normalised and q scaled by 0.7 inside (the reference: by
    hand); ``per_channel``: a decay per key channel."""
    total = batch_length(lengths)
    generator = torch.Generator().manual_seed(5)
    inputs = _random_inputs(rows, total, generator, per_channel)
    if grouped:
        raw = (torch.randn(rows, total, 1, KEY_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
        inputs = (*raw, *inputs[2:])
    if mixed:
        inputs = tuple(tensor.to(torch.bfloat16 if i < 3 else torch.float32) for i, tensor in enumerate(inputs))
    loss_weights = torch.randn(rows, total, HEADS, VALUE_DIM, generator=generator, dtype=torch.float64)
    whole = [tensor.double().clone().requires_grad_() for tensor in inputs]
    prepared = (_by_hand(whole[0]) * 0.7, _by_hand(whole[1]), *whole[2:]) if grouped else tuple(whole)
    expected = _per_document(prepared, lengths or (total,))
    (expected * loss_weights).sum().backward()
    options = {"scale": 0.7, "l2_normalize_qk": True} if grouped else {"scale": 1.0}
    with step_over_the_world(boundary, lengths, rows, tensor_parallel, ulysses, drop_last) as slots:
        shards = [slots.shard(tensor) for tensor in inputs]
        output = cp_gated_delta_rule(*shards, **options, chunk_size=chunk_size)
        if mixed:
            return [slots.error(output, expected) / expected.abs().max().item()]
        (output * loss_weights[:, slots.taken] * slots.mask(output)).sum().backward()
    pairs = [(output, expected), *((shard.grad, full.grad) for shard, full in zip(shards, whole, strict=True))]
    return [slots.error(actual, reference) for actual, reference in pairs]


@SCAN_CASES
def test_the_rule_matches_each_document_alone(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, chunk_size: int, rows: int
) -> None:
    """The batches of ``SCAN_CASES`` (one document's state passing through three transitions at cp 4): outputs and the
    gradients of q, k, v, g and beta equal each document run alone, token by token (float64, 1e-12)."""
    for errors in run_on_ranks(_rule_error, ranks, boundary, lengths, chunk_size, rows):
        assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "rows", "tensor_parallel", "ulysses"),
    [(4, "zigzag", MIXED_DOCUMENTS, 1, 2, 1), (4, "zigzag", MIXED_DOCUMENTS, 1, 1, 2)],
    ids=["cp2xtp2-zigzag", "hybrid-ring2xulysses2"],
)
def test_the_rule_on_shards_split_further(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, rows: int, tensor_parallel: int, ulysses: int
) -> None:
    """Shards split over TP ranks (sequence parallelism) or the Ulysses ranks of ``hybrid``: the state passes through
    the loss group's ranks in order (float64, 1e-12)."""
    for errors in run_on_ranks(_rule_error, ranks, boundary, lengths, 4, rows, tensor_parallel, ulysses):
        assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "rows"),
    [(3, "zigzag", MIXED_DOCUMENTS, 1), (4, "contiguous", (60,), 1), (2, "zigzag", None, 2)],
    ids=["cp3-zigzag", "cp4-one-document-over-all-shards", "cp2-dense"],
)
def test_a_decay_per_key_channel_matches_each_document_alone(
    ranks: int, boundary: str, lengths: tuple[int, ...] | None, rows: int
) -> None:
    """Kimi delta attention's gates, one log decay per key channel (``g`` ``[b, S, heads, dk]``): outputs and the
    gradients of every input equal each document run alone, token by token (float64, 1e-12)."""
    for errors in run_on_ranks(_rule_error, ranks, boundary, lengths, 4, rows, per_channel=True):
        assert max(errors) <= 1e-12, errors


def test_grouped_normalised_keys_under_a_step() -> None:
    """One raw key head for three value heads, normalised and scaled inside, zigzag at cp 3: outputs and the
    gradients of the raw q and k (through the head repeat and the normalisation) and of v, g, beta equal the same
    preparation by hand on one process (float64, 1e-12)."""
    for errors in run_on_ranks(_rule_error, 3, "zigzag", MIXED_DOCUMENTS, 4, grouped=True):
        assert max(errors) <= 1e-12, errors


def test_gates_keep_their_precision_through_a_conversion() -> None:
    """q, k, v in bf16 and the gates in float32 (a Gated DeltaNet layer under autocast) given zigzag at cp 2: the rule
    sees the gates as given and computes in float32 (relative 1e-5 to the same rounded values run in float64)."""
    for errors in run_on_ranks(_rule_error, 2, "zigzag", MIXED_DOCUMENTS, 4, mixed=True):
        assert max(errors) <= 1e-5, errors


def test_a_shard_that_is_not_the_batchs_is_refused() -> None:
    """On every rank: a contiguous shard one token short (62 tokens, 31 per rank)."""
    assert_same_error_on_every_rank(
        _rule_error, 2, "contiguous", MIXED_DOCUMENTS, 4, drop_last=True,
        match="a shard of 30 tokens in a contiguous block, where this batch puts 31 tokens on each rank",
    )  # fmt: skip


def test_without_a_step_each_row_is_one_document_and_shapes_are_checked() -> None:
    """Outside a step: each row run alone (float64, 1e-12); float32 inputs compute and return float32, also under a
    bf16 autocast (bit for bit); bad shapes name what was given and what is expected."""
    inputs = _random_inputs(2, 11, torch.Generator().manual_seed(3))
    got = cp_gated_delta_rule(*inputs, scale=1.0, chunk_size=4)
    torch.testing.assert_close(got, _per_document(inputs, (11,)), rtol=0, atol=1e-12)
    single = tuple(tensor.float() for tensor in inputs)
    expected = cp_gated_delta_rule(*single)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cp_gated_delta_rule(*single)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    q, k, v, g, beta = inputs
    two_channels = g[..., None].expand(-1, -1, -1, 2)  # neither one per head nor one per key channel
    for bad in ((q[..., :2], k, v, g, beta), (q, k, v[:, :3], g, beta), (q, k, v, g, beta[..., :1]),
                (q[:, :, :2], k[:, :, :2], v, g, beta), (q, k, v, two_channels, beta)):  # fmt: skip
        with pytest.raises(ValueError, match="expected q and k \\[b, S, key_heads, dk\\], v \\[b, S, heads, dv\\]"):
            cp_gated_delta_rule(*bad)
    with pytest.raises(ValueError, match="chunk_size=0"):
        cp_gated_delta_rule(*inputs, chunk_size=0)


def test_chunks_default_to_64_tokens_with_a_decay_per_head_and_8_per_key_channel(monkeypatch) -> None:
    """Without ``chunk_size`` the rule runs in chunks of 64 tokens with a decay per head and 8 with one per key channel
    (whose pairwise decays grow with the chunk); a given size is kept, and one below 1 refused."""
    chunks: list[int] = []

    def recording(*args: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        chunks.append(int(args[6]))
        return gated_delta_scan(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(functional, "gated_delta_scan", recording)
    generator = torch.Generator().manual_seed(4)
    for per_channel in (False, True):
        cp_gated_delta_rule(*_random_inputs(1, 9, generator, per_channel))
    cp_gated_delta_rule(*_random_inputs(1, 9, generator, per_channel=True), chunk_size=3)
    assert chunks == [64, 8, 3]
    with pytest.raises(ValueError, match="chunk_size=-1"):
        cp_gated_delta_rule(*_random_inputs(1, 9, generator), chunk_size=-1)


def test_with_decays_per_key_channel_the_backward_keeps_about_the_inputs() -> None:
    """With a decay per key channel, between forward and backward the rule keeps what autograd saves outside its
    recomputed chunks: about its inputs' size (64 tokens: under 1.1 times them, where keeping the chunks' pairwise
    products saved 15 times them), and the gradients still flow."""
    inputs = _random_inputs(1, 64, torch.Generator().manual_seed(2), per_channel=True)
    inputs = tuple(tensor.requires_grad_() for tensor in inputs)
    o, saved = saved_for_backward(lambda: cp_gated_delta_rule(*inputs))
    assert sum(saved) < 1.1 * sum(tensor.numel() for tensor in inputs), sum(saved)
    o.sum().backward()
    assert all(tensor.grad is not None for tensor in inputs)


def test_grouped_keys_normalisation_and_scale_are_applied_as_documented() -> None:
    """One key head per three value heads, L2-normalised q and k and a scale: the same as the heads repeated, the
    vectors normalised (``x / sqrt(|x|^2 + 1e-6)``) and q scaled by hand (float64, 1e-12); the default scale is
    ``dk ** -0.5``."""
    generator = torch.Generator().manual_seed(8)
    _, _, v, g, beta = _random_inputs(2, 9, generator)
    q, k = (torch.randn(2, 9, 1, KEY_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = _per_document((_by_hand(q) * 0.7, _by_hand(k), v, g, beta), (9,))
    got = cp_gated_delta_rule(q, k, v, g, beta, scale=0.7, l2_normalize_qk=True, chunk_size=4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    q, k = _by_hand(q), _by_hand(k)
    default = _per_document((q * KEY_DIM**-0.5, k, v, g, beta), (9,))
    torch.testing.assert_close(cp_gated_delta_rule(q, k, v, g, beta, chunk_size=4), default, rtol=0, atol=1e-12)


def test_the_chunked_rule_restarts_at_document_starts_from_any_state() -> None:
    """``gated_delta_scan`` on random starts and chunk sizes from a random state, with a decay per head or per key
    channel (float64): outputs and last state equal the token-by-token rule restarted at each start."""
    generator = torch.Generator().manual_seed(1)
    for trial in range(20):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        chunk_size = int(torch.randint(1, 9, (1,), generator=generator))
        q, k, v, g, beta = _random_inputs(2, length, generator, per_channel=trial % 2 == 1)
        starts = torch.rand(length, generator=generator) < 0.2
        state = torch.randn(2, HEADS, KEY_DIM, VALUE_DIM, generator=generator, dtype=torch.float64)
        o, last = gated_delta_scan(q, k, v, g, beta, starts, chunk_size, state)
        cuts = [0, *[int(i) for i in torch.nonzero(starts).flatten() if i > 0], length]
        outputs, expected_last = [], state
        for begin, end in zip(cuts, cuts[1:], strict=False):
            entering = expected_last if begin == 0 and not starts[0] else torch.zeros_like(state)
            part, expected_last = _stepwise(*(x[:, begin:end] for x in (q, k, v, g, beta)), entering)
            outputs.append(part)
        torch.testing.assert_close(o, torch.cat(outputs, dim=1), rtol=0, atol=1e-12)
        torch.testing.assert_close(last, expected_last, rtol=0, atol=1e-12)
