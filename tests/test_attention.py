"""zigzag_attention against a plain float64 single-process reference: outputs and q/k/v gradients, every cp size."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention import kernels
from lightning_cp.core.attention.api import zigzag_attention
from tests.attention_helpers import (
    KERNELS,
    Case,
    all_cases,
    case_lengths,
    check_all_cases,
    check_case,
    compare_slots,
    reference_attention,
    zigzag_index,
)
from tests.distributed_harness import run_on_ranks


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_matches_single_device_reference(cp):
    outcomes = run_on_ranks(check_all_cases, cp, all_cases(), timeout=240)
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures)


def _check_cases_on_strided_subgroups(cases: list[Case]) -> list[str]:
    """Rank body on 4 ranks: CP groups {0, 2} and {1, 3}, so group ranks differ from global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[dist.get_rank() % 2]
    failures = []
    for seed, case in enumerate(cases):
        failures += check_case(case, 2, dist.get_rank(group), group, seed)
    return failures


def test_cp_subgroups_of_a_larger_world():
    cases = [case for case in all_cases() if case.dtype == torch.float64 and case.backend == "cpu_flash"]
    outcomes = run_on_ranks(_check_cases_on_strided_subgroups, 4, cases, timeout=240)
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures)


def test_without_group_is_local_attention_with_document_masks():
    failures = []
    for seed, case in enumerate(all_cases()):
        failures += check_case(case, 1, 0, None, seed)
    assert not failures, "\n".join(failures)


def test_compare_detects_a_wrong_output():
    case = Case(True, True, "allgather", "math", (2, 2))
    index = torch.tensor([0, -1, 1])
    ref = torch.ones(2, 1, 2, 8, dtype=torch.float64)
    good = torch.ones(3, 2, 8, dtype=torch.float64)
    good[1] = 0
    assert compare_slots("out", good, ref, index, case) == ""
    assert "max error" in compare_slots("out", good * 1.001, ref, index, case)
    good[1] = 1e-3
    assert "padding" in compare_slots("out", good, ref, index, case)


def test_zigzag_index_matches_design_example():
    assert zigzag_index([3, 5], 2, 0) + zigzag_index([3, 5], 2, 1) == [0, -1, 3, 4, -1, -1, 1, 2, 5, 6, 7, -1]


def test_backend_choice_is_logged_once(caplog):
    attention._LOGGED_CHOICES.clear()
    q = torch.randn(4, 1, 2, 8)
    with caplog.at_level(logging.INFO, logger="lightning_cp.core.attention.api"):
        for _ in range(2):
            zigzag_attention(q, q, q, None, mode="ring")
    messages = [record.getMessage() for record in caplog.records if record.name == "lightning_cp.core.attention.api"]
    assert messages == ["zigzag_attention: backend cpu_flash, mode ring, device cpu"]


def _spans(counts: list[int]) -> kernels._Spans:
    """Spans of adjacent documents with these token counts in one half."""
    stops = torch.tensor(counts).cumsum(0).tolist()
    return kernels._Spans([stop - count for stop, count in zip(stops, counts, strict=True)], stops, counts)


def _groups(
    q_counts: list[int], k_counts: list[int], profile: kernels.PlanProfile = kernels._CPU_PROFILE, span: int = 512
) -> list[list[int]]:
    """``_document_groups`` of adjacent documents with these token counts, with ``profile``'s costs."""
    return kernels._document_groups(_spans(q_counts), _spans(k_counts), profile, span)


def test_small_documents_share_a_masked_call_only_where_it_is_cheaper():
    # Four documents of 2 rows: one masked 8 x 8 call (900 + 1.3 * 64 pairs) beats four calls (4 * 504).
    assert _groups([2] * 4, [2] * 4) == [[0, 1, 2, 3]]
    # Two of 32 rows: a masked 64 x 64 call (900 + 1.3 * 4096) costs more than two calls (2 * (500 + 1024)).
    assert _groups([32, 32], [32, 32]) == [[0], [1]]
    # A document with rows on one side only ends the run; one with rows on neither side does not.
    assert _groups([2, 2, 2, 0, 2], [2, 0, 2, 0, 2]) == [[0], [2, 4]]
    # The box stays within the span: eight documents of 2 rows, boxes of at most 6 rows.
    assert _groups([2] * 8, [2] * 8, span=6) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_on_a_gpu_a_call_costs_more_so_larger_runs_share_one():
    # A call there costs 10**6 pairs: two documents of 300 rows share a masked 600 x 600 call (1.2e6 + 2.5 * 360000
    # = 2.1e6 pairs) rather than two calls (2 * (1e6 + 90000) = 2.18e6), which the CPU never does.
    assert _groups([300, 300], [300, 300], kernels._GPU_PROFILE, span=4096) == [[0, 1]]
    assert _groups([300, 300], [300, 300]) == [[0], [1]]
    # 160 documents of 32 rows join up to the span: 128 of them (4096 rows) in one box, the other 32 in the next.
    assert [len(group) for group in _groups([32] * 160, [32] * 160, kernels._GPU_PROFILE, span=4096)] == [128, 32]


@pytest.mark.parametrize(("cp", "call_pairs"), [(2, 0), (3, 10**9)])
def test_blocks_cut_into_document_groups_give_the_same_results(cp, call_pairs, monkeypatch):
    """The same results whether no document shares a call (a call costing nothing) or every run does (a call
    costing more than any masked pair)."""
    lengths = case_lengths(Case(True, True, "ring", "math", (2, 2)), cp, seed=0)
    tokens = zigzag.ZigzagGeometry.packed(cp, lengths).rank_tokens
    counts = {}
    for pairs in (0, 10**9):
        profile = dataclasses.replace(kernels._CPU_PROFILE, call_pairs=pairs)
        plan = kernels.build_block_plan(tokens, 0, False, torch.device("cpu"), profile=profile)
        counts[pairs] = sum(map(len, plan.blocks))
    assert counts[0] > counts[10**9]
    monkeypatch.setattr(kernels, "_CPU_PROFILE", dataclasses.replace(kernels._CPU_PROFILE, call_pairs=call_pairs))
    attention._block_plan.cache_clear()  # plans cached by earlier tests were built with the default costs
    try:
        outcomes = run_on_ranks(check_all_cases, cp, all_cases(), timeout=240)
    finally:
        attention._block_plan.cache_clear()
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", KERNELS)
def test_contiguous_sharding_through_the_same_blocks_matches_reference(backend):
    cp, lengths = 3, [5, 1, 40, 2, 17]
    torch.manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), 1, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    expected = reference_attention(q, k, v, doc, causal=True)[:, 0]
    tokens = [zigzag.contiguous_rank_tokens(lengths, cp, rank) for rank in range(cp)]
    per_rank = tokens[0].doc.shape[0]
    q_parts, k_parts, v_parts = (_stream_slices(x, cp, per_rank) for x in (q, k, v))
    kv_all = torch.stack([torch.stack(pair) for pair in zip(k_parts, v_parts, strict=True)]).detach()
    sent = torch.zeros_like(kv_all)
    outs = []
    for rank in range(cp):
        plan = kernels.build_block_plan(tokens, rank, True, torch.device("cpu"))
        parts = (q_parts[rank], k_parts[rank], v_parts[rank])
        outs.append(
            attention.emulated_rank_attention(
                *parts, kv_all, sent, plan, scale=8**-0.5, kernel=attention._KERNELS[backend]
            )
        )
    got = torch.cat(outs)[: sum(lengths)]
    assert (got - expected).abs().max() < 1e-10
    dout = torch.randn_like(got)
    dq, dk, dv = torch.autograd.grad(got, (q, k, v), dout)
    dk, dv = (own + sent[:, part].flatten(0, 1)[: sum(lengths)].unsqueeze(1) for part, own in enumerate((dk, dv)))
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    assert max((a - b).abs().max().item() for a, b in zip((dq, dk, dv), expected_grads, strict=True)) < 1e-10


def _stream_slices(x: torch.Tensor, cp: int, per_rank: int) -> list[torch.Tensor]:
    """Every rank's slice ``[T, H, D]`` of the flat ``[N, 1, H, D]`` stream, zero-padded at the end."""
    padded = torch.cat([x[:, 0], x.new_zeros(cp * per_rank - x.shape[0], *x.shape[2:])])
    return list(padded.split(per_rank))


@pytest.mark.parametrize("causal", [False, True])
def test_a_tile_mask_answers_from_its_vectors_as_its_dense_mask_would(causal):
    """``TileMask``'s checks (some pair attends, every pair does) and its sub-tiles, worked out from documents and
    positions, agree with the boolean mask built pair by pair, on random tiles with padding (document -1)."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(300):
        rows, cols, documents = (int(x) for x in torch.randint(1, 7, (3,), generator=generator))
        q_doc, k_doc = (torch.randint(-1, documents, (n,), generator=generator) for n in (rows, cols))
        if trial % 3 == 0:  # one document on both sides, so that "every pair" is reachable
            q_doc, k_doc = q_doc.clamp(min=0) * 0, k_doc.clamp(min=0) * 0
        q_pos, k_pos = (torch.randint(0, 8, (n,), generator=generator) for n in (rows, cols))
        mask = kernels.TileMask(q_doc, q_pos, k_doc, k_pos, causal)
        expected = (q_doc[:, None] == k_doc[None, :]) & (q_doc[:, None] >= 0)
        if causal:
            expected &= k_pos[None, :] <= q_pos[:, None]
        assert torch.equal(mask.dense(), expected)
        assert (mask.any(), mask.all()) == (bool(expected.any()), bool(expected.all())), (q_doc, q_pos, k_doc, k_pos)
        i = torch.randperm(rows, generator=generator)[: max(1, rows // 2)]
        j = torch.randperm(cols, generator=generator)[: max(1, cols // 2)]
        assert torch.equal(mask.take(i, j).dense(), expected[i][:, j])


def test_single_document_block_masks_interleaved_positions():
    rows, cols = slice(0, 3), slice(0, 3)
    block = kernels._single_document_block(rows, cols, torch.tensor([2, 3, 4]), torch.tensor([3, 4, 5]), True)
    assert block.mask.dense().tolist() == [[False, False, False], [True, False, False], [True, True, False]]
    assert kernels._single_document_block(rows, cols, torch.tensor([0, 1]), torch.tensor([2, 3]), True) is None
    diagonal = kernels._single_document_block(rows, cols, torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6]), True)
    assert diagonal.causal and diagonal.mask is None
    assert kernels._single_document_block(rows, cols, torch.tensor([0]), torch.tensor([5]), False).mask is None


def test_the_math_kernel_accumulates_in_float32_under_a_bf16_autocast() -> None:
    """bf16 q, k, v inside ``torch.autocast(bfloat16)`` (as in a bf16-mixed step): the output and gradients within
    bf16's rounding (relative 4e-3) of float64 attention of the same values; the kernel's score matmuls must not
    follow the autocast into bf16 (that measured 6e-3 on the output and 1.5e-2 on the gradients)."""
    generator = torch.Generator().manual_seed(0)
    length, heads, dim = 64, 2, 16
    shape = (length, 1, heads, dim)
    q, k, v = (torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_() for _ in "qkv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zigzag_attention(q, k, v, None, backend="math")
    out.float().pow(2).sum().backward()
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("qbhd,kbhd->bhqk", exact[0], exact[1]) / dim**0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), -torch.inf)
    expected = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), exact[2])
    expected.pow(2).sum().backward()
    assert (out.double() - expected).abs().max() <= 4e-3 * expected.abs().max()
    for low, high in zip((q, k, v), exact, strict=True):
        assert (low.grad.double() - high.grad).norm() <= 4e-3 * high.grad.norm()


@pytest.mark.parametrize("backend", ["math", "cpu_flash"])
def test_a_second_order_gradient_is_refused_not_wrong(backend):
    """The backward keeps the output and log-sum-exp as saved values, so it has no derivative of its own: a
    ``create_graph`` backward through it raises at once (before, the math kernel gave wrong second-order gradients)."""
    q, k, v = (torch.randn(8, 1, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = zigzag_attention(q, k, v, None, backend=backend)
    with pytest.raises(RuntimeError, match="no second-order gradient"):
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
