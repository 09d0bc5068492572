"""The layer manager on gloo ranks: counted collectives, per-layer layouts and metadata, per-token tensors, no-ops."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist

from lightning_cp.core import comm
from lightning_cp.core.layout.api import ContextParallelLayoutManager, ContextParallelLayoutState, CPLayout
from lightning_cp.core.packed import PackedSeqParams
from tests.distributed_harness import run_on_ranks
from tests.layout_reference import dense_positions, make_groups, take, thd_positions

WALK = ("zigzag", "zigzag", "contiguous", "contiguous", "zigzag")


def _count_all_to_all_calls() -> list[int]:
    """Wrap ``comm.all_to_all_v_into`` in this process so every call is recorded; return the record."""
    calls: list[int] = []
    original = comm.all_to_all_v_into

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    comm.all_to_all_v_into = counted
    return calls


def _integers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Integer-valued float64 data, so products of layer scales stay exact in any order."""
    return torch.randint(-99, 100, shape, generator=torch.Generator().manual_seed(seed)).double()


def _walk(state, hidden: torch.Tensor, reference_input, expected_params) -> torch.Tensor:
    """Run the layer walk with layers that scale by ``i + 2``; check each layer's input and metadata."""
    for index, layout in enumerate(WALK):
        layer_input, params = state.prepare_layer(index, hidden)
        assert state.layout_of_layer(index) is CPLayout(layout)
        assert torch.equal(layer_input, reference_input(index, layout)), (index, layout)
        assert params is expected_params(layout)
        hidden = state.finalize_layer(index, layer_input * (index + 2))
    return hidden


def _dense_walk(cp_group, cp_rank: int, calls: list[int]) -> None:
    """Dense ``[B, S, H]`` walk with seq_dim=1: 4 conversions forward, 4 backward, exact values and gradient."""
    cp = comm.group_size(cp_group)
    length = 2 * cp * 2
    sequence = _integers((2, length, 3), seed=0)
    upstream = _integers((2, length, 3), seed=1)
    manager = ContextParallelLayoutManager(WALK, "contiguous", False, cp_group, seq_dim=1)
    assert manager.requires_conversion and manager.layout_of_layer(-1) is CPLayout.CONTIGUOUS
    state = manager.build_forward_state(None)
    assert state.thd_plan is None
    contiguous = dense_positions("contiguous", cp, 1, length)[cp_rank]
    local = take(sequence, contiguous, 1).requires_grad_()

    def reference_input(index: int, layout: str) -> torch.Tensor:
        scale = torch.tensor([i + 2 for i in range(index)], dtype=torch.float64).prod()
        return take(sequence * scale, dense_positions(layout, cp, 1, length)[cp_rank], 1)

    start = len(calls)
    output = _walk(state, local, reference_input, lambda layout: None)
    assert len(calls) - start == 4
    total_scale = 2 * 3 * 4 * 5 * 6
    assert torch.equal(output, take(sequence * total_scale, contiguous, 1))
    output.backward(take(upstream, contiguous, 1))
    assert len(calls) - start == 8
    assert torch.equal(local.grad, take(upstream * total_scale, contiguous, 1))


def _packed_walk(cp_group, cp_rank: int, calls: list[int]) -> None:
    """Packed ``[1, T, H]`` walk: zigzag layers get padded metadata, the rest the original; ids and masks convert."""
    cp = comm.group_size(cp_group)
    cu = [0, 1, 6, 3 * 2 * cp + 6]
    token_count = cu[-1] + (-cu[-1]) % cp
    cu[-1] = token_count
    positions, offsets = thd_positions(cu, None, cp, 1)
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(cu_seqlens_q=cu_tensor, cu_seqlens_kv=cu_tensor, max_seqlen_q=20, max_seqlen_kv=20)
    manager = ContextParallelLayoutManager(WALK, CPLayout.CONTIGUOUS, False, cp_group, seq_dim=1)
    state = manager.build_forward_state(params)
    zigzag = state.zigzag_packed_seq_params
    assert state.contiguous_packed_seq_params is params
    assert zigzag.cu_seqlens_q_padded.tolist() == offsets and zigzag.cu_seqlens_kv_padded.tolist() == offsets
    assert zigzag.cu_seqlens_q.tolist() == cu and zigzag.qkv_format == "thd"
    longest = max(b - a for a, b in pairwise(offsets))
    assert zigzag.max_seqlen_q == longest and zigzag.max_seqlen_kv == longest
    assert zigzag.total_tokens is None and zigzag.seq_idx is None and zigzag.pad_between_seqs is True
    shard = token_count // cp
    own = list(range(cp_rank * shard, (cp_rank + 1) * shard))
    stream = _integers((token_count, 5), seed=2)
    local = stream[own].unsqueeze(0)

    def reference_input(index: int, layout: str) -> torch.Tensor:
        scale = torch.tensor([i + 2 for i in range(index)], dtype=torch.float64).prod()
        chosen = positions[cp_rank] if layout == "zigzag" else own
        return take(stream * scale, chosen).unsqueeze(0)

    start = len(calls)
    output = _walk(state, local, reference_input, state.packed_seq_params_for)
    assert len(calls) - start == 4
    assert torch.equal(output, local * (2 * 3 * 4 * 5 * 6))

    position_ids = torch.arange(token_count)[own].unsqueeze(0)
    zigzag_ids = state.convert(position_ids, "contiguous", "zigzag")
    assert zigzag_ids.dtype == torch.int64
    assert torch.equal(zigzag_ids, take(torch.arange(token_count), positions[cp_rank]).unsqueeze(0))
    assert torch.equal(state.convert(zigzag_ids, CPLayout.ZIGZAG, CPLayout.CONTIGUOUS), position_ids)
    mask = (torch.arange(token_count) % 3 == 0)[own].unsqueeze(0)
    zigzag_mask = state.convert(mask, "contiguous", "zigzag")
    expected_mask = torch.tensor([p >= 0 and p % 3 == 0 for p in positions[cp_rank]]).unsqueeze(0)
    assert zigzag_mask.dtype == torch.bool and torch.equal(zigzag_mask, expected_mask)
    assert state.convert(mask, "zigzag", "zigzag") is mask
    assert len(calls) - start == 7


def _manager_checks() -> str:
    """Counted walks on a cp=2 group, then the cases where nothing may happen."""
    calls = _count_all_to_all_calls()
    rank = dist.get_rank()
    cp_group = dist.new_group([0, 1])
    _dense_walk(cp_group, rank, calls)
    _packed_walk(cp_group, rank, calls)

    only_zigzag = ContextParallelLayoutManager(("zigzag",) * 3, "contiguous", False, cp_group)
    hidden = torch.arange(8.0).view(4, 2) + 10 * rank
    state = only_zigzag.build_forward_state(None)
    start = len(calls)
    for index in range(3):
        hidden = state.finalize_layer(index, state.prepare_layer(index, hidden)[0])
    assert len(calls) - start == 2 and torch.equal(hidden, torch.arange(8.0).view(4, 2) + 10 * rank)

    single_rank_groups = [dist.new_group([r]) for r in range(2)]
    cp1 = ContextParallelLayoutManager(WALK, "contiguous", False, single_rank_groups[rank])
    unchanged = ContextParallelLayoutManager(("zigzag",) * 2, "zigzag", False, cp_group)
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 8], dtype=torch.int32))
    start = len(calls)
    for manager in (cp1, unchanged):
        assert not manager.requires_conversion
        assert manager.build_forward_state(None) is None and manager.build_forward_state(params) is None
        for index in range(len(manager.layer_layouts)):
            assert manager.prepare_layer_input(index, hidden) is hidden
            assert manager.finalize_layer_output(index, hidden) is hidden
    assert ContextParallelLayoutState(cp1, None, None, None).convert(hidden, "contiguous", "zigzag") is hidden
    assert len(calls) == start
    return "ok"


def test_manager_walks_convert_only_at_layout_changes():
    assert run_on_ranks(_manager_checks, 2, timeout=120) == ["ok", "ok"]


def _conversion_state_check() -> str:
    """``build_conversion_state`` without a layout transition: a working plan and zigzag metadata; None at cp=1."""
    calls = _count_all_to_all_calls()
    rank = dist.get_rank()
    cp_group = dist.new_group([0, 1])
    single_rank_groups = [dist.new_group([r]) for r in range(2)]
    cu = [0, 3, 8]
    positions, offsets = thd_positions(cu, None, 2, 1)
    assert offsets == [0, 4, 12] and positions[rank] == [[0, -1, 3, 4, -1, -1], [1, 2, 5, 6, 7, -1]][rank]
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(cu_seqlens_q=cu_tensor, cu_seqlens_kv=cu_tensor, max_seqlen_q=5, max_seqlen_kv=5)
    manager = ContextParallelLayoutManager(("contiguous",) * 2, "contiguous", False, cp_group, seq_dim=1)
    assert not manager.requires_conversion and manager.build_forward_state(params) is None

    state = manager.build_conversion_state(params)
    zigzag = state.zigzag_packed_seq_params
    assert state.contiguous_packed_seq_params is params and state.thd_plan is not None
    assert zigzag.cu_seqlens_q_padded.tolist() == offsets and zigzag.cu_seqlens_kv_padded.tolist() == offsets
    assert zigzag.cu_seqlens_q.tolist() == cu and zigzag.qkv_format == "thd"
    assert zigzag.max_seqlen_q == 8 and zigzag.max_seqlen_kv == 8
    assert zigzag.total_tokens is None and zigzag.seq_idx is None and zigzag.pad_between_seqs is True
    stream = _integers((8, 3), seed=3)
    own = list(range(rank * 4, rank * 4 + 4))
    local = stream[own].unsqueeze(0)
    start = len(calls)
    for index in range(2):
        layer_input, layer_params = state.prepare_layer(index, local)
        assert layer_input is local and layer_params is params
        assert state.finalize_layer(index, local) is local
    assert len(calls) == start
    to_zigzag = state.convert(local, "contiguous", "zigzag")
    assert torch.equal(to_zigzag, take(stream, positions[rank]).unsqueeze(0))
    assert torch.equal(state.convert(to_zigzag, "zigzag", "contiguous"), local)
    assert len(calls) - start == 2

    dense_state = manager.build_conversion_state(None)
    assert dense_state.thd_plan is None and dense_state.zigzag_packed_seq_params is None
    sequence = _integers((2, 8, 3), seed=4)
    dense_local = take(sequence, dense_positions("contiguous", 2, 1, 8)[rank], 1)
    expected = take(sequence, dense_positions("zigzag", 2, 1, 8)[rank], 1)
    assert torch.equal(dense_state.convert(dense_local, "contiguous", "zigzag"), expected)

    cp1 = ContextParallelLayoutManager(WALK, "contiguous", False, single_rank_groups[rank], seq_dim=1)
    assert cp1.build_conversion_state(params) is None and cp1.build_conversion_state(None) is None
    return "ok"


def test_conversion_state_without_layout_transition():
    assert run_on_ranks(_conversion_state_check, 2, timeout=120) == ["ok", "ok"]


def _sequence_parallel_manager_check() -> str:
    """Packed walk over tp2 x cp2 with sequence parallelism: metadata and values per layer."""
    cp_group, tp_group, tp_cp_group, cp_rank, tp_rank = make_groups(2, 2, tp_fastest=False)
    calls = _count_all_to_all_calls()
    cu = [0, 5, 11]
    positions, offsets = thd_positions(cu, [0, 5, 12], 2, 2)
    params = PackedSeqParams(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), cu_seqlens_q_padded=torch.tensor([0, 5, 12]).int()
    )
    manager = ContextParallelLayoutManager(WALK, "contiguous", True, cp_group, tp_group, tp_cp_group)
    state = manager.build_forward_state(params)
    assert state.zigzag_packed_seq_params.cu_seqlens_q_padded.tolist() == offsets
    logical = cp_rank * 2 + tp_rank
    stream = torch.arange(12.0).unsqueeze(1) + 1
    own = list(range(logical * 3, logical * 3 + 3))

    def reference_input(index: int, layout: str) -> torch.Tensor:
        scale = torch.tensor([i + 2 for i in range(index)], dtype=torch.float32).prod()
        return take(stream * scale, positions[logical] if layout == "zigzag" else own)

    output = _walk(state, stream[own], reference_input, state.packed_seq_params_for)
    assert len(calls) == 4 and torch.equal(output, stream[own] * 720)
    return "ok"


def test_sequence_parallel_manager_on_tp2_cp2():
    assert run_on_ranks(_sequence_parallel_manager_check, 4, timeout=120) == ["ok"] * 4
