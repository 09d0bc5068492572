"""Local attention kernels with an explicit log-sum-exp forward and backward, so CP attention can merge key blocks.

Every kernel takes ``q`` ``[B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hkv, Sk, D]`` (``Hq`` a multiple of ``Hkv``), a
boolean ``mask`` ``[Sq, Sk]`` (``True``: the query sees the key; ``None``: it sees every key) and ``causal`` (a square
block where query ``i`` sees keys ``<= i``; then ``mask`` is ``None``). ``forward`` returns the
block output and its log-sum-exp ``[B, Hq, Sq]``, ``-inf`` (and a zero output) for rows that see no key.
``backward`` takes the *merged* output and log-sum-exp of all blocks and returns this block's share of the gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_NEG_INF = -math.inf


@dataclass(frozen=True)
class BlockKernel:
    """A named pair of block functions: ``forward(q, k, v, mask, causal, scale)`` and its explicit ``backward``."""

    name: str
    forward: Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype partial results are accumulated in: float32 for half precisions, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def finite_lse(lse: Tensor) -> Tensor:
    """Replace ``-inf`` (rows without keys) by 0 so ``exp(score - lse)`` stays 0 instead of NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """View ``[B, Hq, S, ...]`` as ``[B, Hkv, Hq/Hkv, S, ...]`` so GQA needs no copy of K/V."""
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _math_scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """Return masked scaled scores ``[B, Hkv, G, Sq, Sk]`` in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    scores = _grouped(q.to(acc), k.shape[1]) @ k.to(acc).unsqueeze(2).transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return scores if mask is None else scores.masked_fill(~mask, _NEG_INF)


def math_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain softmax attention in torch ops: any device, any dtype, exact in float64."""
    scores = _math_scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - finite_lse(lse).unsqueeze(-1))
    out = probs @ v.to(scores.dtype).unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def math_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flash-style backward of one block given the merged ``out`` and ``lse``: ``dS = P * (dP - rowsum(dO * O))``."""
    kv_heads = k.shape[1]
    scores = _math_scores(q, k, mask, causal, scale)
    acc = scores.dtype
    probs = torch.exp(scores - _grouped(finite_lse(lse).to(acc), kv_heads).unsqueeze(-1))
    dout_g = _grouped(dout.to(acc), kv_heads)
    delta = (dout_g * _grouped(out.to(acc), kv_heads)).sum(-1, keepdim=True)
    dprobs = dout_g @ v.to(acc).unsqueeze(2).transpose(-1, -2)
    dscores = probs * (dprobs - delta) * scale
    dq = (dscores @ k.to(acc).unsqueeze(2)).flatten(1, 2)
    dk = (dscores.transpose(-1, -2) @ _grouped(q.to(acc), kv_heads)).sum(2)
    dv = (probs.transpose(-1, -2) @ dout_g).sum(2)
    return dq, dk, dv


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """Repeat K/V heads for kernels without GQA support."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Turn a boolean visibility mask into the additive float mask the CPU flash kernel wants."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, _NEG_INF)


def cpu_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """ATen's tiled CPU flash kernel, which returns the log-sum-exp; rows without keys are fixed to ``-inf``/zero."""
    groups = q.shape[1] // k.shape[1]
    k, v, additive = _repeat_kv(k, groups), _repeat_kv(v, groups), _additive_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive, scale=scale
    )
    if mask is not None:
        empty = ~mask.any(-1)
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def cpu_flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``cpu_flash_forward`` for one block given the merged ``out`` and ``lse``."""
    kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype),
        q,
        _repeat_kv(k, groups),
        _repeat_kv(v, groups),
        out.to(q.dtype),
        finite_lse(lse),
        0.0,
        causal,
        attn_mask=_additive_mask(mask, q.dtype),
        scale=scale,
    )
    return dq, _grouped(dk, kv_heads).sum(2), _grouped(dv, kv_heads).sum(2)


MATH = BlockKernel("math", math_forward, math_backward)
CPU_FLASH = BlockKernel("cpu_flash", cpu_flash_forward, cpu_flash_backward)


@functools.cache
def flash_attn_varlen_func() -> Callable[..., Tensor] | None:
    """Return ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed, else ``None``."""
    try:
        from flash_attn import flash_attn_varlen_func as varlen
    except ImportError:
        return None
    return varlen
