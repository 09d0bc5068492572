"""Bad ``cp_zigzag`` arguments and bad batches give the same ``ValueError`` on every rank, naming the numbers."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import instantiate_class
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from lightning_cp import CPZigzagStrategy
from tests.distributed_harness import run_outcomes
from tests.model_helpers import TRAINER_OPTIONS, TinyTransformer, packed_batches

torch.set_num_threads(1)

WORLD_SIZE = 4
BAD_ARGUMENTS = {
    "cp does not divide the world": (
        {"context_parallel_size": 3},
        "world size 4 is not divisible by context_parallel_size x tensor_parallel_size = 3 x 1 = 3",
    ),
    "cp x tp does not divide the world": (
        {"context_parallel_size": 2, "tensor_parallel_size": 3, "data_parallel": "fsdp"},
        "world size 4 is not divisible by context_parallel_size x tensor_parallel_size = 2 x 3 = 6",
    ),
    "dp does not fit": (
        {"context_parallel_size": 2, "data_parallel_size": 3},
        "data_parallel_size=3 does not fit world size 4: it must be world size / (context_parallel_size x "
        "tensor_parallel_size) = 4 / 2 = 2",
    ),
    "cp below 1": ({"context_parallel_size": 0}, "context_parallel_size=0 is invalid: expected an integer >= 1"),
    "tp below 1": ({"tensor_parallel_size": -1}, "tensor_parallel_size=-1 is invalid: expected an integer >= 1"),
    "dp below 1": ({"data_parallel_size": 0}, "data_parallel_size=0 is invalid: expected an integer >= 1 or 'auto'"),
    "sequence parallel without tp": (
        {"sequence_parallel": True},
        "sequence_parallel=True needs tensor_parallel_size > 1, got tensor_parallel_size=1",
    ),
    "unknown boundary layout": (
        {"boundary_layout": "diagonal"},
        "boundary_layout='diagonal' is invalid: expected 'contiguous' or 'zigzag'",
    ),
    "unknown attention mode": (
        {"attention_mode": "tree"},
        "attention_mode='tree' is invalid: expected one of 'allgather', 'ring', 'ulysses', 'hybrid'",
    ),
}


def bad_batch() -> dict[str, torch.Tensor]:
    """Return a packed batch whose ``cu_seqlens`` stop short of the token count."""
    batch = packed_batches(1)[0]
    batch["cu_seqlens"] = batch["cu_seqlens"][:-1]
    return batch


def fit_each_case(world_size: int) -> dict[str, str]:
    """Try every bad argument (and last a bad batch) and return each case's ``ValueError`` message."""
    messages = {}
    cases = [(name, arguments, [packed_batches(1)[0]]) for name, (arguments, _) in BAD_ARGUMENTS.items()]
    cases.append(("bad batch", {"context_parallel_size": 4}, [bad_batch()]))
    for name, arguments, batches in cases:
        os.environ["WORLD_SIZE"] = str(world_size)
        try:
            trainer = pl.Trainer(
                devices=world_size, strategy=CPZigzagStrategy(**arguments), max_steps=1, **TRAINER_OPTIONS
            )
            trainer.fit(TinyTransformer(), DataLoader(batches, batch_size=None))
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages


@pytest.fixture(scope="module")
def messages_by_rank() -> list[dict[str, str]]:
    """Run all cases once on four ranks."""
    return run_outcomes(fit_each_case, WORLD_SIZE, WORLD_SIZE, init_process_group=False, timeout=120)


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_fails_the_same_way_on_every_rank(case: str, messages_by_rank: list[dict[str, str]]) -> None:
    """Each rank raises ``ValueError`` with the expected message."""
    expected = BAD_ARGUMENTS[case][1]
    for rank, messages in enumerate(messages_by_rank):
        assert isinstance(messages, dict), f"rank {rank} failed outside the cases: {messages}"
        assert expected in messages[case], f"rank {rank}: {messages[case]!r}"
    assert len({messages[case] for messages in messages_by_rank}) == 1


def test_bad_batch_fails_the_same_way_on_every_rank(messages_by_rank: list[dict[str, str]]) -> None:
    """A packed batch whose offsets do not end at the token count is rejected before any collective."""
    for messages in messages_by_rank:
        assert "cu_seqlens must start at 0 and end at the token count" in messages["bad batch"]
    assert len({messages["bad batch"] for messages in messages_by_rank}) == 1


def test_strategy_is_configurable_from_yaml_class_path() -> None:
    """``class_path``/``init_args`` from YAML build the strategy with those arguments; defaults fill the rest."""
    config = OmegaConf.create(
        """
        strategy:
          class_path: lightning_cp.CPZigzagStrategy
          init_args:
            context_parallel_size: 2
            attention_mode: ring
            boundary_layout: zigzag
            find_unused_parameters: true
        """
    )
    strategy = instantiate_class((), OmegaConf.to_container(config.strategy))
    assert isinstance(strategy, CPZigzagStrategy)
    assert (strategy.context_parallel_size, strategy.attention_mode, strategy.boundary_layout) == (2, "ring", "zigzag")
    assert (strategy.tensor_parallel_size, strategy.data_parallel_size, strategy.sequence_parallel) == (
        1,
        "auto",
        False,
    )
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}


def test_strategy_name_resolves_through_lightning() -> None:
    """``Trainer(strategy="cp_zigzag")`` builds a ``CPZigzagStrategy`` with defaults."""
    trainer = pl.Trainer(strategy="cp_zigzag", devices=1, **TRAINER_OPTIONS)
    assert isinstance(trainer.strategy, CPZigzagStrategy)
    assert trainer.strategy.context_parallel_size is None
