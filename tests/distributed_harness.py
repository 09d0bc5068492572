"""Fork-started gloo process groups for tests: real collectives, a timeout so a hang fails."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, carried back to the test process."""

    type_name: str
    message: str
    traceback: str


class DistributedTestFailure(AssertionError):
    """Some rank raised, exited abnormally, or the group timed out."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        outcome: Any = fn(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the test process
        outcome = RankError(type(error).__name__, str(error), traceback.format_exc())
    try:
        results.put((rank, outcome))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Fork ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each and return each rank's result.

    A rank that raised yields a ``RankError`` in its slot. Ranks see ``RANK``/``WORLD_SIZE`` and
    friends in the environment; with ``init_process_group`` the default gloo group is up.
    """
    context = mp.get_context("fork")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, init_process_group, fn, args, kwargs, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, outcome = results.get(timeout=timeout)
            outcomes[rank] = outcome
    except Exception as error:  # queue.Empty: some rank hangs or died without reporting
        for process in processes:
            process.kill()
        raise DistributedTestFailure(
            f"timed out after {timeout}s; ranks that reported: {sorted(outcomes)}; "
            f"exit codes: {[process.exitcode for process in processes]}"
        ) from error
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return [outcomes[rank] for rank in range(world_size)]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like ``run_outcomes`` but fail the test if any rank raised, showing that rank's traceback."""
    outcomes = run_outcomes(fn, world_size, *args, **kwargs)
    errors = [(rank, outcome) for rank, outcome in enumerate(outcomes) if isinstance(outcome, RankError)]
    if errors:
        rank, error = errors[0]
        raise DistributedTestFailure(f"rank {rank} raised {error.type_name}: {error.message}\n{error.traceback}")
    return outcomes


def assert_same_error_on_every_rank(
    fn: Callable[..., Any], world_size: int, *args: Any, match: str, error_type: str = "ValueError", **kwargs: Any
) -> str:
    """Run ``fn`` on every rank and assert each rank raised the same ``error_type`` whose message contains ``match``."""
    outcomes = run_outcomes(fn, world_size, *args, **kwargs)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankError), f"rank {rank} did not raise; it returned {outcome!r}"
        assert outcome.type_name == error_type, f"rank {rank} raised {outcome.type_name}: {outcome.traceback}"
        assert match in outcome.message, f"rank {rank}: {match!r} not in {outcome.message!r}"
    messages = {outcome.message for outcome in outcomes}
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    return outcomes[0].message
