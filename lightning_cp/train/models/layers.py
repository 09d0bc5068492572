"""Llama building blocks: rotary embeddings from position ids, GQA attention through ``cp_attention``, SwiGLU, and for
hybrid stacks a recurrent block (short convolution through ``cp_causal_conv1d`` and gated linear recurrence), an
LFM2-style gated short-convolution block and a Mamba2 block (``cp_causal_conv1d`` and ``cp_ssd_scan``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_cp.core.functional import cp_attention, cp_causal_conv1d, cp_previous_state, cp_ssd_scan


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple:
    """Return ``cos, sin`` ``[B, S, 1, head_dim]`` in ``dtype`` for the (global, per-document) ``position_ids``
    ``[B, S]``. The angles are computed in at least float32: half precisions cannot even hold the positions (bf16
    rounds 1001 to 1000, fp16 overflows at 65520)."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float64) / head_dim
    inv_freq = (1.0 / theta**exponent).to(exact)
    angles = position_ids.to(exact).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, D]`` by the rotary angles (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, run across context-parallel ranks by ``cp_attention``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, rope_theta: float) -> None:
        super().__init__()
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) "
                f"and num_heads by num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` ``[B, S_local, hidden]`` whose tokens sit at ``position_ids`` ``[B, S_local]`` (under
        tensor parallelism with this rank's share of the heads)."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)  # this TP rank's heads
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = cp_attention(q, k, v, causal=True)
        return self.o_proj(out.reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """The gated MLP ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP token-wise."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm Llama block; called as ``block(h, position_ids=...)`` so the layout callback can convert both."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        rope_theta: float,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.attention = Attention(hidden_size, num_heads, num_kv_heads, rope_theta)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the block output for hidden states ``[B, S_local, hidden]``."""
        h = h + self.attention(self.attention_norm(h), position_ids)
        return h + self.mlp(self.mlp_norm(h))


def gated_scan(values: torch.Tensor, log_decays: torch.Tensor, starts: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """States ``h_t = a_t * h_{t-1} + x_t`` along dim 1 of ``[B, S, D]`` from a zero state, with ``a_t`` =
    ``exp(log_decays_t)``, or 0 where ``starts`` marks a document's first token. Each chunk of ``chunk`` tokens at
    once (token ``s`` reaches ``t`` with the decays between them, unless a document starts in between; masked before
    the exponential, so no gradient is NaN), the last state carried from chunk to chunk. Each chunk keeps a
    ``[B, chunk, chunk, D]`` matrix for the backward: ``chunk`` times the values' memory."""
    outputs, carried = [], values.new_zeros(values[:, 0].shape)
    pieces = (tensor.split(chunk, dim=1) for tensor in (values, log_decays, starts))  # split: a linear backward
    for x, log_a, chunk_starts in zip(*pieces, strict=True):
        document = torch.cumsum(chunk_starts.long(), 1)  # documents begun in the chunk so far
        decayed = torch.cumsum(log_a, 1)
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        reaches = (document[:, :, None] == document[:, None, :]) & causal  # [B, t, s]
        gaps = torch.where(reaches[..., None], decayed[:, :, None] - decayed[:, None, :], -torch.inf)
        states = torch.einsum("btsd,bsd->btd", gaps.exp(), x)
        states = states + torch.where(document[..., None] == 0, decayed.exp(), 0) * carried[:, None]
        outputs.append(states)
        carried = states[:, -1]
    return torch.cat(outputs, 1)


class GatedRecurrence(nn.Module):
    """A diagonal linear recurrence over a short causal convolution, gated on the way out (a small state-space mixer
    of hybrid models). On contiguous CP shards it is exact: the convolution is ``cp_causal_conv1d`` (per document,
    the tokens before the shard from the ranks before), the scan runs from a zero state and adds the state entering
    the shard (``cp_previous_state``) times its cumulative decay; both restart at each document's start (without a
    step the convolution takes each row as one document, as attention does, while the scan restarts where
    ``position_ids`` does)."""

    def __init__(self, hidden_size: int, kernel: int = 4) -> None:
        super().__init__()
        self.value_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.decay_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.taps = nn.Parameter(torch.zeros(kernel, hidden_size))
        with torch.no_grad():
            self.taps[0] = 1.0  # the convolution starts as the identity
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[B, S_local, hidden]`` along the sequence (this rank's contiguous shard)."""
        values = self.value_proj(x)
        values = cp_causal_conv1d(values, self.taps.flip(0).T)  # taps newest first; the weight oldest first
        log_decays, starts = F.logsigmoid(self.decay_proj(x)), position_ids == 0
        states = gated_scan(values, log_decays, starts)
        no_start_yet = (torch.cumsum(starts.long(), 1) == 0).unsqueeze(-1)
        cumulative = torch.where(no_start_yet, torch.cumsum(log_decays, 1).exp(), 0)  # product of a_t so far
        states = states + cumulative * cp_previous_state(states[:, -1], cumulative[:, -1]).unsqueeze(1)
        return self.out_proj(states * F.silu(self.gate_proj(x)))


class RecurrentBlock(nn.Module):
    """Pre-norm block of a ``GatedRecurrence`` and a SwiGLU MLP; the default layout policy runs ``*RecurrentBlock``
    on contiguous shards."""

    def __init__(self, hidden_size: int, intermediate_size: int, norm_eps: float) -> None:
        super().__init__()
        self.recurrence_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.recurrence = GatedRecurrence(hidden_size)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the block output for hidden states ``[B, S_local, hidden]``."""
        h = h + self.recurrence(self.recurrence_norm(h), position_ids)
        return h + self.mlp(self.mlp_norm(h))


class ShortConvolution(nn.Module):
    """LFM2's token mixer: ``B``, ``C`` and ``x`` from one projection, a depthwise causal convolution of ``B * x``
    (``cp_causal_conv1d``: per document, in whichever layout the block runs), gated by ``C`` on the way out."""

    def __init__(self, hidden_size: int, kernel: int = 3) -> None:
        super().__init__()
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.taps = nn.Parameter(torch.zeros(hidden_size, kernel))  # oldest tap first, as a depthwise Conv1d's
        with torch.no_grad():
            self.taps[:, -1] = 1.0  # the convolution starts as the identity
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[B, S_local, hidden]`` along the sequence (this rank's shard, in any layout)."""
        gate_in, gate_out, values = self.in_proj(x).chunk(3, dim=-1)
        return self.out_proj(gate_out * cp_causal_conv1d(gate_in * values, self.taps))


class ConvolutionDecoderBlock(nn.Module):
    """Pre-norm block of a ``ShortConvolution`` and a SwiGLU MLP. Its name matches the default policy's
    ``*DecoderBlock``, so it runs on zigzag shards next to the attention blocks: no layout conversion between them."""

    def __init__(self, hidden_size: int, intermediate_size: int, norm_eps: float) -> None:
        super().__init__()
        self.convolution_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.convolution = ShortConvolution(hidden_size)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the block output for hidden states ``[B, S_local, hidden]`` (documents come from the step)."""
        h = h + self.convolution(self.convolution_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Mamba2Mixer(nn.Module):
    """Mamba2's token mixer (as in Bamba and Granite's hybrids, one group): one projection to the gate ``z``, the
    convolved ``x``, ``B``, ``C`` and the step sizes; a depthwise causal convolution with SiLU (``cp_causal_conv1d``);
    the selective scan with its ``D`` skip (``cp_ssd_scan``, per document); a gated RMSNorm and the output projection.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, norm_eps: float, state: int = 16, kernel: int = 4, chunk_size: int = 64
    ) -> None:
        super().__init__()
        inner = 2 * hidden_size
        if inner % num_heads:
            raise ValueError(f"2 x hidden_size ({inner}) must divide by num_heads ({num_heads}) for a Mamba2 layer")
        self.num_heads, self.head_dim, self.state, self.chunk_size = num_heads, inner // num_heads, state, chunk_size
        self.in_proj = nn.Linear(hidden_size, 2 * inner + 2 * state + num_heads, bias=False)
        self.taps = nn.Parameter(torch.zeros(inner + 2 * state, kernel))  # oldest tap first, as a depthwise Conv1d's
        with torch.no_grad():
            self.taps[:, -1] = 1.0  # the convolution starts as the identity
        steps = torch.logspace(-3, -1, num_heads)  # initial step sizes from 0.001 to 0.1, as Mamba2's
        self.dt_bias = nn.Parameter(steps + torch.log(-torch.expm1(-steps)))  # softplus(dt_bias) = steps
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = nn.RMSNorm(inner, eps=norm_eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix ``x`` ``[B, S_local, hidden]`` along the sequence (this rank's shard, in any layout)."""
        rows, length, _ = x.shape
        inner = self.num_heads * self.head_dim
        gate, convolved, steps = self.in_proj(x).split([inner, inner + 2 * self.state, self.num_heads], dim=-1)
        convolved = F.silu(cp_causal_conv1d(convolved, self.taps))
        values, B, C = convolved.split([inner, self.state, self.state], dim=-1)
        values = values.view(rows, length, self.num_heads, self.head_dim)
        steps = F.softplus(steps + self.dt_bias)
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))
        B, C = (tensor.view(rows, length, 1, self.state) for tensor in (B, C))
        y = cp_ssd_scan(values, steps, A, B, C, chunk_size=self.chunk_size) + self.D[:, None] * values
        return self.out_proj(self.norm(y.reshape(rows, length, inner).to(x.dtype) * F.silu(gate)))


class MambaBlock(nn.Module):
    """Pre-norm block of a ``Mamba2Mixer`` and a SwiGLU MLP; the default layout policy runs ``*MambaBlock`` on
    contiguous shards, where the scan needs no conversion of its own."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, norm_eps: float) -> None:
        super().__init__()
        self.mixer_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.mixer = Mamba2Mixer(hidden_size, num_heads, norm_eps)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=norm_eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the block output for hidden states ``[B, S_local, hidden]`` (documents come from the step)."""
        h = h + self.mixer(self.mixer_norm(h))
        return h + self.mlp(self.mlp_norm(h))
