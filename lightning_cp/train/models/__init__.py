"""The reference Llama-style decoder and its LightningModule."""

from lightning_cp.train.models.layers import Attention, DecoderBlock, SwiGLU
from lightning_cp.train.models.llama import LlamaConfig, LlamaDecoder
from lightning_cp.train.models.module import LlamaLM

__all__ = ["Attention", "DecoderBlock", "LlamaConfig", "LlamaDecoder", "LlamaLM", "SwiGLU"]
