"""Test helper: the main job's ``LlamaLM`` as the FSDP / tensor-parallel tests train it (float64, AdamW, clipping),
recording losses, batch indices and the bytes of its local model state."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_cp.train.models import LlamaLM
from tests.model_helpers import TRAINER_OPTIONS, VOCAB, dense_batches, packed_batches

STEPS = 5
ARCHITECTURE = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "num_layers": 2,
    "num_heads": 6,
    "num_kv_heads": 6,
    "intermediate_size": 48,
    "init_std": 0.2,
}
FIT_OPTIONS = {**TRAINER_OPTIONS, "precision": "64-true", "gradient_clip_val": 0.5, "max_steps": STEPS}


class RecordingLM(LlamaLM):
    """``LlamaLM`` that records each step's replica mean loss and the bytes this rank holds for its model state."""

    def __init__(self, seed_by_rank: bool = False, **architecture: Any) -> None:
        torch.manual_seed(int(os.environ.get("RANK", "0")) if seed_by_rank else 0)
        super().__init__(lr=3e-2, warmup_steps=0, **{**ARCHITECTURE, **architecture})
        self.losses: list[float] = []
        self.indices: list[int] = []
        self.parameter_and_gradient_bytes = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Return the scaled loss and record the replica mean."""
        out, _ = self._loss(batch)
        self.losses.append(out.mean.item())
        self.indices.append(int(batch["index"]))
        return out.loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the local bytes of parameters and gradients while both exist."""
        tensors = [p for p in self.parameters()] + [p.grad for p in self.parameters() if p.grad is not None]
        self.parameter_and_gradient_bytes = sum(local_bytes(tensor) for tensor in tensors)


def local_bytes(tensor: torch.Tensor) -> int:
    """Return the bytes of this rank's part of ``tensor``."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def whole_model_state_bytes(module: torch.nn.Module) -> int:
    """Return the bytes of the whole (unsharded) parameters, gradients and two AdamW moments of ``module``."""
    return 4 * sum(p.numel() * p.element_size() for p in module.parameters())  # a DTensor's numel is the global one


def batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """Return enough batches for two replicas."""
    return (dense_batches if kind == "dense" else packed_batches)(2 * STEPS)
