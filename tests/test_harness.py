"""The harness itself: results come back, errors are reported, hangs time out."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed_harness import DistributedTestFailure, assert_same_error_on_every_rank, run_on_ranks


def _sum_of_ranks() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def _raise_value_error() -> None:
    raise ValueError("bad input 7")


def _both_ranks_wait_for_each_other() -> None:
    dist.recv(torch.empty(1), src=1 - dist.get_rank())


def test_results_come_back_from_every_rank():
    assert run_on_ranks(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]


def test_same_error_on_every_rank_is_detected():
    assert assert_same_error_on_every_rank(_raise_value_error, 2, match="bad input") == "bad input 7"


def test_a_hang_fails_instead_of_freezing():
    with pytest.raises(DistributedTestFailure, match="timed out"):
        run_on_ranks(_both_ranks_wait_for_each_other, 2, timeout=5)
