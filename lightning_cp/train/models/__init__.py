"""The reference Llama-style decoder (attention blocks, and recurrent ones in hybrid stacks) and its module."""

from lightning_cp.train.models.layers import Attention, DecoderBlock, GatedRecurrence, RecurrentBlock, SwiGLU
from lightning_cp.train.models.llama import LlamaConfig, LlamaDecoder
from lightning_cp.train.models.module import LlamaLM

__all__ = [
    "Attention",
    "DecoderBlock",
    "GatedRecurrence",
    "LlamaConfig",
    "LlamaDecoder",
    "LlamaLM",
    "RecurrentBlock",
    "SwiGLU",
]
