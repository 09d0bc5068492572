"""``trainer.predict`` under ``cp_zigzag``: ``cp_gather_sequence`` gives every rank the whole batch's per-token outputs,
equal to one process's (float64, 1e-10), for packed and dense batches and either boundary layout; the causal LMs'
own ``predict_step`` returns the whole batch's logits the same way."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import ContextParallelLayoutCallback, CPZigzagStrategy, cp_gather_sequence
from lightning_cp.hf import HFCausalLM
from lightning_cp.train.models.module import LlamaLM
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.model_helpers import HYBRID, POLICY, TRAINER_OPTIONS, TinyTransformer, dense_batches, packed_batches
from tests.test_hf import tiny_model

torch.set_num_threads(1)


class Predictor(TinyTransformer):
    """Predicts each token's logits, gathered over the ranks sharing the sequence."""

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return cp_gather_sequence(self(batch["input_ids"], batch["position_ids"]))


TINY_LLAMA = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def batches() -> list[dict[str, torch.Tensor]]:
    """Two packed and two dense batches (lengths that need padding at cp=2)."""
    return packed_batches(2) + dense_batches(2, seq_len=21)


def predict(world_size: int, strategy: dict[str, Any], model_kind: str = "gathered") -> list[np.ndarray]:
    """Predict the batches with a fresh model under ``cp_zigzag(**strategy)`` (one process: plain Lightning); as
    arrays, which reach the test process by value. ``model_kind``: ``"gathered"`` (``Predictor``), or a causal LM with
    its own ``predict_step``: the main job's ``"llama"`` or ``"hf"`` (``HFCausalLM`` of a tiny Llama), whose layers
    are the default policy's."""
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.manual_seed(0)
    models = {"gathered": lambda: Predictor(HYBRID), "llama": lambda: LlamaLM(**TINY_LLAMA).double(),
              "hf": lambda: HFCausalLM(tiny_model("llama"))}  # fmt: skip
    model = models[model_kind]()
    built_in = model_kind != "gathered"
    trainer = pl.Trainer(
        devices=world_size,
        strategy=CPZigzagStrategy(**strategy) if strategy else "auto",
        callbacks=[] if built_in else [ContextParallelLayoutCallback(**POLICY)],
        **TRAINER_OPTIONS,
    )
    return [prediction.numpy() for prediction in trainer.predict(model, DataLoader(batches(), batch_size=None))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [
        (2, {"context_parallel_size": 2}),
        (2, {"context_parallel_size": 2, "boundary_layout": "zigzag", "attention_mode": "ring"}),
    ],
    ids=["cp2", "cp2-zigzag-boundary"],
)
@pytest.mark.parametrize("model_kind", ["gathered", "llama", "hf"])
def test_predictions_are_the_whole_sequence_on_every_rank(
    world_size: int, strategy: dict[str, Any], model_kind: str
) -> None:
    reference = predict(1, {}, model_kind)
    ranks = run_on_ranks(predict, world_size, world_size, strategy, model_kind, init_process_group=False)
    for rank, predictions in enumerate(ranks):
        assert len(predictions) == len(reference)
        for got, expected in zip(predictions, reference, strict=True):
            assert got.shape == expected.shape, f"rank {rank}"
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10, err_msg=f"rank {rank}")


def validation_loss(world_size: int) -> float:
    """The built-in model's ``val_loss`` over two batches of 2 and 3 targets, at dp = world size (cp 1)."""
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.manual_seed(0)
    model = LlamaLM(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64).double()
    batches = [{"input_ids": torch.tensor([[5, 6, 7]])}, {"input_ids": torch.tensor([[8, 9, 10, 11]])}]
    strategy = CPZigzagStrategy(context_parallel_size=1) if world_size > 1 else "auto"
    trainer = pl.Trainer(devices=world_size, strategy=strategy, **TRAINER_OPTIONS)
    return trainer.validate(model, DataLoader(batches, batch_size=None), verbose=False)[0]["val_loss"]


@pytest.mark.timeout(120)
def test_validation_loss_over_replicas_is_one_devices():
    """Each replica validates one batch: the token-weighted mean over 5 targets is one device's (before, Lightning's
    mean sync of an integer count truncated 5 / 2 and the loss came out 1.25x)."""
    (expected,) = run_on_ranks(validation_loss, 1, 1, init_process_group=False, timeout=100)
    for loss in run_on_ranks(validation_loss, 2, 2, init_process_group=False, timeout=100):
        assert abs(loss - expected) <= 1e-6 * abs(expected), (loss, expected)


class _Stream(torch.utils.data.IterableDataset):
    """The batches as a stream without a length (every replica reads all of them)."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def fsdp_predict(batch_count: int, stream: bool = False) -> list[np.ndarray]:
    """The built-in model's predictions of the first ``batch_count`` batches under ``fsdp`` over two replicas (a
    ``stream``: from an iterable dataset, which Lightning does not split)."""
    os.environ["WORLD_SIZE"] = "2"
    torch.manual_seed(0)
    strategy = CPZigzagStrategy(context_parallel_size=1, data_parallel="fsdp")
    trainer = pl.Trainer(devices=2, strategy=strategy, **TRAINER_OPTIONS)
    items = batches()[:batch_count]
    loader = DataLoader(_Stream(items) if stream else items, batch_size=None)
    return [prediction.numpy() for prediction in trainer.predict(LlamaLM(**TINY_LLAMA).double(), loader)]


@pytest.mark.timeout(120)
def test_fsdp_predict_over_replicas_is_one_devices_or_refused_when_they_would_wait():
    """Under fsdp every forward gathers weights over both replicas: 4 batches split 2 and 2 give one device's
    predictions; 3 split 2 and 1 (the predict sampler does not pad) are refused on every rank (before, the replica
    with the extra batch waited for good)."""
    reference = predict(1, {}, "llama")
    for replica, predictions in enumerate(run_on_ranks(fsdp_predict, 2, 4, init_process_group=False, timeout=100)):
        assert len(predictions) == 2
        for got, expected in zip(predictions, reference[replica::2], strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)
    assert_same_error_on_every_rank(
        fsdp_predict, 2, 3, match="different numbers of batches", init_process_group=False, timeout=100
    )
    for predictions in run_on_ranks(fsdp_predict, 2, 4, True, init_process_group=False, timeout=100):
        assert len(predictions) == 4  # a stream has no length to compare: every replica reads it all
        for got, expected in zip(predictions, reference, strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


class _TestedLM(LlamaLM):
    """The built-in model with a test step (its validation step)."""

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)


def fsdp_evaluate_uneven(stage: str, sanity_steps: int, counts: tuple[int, int]) -> None:
    """``trainer.validate``, ``test`` or ``fit`` (one training batch per replica, then validation) under ``fsdp`` over
    two replicas whose own evaluation loaders (no distributed sampler) hold ``counts`` batches."""
    os.environ["WORLD_SIZE"] = "2"
    uneven = DataLoader(batches()[: counts[int(os.environ["RANK"])]], batch_size=None)
    strategy = CPZigzagStrategy(context_parallel_size=1, data_parallel="fsdp")
    options = {**TRAINER_OPTIONS, "num_sanity_val_steps": sanity_steps, "max_steps": 1}
    trainer = pl.Trainer(devices=2, strategy=strategy, use_distributed_sampler=False, **options)
    model = _TestedLM(**TINY_LLAMA).double()
    if stage == "fit":
        trainer.fit(model, DataLoader(batches()[:1], batch_size=None), uneven)
    else:
        getattr(trainer, stage)(model, uneven)


@pytest.mark.parametrize(
    ("stage", "sanity_steps", "counts"),
    [("validate", 0, (2, 1)), ("test", 0, (2, 1)), ("fit", 0, (2, 1)), ("fit", 2, (2, 1)), ("fit", 2, (3, 2))],
)
def test_fsdp_evaluation_loaders_that_give_replicas_different_batch_counts_are_refused(stage, sanity_steps, counts):
    """Validation (also validation inside ``fit``, after a sanity check or none) and test loaders that give the fsdp
    replicas different numbers of batches are refused on every rank, as predict ones are (before, the replica with
    the extra batch waited for the other's weight gathers until the collective timeout, 30 minutes by default). The
    sanity check's own cap does not hide it: validation in ``fit`` reuses the loader it checked (3 and 2 batches
    give 2 and 2 sanity steps, then 3 and 2 validation steps)."""
    assert_same_error_on_every_rank(
        fsdp_evaluate_uneven, 2, stage, sanity_steps, counts, match="different numbers of batches",
        init_process_group=False, timeout=100,
    )  # fmt: skip
