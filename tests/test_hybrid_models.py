"""Hybrid attention/recurrent models under CP against one process running each document on its own (float64): the
own-module example's and the built-in model's recurrent blocks, documents starting inside shards and shards shorter
than the convolution."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp import ContextParallelRuntime, ContextParallelSetting, cp_cross_entropy
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.train.models import LlamaConfig, LlamaDecoder
from tests.distributed_harness import run_on_ranks

_PATH = Path(__file__).resolve().parents[1] / "examples" / "own_module.py"
_SPEC = importlib.util.spec_from_file_location("own_module_example", _PATH)
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)

DOCUMENTS = {
    # 48 tokens: the third document crosses every shard boundary at cp 2 and 3 and holds all of the middle shard at
    # cp 3 (so the state entering the last shard is composed over two ranks); documents start inside shards
    "long": (3, 2, 38, 1, 4),
    # 6 tokens: shards of 2 (cp 3) or 3 (cp 2) tokens, fewer than the convolution's 3 earlier taps at cp 3
    "short": (2, 4),
}
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "example": lambda: example.TinyLM(dim=16, heads=2, layers=4, max_len=64, hybrid=True),
    "built-in": lambda: LlamaDecoder(
        LlamaConfig(
            hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=32,
            layer_types=["attention", "recurrent", "mamba", "convolution"],
        )
    ),
}  # fmt: skip


def _model(name: str) -> torch.nn.Module:
    """A hybrid model in float64, the same on every rank."""
    torch.manual_seed(0)
    return MODELS[name]().double()


def _token_ids(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 257, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))


def _one_process(name: str, lengths: tuple[int, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean next-token loss over the packed documents, each run on its own in one process, and its gradients."""
    model, token_ids = _model(name), _token_ids(lengths)
    losses, count = [], 0
    for document in token_ids.split(lengths, 1):
        logits = model(document, torch.arange(document.shape[1]).unsqueeze(0))
        losses.append(F.cross_entropy(logits[0, :-1], document[0, 1:], reduction="sum"))
        count += document.shape[1] - 1
    loss = sum(losses) / count
    loss.backward()
    return loss.item(), {key: parameter.grad.clone() for key, parameter in model.named_parameters()}


def _context_parallel(name: str, lengths: tuple[int, ...]) -> tuple[float, dict[str, np.ndarray]]:
    """The same loss and gradients from a packed batch at cp = the world size (gradients averaged over the ranks;
    as arrays, which leave a forked rank without shared memory)."""
    cp = dist.get_world_size()
    model = _model(name)
    runtime = ContextParallelRuntime(ContextParallelSetting(build_context_parallel_mesh("cpu", ParallelDims(1, cp, 1))))
    runtime.wrap(model)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = {"input_ids": _token_ids(lengths), "cu_seqlens": offsets}
    with runtime.step(batch):
        logits = model(batch["input_ids"], batch["position_ids"])
        result = cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])
    result.loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= cp
    return result.mean.item(), {key: parameter.grad.numpy().copy() for key, parameter in model.named_parameters()}


@pytest.mark.parametrize("documents", DOCUMENTS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cp", [2, 3])
def test_a_hybrid_model_at_cp_equals_one_process(cp: int, model: str, documents: str) -> None:
    """Attention blocks on zigzag shards, recurrent blocks (a short convolution and a gated linear recurrence) and
    Mamba2 blocks on contiguous ones, convolution blocks next to attention: the loss and every parameter's gradient
    equal one process's (float64, relative 1e-10)."""
    lengths = DOCUMENTS[documents]
    expected_loss, expected_gradients = _one_process(model, lengths)
    for loss, gradients in run_on_ranks(_context_parallel, cp, model, lengths):
        assert abs(loss - expected_loss) <= 1e-10 * expected_loss
        for key, expected in expected_gradients.items():
            error = (torch.from_numpy(gradients[key]) - expected).abs().max().item()
            assert error <= 1e-10 * expected.abs().max().item(), f"{key}: {error}"
