"""Context parallelism for PyTorch Lightning; importing it registers ``strategy="cp_zigzag"``.

The public API: ``cp_attention``, ``cp_cross_entropy``, ``cp_gather_sequence``, ``cp_causal_conv1d``,
``cp_ssd_scan``, ``cp_selective_scan``, ``cp_gated_delta_rule``, ``cp_previous_tokens`` and ``cp_previous_state`` for
model code, the strategy and its callback for Lightning, ``ContextParallelRuntime`` for any other training loop,
``PackedSeqParams`` for packed metadata.
"""

from lightning_cp.core.functional import (
    cp_attention,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_gather_sequence,
    cp_previous_state,
    cp_previous_tokens,
    cp_selective_scan,
    cp_ssd_scan,
)
from lightning_cp.core.loss import CPLoss, cp_chunked_cross_entropy, cp_cross_entropy
from lightning_cp.core.packed import PackedSeqParams
from lightning_cp.core.runtime import ContextParallelRuntime, LayerPolicy
from lightning_cp.core.step import ContextParallelSetting
from lightning_cp.lightning.callback import ContextParallelLayoutCallback
from lightning_cp.lightning.strategy import CPZigzagStrategy

__all__ = [
    "CPLoss",
    "CPZigzagStrategy",
    "ContextParallelLayoutCallback",
    "ContextParallelRuntime",
    "ContextParallelSetting",
    "LayerPolicy",
    "PackedSeqParams",
    "cp_attention",
    "cp_causal_conv1d",
    "cp_chunked_cross_entropy",
    "cp_cross_entropy",
    "cp_gated_delta_rule",
    "cp_gather_sequence",
    "cp_previous_state",
    "cp_previous_tokens",
    "cp_selective_scan",
    "cp_ssd_scan",
]
