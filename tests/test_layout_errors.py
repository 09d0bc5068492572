"""Bad input: the same ValueError on every rank, before any collective, so nothing hangs (docs/layout.md)."""

from __future__ import annotations

import pytest
import torch

from lightning_cp.core.layout.api import (
    ContextParallelLayoutManager,
    _redistribute_layout,
    build_thd_cp_layout_plan,
    contiguous_to_zigzag,
    zigzag_to_contiguous,
)
from lightning_cp.core.packed import PackedSeqParams
from tests.distributed_harness import RankError, assert_same_error_on_every_rank, run_outcomes
from tests.layout_reference import make_groups


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _bad_inputs(cp_group, tp_group, tp_cp_group) -> dict[str, tuple[str, object]]:
    """Each bad input of section 4 as ``name -> (expected message fragment, call)`` on a tp2 x cp2 world."""
    good_cu = _int32([0, 4, 8])
    plan = build_thd_cp_layout_plan(good_cu, 8, cp_group)
    sequence_parallel = (True, tp_group, tp_cp_group)
    return {
        "cu_seqlens dtype": (
            "dtype torch.int32, got torch.int64",
            lambda: build_thd_cp_layout_plan(torch.tensor([0, 4, 8]), 8, cp_group),
        ),
        "cu_seqlens 2-D": (
            "must be 1-D, got shape (1, 3)",
            lambda: build_thd_cp_layout_plan(_int32([[0, 4, 8]]), 8, cp_group),
        ),
        "cu_seqlens too short": (
            "at least 2 entries, got 1",
            lambda: build_thd_cp_layout_plan(_int32([0]), 0, cp_group),
        ),
        "cu_seqlens start": (
            "must start at 0, got 2",
            lambda: build_thd_cp_layout_plan(_int32([2, 4, 8]), 8, cp_group),
        ),
        "cu_seqlens decreasing": (
            "entry 2 (4) is smaller than entry 1 (6)",
            lambda: build_thd_cp_layout_plan(_int32([0, 6, 4, 8]), 8, cp_group),
        ),
        "padded shape": (
            "cu_seqlens_padded has shape (2,)",
            lambda: build_thd_cp_layout_plan(good_cu, 8, cp_group, _int32([0, 8])),
        ),
        "padded dtype": (
            "cu_seqlens_padded has dtype torch.int64",
            lambda: build_thd_cp_layout_plan(good_cu, 8, cp_group, torch.tensor([0, 4, 8])),
        ),
        "padded device": (
            "cu_seqlens_padded is on meta",
            lambda: build_thd_cp_layout_plan(good_cu, 8, cp_group, torch.empty(3, dtype=torch.int32, device="meta")),
        ),
        "padded shorter": (
            "sequence 0 a padded length of 2, shorter than its actual length 4",
            lambda: build_thd_cp_layout_plan(good_cu, 8, cp_group, _int32([0, 2, 8])),
        ),
        "total_tokens": (
            "total_tokens is 9, but the physical token count",
            lambda: build_thd_cp_layout_plan(good_cu, 9, cp_group),
        ),
        "token count divisibility": (
            "token count 6 is not divisible by cp_size * tp_size = 2 * 2",
            lambda: build_thd_cp_layout_plan(_int32([0, 6]), 6, cp_group, None, *sequence_parallel),
        ),
        "dense local length": (
            "local sequence length 5 (dim 0) is not divisible by the 2 segments",
            lambda: contiguous_to_zigzag(torch.zeros(5, 2), cp_group),
        ),
        "plan token count": (
            "input has 3 tokens on dim 0, but the THD plan expects 4",
            lambda: zigzag_to_contiguous(torch.zeros(3, 2), cp_group, thd_plan=plan),
        ),
        "plan group size": (
            "THD plan was built for a group of 2 ranks, but the conversion group has 4",
            lambda: contiguous_to_zigzag(torch.zeros(4, 2), cp_group, *sequence_parallel, thd_plan=plan),
        ),
        "no tp_group": (
            "sequence_parallel=True requires tp_group",
            lambda: contiguous_to_zigzag(torch.zeros(4, 2), cp_group, True),
        ),
        "no tp_cp_group": (
            "requires tp_cp_group",
            lambda: contiguous_to_zigzag(torch.zeros(4, 2), cp_group, True, tp_group),
        ),
        "unknown layout": (
            "unknown CP layout 'ring'",
            lambda: ContextParallelLayoutManager(("zigzag", "ring"), "contiguous", False, cp_group),
        ),
        "unknown layout conversion": (
            "unknown CP layout 'bogus'",
            lambda: _redistribute_layout(torch.zeros(4, 2), cp_group, "bogus", "zigzag", False, None, None),
        ),
        "kv offsets differ": (
            "cu_seqlens_kv differs from cu_seqlens_q",
            lambda: ContextParallelLayoutManager(("zigzag",), "contiguous", False, cp_group).build_packed_zigzag_layout(
                PackedSeqParams(cu_seqlens_q=good_cu, cu_seqlens_kv=_int32([0, 2, 8]))
            ),
        ),
        "layer index": (
            "layer_index 1 is outside [0, 1)",
            lambda: ContextParallelLayoutManager(("zigzag",), "contiguous", False, cp_group).prepare_layer_input(
                1, torch.zeros(4, 2)
            ),
        ),
        "not Cartesian": (
            "do not form a Cartesian product",
            lambda: contiguous_to_zigzag(torch.zeros(4, 2), cp_group, True, cp_group, tp_cp_group),
        ),
    }


def _every_bad_input() -> dict[str, tuple[str, str, str]]:
    """Run every bad input on this rank; return ``name -> (fragment, error type, message)``; then prove no hang."""
    cp_group, tp_group, tp_cp_group, cp_rank, _ = make_groups(2, 2, tp_fastest=True)
    outcomes = {}
    for name, (fragment, call) in _bad_inputs(cp_group, tp_group, tp_cp_group).items():
        try:
            call()
            outcomes[name] = (fragment, "no error", "")
        except Exception as error:  # noqa: BLE001 - the test compares the type
            outcomes[name] = (fragment, type(error).__name__, str(error))
    converted = contiguous_to_zigzag(torch.arange(4.0) + 4 * cp_rank, cp_group)
    assert converted.tolist() == ([0, 1, 6, 7] if cp_rank == 0 else [2, 3, 4, 5])
    return outcomes


def test_every_bad_input_fails_identically_on_every_rank():
    outcomes = run_outcomes(_every_bad_input, 4, timeout=120)
    failures = [outcome for outcome in outcomes if isinstance(outcome, RankError)]
    assert not failures, failures[0].traceback
    names = list(outcomes[0])
    assert len(names) == 21
    for name in names:
        fragment, error_type, message = outcomes[0][name]
        assert error_type == "ValueError", f"{name}: got {error_type} {message}"
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
        assert all(outcome[name] == outcomes[0][name] for outcome in outcomes), f"{name} differs across ranks"


def _bad_total_tokens_on_cp3() -> None:
    cp_group = make_groups(3, 1)[0]
    build_thd_cp_layout_plan(_int32([0, 3, 8]), 12, cp_group)


def _indivisible_token_count_on_cp3() -> None:
    cp_group = make_groups(3, 1)[0]
    build_thd_cp_layout_plan(_int32([0, 3, 8]), 8, cp_group)


def _wrong_plan_input_on_cp3() -> None:
    cp_group = make_groups(3, 1)[0]
    plan = build_thd_cp_layout_plan(_int32([0, 3, 9]), 9, cp_group)
    contiguous_to_zigzag(torch.zeros(plan.zigzag_local_token_count + 1, 2), cp_group, thd_plan=plan)


@pytest.mark.parametrize(
    ("rank_function", "fragment"),
    [
        (_bad_total_tokens_on_cp3, "total_tokens is 12, but the physical token count of the packed sequences is 8"),
        (_indivisible_token_count_on_cp3, "packed token count 8 is not divisible by cp_size * tp_size = 3 * 1"),
        (_wrong_plan_input_on_cp3, "THD plan expects 3 local tokens in the contiguous layout"),
    ],
)
def test_same_error_on_every_rank_of_cp3(rank_function, fragment):
    assert_same_error_on_every_rank(rank_function, 3, match=fragment, timeout=60)
