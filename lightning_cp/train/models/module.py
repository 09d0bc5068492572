"""The reference LightningModule: a Llama-style decoder trained with the CP-aware loss."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_cp.core.loss import CPLoss, cp_chunked_cross_entropy
from lightning_cp.core.mesh import TENSOR_PARALLEL
from lightning_cp.lightning.module import CausalLMModule
from lightning_cp.train.models.llama import LlamaConfig, LlamaDecoder
from lightning_cp.train.models.parallelize import apply_tensor_parallel


class LlamaLM(CausalLMModule):
    """Causal language model over packed or dense batches; trains under ``cp_zigzag`` at any cp, cp=1 included."""

    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        **architecture: Any,
    ) -> None:
        """Take optimizer settings and ``LlamaConfig`` fields; all values, defaults included, are hyperparameters."""
        super().__init__()
        config = LlamaConfig(**architecture)
        optimizer = {
            "lr": lr,
            "weight_decay": weight_decay,
            "betas": betas,
            "warmup_steps": warmup_steps,
            "min_lr_ratio": min_lr_ratio,
        }
        self.save_hyperparameters({**dataclasses.asdict(config), **optimizer})
        self.config = config
        self.model = LlamaDecoder(config)

    def configure_model(self) -> None:
        """Apply the decoder's tensor-parallel plan when the strategy's mesh has more than one TP rank (once)."""
        mesh = self.device_mesh
        if mesh is None or TENSOR_PARALLEL not in (mesh.mesh_dim_names or ()):
            return
        tp_mesh = mesh[TENSOR_PARALLEL]
        if tp_mesh.size() == 1 or any(isinstance(parameter, DTensor) for parameter in self.model.parameters()):
            return
        sequence_parallel = bool(getattr(self.trainer.strategy, "sequence_parallel", False))
        apply_tensor_parallel(self.model, self.config, tp_mesh, sequence_parallel)

    def token_loss(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, loss_token_count: int
    ) -> CPLoss:
        """Return the loss of this rank's tokens; with ``loss_chunk_tokens`` the logits are made chunk by chunk."""
        chunk = self.config.loss_chunk_tokens
        if not chunk:
            return super().token_loss(input_ids, position_ids, labels, loss_token_count)
        hidden = self.model.hidden_states(input_ids, position_ids)
        return cp_chunked_cross_entropy(hidden, self.model.lm_head, labels, loss_token_count, chunk)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the logits of this rank's tokens."""
        return self.model(input_ids, position_ids)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the logits of this rank's tokens."""
        return self(input_ids, position_ids)
