"""Context parallelism for PyTorch Lightning; importing it registers ``strategy="cp_zigzag"``."""

from lightning_cp.core.loss import CPLoss, cp_cross_entropy
from lightning_cp.core.packed import PackedSeqParams
from lightning_cp.core.step import cp_attention
from lightning_cp.lightning.callback import ContextParallelLayoutCallback
from lightning_cp.lightning.strategy import CPZigzagStrategy

__all__ = [
    "CPLoss",
    "CPZigzagStrategy",
    "ContextParallelLayoutCallback",
    "PackedSeqParams",
    "cp_attention",
    "cp_cross_entropy",
]
