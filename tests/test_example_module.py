"""The own-module example's hybrid model at cp 2 and 3 against one process running each document on its own
(float64)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp import ContextParallelRuntime, ContextParallelSetting, cp_cross_entropy
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from tests.distributed_harness import run_on_ranks

_PATH = Path(__file__).resolve().parents[1] / "examples" / "own_module.py"
_SPEC = importlib.util.spec_from_file_location("own_module_example", _PATH)
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)

DOCUMENT_LENGTHS = (3, 2, 38, 1, 4)  # 48 tokens: the third document crosses every shard boundary at cp 2 and 3
# and holds all of the middle shard at cp 3, so the state entering the last shard is composed over two ranks


def _model() -> torch.nn.Module:
    """The example's hybrid model (attention, recurrence, attention, recurrence) in float64, the same on every rank."""
    torch.manual_seed(0)
    return example.TinyLM(dim=16, heads=2, layers=4, max_len=64, hybrid=True).double()


def _token_ids() -> torch.Tensor:
    return torch.randint(0, 257, (1, sum(DOCUMENT_LENGTHS)), generator=torch.Generator().manual_seed(1))


def _one_process() -> tuple[float, dict[str, torch.Tensor]]:
    """Mean next-token loss over the packed documents, each run on its own in one process, and its gradients."""
    model, token_ids = _model(), _token_ids()
    losses, count = [], 0
    for document in token_ids.split(DOCUMENT_LENGTHS, 1):
        logits = model(document, torch.arange(document.shape[1]).unsqueeze(0))
        losses.append(F.cross_entropy(logits[0, :-1], document[0, 1:], reduction="sum"))
        count += document.shape[1] - 1
    loss = sum(losses) / count
    loss.backward()
    return loss.item(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def _context_parallel() -> tuple[float, dict[str, np.ndarray]]:
    """The same loss and gradients from a packed batch at cp = the world size (gradients averaged over the ranks;
    as arrays, which leave a forked rank without shared memory)."""
    cp = dist.get_world_size()
    model = _model()
    runtime = ContextParallelRuntime(ContextParallelSetting(build_context_parallel_mesh("cpu", ParallelDims(1, cp, 1))))
    runtime.wrap(model)
    offsets = torch.tensor([0, *torch.tensor(DOCUMENT_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    batch = {"input_ids": _token_ids(), "cu_seqlens": offsets}
    with runtime.step(batch):
        logits = model(batch["input_ids"], batch["position_ids"])
        result = cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])
    result.loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= cp
    return result.mean.item(), {name: parameter.grad.numpy().copy() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("cp", [2, 3])
def test_the_hybrid_example_model_at_cp_equals_one_process(cp: int) -> None:
    """Attention blocks on zigzag shards, gated linear recurrences with a short convolution on contiguous ones: the
    loss and every parameter's gradient equal one process's (float64, relative 1e-10)."""
    expected_loss, expected_gradients = _one_process()
    for loss, gradients in run_on_ranks(_context_parallel, cp):
        assert abs(loss - expected_loss) <= 1e-10 * expected_loss
        for name, expected in expected_gradients.items():
            error = (torch.from_numpy(gradients[name]) - expected).abs().max().item()
            assert error <= 1e-10 * expected.abs().max().item(), f"{name}: {error}"
