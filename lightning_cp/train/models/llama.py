"""The Llama-style decoder stack as a plain ``nn.Module``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_cp.train.models.layers import ConvolutionDecoderBlock, DecoderBlock, MambaBlock, RecurrentBlock

LAYER_TYPES = ("attention", "recurrent", "convolution", "mamba")


@dataclass
class LlamaConfig:
    """Architecture of the reference Llama-style decoder (also the ``model`` section of the YAML configuration)."""

    vocab_size: int = 257
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 352
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    activation_checkpointing: bool = False
    loss_chunk_tokens: int = 0
    layer_types: list[str] | None = None
    """One of ``LAYER_TYPES`` per layer (a hybrid stack); None: every layer attention."""


def layer_kinds(num_layers: int, layer_types: Sequence[str] | None) -> list[str]:
    """Each layer's type, checked: ``layer_types``, or attention throughout."""
    kinds = ["attention"] * num_layers if layer_types is None else list(layer_types)
    if len(kinds) != num_layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(
            f"layer_types: got {kinds}; expected {num_layers} entries (num_layers), each one of {LAYER_TYPES}"
        )
    return kinds


def _block(kind: str, config: LlamaConfig) -> nn.Module:
    """One decoder block of ``kind`` (one of ``LAYER_TYPES``)."""
    if kind == "attention":
        return DecoderBlock(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.intermediate_size, config.rope_theta,
            config.norm_eps,
        )  # fmt: skip
    if kind == "mamba":
        return MambaBlock(config.hidden_size, config.num_heads, config.intermediate_size, config.norm_eps)
    block = {"recurrent": RecurrentBlock, "convolution": ConvolutionDecoderBlock}[kind]
    return block(config.hidden_size, config.intermediate_size, config.norm_eps)


class LlamaDecoder(nn.Module):
    """Token embedding, ``num_layers`` blocks (attention, or recurrent, convolution or Mamba2 where ``layer_types``
    says), final RMSNorm and the (tied or untied) output head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_block(kind, config) for kind in layer_kinds(config.num_layers, config.layer_types))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.activation_checkpointing = config.activation_checkpointing
        self._init_weights(config.init_std, config.num_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self, std: float, num_layers: int) -> None:
        """Normal init of the matrices (the convolution taps keep their identity start); output projections of the
        residual branches scaled down by ``sqrt(2 * num_layers)``."""
        for name, param in self.named_parameters():
            if param.dim() < 2 or name.endswith(".taps"):
                continue
            residual_outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
            scale = (2 * num_layers) ** -0.5 if name.endswith(residual_outputs) else 1.0
            nn.init.normal_(param, mean=0.0, std=std * scale)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return logits ``[B, S_local, vocab]`` for this rank's tokens ``[B, S_local]``."""
        return self.lm_head(self.hidden_states(input_ids, position_ids))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the final-norm hidden states ``[B, S_local, hidden]`` (what ``lm_head`` turns into logits)."""
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_reentrant=False, position_ids=position_ids)
            else:
                h = layer(h, position_ids=position_ids)
        return self.norm(h)
