"""Real gloo ranks: dense and packed conversions, round trips and gradients against the plain reference layouts."""

from __future__ import annotations

import dataclasses
import math
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core.layout.api import build_thd_cp_layout_plan, contiguous_to_zigzag, zigzag_to_contiguous
from tests.distributed_harness import run_on_ranks
from tests.layout_reference import dense_positions, make_groups, random_packed_case, take, thd_positions


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same random tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_dense(cp, tp, logical, groups, seq_dim) -> None:
    """Values, round trip and both backward directions of a dense conversion along ``seq_dim``."""
    length = 2 * cp * tp * 3
    shape = (length, 3) if seq_dim == 0 else (2, length, 3)
    sequence, upstream = _random(shape, 1), _random(shape, 2)
    contiguous = dense_positions("contiguous", cp, tp, length)[logical]
    zigzag = dense_positions("zigzag", cp, tp, length)[logical]
    local = take(sequence, contiguous, seq_dim).requires_grad_()
    converted = contiguous_to_zigzag(local, *groups, seq_dim=seq_dim)
    assert torch.equal(converted, take(sequence, zigzag, seq_dim))
    converted.backward(take(upstream, zigzag, seq_dim))
    assert torch.equal(local.grad, take(upstream, contiguous, seq_dim))
    zigzag_local = converted.detach().requires_grad_()
    restored = zigzag_to_contiguous(zigzag_local, *groups, seq_dim=seq_dim)
    assert torch.equal(restored, take(sequence, contiguous, seq_dim))
    restored.backward(take(upstream, contiguous, seq_dim))
    assert torch.equal(zigzag_local.grad, take(upstream, zigzag, seq_dim))
    assert torch.equal(converted, take(sequence, zigzag, seq_dim)), "a later conversion overwrote an earlier output"
    with torch.no_grad():
        assert torch.equal(contiguous_to_zigzag(local, *groups, seq_dim=seq_dim), converted)
        assert torch.equal(zigzag_to_contiguous(converted, *groups, seq_dim=seq_dim), local)


def _replay(plan, rows: torch.Tensor, group, to_zigzag: bool) -> torch.Tensor:
    """Apply a THD plan's documented fields exactly, with a raw ``all_to_all_single``."""
    send_indices = plan.forward_send_indices if to_zigzag else plan.reverse_send_indices
    sizes = (plan.forward_input_split_sizes, plan.forward_output_split_sizes)
    input_sizes, output_sizes = sizes if to_zigzag else sizes[::-1]
    received = rows.new_empty((sum(output_sizes), *rows.shape[1:]))
    sent = rows.index_select(0, send_indices)
    dist.all_to_all_single(received, sent, list(output_sizes), list(input_sizes), group=group)
    if not to_zigzag:
        return received.index_select(0, plan.reverse_receive_indices)
    output = rows.new_zeros((plan.zigzag_local_token_count, *rows.shape[1:]))
    return output.index_copy_(0, plan.forward_receive_positions, received)


def _check_packed(cp, tp, logical, groups, cu, cu_padded, seq_dim) -> None:
    """Plan metadata, values, round trip and gradients of a packed conversion; padding slots are zeros."""
    token_count = (cu_padded or cu)[-1]
    positions, offsets = thd_positions(cu, cu_padded, cp, tp)
    shard = token_count // (cp * tp)
    plan = build_thd_cp_layout_plan(
        torch.tensor(cu, dtype=torch.int32),
        token_count,
        groups[0],
        None if cu_padded is None else torch.tensor(cu_padded, dtype=torch.int32),
        *groups[1:],
    )
    assert plan.cu_seqlens_padded.tolist() == offsets and plan.cu_seqlens_padded.dtype == torch.int32
    assert plan.max_seqlen_padded == max(b - a for a, b in pairwise(offsets))
    assert plan.pad_between_seqs == (offsets != cu)
    zigzag_slots = len(positions[logical])
    assert plan.zigzag_local_token_count == zigzag_slots and plan.contiguous_local_token_count == shard

    def shaped(tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, -tensor]) if seq_dim == 1 else tensor

    stream, upstream = _random((token_count, 4), 3), _random((token_count, 4), 4)
    zigzag_upstream = _random((sum(len(p) for p in positions), 4), 5)[logical * zigzag_slots :][:zigzag_slots]
    own = list(range(logical * shard, (logical + 1) * shard))
    local = shaped(stream[own]).requires_grad_()
    converted = contiguous_to_zigzag(local, *groups, thd_plan=plan, seq_dim=seq_dim)
    assert torch.equal(converted, shaped(take(stream, positions[logical])))
    communication_group = groups[3] if groups[1] and tp > 1 else groups[0]
    replayed = _replay(plan, stream[own], communication_group, to_zigzag=True)
    assert torch.equal(shaped(replayed), converted), "the documented fields replayed give the conversion"
    assert torch.equal(_replay(plan, replayed, communication_group, to_zigzag=False), stream[own])
    converted.backward(shaped(zigzag_upstream))
    gradient = torch.zeros(token_count, 4, dtype=torch.float64)
    flat = [p for rank in positions for p in rank]
    all_upstream = _random((len(flat), 4), 5)
    for slot, source in enumerate(flat):
        if source >= 0:
            gradient[source] = all_upstream[slot]
    assert torch.equal(local.grad, shaped(gradient[own]))
    zigzag_local = converted.detach().requires_grad_()
    restored = zigzag_to_contiguous(zigzag_local, *groups, thd_plan=plan, seq_dim=seq_dim)
    assert torch.equal(restored, shaped(stream[own]))
    restored.backward(shaped(upstream[own]))
    assert torch.equal(zigzag_local.grad, shaped(take(upstream, positions[logical])))
    assert torch.equal(converted, shaped(take(stream, positions[logical]))), "a later conversion overwrote an output"
    hand_built = dataclasses.replace(plan)  # a plan made outside the builder derives its moves at first use
    lazy = contiguous_to_zigzag(shaped(stream[own]), *groups, thd_plan=hand_built, seq_dim=seq_dim)
    assert torch.equal(lazy, converted)
    assert torch.equal(zigzag_to_contiguous(lazy, *groups, thd_plan=hand_built, seq_dim=seq_dim), shaped(stream[own]))
    rebuilt = build_thd_cp_layout_plan(
        torch.tensor(cu, dtype=torch.int32),
        token_count,
        groups[0],
        None if cu_padded is None else torch.tensor(cu_padded, dtype=torch.int32),
        *groups[1:],
    )
    mixed = dataclasses.replace(rebuilt) if logical % 2 else rebuilt  # plans with equal fields work together
    assert torch.equal(contiguous_to_zigzag(shaped(stream[own]), *groups, thd_plan=mixed, seq_dim=seq_dim), converted)


def _conversion_checks(cp: int, tp: int, tp_fastest: bool) -> int:
    """Run every conversion check for one group shape; return how many ran."""
    cp_group, tp_group, tp_cp_group, cp_rank, tp_rank = make_groups(cp, tp, tp_fastest)
    shapes = [(cp, 1, cp_rank, (cp_group, False, None, None))]
    if tp > 1:
        shapes.append((cp, tp, cp_rank * tp + tp_rank, (cp_group, True, tp_group, tp_cp_group)))
    generator = torch.Generator().manual_seed(7 * cp + tp)
    checks = 0
    for cp_size, tp_size, logical, groups in shapes:
        for seq_dim in (0, 1):
            _check_dense(cp_size, tp_size, logical, groups, seq_dim)
            checks += 1
        cases = [random_packed_case(generator, cp_size, tp_size, padding) for padding in (False, True, True)]
        ranks = cp_size * tp_size
        cases.append(([0, 2 * ranks, 4 * ranks], None))
        cases.append(([0, 150 * ranks + 1, 300 * ranks - 5, 600 * ranks], None))  # long runs, little padding
        for index, (cu, cu_padded) in enumerate(cases):
            _check_packed(cp_size, tp_size, logical, groups, cu, cu_padded, seq_dim=index % 2)
            checks += 1
    return checks


@pytest.mark.parametrize(
    ("cp", "tp", "tp_fastest"),
    [(2, 1, True), (3, 1, True), (4, 1, True), (2, 2, True), (2, 2, False), (2, 3, True)],
    ids=["cp2", "cp3", "cp4", "tp2xcp2-tp-fastest", "tp2xcp2-cp-fastest", "tp3xcp2"],
)
def test_conversions_on_gloo_ranks(cp, tp, tp_fastest):
    counts = run_on_ranks(_conversion_checks, cp * tp, cp, tp, tp_fastest, timeout=120)
    assert counts == [7 if tp == 1 else 14] * (cp * tp)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in one more trailing dimension: a bit-exact comparison for any dtype."""
    return tensor.unsqueeze(-1).view(torch.uint8)


_UNUSUAL_DTYPES = (torch.bool, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn)


def _every_dtype_and_width_converts() -> int:
    """Dtypes gloo cannot exchange (bool, int16, unsigned, float8) and empty rows convert exactly, both ways."""
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    length = 4 * cp
    cu = [0, 1, 2 * cp + 1, length]
    plan = build_thd_cp_layout_plan(torch.tensor(cu, dtype=torch.int32), length, group)
    packed_positions, _ = thd_positions(cu, None, cp, 1)
    own = list(range(rank * length // cp, (rank + 1) * length // cp))
    cases = [
        (dense_positions("contiguous", cp, 1, length)[rank], dense_positions("zigzag", cp, 1, length)[rank], None),
        (own, packed_positions[rank], plan),
    ]
    checks = 0
    for contiguous, zigzag, thd_plan in cases:
        for dtype in _UNUSUAL_DTYPES:
            for shape in ((length,), (length, 2, 3)):
                values = (torch.arange(1, math.prod(shape) + 1) % 7).reshape(shape)
                for seq_dim, numbers in ((0, values), (1, torch.stack([values, values.flip(0)]))):
                    stream, local = numbers.to(dtype), take(numbers, contiguous, seq_dim).to(dtype)
                    converted = contiguous_to_zigzag(local, group, thd_plan=thd_plan, seq_dim=seq_dim)
                    assert converted.dtype == dtype
                    assert torch.equal(_as_bytes(converted), take(_as_bytes(stream), zigzag, seq_dim)), (dtype, shape)
                    back = zigzag_to_contiguous(converted, group, thd_plan=thd_plan, seq_dim=seq_dim)
                    assert torch.equal(_as_bytes(back), _as_bytes(local)), (dtype, shape, seq_dim)
                    checks += 1
        for shape in ((length, 0), (2, length, 0)):
            seq_dim = len(shape) - 2
            empty = torch.zeros(shape).narrow(seq_dim, 0, len(contiguous))
            converted = contiguous_to_zigzag(empty, group, thd_plan=thd_plan, seq_dim=seq_dim)
            assert converted.shape == take(torch.zeros(shape), zigzag, seq_dim).shape
            assert zigzag_to_contiguous(converted, group, thd_plan=thd_plan, seq_dim=seq_dim).shape == empty.shape
            checks += 1
    return checks


@pytest.mark.parametrize("cp", [2, 3])
def test_every_dtype_and_empty_rows_convert_exactly(cp):
    counts = run_on_ranks(_every_dtype_and_width_converts, cp, timeout=120)
    assert counts == [2 * (len(_UNUSUAL_DTYPES) * 2 * 2 + 2)] * cp


def _second_order_gradients() -> list[bool]:
    """A backward that builds a graph (``create_graph=True``) differentiates through the inverse conversion too."""
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    length = 4 * cp
    cu = [0, 3, length]
    plan = build_thd_cp_layout_plan(torch.tensor(cu, dtype=torch.int32), length, group)
    packed_positions, _ = thd_positions(cu, None, cp, 1)
    own = list(range(rank * length // cp, (rank + 1) * length // cp))
    weights = _random((length, 2), 11)
    outcomes = []
    for contiguous, zigzag, thd_plan in (
        (dense_positions("contiguous", cp, 1, length)[rank], dense_positions("zigzag", cp, 1, length)[rank], None),
        (own, packed_positions[rank], plan),
    ):
        local = torch.zeros(len(contiguous), 2, dtype=torch.float64, requires_grad=True)
        converted = contiguous_to_zigzag(local, group, thd_plan=thd_plan)
        upstream = torch.ones_like(converted, requires_grad=True)
        (gradient,) = torch.autograd.grad(converted, local, upstream, create_graph=True)
        # the gradient is the inverse conversion of ``upstream``, so d<gradient, w>/d upstream is w converted
        (second,) = torch.autograd.grad((gradient * take(weights, contiguous)).sum(), upstream)
        outcomes.append(torch.equal(second, take(weights, zigzag)))
    return outcomes


def test_second_order_gradients_go_through_the_inverse_conversion():
    assert run_on_ranks(_second_order_gradients, 2, timeout=120) == [[True, True]] * 2
