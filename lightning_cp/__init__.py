"""Context parallelism for PyTorch Lightning; importing it registers ``strategy="cp_zigzag"``."""

from lightning_cp.callback import ContextParallelLayoutCallback
from lightning_cp.context import cp_attention
from lightning_cp.loss import CPLoss, cp_cross_entropy
from lightning_cp.packed import PackedSeqParams
from lightning_cp.strategy import CPZigzagStrategy

__all__ = [
    "CPLoss",
    "CPZigzagStrategy",
    "ContextParallelLayoutCallback",
    "PackedSeqParams",
    "cp_attention",
    "cp_cross_entropy",
]
