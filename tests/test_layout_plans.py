"""Pure plan simulation: every rank's plan, an emulated all-to-all-v, compared with the plain reference layouts."""

from __future__ import annotations

import itertools
import random
from itertools import pairwise

import pytest
import torch

from lightning_cp.core.layout.api import (
    CPLayout,
    _build_group_rank_by_logical_rank,
    _build_layout_redistribution_plan,
    _build_thd_cp_layout_plan_from_rank_order_indices,
    _build_thd_rank_order_indices,
    _local_segment_ids,
    _segment_owner,
    _segments_per_rank,
)
from tests.layout_reference import dense_positions, random_packed_case, take, thd_positions

CP_SIZES = range(1, 9)
TP_SIZES = range(1, 5)


def _group_orders(ranks: int) -> list[tuple[int, ...]]:
    """Identity and a shuffled logical-to-group rank map."""
    shuffled = list(range(ranks))
    random.Random(ranks).shuffle(shuffled)
    return [tuple(range(ranks)), tuple(shuffled)]


def _all_to_all(sends: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Emulate all-to-all-v: ``sends[g][h]`` goes from group rank g to h; each receiver concatenates in g order."""
    return [torch.cat([sends[g][h] for g in range(len(sends))]) for h in range(len(sends))]


def test_segments_per_rank_rule():
    assert [_segments_per_rank(tp) for tp in (1, 2, 3, 4, 5, 6)] == [2, 1, 2, 1, 2, 1]


def test_design_example_facts():
    indices, offsets = _build_thd_rank_order_indices(torch.tensor([0, 3, 8], dtype=torch.int32), None, 2, 1)
    assert indices.tolist() == [0, -1, 3, 4, -1, -1, 1, 2, 5, 6, 7, -1]
    assert offsets.tolist() == [0, 4, 12] and offsets.dtype == torch.int32
    assert _build_group_rank_by_logical_rank((1, 3, 5, 7), (4, 5), tuple(range(8)), 5) == tuple(range(8))
    assert _build_group_rank_by_logical_rank((4, 5, 6, 7), (2, 6), tuple(range(8)), 6) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert _local_segment_ids(CPLayout.ZIGZAG, 2, 0) == (0, 3)
    assert _local_segment_ids("zigzag", 2, 1) == (1, 2)
    assert _local_segment_ids("contiguous", 2, 1) == (2, 3)
    assert [_local_segment_ids("zigzag", 2, 0, 2, t) for t in range(2)] == [(0,), (3,)]
    assert [_local_segment_ids("zigzag", 2, 1, 4, t) for t in range(4)] == [(2,), (3,), (4,), (5,)]


def test_non_cartesian_groups_are_rejected():
    with pytest.raises(ValueError, match="Cartesian product"):
        _build_group_rank_by_logical_rank((0, 1), (0, 1), (0, 1, 2, 3), 0)
    with pytest.raises(ValueError, match="not the product"):
        _build_group_rank_by_logical_rank((0, 1), (0, 2), (0, 1, 2), 0)


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="'ring'.*'contiguous', 'zigzag'"):
        _local_segment_ids("ring", 2, 0)
    assert CPLayout("zigzag") is CPLayout.ZIGZAG and CPLayout.ZIGZAG == "zigzag"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_segment_ownership_matches_reference(cp, tp):
    per_rank = _segments_per_rank(tp)
    segments = cp * tp * per_rank
    for layout in ("contiguous", "zigzag"):
        reference = dense_positions(layout, cp, tp, segments)
        for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
            owned = _local_segment_ids(layout, cp, cp_rank, tp, tp_rank)
            assert list(owned) == reference[cp_rank * tp + tp_rank]
            assert all(_segment_owner(s, layout, cp, tp) == (cp_rank, tp_rank) for s in owned)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_dense_plans_move_every_token_to_its_reference_place(cp, tp):
    ranks = cp * tp
    length = 2 * ranks * 3
    sequence = torch.arange(length * 2).view(length, 2)
    for source, target in (("contiguous", "zigzag"), ("zigzag", "contiguous")):
        source_positions = dense_positions(source, cp, tp, length)
        target_positions = dense_positions(target, cp, tp, length)
        for order in _group_orders(ranks):
            logical_of_group = {group: logical for logical, group in enumerate(order)}
            sends = []
            plans = {}
            for group_rank in range(ranks):
                logical = logical_of_group[group_rank]
                plan = _build_layout_redistribution_plan(source, target, cp, logical // tp, tp, logical % tp, order)
                plans[group_rank] = plan
                local = sequence[source_positions[logical]]
                segment = local.shape[0] // len(plan.send_slots)
                buffer = torch.cat([local[slot * segment : (slot + 1) * segment] for slot in plan.send_slots])
                splits = [count * segment for count in plan.input_segment_counts]
                sends.append(list(buffer.split(splits)))
            received = _all_to_all(sends)
            for group_rank in range(ranks):
                plan = plans[group_rank]
                segments = received[group_rank].chunk(len(plan.receive_permutation))
                result = torch.cat([segments[index] for index in plan.receive_permutation])
                expected = sequence[target_positions[logical_of_group[group_rank]]]
                assert torch.equal(result, expected), (source, target, cp, tp, group_rank)
                assert sum(plan.output_segment_counts) == len(plan.send_slots)


def _packed_cases(cp: int, tp: int) -> list[tuple[list[int], list[int] | None]]:
    """Seeded random packed cases with and without physical padding."""
    generator = torch.Generator().manual_seed(1000 * cp + tp)
    return [random_packed_case(generator, cp, tp, with_padding) for with_padding in (False, True, False, True)]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_thd_rank_order_matches_reference(cp, tp):
    for cu, cu_padded in _packed_cases(cp, tp):
        indices, offsets = _build_thd_rank_order_indices(
            torch.tensor(cu, dtype=torch.int32),
            None if cu_padded is None else torch.tensor(cu_padded, dtype=torch.int32),
            cp,
            tp,
            expected_source_token_count=(cu_padded or cu)[-1],
        )
        positions, reference_offsets = thd_positions(cu, cu_padded, cp, tp)
        assert indices.tolist() == [p for rank in positions for p in rank], (cu, cu_padded)
        assert offsets.tolist() == reference_offsets


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_thd_plans_replayed_field_by_field_reproduce_the_conversion(cp, tp):
    """Replaying exactly the documented fields (index_select, all-to-all with the split sizes, index_copy into zeros;
    back: index_select, all-to-all, index_select) gives the reference zigzag shards and back; no padding travels."""
    ranks = cp * tp
    for cu, cu_padded in _packed_cases(cp, tp):
        token_count = (cu_padded or cu)[-1]
        positions, offsets = thd_positions(cu, cu_padded, cp, tp)
        indices = torch.tensor([p for rank in positions for p in rank], dtype=torch.int64)
        offsets_tensor = torch.tensor(offsets, dtype=torch.int32)
        stream = torch.arange(1, token_count + 1, dtype=torch.float64).unsqueeze(1) * torch.tensor([1.0, -1.0])
        shard = token_count // ranks
        for order in _group_orders(ranks):
            logical_of_group = {group: logical for logical, group in enumerate(order)}
            plans = {
                g: _build_thd_cp_layout_plan_from_rank_order_indices(
                    indices, token_count, offsets_tensor, cp, logical // tp, tp, logical % tp, order, True
                )
                for g, logical in logical_of_group.items()
            }
            sends = []
            for g in range(ranks):
                plan, logical = plans[g], logical_of_group[g]
                real_slots = [slot for slot, p in enumerate(positions[logical]) if p >= 0]
                assert ((plan.forward_send_indices >= 0) & (plan.forward_send_indices < shard)).all()
                assert sum(plan.forward_input_split_sizes) == plan.forward_send_indices.numel() == shard
                assert sum(plan.forward_output_split_sizes) == len(real_slots), "padding slots are not received"
                assert sorted(plan.forward_receive_positions.tolist()) == real_slots
                assert sorted(plan.reverse_send_indices.tolist()) == real_slots, "padding is never sent back"
                local = stream[logical * shard : (logical + 1) * shard]
                buffer = local.index_select(0, plan.forward_send_indices)
                sends.append(list(buffer.split(list(plan.forward_input_split_sizes))))
            received = _all_to_all(sends)
            zigzag = {}
            for g in range(ranks):
                plan = plans[g]
                out = torch.zeros(plan.zigzag_local_token_count, 2, dtype=stream.dtype)
                out.index_copy_(0, plan.forward_receive_positions, received[g])
                assert torch.equal(out, take(stream, positions[logical_of_group[g]])), (cu, cu_padded, cp, tp, g)
                zigzag[g] = out
            back_sends = [
                list(
                    zigzag[g]
                    .index_select(0, plans[g].reverse_send_indices)
                    .split(list(plans[g].forward_output_split_sizes))
                )
                for g in range(ranks)
            ]
            back = _all_to_all(back_sends)
            for g in range(ranks):
                logical = logical_of_group[g]
                restored = back[g].index_select(0, plans[g].reverse_receive_indices)
                assert torch.equal(restored, stream[logical * shard : (logical + 1) * shard])
                assert plans[g].max_seqlen_padded == max(b - a for a, b in pairwise(offsets))


def test_documented_plan_example():
    """cp=4, cu_seqlens (0, 3, 10, 16), logical rank 0: the fields the layout contract spells out."""
    indices, offsets = _build_thd_rank_order_indices(torch.tensor([0, 3, 10, 16], dtype=torch.int32), None, 4, 1)
    plan = _build_thd_cp_layout_plan_from_rank_order_indices(indices, 16, offsets, 4, 0)
    assert plan.forward_send_indices.tolist() == [0, 3, 1, 2]
    assert plan.forward_input_split_sizes == (2, 1, 1, 0)
    assert plan.forward_output_split_sizes == (2, 0, 1, 0)
    assert plan.forward_receive_positions.tolist() == [0, 2, 4]
    assert plan.reverse_send_indices.tolist() == [0, 2, 4]
    assert plan.reverse_receive_indices.tolist() == [0, 2, 3, 1]
    assert (plan.contiguous_local_token_count, plan.zigzag_local_token_count) == (4, 6)


@pytest.mark.parametrize(
    "change", ["a token placed twice", "an index past the tokens", "a token missing"], ids=lambda change: change
)
def test_malformed_rank_order_indices_give_every_rank_the_same_error(change: str) -> None:
    """The whole order is checked, not only this rank's part, so every rank refuses it alike (before, one rank built
    a plan and another raised, or raised an ``IndexError``)."""
    indices, offsets = _build_thd_rank_order_indices(torch.tensor([0, 3, 8], dtype=torch.int32), None, 2, 1)
    position_of_5, position_of_4 = int((indices == 5).nonzero()), int((indices == 4).nonzero())
    if change == "a token placed twice":
        indices[position_of_4] = 5
    elif change == "an index past the tokens":
        indices[position_of_4] = 9
    else:
        indices[position_of_5] = -1
    for rank in range(2):
        with pytest.raises(ValueError, match="rank_order_indices must place each of the 8 source tokens exactly once"):
            _build_thd_cp_layout_plan_from_rank_order_indices(indices, 8, offsets, 2, rank)
