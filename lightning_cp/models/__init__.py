"""The reference Llama-style decoder and its LightningModule."""

from lightning_cp.models.layers import Attention, DecoderBlock, SwiGLU
from lightning_cp.models.llama import LlamaConfig, LlamaDecoder
from lightning_cp.models.module import LlamaLM

__all__ = ["Attention", "DecoderBlock", "LlamaConfig", "LlamaDecoder", "LlamaLM", "SwiGLU"]
