"""The reference Llama-style decoder (attention blocks, and recurrent, short-convolution or Mamba2 ones in hybrid
stacks) and its module."""

from lightning_cp.train.models.layers import (
    Attention,
    ConvolutionDecoderBlock,
    DecoderBlock,
    GatedRecurrence,
    Mamba2Mixer,
    MambaBlock,
    RecurrentBlock,
    ShortConvolution,
    SwiGLU,
)
from lightning_cp.train.models.llama import LlamaConfig, LlamaDecoder
from lightning_cp.train.models.module import LlamaLM

__all__ = [
    "Attention",
    "ConvolutionDecoderBlock",
    "DecoderBlock",
    "GatedRecurrence",
    "LlamaConfig",
    "LlamaDecoder",
    "LlamaLM",
    "Mamba2Mixer",
    "MambaBlock",
    "RecurrentBlock",
    "ShortConvolution",
    "SwiGLU",
]
