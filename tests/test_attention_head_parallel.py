"""Head-parallel attention (``ulysses``, ``hybrid``) on real gloo groups against a float64 single-process reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from lightning_cp.attention import attention_work_per_rank, zigzag_attention
from lightning_cp.packed import PackedSeqParams
from tests.attention_helpers import Case, compare_slots, reference_case, shard_slots
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.layout_reference import dense_positions, thd_positions

HEADS = [(12, 2), (12, 1), (12, 12), (12, 4)]


def _lengths(packed: bool, ranks: int, seed: int) -> list[int]:
    """Dense: one sequence of 6 x ranks tokens. Packed: lengths 1, below 2 x ranks, and not multiples of anything."""
    if not packed:
        return [6 * ranks]
    rng = random.Random(seed)
    lengths = [1, max(1, 2 * ranks - 1), rng.randint(1, 3), *(rng.randint(1, 19) for _ in range(3)), 2 * ranks + 1]
    rng.shuffle(lengths)
    return lengths


def _layout(lengths: list[int], packed: bool, ring: int, ulysses: int) -> tuple[list[list[int]], list[int]]:
    """Each logical rank's slots (``ring_rank * u + ulysses_rank``) in the zigzag layout over ``ring`` ranks with each
    shard split over ``ulysses`` ranks, and the zigzag offsets (the plain layout reference of the tests)."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    if not packed:
        return dense_positions("zigzag", ring, ulysses, cu[-1]), cu
    return thd_positions(cu, None, ring, ulysses)


def _check(case: Case, ring: int, ulysses: int, group, ulysses_group, ring_group, seed: int) -> list[str]:
    """Run one case on this rank; return its failures (outputs and q/k/v gradients at 1e-10, padding zero)."""
    torch.manual_seed(seed)
    lengths = _lengths(case.packed, ring * ulysses, seed)
    positions, offsets = _layout(lengths, case.packed, ring, ulysses)
    (q, k, v, dout), expected, reference_grads = reference_case(case, lengths)
    rank = group.rank()
    index = torch.tensor(positions[rank])
    local = [shard_slots(x, index, case) for x in (q, k, v, dout)]
    for x in local:
        x[index < 0] = 3.0  # garbage in padding slots must not leak
    *inputs, local_dout = local
    inputs = [x.requires_grad_() for x in inputs]
    params = None
    if case.packed:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        padded = torch.tensor(offsets, dtype=torch.int32)
        params = PackedSeqParams(
            cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded
        )
    groups = {"ulysses_group": ulysses_group, "ring_group": ring_group} if case.mode == "hybrid" else {}
    out = zigzag_attention(
        *inputs, group, packed_seq_params=params, causal=case.causal, mode=case.mode, backend=case.backend, **groups
    )
    out.backward(local_dout)
    got = (out, *(x.grad for x in inputs))
    want = (expected, *reference_grads)
    failures = (compare_slots(*args, index, case) for args in zip(("out", "dq", "dk", "dv"), got, want, strict=True))
    return [f"{case.name} ring={ring} u={ulysses} rank={rank}: {failure}" for failure in failures if failure]


def _cases(mode: str) -> list[Case]:
    cases = []
    combinations = [(p, c, b) for p in (False, True) for c in (True, False) for b in ("cpu_flash", "math")]
    for number, (packed, causal, backend) in enumerate(combinations):
        cases.append(Case(packed, causal, mode, backend, HEADS[number % len(HEADS)]))
    return cases


def _subgroups(ring: int, ulysses: int):
    """Ulysses groups of consecutive ranks and ring groups of equal Ulysses index; CP rank = ring * u + ulysses."""
    rank = dist.get_rank()
    ulysses_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)]) for r in range(ring)]
    ring_groups = [dist.new_group([r * ulysses + u for r in range(ring)]) for u in range(ulysses)]
    return ulysses_groups[rank // ulysses], ring_groups[rank % ulysses]


def _run_cases(mode: str, ring: int, ulysses: int) -> list[str]:
    ulysses_group, ring_group = _subgroups(ring, ulysses) if mode == "hybrid" else (None, None)
    failures = []
    for seed, case in enumerate(_cases(mode)):
        failures += _check(case, ring, ulysses, dist.group.WORLD, ulysses_group, ring_group, seed)
    return failures


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ulysses_matches_single_device_reference(cp: int):
    """Dense and packed, causal or not, MHA and GQA with kv heads 1, 2, 4 (replicated where they do not split)."""
    outcomes = run_on_ranks(_run_cases, cp, "ulysses", cp, 1, timeout=240)
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize(("ring", "ulysses"), [(2, 2), (2, 3), (3, 2)])
def test_hybrid_matches_single_device_reference(ring: int, ulysses: int):
    """Ulysses inside groups of u, ring attention across r = cp / u: cp 4 as 2x2, cp 6 as 3x2 and 2x3."""
    outcomes = run_on_ranks(_run_cases, ring * ulysses, "hybrid", ring, ulysses, timeout=240)
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures[:10])


def _heads_not_divisible() -> None:
    q, k, v = torch.randn(4, 1, 6, 8), torch.randn(4, 1, 2, 8), torch.randn(4, 1, 2, 8)
    try:
        zigzag_attention(q, k, v, dist.group.WORLD, mode="ulysses")
    finally:
        dist.barrier()


def test_heads_that_do_not_split_fail_the_same_way_on_every_rank():
    message = assert_same_error_on_every_rank(_heads_not_divisible, 4, match="6 is not divisible by 4", timeout=60)
    assert "'allgather' or 'ring'" in message and "query heads" in message


def _hybrid_without_groups() -> None:
    q = torch.randn(4, 1, 4, 8)
    try:
        zigzag_attention(q, q, q, dist.group.WORLD, mode="hybrid")
    finally:
        dist.barrier()


def test_hybrid_without_its_groups_fails_the_same_way_on_every_rank():
    assert_same_error_on_every_rank(_hybrid_without_groups, 2, match="needs ulysses_group and ring_group", timeout=60)


def test_work_per_rank_covers_the_head_parallel_modes():
    total = 32 * 33 // 2
    assert sum(attention_work_per_rank(4, seq_len=32)) == total
    assert attention_work_per_rank(4, seq_len=32, mode="ulysses") == [total / 4] * 4
    ring = attention_work_per_rank(2, seq_len=32)
    assert (
        attention_work_per_rank(4, seq_len=32, mode="hybrid", ulysses_size=2) == [ring[0] / 2] * 2 + [ring[1] / 2] * 2
    )
