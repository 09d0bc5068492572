"""Context-parallel attention on zigzag shards, dense or packed, exact versus single-device attention.

Each CP rank holds chunks ``r`` and ``2cp-1-r`` of every sequence (see ``shared/DESIGN.md`` §1, §4). Internally the
local tokens are reordered "half-major" (chunk ``r`` of every sequence, then chunk ``2cp-1-r``), so each rank's keys
split into two halves and attention runs over (query half, source rank, key half) blocks, each cut into sub-blocks
of whole documents; blocks the mask leaves empty are skipped, which is what balances causal work. ``allgather``
gathers K/V (Llama 3 scheme); ``ring`` passes K/V point-to-point around the group, overlapping the transfer with the
current block's compute, merges partial results by log-sum-exp, and passes dK/dV back around in the backward.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from itertools import pairwise

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_cp.core import comm
from lightning_cp.core.attention.kernels import (
    CPU_FLASH,
    MATH,
    BlockKernel,
    BlockPlan,
    RankTokens,
    accumulation_dtype,
    backward_source,
    build_block_plan,
    flash_attn_varlen_func,
    forward_source,
    halves,
    new_accumulator,
)
from lightning_cp.core.packed import PackedSeqParams, host_offsets

logger = logging.getLogger("lightning_cp.core.attention.api")

MODES = ("allgather", "ring")
BACKENDS = ("auto", "cpu_flash", "math", "flash_attn")
_KERNELS = {"cpu_flash": CPU_FLASH, "math": MATH}
_LOGGED_CHOICES: set[tuple[str, str, str]] = set()
_RING_KV_TAG, _RING_BACKWARD_KV_TAG, _RING_DKV_TAG = 0, 1, 2


def zigzag_tokens(lengths: Sequence[int], padded: Sequence[int], cp: int, rank: int) -> RankTokens:
    """Describe the tokens CP rank ``rank`` holds in the zigzag layout: chunks ``rank`` and ``2cp-1-rank`` of each."""
    actual = torch.tensor(list(lengths), dtype=torch.int64)
    chunk = torch.tensor(list(padded), dtype=torch.int64) // (2 * cp)
    seq = torch.repeat_interleave(torch.arange(len(actual)), chunk)
    starts = torch.cumsum(chunk, 0) - chunk
    offset = torch.arange(int(chunk.sum())) - starts[seq]
    docs, positions = [], []
    for chunk_id in (rank, 2 * cp - 1 - rank):
        pos = chunk_id * chunk[seq] + offset
        docs.append(torch.where(pos < actual[seq], seq, -1))
        positions.append(pos)
    front_local = 2 * starts[seq] + offset
    perm = torch.cat([front_local, front_local + chunk[seq]]) if len(actual) > 1 else None
    return RankTokens(torch.cat(docs), torch.cat(positions), perm)


def contiguous_tokens(lengths: Sequence[int], cp: int, rank: int) -> RankTokens:
    """Describe rank ``rank``'s tokens when the packed stream is split evenly (padded at the end) into ``cp`` slices."""
    actual = torch.tensor(list(lengths), dtype=torch.int64)
    total = int(actual.sum())
    per_rank = 2 * math.ceil(total / (2 * cp))
    doc = torch.full((cp * per_rank,), -1, dtype=torch.int64)
    pos = torch.zeros(cp * per_rank, dtype=torch.int64)
    doc[:total] = torch.repeat_interleave(torch.arange(len(actual)), actual)
    pos[:total] = torch.arange(total) - (torch.cumsum(actual, 0) - actual)[doc[:total]]
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    return RankTokens(doc[local], pos[local], None)


def padded_lengths(lengths: Sequence[int], cp: int) -> list[int]:
    """Pad every length up to a multiple of ``2 * cp``, as the zigzag layout does."""
    return [-(-length // (2 * cp)) * (2 * cp) for length in lengths]


def attention_work_per_rank(
    cp_size: int,
    *,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    causal: bool = True,
    layout: str = "zigzag",
) -> list[int]:
    """Count the unmasked query-key pairs each CP rank computes (padding excluded), to measure load balance.

    ``seq_len`` describes one dense sequence, ``cu_seqlens`` a packed batch; ``layout`` is ``"zigzag"`` (each
    sequence padded to a multiple of ``2*cp``) or ``"contiguous"`` (the token stream split evenly).
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r}; expected a positive int")
    lengths = _work_lengths(seq_len, cu_seqlens)
    if layout == "zigzag":
        padded = padded_lengths(lengths, cp_size)
        tokens = [zigzag_tokens(lengths, padded, cp_size, rank) for rank in range(cp_size)]
    elif layout == "contiguous":
        tokens = [contiguous_tokens(lengths, cp_size, rank) for rank in range(cp_size)]
    else:
        raise ValueError(f"layout={layout!r}; expected 'zigzag' or 'contiguous'")
    actual = torch.tensor(lengths, dtype=torch.int64)
    return [_pair_count(rank_tokens, actual, causal) for rank_tokens in tokens]


def _work_lengths(seq_len: int | None, cu_seqlens: Sequence[int] | Tensor | None) -> list[int]:
    """Return the sequence lengths described by exactly one of ``seq_len`` and ``cu_seqlens``."""
    if (seq_len is None) == (cu_seqlens is None):
        raise ValueError(f"seq_len={seq_len!r}, cu_seqlens={cu_seqlens!r}; expected exactly one of them")
    if seq_len is not None:
        if seq_len < 0:
            raise ValueError(f"seq_len={seq_len}; expected a non-negative int")
        return [int(seq_len)]
    offsets = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    _check_offsets("cu_seqlens", offsets)
    return [b - a for a, b in pairwise(offsets)]


def _pair_count(tokens: RankTokens, lengths: Tensor, causal: bool) -> int:
    """Sum, over the valid queries of one rank, the number of keys each one sees."""
    valid = tokens.doc >= 0
    seen = tokens.pos.masked_select(valid) + 1 if causal else lengths[tokens.doc.masked_select(valid)]
    return int(seen.sum())


def zigzag_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: ProcessGroup | None,
    *,
    packed_seq_params: PackedSeqParams | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    mode: str = "allgather",
    backend: str = "auto",
) -> Tensor:
    """Attention of this rank's zigzag-shard queries over the whole sequence, with exact forward and backward.

    Dense: ``q`` ``[S_local, B, Hq, D]``, ``k``/``v`` ``[S_local, B, Hkv, D]``. Packed: ``[T_local, H, D]`` with the
    zigzag-side ``packed_seq_params``. ``cp_group`` ``None`` means no context parallelism (one rank).
    """
    cp, rank = (1, 0) if cp_group is None else (comm.group_size(cp_group), comm.group_rank(cp_group))
    lengths, padded = _validate(q, k, v, cp, packed_seq_params, mode, backend, softmax_scale)
    kernel_name = _choose_kernel(backend, mode, q)
    _log_choice_once(kernel_name, mode, q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    tokens, plan, perm = _zigzag_plan(tuple(lengths), tuple(padded), cp, rank, causal, q.device)
    packed = packed_seq_params is not None
    if kernel_name == "flash_attn":
        return _flash_attention(q, k, v, cp_group, tokens, rank, packed, causal, scale)
    kernel = _KERNELS[kernel_name]
    return context_parallel_attention(
        q, k, v, cp_group, plan, perm, packed=packed, scale=scale, mode=mode, kernel=kernel
    )


@functools.lru_cache(maxsize=16)
def _zigzag_plan(
    lengths: tuple[int, ...], padded: tuple[int, ...], cp: int, rank: int, causal: bool, device: torch.device
) -> tuple[tuple[RankTokens, ...], BlockPlan, Tensor | None]:
    """Token metadata, block plan and this rank's local-to-half-major permutation on ``device`` of one batch layout.

    Built once and reused by every layer and the backward.
    """
    tokens = tuple(zigzag_tokens(lengths, padded, cp, src) for src in range(cp))
    perm = tokens[rank].perm
    return tokens, build_block_plan(tokens, rank, causal, device), None if perm is None else perm.to(device)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: ProcessGroup | None,
    plan: BlockPlan,
    perm: Tensor | None,
    *,
    packed: bool,
    scale: float,
    mode: str,
    kernel: BlockKernel,
) -> Tensor:
    """Run CP attention for any sharding, given its block plan and local-to-half-major ``perm``; no validation."""
    perm = None if perm is None else perm.to(q.device)
    qi, ki, vi = (_to_internal(x, packed, perm) for x in (q, k, v))
    if mode == "ring":
        out = _RingAttention.apply(qi, ki, vi, plan, kernel, scale, cp_group)
    else:
        kv = torch.stack([ki, vi])
        kv_all = kv.unsqueeze(0) if plan.cp == 1 else comm.all_gather_stack(kv, cp_group)
        out = _GatheredAttention.apply(qi, kv_all, plan, kernel, scale)
    return _from_internal(out, packed, perm)


def _to_internal(x: Tensor, packed: bool, perm: Tensor | None) -> Tensor:
    """Bring ``[S, B, H, D]`` or ``[T, H, D]`` to the kernels' ``[B, H, S, D]`` in half-major token order."""
    if not packed:
        return x.permute(1, 2, 0, 3).contiguous()
    if perm is not None:
        x = x.index_select(0, perm)
    return x.permute(1, 0, 2).unsqueeze(0).contiguous()


def _from_internal(out: Tensor, packed: bool, perm: Tensor | None) -> Tensor:
    """Undo ``_to_internal`` on the attention output."""
    if not packed:
        return out.permute(2, 0, 1, 3).contiguous()
    out = out.squeeze(0).permute(1, 0, 2)
    return (out if perm is None else out.index_select(0, torch.argsort(perm))).contiguous()


class _GatheredAttention(torch.autograd.Function):
    """Local queries against every rank's gathered K/V ``[cp, 2, B, Hkv, T, D]``; the gather's backward sums dK/dV."""

    @staticmethod
    def forward(ctx, q, kv_all, plan, kernel, scale):  # type: ignore[override]
        acc = new_accumulator(q)
        for src in range(plan.cp):
            forward_source(acc, q, kv_all[src, 0], kv_all[src, 1], plan.blocks[src], kernel, scale)
        out, lse = acc[0].to(q.dtype), acc[1]
        ctx.save_for_backward(q, kv_all, out, lse)
        ctx.plan, ctx.kernel, ctx.scale = plan, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv_all, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        tensors, plan = (dout, q, out, lse), ctx.plan
        dkv_all = torch.stack(
            [
                backward_source(dq, tensors, kv_all[src, 0], kv_all[src, 1], plan.blocks[src], ctx.kernel, ctx.scale)
                for src in range(plan.cp)
            ]
        )
        return dq.to(q.dtype), dkv_all.to(kv_all.dtype), None, None, None


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V travel to the next rank while the current block computes; dK/dV travel back home."""

    @staticmethod
    def forward(ctx, q, k, v, plan, kernel, scale, group):  # type: ignore[override]
        acc = new_accumulator(q)
        kv = torch.stack([k, v])
        for step in range(plan.cp):
            transfer = comm.ring_shift(kv, group, _RING_KV_TAG) if step < plan.cp - 1 else None
            src = (plan.rank - step) % plan.cp
            forward_source(acc, q, kv[0], kv[1], plan.blocks[src], kernel, scale)
            if transfer is not None:
                kv = transfer.wait()
        out, lse = acc[0].to(q.dtype), acc[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kernel, ctx.scale, ctx.group = plan, kernel, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan, cp = ctx.plan, ctx.plan.cp
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        kv, dkv_transfer = torch.stack([k, v]), None
        for step in range(cp):
            transfer = comm.ring_shift(kv, ctx.group, _RING_BACKWARD_KV_TAG) if step < cp - 1 else None
            src = (plan.rank - step) % cp
            dkv = backward_source(dq, (dout, q, out, lse), kv[0], kv[1], plan.blocks[src], ctx.kernel, ctx.scale)
            if dkv_transfer is not None:
                dkv += dkv_transfer.wait()
            if cp > 1:
                dkv_transfer = comm.ring_shift(dkv, ctx.group, _RING_DKV_TAG)
            if transfer is not None:
                kv = transfer.wait()
        if dkv_transfer is not None:
            dkv = dkv_transfer.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: ProcessGroup | None,
    tokens: Sequence[RankTokens],
    rank: int,
    packed: bool,
    causal: bool,
    scale: float,
    varlen: Callable[..., Tensor] | None = None,
) -> Tensor:
    """All-gather K/V and run flash-attn's varlen kernel once per query half (bottom-right causal alignment)."""
    varlen = varlen or flash_attn_varlen_func()
    perm = None if tokens[rank].perm is None else tokens[rank].perm.to(q.device)
    qi, ki, vi = (_to_internal(x, packed, perm) for x in (q, k, v))
    kv = torch.stack([ki, vi])
    kv_all = kv.unsqueeze(0) if len(tokens) == 1 else comm.all_gather_stack(kv, cp_group)
    batch, heads, local, dim = qi.shape
    q_tokens = qi.permute(0, 2, 1, 3).reshape(batch * local, heads, dim)
    kv_tokens = kv_all.permute(1, 2, 0, 4, 3, 5).reshape(2, batch * len(tokens) * local, *kv_all.shape[3:4], dim)
    out = torch.zeros_like(q_tokens)
    for rows, keys, cu_q, cu_k, max_q, max_k in _varlen_pieces(tokens, rank, causal, batch, q.device):
        piece = varlen(
            q_tokens[rows], kv_tokens[0, keys], kv_tokens[1, keys], cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
        )  # fmt: skip
        out = out.index_copy(0, rows, piece)
    out = out.reshape(batch, local, heads, dim).permute(0, 2, 1, 3)
    return _from_internal(out, packed, perm)


def _varlen_pieces(
    tokens: Sequence[RankTokens], rank: int, causal: bool, batch: int, device: torch.device
) -> list[tuple[Tensor, Tensor, Tensor, Tensor, int, int]]:
    """Per query half with valid tokens: query rows, key rows (document order), cu_seqlens, max lengths."""
    doc_all, pos_all = torch.cat([t.doc for t in tokens]), torch.cat([t.pos for t in tokens])
    valid_keys = torch.nonzero(doc_all >= 0).squeeze(1)
    lengths = torch.bincount(doc_all[valid_keys], minlength=int(doc_all.max()) + 1)
    doc_start = torch.cumsum(lengths, 0) - lengths
    sorted_keys = torch.empty_like(valid_keys)
    sorted_keys[doc_start[doc_all[valid_keys]] + pos_all[valid_keys]] = valid_keys
    local, per_batch_keys = tokens[rank].doc.shape[0], doc_all.shape[0]
    pieces = []
    for half, (doc, pos) in enumerate(halves(tokens[rank])):
        rows = torch.nonzero(doc >= 0).squeeze(1) + half * (local // 2)
        valid_doc, valid_pos = doc.masked_select(doc >= 0), pos.masked_select(doc >= 0)
        q_count = torch.bincount(valid_doc, minlength=lengths.shape[0])
        last = torch.zeros_like(lengths).scatter_reduce(0, valid_doc, valid_pos, "amax")
        docs = torch.nonzero(q_count > 0).squeeze(1)
        if docs.numel() == 0:
            continue
        k_count = (last + 1)[docs] if causal else lengths[docs]
        keys = sorted_keys[torch.repeat_interleave(doc_start[docs], k_count) + _ranges(k_count)]
        batch_offsets = torch.arange(batch)
        all_rows = (rows.unsqueeze(0) + (batch_offsets * local).unsqueeze(1)).flatten()
        all_keys = (keys.unsqueeze(0) + (batch_offsets * per_batch_keys).unsqueeze(1)).flatten()
        cu_q = _cumulative(q_count[docs].repeat(batch))
        cu_k = _cumulative(k_count.repeat(batch))
        max_q, max_k = int(q_count.max()), int(k_count.max())
        pieces.append((all_rows.to(device), all_keys.to(device), cu_q.to(device), cu_k.to(device), max_q, max_k))
    return pieces


def _ranges(counts: Tensor) -> Tensor:
    """Concatenate ``arange(c)`` for every ``c`` in ``counts``."""
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


def _cumulative(counts: Tensor) -> Tensor:
    """Return int32 cumulative offsets starting at 0."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp: int,
    params: PackedSeqParams | None,
    mode: str,
    backend: str,
    softmax_scale: float | None,
) -> tuple[list[int], list[int]]:
    """Check everything before any collective; return the global actual and padded sequence lengths."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; expected one of {MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale!r}; expected a positive float or None")
    _check_shapes(q, k, v, packed=params is not None)
    if params is None:
        if q.shape[0] % 2:
            raise ValueError(f"dense q has S_local={q.shape[0]} tokens; a zigzag shard holds two equal chunks")
        return [cp * q.shape[0]], [cp * q.shape[0]]
    return _packed_lengths(q.shape[0], cp, params)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, packed: bool) -> None:
    """Reject tensors whose ranks, token counts, batch sizes, head counts, head dims, dtypes or devices disagree."""
    dims, layout = (3, "[T_local, H, D]") if packed else (4, "[S_local, B, H, D]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != dims:
            hint = "; packed (THD) tensors need packed_seq_params" if not packed and x.dim() == 3 else ""
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {dims} dims {layout}{hint}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"token counts differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}; expected equal")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected equal shapes")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q has shape {tuple(q.shape)} but k has {tuple(k.shape)}; expected equal leading dims")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k/v {k.shape[-1]}; expected equal")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"Hq={q.shape[-2]} query heads, Hkv={k.shape[-2]} key heads; expected Hq a multiple of Hkv")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(
            f"q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, {v.device}; expected one each"
        )


def _packed_lengths(tokens: int, cp: int, params: PackedSeqParams) -> tuple[list[int], list[int]]:
    """Read and check the zigzag-side packed metadata; return the actual and padded global lengths."""
    for field in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        if getattr(params, field) is None:
            raise ValueError(
                f"packed_seq_params.{field} is None; expected the global cumulative "
                f"{'padded offsets (each sequence padded to a multiple of 2*cp)' if 'padded' in field else 'lengths'}"
            )
    for q_field, kv_field in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        kv_value, q_value = getattr(params, kv_field), getattr(params, q_field)
        if kv_value is not None and kv_value is not q_value and host_offsets(kv_value) != host_offsets(q_value):
            raise ValueError(f"packed_seq_params.{kv_field}={kv_value.tolist()}; expected it to equal {q_field}")
    offsets, padded_offsets = host_offsets(params.cu_seqlens_q), host_offsets(params.cu_seqlens_q_padded)
    _check_offsets("packed_seq_params.cu_seqlens_q", offsets)
    _check_offsets("packed_seq_params.cu_seqlens_q_padded", padded_offsets)
    if len(offsets) != len(padded_offsets):
        raise ValueError(f"cu_seqlens_q has {len(offsets)} entries, cu_seqlens_q_padded {len(padded_offsets)}")
    lengths = [b - a for a, b in pairwise(offsets)]
    padded = [b - a for a, b in pairwise(padded_offsets)]
    for index, (length, pad) in enumerate(zip(lengths, padded, strict=True)):
        if pad < length or pad % (2 * cp):
            raise ValueError(
                f"sequence {index} has length {length} and padded length {pad}; expected a padded length "
                f">= the length and divisible by 2*cp={2 * cp}"
            )
    if cp * tokens != padded_offsets[-1]:
        raise ValueError(
            f"local token count {tokens} does not match packed_seq_params: {padded_offsets[-1]} padded tokens "
            f"over cp={cp} ranks; expected {padded_offsets[-1] / cp:g} per rank"
        )
    return lengths, padded


def _check_offsets(name: str, offsets: list[int]) -> None:
    """Reject cumulative offsets that do not start at 0 or decrease."""
    if not offsets or offsets[0] != 0 or any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"{name}={offsets}; expected non-decreasing cumulative offsets starting at 0")


def _choose_kernel(backend: str, mode: str, q: Tensor) -> str:
    """Resolve ``backend`` to a kernel name, rejecting choices this input cannot use."""
    flash_ok = flash_attn_varlen_func() is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        if flash_ok and mode == "allgather":
            return "flash_attn"
        return "cpu_flash" if q.device.type == "cpu" else "math"
    if backend == "flash_attn" and (not flash_ok or mode != "allgather"):
        raise ValueError(
            f"backend='flash_attn' with mode={mode!r}, {q.dtype} on {q.device}; expected flash-attn installed, "
            "CUDA float16/bfloat16 tensors and mode='allgather'"
        )
    if backend == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"backend='cpu_flash' with tensors on {q.device}; expected CPU tensors")
    return backend


def _log_choice_once(kernel_name: str, mode: str, q: Tensor) -> None:
    """Log the kernel chosen for a (kernel, mode, device type) combination the first time it is used."""
    key = (kernel_name, mode, q.device.type)
    if key not in _LOGGED_CHOICES:
        _LOGGED_CHOICES.add(key)
        logger.info("zigzag_attention: backend %s, mode %s, device %s", kernel_name, mode, q.device.type)
