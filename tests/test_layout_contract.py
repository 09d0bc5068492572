"""The layout module's contract without processes: stand-in groups, patchable converters, mutable per-forward state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_cp import layout
from lightning_cp.packed import PackedSeqParams
from tests.layout_reference import take, thd_positions

HYBRID_WALK = ("zigzag", "zigzag", "contiguous", "contiguous", "zigzag")


def stand_in_group(size: int, rank: int = 0) -> SimpleNamespace:
    """An object with only ``size()`` and ``rank()``, as the reference's own tests use."""
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


def _offsets(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("cp", [2, 3, 8])
def test_plans_from_stand_in_groups_replay_to_the_reference_layout(cp: int):
    """Every rank's plan, built with a stand-in group and no process, moves the stream to the plain reference's
    zigzag slots when its fields are replayed through an emulated all-to-all, and back."""
    total = 48
    cu = [0, 3, 10, 16, total]
    positions, offsets = thd_positions(cu, None, cp, 1)
    plans = [layout.build_thd_cp_layout_plan(_offsets(cu), total, stand_in_group(cp, rank)) for rank in range(cp)]
    stream = torch.arange(1.0, total + 1).unsqueeze(1)
    shard = total // cp
    sent = [stream[r * shard : (r + 1) * shard].index_select(0, p.forward_send_indices) for r, p in enumerate(plans)]
    parts = [list(buffer.split(list(p.forward_input_split_sizes))) for buffer, p in zip(sent, plans, strict=True)]
    for rank, plan in enumerate(plans):
        assert plan.cu_seqlens_padded.tolist() == offsets and plan.pad_between_seqs == (offsets != cu)
        assert plan.max_seqlen_padded == max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
        received = torch.cat([parts[source][rank] for source in range(cp)])
        zigzag = torch.zeros(plan.zigzag_local_token_count, 1).index_copy_(0, plan.forward_receive_positions, received)
        assert torch.equal(zigzag, take(stream, positions[rank]))
        back = [zigzag.index_select(0, plan.reverse_send_indices).split(list(plan.forward_output_split_sizes))]
        assert sum(len(part) for part in back[0]) == sum(p >= 0 for p in positions[rank])


def test_manager_and_dense_state_take_stand_in_groups():
    manager = layout.ContextParallelLayoutManager(HYBRID_WALK, "contiguous", False, stand_in_group(2), None, None)
    assert manager.requires_conversion
    state = manager.build_forward_state(None)
    assert isinstance(state, layout.ContextParallelLayoutState) and state.thd_plan is None
    single = layout.ContextParallelLayoutManager(HYBRID_WALK, "contiguous", False, stand_in_group(1), None, None)
    assert not single.requires_conversion and single.build_forward_state(None) is None


def test_manager_dispatches_through_the_patched_module_converters(monkeypatch):
    calls: list[tuple[str, tuple]] = []

    def recorder(name: str):
        def convert(input_, cp_group, sequence_parallel=False, tp_group=None, tp_cp_group=None, thd_plan=None):
            calls.append((name, (cp_group, sequence_parallel, tp_group, tp_cp_group, thd_plan)))
            return input_ + (1 if name == "contiguous_to_zigzag" else 100)

        return convert

    monkeypatch.setattr(layout, "contiguous_to_zigzag", recorder("contiguous_to_zigzag"))
    monkeypatch.setattr(layout, "zigzag_to_contiguous", recorder("zigzag_to_contiguous"))
    group = stand_in_group(2)
    state = layout.ContextParallelLayoutManager(
        HYBRID_WALK, "contiguous", False, group, None, None
    ).build_forward_state(None)
    hidden = torch.zeros(4, 3)
    for index in range(len(HYBRID_WALK)):
        hidden, _ = state.prepare_layer(index, hidden)
        hidden = state.finalize_layer(index, hidden)
    assert [name for name, _ in calls] == [
        "contiguous_to_zigzag",
        "zigzag_to_contiguous",
        "contiguous_to_zigzag",
        "zigzag_to_contiguous",
    ]
    assert all(arguments == (group, False, None, None, None) for _, arguments in calls)
    assert torch.equal(hidden, torch.full((4, 3), 202.0)), "the patched converters' results are used"


def test_packed_layout_builds_its_plan_through_the_module_builder(monkeypatch):
    built = []
    original = layout.build_thd_cp_layout_plan

    def recording_builder(*args, **kwargs):
        built.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(layout, "build_thd_cp_layout_plan", recording_builder)
    manager = layout.ContextParallelLayoutManager(("zigzag",), "contiguous", False, stand_in_group(2), None, None)
    plan, params = manager.build_packed_zigzag_layout(PackedSeqParams(cu_seqlens_q=_offsets([0, 3, 8])))
    assert len(built) == 1 and built[0][1] == 8
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12] and plan.zigzag_local_token_count == 6


def test_layout_state_fields_can_be_assigned():
    manager = layout.ContextParallelLayoutManager(("zigzag",), "contiguous", False, stand_in_group(2), None, None)
    state = manager.build_forward_state(None)
    plan, params = manager.build_packed_zigzag_layout(PackedSeqParams(cu_seqlens_q=_offsets([0, 3, 8])))
    state.thd_plan = plan
    state.zigzag_packed_seq_params = params
    state.contiguous_packed_seq_params = PackedSeqParams(cu_seqlens_q=_offsets([0, 3, 8]))
    assert state.thd_plan is plan and state.packed_seq_params_for("zigzag") is params
