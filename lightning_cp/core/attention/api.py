"""Context-parallel attention on zigzag shards, dense or packed, exact versus single-device attention.

Each CP rank holds chunks ``r`` and ``2cp-1-r`` of every sequence (``lightning_cp.core.zigzag``). The block plan
orders a rank's tokens "half-major" (chunk ``r`` of every sequence, then chunk ``2cp-1-r``), so each rank's keys
split into two halves and attention runs over (query half, source rank, key half) blocks, each cut into sub-blocks
of whole documents; blocks the mask leaves empty are skipped, which is what balances causal work. Those blocks are
cut into tiles addressed in the caller's own token order, so no reordered copy of q, k, v or the output is made.
Between forward and backward a rank keeps only its own q, k, v, the output and the log-sum-exp, so its memory is
``1/cp`` of single-device attention's. ``allgather`` broadcasts each rank's K/V in turn (the next one on its way
while the current one computes); ``ring`` passes K/V point-to-point around the group, overlapping the transfer with
the current source's compute; both merge partial results by log-sum-exp. The backward fetches the K/V again one
key piece at a time and returns each piece's dK/dV to its owner (summed by a reduce, or travelling round the ring).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_cp.core import comm
from lightning_cp.core.attention.head_parallel import head_parallel, kv_replication, natural_order_plan
from lightning_cp.core.attention.kernels import (
    CPU_FLASH,
    CUDA_SDPA,
    MATH,
    BlockKernel,
    BlockPlan,
    PlanProfile,
    accumulation_dtype,
    add_rows,
    all_finite,
    backward_source,
    build_block_plan,
    copy_rows,
    finite_lse,
    flash_attn_varlen_func,
    forward_source,
    halves,
    index_count,
    plan_profile,
    set_rows,
    take_rows,
)
from lightning_cp.core.consensus import require_agreement, tensor_description
from lightning_cp.core.packed import PackedSeqParams, host_copies, host_offsets
from lightning_cp.core.zigzag import (
    LAYOUT_NAMES,
    CPLayout,
    RankTokens,
    ZigzagGeometry,
    check_offsets,
    padded_length,
    zigzag_padded_lengths,
)

logger = logging.getLogger("lightning_cp.core.attention.api")


class AttentionMode(str, Enum):
    """How attention spans the CP ranks: K/V gathered at once (``allgather``), passed around the ring (``ring``), heads
    exchanged for the sequence (``ulysses``), or heads exchanged within groups and a ring across them (``hybrid``)."""

    ALLGATHER = "allgather"
    RING = "ring"
    ULYSSES = "ulysses"
    HYBRID = "hybrid"


MODES = tuple(mode.value for mode in AttentionMode)
BACKENDS = ("auto", "cpu_flash", "cuda_sdpa", "math", "flash_attn")
_KERNELS = {"cpu_flash": CPU_FLASH, "cuda_sdpa": CUDA_SDPA, "math": MATH}
_CUDA_SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOGGED_CHOICES: set[tuple[str, str, str]] = set()
_RING_KV_TAG, _RING_BACKWARD_KV_TAG, _RING_DKV_TAG = 0, 1, 2


def attention_work_per_rank(
    cp_size: int,
    *,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    mode: str = "allgather",
    ulysses_size: int | None = None,
) -> list[float]:
    """Count the unmasked query-key pairs each CP rank computes (padding excluded), to measure load balance.

    ``seq_len`` describes one dense sequence, ``cu_seqlens`` a packed batch; ``layout`` is ``"zigzag"`` (each
    sequence padded to a multiple of ``2*cp``) or ``"contiguous"`` (the token stream split evenly). Head-parallel
    modes count pairs times the rank's share of the heads: ``ulysses`` attends the whole sequence for ``1/cp`` of
    them, ``hybrid`` its ring position's zigzag shard for ``1/ulysses_size`` of them.
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r}; expected a positive int")
    if (seq_len is None) == (cu_seqlens is None):
        raise ValueError(f"seq_len={seq_len!r}, cu_seqlens={cu_seqlens!r}; expected exactly one of them")
    if layout not in LAYOUT_NAMES:
        raise ValueError(f"layout={layout!r}; expected 'zigzag' or 'contiguous'")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; expected one of {MODES}")
    if mode == AttentionMode.HYBRID.value and not (isinstance(ulysses_size, int) and ulysses_size > 1):
        raise ValueError(f"mode='hybrid' needs an integer ulysses_size >= 2, got {ulysses_size!r}")
    ulysses = {AttentionMode.ULYSSES.value: cp_size, AttentionMode.HYBRID.value: ulysses_size}.get(mode, 1)
    if cp_size % ulysses:
        raise ValueError(f"ulysses_size={ulysses_size} does not divide cp_size={cp_size}")
    ranks, split = (cp_size // ulysses, ulysses) if mode == AttentionMode.HYBRID.value else (cp_size // ulysses, 1)
    if seq_len is not None:
        if seq_len < 0:
            raise ValueError(f"seq_len={seq_len}; expected a non-negative int")
        geometry = ZigzagGeometry.dense(ranks, int(seq_len), padded_length(int(seq_len), 2 * ranks * split))
    else:
        lengths = check_offsets("cu_seqlens", cu_seqlens)
        geometry = ZigzagGeometry.packed(ranks, lengths.tolist(), zigzag_padded_lengths(lengths, ranks, split).tolist())
    work = geometry.work_per_rank(causal, layout)
    return [pairs / ulysses for pairs in work for _ in range(ulysses)]


@comm.eager_under_compile
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
    ulysses_group: ProcessGroup | None = None,
    ring_group: ProcessGroup | None = None,
    check_consensus: bool = True,
) -> Tensor:
    """Attention of this rank's zigzag-shard queries over the whole sequence, with exact forward and backward.

    Dense: ``q`` ``[S_local, B, Hq, D]``, ``k``/``v`` ``[S_local, B, Hkv, D]``. Packed: ``[T_local, H, D]`` with the
    zigzag-side ``packed_seq_params``. ``cp_group`` ``None`` means no context parallelism (one rank). With
    ``mode="hybrid"`` the CP group is ``ring_group`` x ``ulysses_group`` (CP rank ``ring_rank * u + ulysses_rank``):
    the shards are zigzag over the ``r`` ring positions, each position's two chunks split evenly over its ``u``
    Ulysses ranks (the sequence-parallel zigzag layout with ``cp=r, tp=u``). ``check_consensus``: first compare the
    call's shapes, dtypes, options and offsets over ``cp_group`` (one tiny all-reduce), so inputs that differ between
    ranks give the same ``ValueError`` everywhere instead of a crash, a hang or garbage; and reject NaN or infinite
    values in ``q``/``k``/``v`` the same way (their effect would depend on the kernel and the sharding). Without it
    nothing is compared between ranks: non-finite values give NaN rows, never wrong finite ones (a kernel that needs
    finite inputs checks them on the device).
    """
    non_finite: tuple[str, ...] = ()
    if check_consensus:
        sub_groups = (ulysses_group, ring_group) if mode == AttentionMode.HYBRID.value else ()
        non_finite = _require_agreement(
            q, k, v, cp_group, packed_seq_params, causal, softmax_scale, mode, backend, sub_groups
        )
    zigzag_ranks, exchange = _zigzag_ranks(cp_group, mode, ulysses_group, ring_group)
    geometry = _validate(q, k, v, zigzag_ranks, exchange, packed_seq_params, mode, backend, softmax_scale)
    if non_finite:
        raise ValueError(
            f"{' and '.join(non_finite)} {'holds' if len(non_finite) == 1 else 'hold'} NaN or infinite values: "
            "zigzag_attention rejects non-finite inputs (on every rank of the group)"
        )
    return attend_on_shards(
        q, k, v, cp_group, geometry, packed=packed_seq_params is not None, causal=causal, softmax_scale=softmax_scale,
        mode=mode, backend=backend, ulysses_group=ulysses_group, ring_group=ring_group, known_finite=check_consensus,
    )  # fmt: skip


def _require_agreement(
    q: Any,
    k: Any,
    v: Any,
    cp_group: ProcessGroup | None,
    params: PackedSeqParams | None,
    causal: bool,
    softmax_scale: float | None,
    mode: str,
    backend: str,
    sub_groups: tuple[ProcessGroup | None, ...] = (),
) -> tuple[str, ...]:
    """Raise the same ``ValueError`` on every rank when the ranks' calls differ (before any check that could raise
    on one rank only); return the names of the inputs with NaN or infinite values, the same on every rank."""
    non_finite = non_finite_inputs(q, k, v)
    fields: dict[str, Any] = {"q": tensor_description(q), "k": tensor_description(k), "v": tensor_description(v)}
    fields[NON_FINITE_FIELD] = non_finite
    fields.update(mode=mode, backend=backend, causal=causal, softmax_scale=softmax_scale, packed=params is not None)
    fields["hybrid sub-groups"] = tuple(None if group is None else group.size() for group in sub_groups)
    if params is not None:
        names = ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded")
        offsets = [getattr(params, name) for name in names]
        copies = host_copies(*(value if isinstance(value, Tensor) else None for value in offsets))  # one transfer
        for name, value, copy in zip(names, offsets, copies, strict=True):
            fields[name] = copy if isinstance(value, Tensor) else repr(value)
    require_agreement("zigzag_attention", fields, cp_group)
    return non_finite


NON_FINITE_FIELD = "NaN or infinite values in q, k, v (rejected)"


def non_finite_inputs(q: Any, k: Any, v: Any) -> tuple[str, ...]:
    """The names of the floating-point tensors among ``q``, ``k``, ``v`` holding NaN or infinite values (one host
    read for all three)."""
    named = [(name, x) for name, x in (("q", q), ("k", k), ("v", v)) if isinstance(x, Tensor) and x.is_floating_point()]
    if not named:
        return ()
    with torch.no_grad():  # a check, not part of the graph
        flags = [all_finite(x) for _, x in named]
    finite = torch.stack([flag.to(flags[0].device) for flag in flags]).tolist()
    return tuple(name for (name, _), ok in zip(named, finite, strict=True) if not ok)


def _zigzag_ranks(
    cp_group: ProcessGroup | None, mode: str, ulysses_group: ProcessGroup | None, ring_group: ProcessGroup | None
) -> tuple[int, int]:
    """Return the ranks the zigzag layout spans and how many ranks share each zigzag shard (Ulysses in hybrid)."""
    if mode != AttentionMode.HYBRID.value:
        return (1 if cp_group is None else cp_group.size()), 1
    if ulysses_group is None or ring_group is None:
        raise ValueError("mode='hybrid' needs ulysses_group and ring_group (the two sub-groups of the CP group)")
    return ring_group.size(), ulysses_group.size()


def _autocast_off(attend: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Run ``attend(q, ...)`` with autocast off on q's device: q, k, v come in the model's dtype and the kernels
    accumulate in their own (under a bf16 autocast the math kernel's score matmuls would run in bf16, and its float32
    backward would not match them)."""

    @functools.wraps(attend)
    def run(q: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            return attend(q, *args, **kwargs)

    return run


@_autocast_off
def attend_on_shards(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: ProcessGroup | None,
    geometry: ZigzagGeometry,
    *,
    packed: bool,
    causal: bool,
    softmax_scale: float | None,
    mode: str,
    backend: str = "auto",
    ulysses_group: ProcessGroup | None = None,
    ring_group: ProcessGroup | None = None,
    layout: CPLayout = CPLayout.ZIGZAG,
    stream_length: int | None = None,
    known_finite: bool = False,
) -> Tensor:
    """Run CP attention for a batch whose ``geometry`` is known (validated shapes; no host synchronisation).

    The shards are zigzag, except that ``ulysses`` also takes them in the contiguous ``layout`` (of a stream padded to
    ``stream_length``): head exchange works on any layout, so it needs no conversion. ``known_finite``: every rank's
    q, k, v were read and hold only finite values (``zigzag_attention``'s check), so kernels skip their own guard.
    Autocast is off inside (``_autocast_off``).
    """
    _check_local_token_count(q.shape[0], geometry, mode, ulysses_group, layout, stream_length)
    kernel_name = _choose_kernel(backend, mode, q)
    _log_choice_once(kernel_name, mode, q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if mode == AttentionMode.ULYSSES.value:
        tokens = geometry.gathered_tokens(layout, stream_length)
        attend = functools.partial(_attend_whole_sequence, tokens=tokens, packed=packed, causal=causal, scale=scale,
                                   kernel_name=kernel_name, known_finite=known_finite)  # fmt: skip
        return attend(q, k, v) if cp_group is None else head_parallel(q, k, v, cp_group, mode, attend)
    if mode == AttentionMode.HYBRID.value:
        kernel = _block_kernel(kernel_name, known_finite)
        plan = _block_plan(geometry, ring_group.rank(), causal, q.device, plan_profile(kernel))
        attend = functools.partial(context_parallel_attention, cp_group=ring_group, plan=plan, scale=scale,
                                   mode="ring", kernel=kernel)  # fmt: skip
        return head_parallel(q, k, v, ulysses_group, mode, attend)
    rank = 0 if cp_group is None else comm.group_rank(cp_group)
    if kernel_name == "flash_attn":
        return _flash_attention(q, k, v, cp_group, geometry.rank_tokens, rank, packed, causal, scale)
    kernel = _block_kernel(kernel_name, known_finite)
    plan = _block_plan(geometry, rank, causal, q.device, plan_profile(kernel))
    return context_parallel_attention(q, k, v, cp_group, plan, scale=scale, mode=mode, kernel=kernel)


def _block_kernel(name: str, known_finite: bool) -> BlockKernel:
    """The block kernel ``name``; without its non-finite guard where the inputs are known to be finite."""
    kernel = _KERNELS[name]
    return dataclasses.replace(kernel, needs_finite_inputs=False) if known_finite else kernel


def _attend_whole_sequence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    tokens: RankTokens,
    packed: bool,
    causal: bool,
    scale: float,
    kernel_name: str,
    known_finite: bool = False,
) -> Tensor:
    """One-rank attention over a whole gathered sequence that ``tokens`` describe in gathered order."""
    profile = plan_profile(_KERNELS.get(kernel_name, MATH))  # flash-attn takes no block plan
    plan, natural, to_natural, from_natural = natural_order_plan(tokens, causal, q.device, profile)
    if to_natural is not None:
        q, k, v = (x.index_select(0, to_natural) for x in (q, k, v))
    if kernel_name == "flash_attn":
        out = _flash_attention(q, k, v, None, (natural,), 0, packed, causal, scale)
    else:
        out = context_parallel_attention(
            q, k, v, None, plan, scale=scale, mode="allgather", kernel=_block_kernel(kernel_name, known_finite)
        )
    return out if from_natural is None else out.index_select(0, from_natural)


def _check_local_token_count(
    tokens: int,
    geometry: ZigzagGeometry,
    mode: str = AttentionMode.ALLGATHER.value,
    ulysses_group: ProcessGroup | None = None,
    layout: CPLayout = CPLayout.ZIGZAG,
    stream_length: int | None = None,
) -> None:
    """Reject a local token count that is not this batch's number of slots per rank."""
    exchange = ulysses_group.size() if mode == AttentionMode.HYBRID.value else 1
    total = sum(geometry.padded_lengths) if layout is CPLayout.ZIGZAG or stream_length is None else stream_length
    ranks = geometry.cp_size * exchange
    if ranks * tokens != total:
        raise ValueError(
            f"local token count {tokens} does not match packed_seq_params: {total} padded tokens "
            f"over cp={ranks} ranks; expected {total / ranks:g} per rank"
        )


@functools.lru_cache(maxsize=4)
def _block_plan(
    geometry: ZigzagGeometry, rank: int, causal: bool, device: torch.device, profile: PlanProfile
) -> BlockPlan:
    """This rank's block plan on ``device`` for kernels of ``profile``, built once per batch (shared by every layer
    and the backward). A few are kept (a training and a validation batch, causal and bidirectional layers): a GPU
    plan's masks of grouped small documents can take a hundred MiB of device memory."""
    return build_block_plan(geometry.rank_tokens, rank, causal, device, profile=profile)


@comm.eager_under_compile
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_group: ProcessGroup | None,
    plan: BlockPlan,
    *,
    scale: float,
    mode: str,
    kernel: BlockKernel,
) -> Tensor:
    """Run CP attention on local shards in any sharding (tensors in the caller's layout and token order), given the
    shards' block plan; no validation."""
    if cp_group is None and plan.cp > 1:
        raise ValueError(f"a block plan over {plan.cp} ranks needs their process group (or emulated_rank_attention)")
    exchange = _LocalKV() if plan.cp == 1 else _RingKV(cp_group) if mode == "ring" else _GatheredKV(cp_group)
    return _ShardAttention.apply(q, k, v, plan, kernel, scale, exchange)


def _to_internal(x: Tensor, packed: bool, perm: Tensor | None) -> Tensor:
    """Copy ``[S, B, H, D]`` or ``[T, H, D]`` to a contiguous ``[B, H, S, D]`` in half-major token order."""
    if not packed:
        return x.permute(1, 2, 0, 3).contiguous()
    if perm is not None:
        x = x.index_select(0, perm)
    return x.permute(1, 0, 2).unsqueeze(0).contiguous()


def _from_internal(out: Tensor, packed: bool, inverse: Tensor | None) -> Tensor:
    """Undo ``_to_internal`` on an output or a gradient (``inverse``: the inverse of its ``perm``)."""
    if not packed:
        return out.permute(2, 0, 1, 3).contiguous()
    out = out.squeeze(0).permute(1, 0, 2)
    return (out if inverse is None else out.index_select(0, inverse)).contiguous()


@functools.lru_cache(maxsize=4)
def _device_perm(tokens: RankTokens, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """A rank's local -> half-major permutation and its inverse on ``device``, copied once per batch layout: a
    host-to-device copy per call would wait for the device in every layer."""
    if tokens.perm is None:
        return None, None
    return tokens.perm.to(device), torch.argsort(tokens.perm).to(device)


def _heads_first(x: Tensor) -> Tensor:
    """View ``[S, B, H, D]`` or ``[T, H, D]`` as the kernels' ``[B, H, S, D]`` (no copy; local token order)."""
    return x.permute(1, 2, 0, 3) if x.dim() == 4 else x.permute(1, 0, 2).unsqueeze(0)


class _ShardAttention(torch.autograd.Function):
    """This rank's queries against every rank's K/V, keeping between forward and backward only what a flash-style
    backward needs: the caller's q, k, v, the output and the log-sum-exp.

    The forward takes each source's K/V whole from ``exchange``; the backward takes them again one key piece at a
    time and sends each piece's dK/dV contribution towards its owner, so besides the gradients it holds a few
    piece-sized buffers. Tensors stay in the caller's layout and token order (the plan's tiles address local rows).
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, kernel, scale, exchange: _KVExchange):  # type: ignore[override]
        q, k, v = (x.contiguous() for x in (q, k, v))
        acc = accumulation_dtype(q.dtype)
        out = q.new_zeros(q.shape, dtype=acc)
        heads, queries = _heads_first(out), _heads_first(q)
        lse = q.new_full(heads.shape[:3], -math.inf, dtype=acc)

        queries_finite = all_finite(q) if kernel.needs_finite_inputs else None

        def visit(src: int, k_src: Tensor, v_src: Tensor, keys_finite: Tensor | None) -> None:
            keys, values = _heads_first(k_src), _heads_first(v_src)
            blocks = plan.tiles[src]
            forward_source(heads, lse, queries, keys, values, blocks, kernel, scale, queries_finite, keys_finite)

        exchange.sources(k, v, visit, kernel.needs_finite_inputs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kernel, ctx.scale, ctx.exchange = plan, kernel, scale, exchange
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        if torch.is_grad_enabled():  # it would treat the saved output and log-sum-exp as constants
            raise RuntimeError("CP attention has no second-order gradient (a backward with create_graph=True)")
        q, k, v, out, lse = ctx.saved_tensors
        plan, acc = ctx.plan, accumulation_dtype(q.dtype)
        dq, dk, dv = (x.new_zeros(x.shape, dtype=acc) for x in (q, k, v))
        dq_heads = _heads_first(dq)
        tensors = (_heads_first(dout), _heads_first(q), _heads_first(out), finite_lse(lse))

        def visit(src: int, piece: int, k_piece: Tensor, v_piece: Tensor, dk_piece: Tensor, dv_piece: Tensor) -> None:
            grads = (dq_heads, _heads_first(dk_piece), _heads_first(dv_piece))
            blocks = plan.piece_tiles[src][piece]
            backward_source(grads, tensors, _heads_first(k_piece), _heads_first(v_piece), blocks, ctx.kernel, ctx.scale)

        ctx.exchange.pieces(k, v, (dk, dv), plan.pieces, visit)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


_SourceVisit = Callable[[int, Tensor, Tensor, Tensor | None], None]
_PieceVisit = Callable[[int, int, Tensor, Tensor, Tensor, Tensor], None]


class _KVExchange(Protocol):
    """How every source rank's K/V reach this rank, and their dK/dV go back to their owners."""

    def sources(self, k: Tensor, v: Tensor, visit: _SourceVisit, finite_flags: bool) -> None:
        """Call ``visit(src, k_src, v_src, keys_finite)`` for every source rank with its whole K/V (this rank's: ``k``,
        ``v``); with ``finite_flags``, ``keys_finite`` is whether the source's K and V hold only finite values, as its
        owner found and sent with them (else, or where the exchange has no such flag, None)."""

    def pieces(
        self, k: Tensor, v: Tensor, grads: tuple[Tensor, Tensor], pieces: Sequence[slice | Tensor], visit: _PieceVisit
    ) -> None:
        """Call ``visit(src, piece, k_piece, v_piece, dk_piece, dv_piece)`` for every key piece of every source; the
        dK/dV each call adds in place end up, summed over the ranks, in this rank's ``grads`` (dK, dV)."""


class _LocalKV:
    """One rank: its own K/V are the only source, and their pieces are views."""

    def sources(self, k: Tensor, v: Tensor, visit: _SourceVisit, finite_flags: bool) -> None:
        visit(0, k, v, None)

    def pieces(
        self, k: Tensor, v: Tensor, grads: tuple[Tensor, Tensor], pieces: Sequence[slice | Tensor], visit: _PieceVisit
    ) -> None:
        for index, rows in enumerate(pieces):
            visit(0, index, k[rows], v[rows], grads[0][rows], grads[1][rows])


@dataclasses.dataclass(frozen=True)
class _KVMessage:
    """One source's K/V rows as an exchange sends them: ``flat`` (what goes over the wire) holds ``kv`` ``[2, rows,
    ...]`` and, with a ``flag``, one more element, 0 when the owner's rows are all finite and NaN when not, so the
    receivers need not check K/V they did not make (the flag travels with the rows it describes)."""

    flat: Tensor
    kv: Tensor
    flag: Tensor | None

    def fill(self, k: Tensor, v: Tensor, rows: slice | Tensor) -> None:
        """The owner's side: copy rows ``rows`` of ``k`` and ``v`` in and set the flag (one pass over both)."""
        copy_rows(self.kv[0], k, rows)
        copy_rows(self.kv[1], v, rows)
        if self.flag is not None:
            self.flag.fill_(0.0).masked_fill_(~all_finite(self.kv), math.nan)

    def finite(self) -> Tensor | None:
        """Whether the rows are all finite, as their owner found (a 0-dim bool), or None without a flag."""
        return None if self.flag is None else torch.isfinite(self.flag[0])


class _BufferPair:
    """Two buffers for K/V-shaped pairs ``[2, rows, ...]`` of at most ``rows`` rows (with ``flag_slot``, one element
    more: a ``_KVMessage``'s flag), handed out in turn: a piece's buffer serves again two pieces later, when its
    transfer has finished, instead of a fresh allocation of megabytes (and its page faults) for every piece."""

    def __init__(self, like: Tensor, rows: int, dtype: torch.dtype, flag_slot: bool = False) -> None:
        self._like, self._rows, self._dtype, self._slot = like, rows, dtype, int(flag_slot)
        self._buffers: list[Tensor] = []
        self._turn = 0

    def _next(self, elements: int) -> Tensor:
        """The first ``elements`` elements of the next buffer."""
        if len(self._buffers) < 2:
            self._buffers.append(self._like.new_empty(self._elements(self._rows) + self._slot, dtype=self._dtype))
        buffer, self._turn = self._buffers[self._turn], 1 - self._turn
        return buffer[:elements]

    def _shape(self, rows: int) -> tuple[int, ...]:
        """The shape of a K/V pair of ``rows`` rows."""
        return (2, rows, *self._like.shape[1:])

    def _elements(self, rows: int) -> int:
        """The elements of a K/V pair of ``rows`` rows."""
        return math.prod(self._shape(rows))

    def take(self, rows: int) -> Tensor:
        """The next buffer as a contiguous ``[2, rows, ...]`` tensor (contents undefined)."""
        return self._next(self._elements(rows)).view(self._shape(rows))

    def message(self, rows: int) -> _KVMessage:
        """The next buffer as a message of ``rows`` rows, flagged if the pair has the slot (contents undefined)."""
        size = self._elements(rows)
        flat = self._next(size + self._slot)
        return _KVMessage(flat, flat[:size].view(self._shape(rows)), flat[size:] if self._slot else None)


def _largest_piece(pieces: Sequence[slice | Tensor]) -> int:
    """Rows of the largest key piece: what a piece buffer must hold."""
    return max((index_count(piece) for piece in pieces), default=0)


class _GatheredKV:
    """``allgather``: each source's K/V broadcast by its owner, whole in the forward and one piece at a time in the
    backward (the next one already on its way), and each piece's dK/dV summed onto its owner while the next piece
    computes: a rank holds at most two sources' (or pieces') K/V at a time, never the whole gathered sequence."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group, self.rank, self.cp = group, comm.group_rank(group), comm.group_size(group)

    def _fetch(
        self, src: int, k: Tensor, v: Tensor, rows: slice | Tensor, buffers: _BufferPair
    ) -> tuple[comm.Transfer, _KVMessage]:
        """Start the broadcast of source ``src``'s K/V rows ``rows`` as a message in the next buffer."""
        message = buffers.message(index_count(rows))
        if src == self.rank:
            message.fill(k, v, rows)
        return comm.broadcast_from(message.flat, src, self.group), message

    def sources(self, k: Tensor, v: Tensor, visit: _SourceVisit, finite_flags: bool) -> None:
        whole, buffers = slice(0, k.shape[0]), _BufferPair(k, k.shape[0], k.dtype, flag_slot=finite_flags)
        pending = self._fetch(0, k, v, whole, buffers)
        for src in range(self.cp):
            transfer, message = pending
            transfer.wait()
            pending = self._fetch(src + 1, k, v, whole, buffers) if src + 1 < self.cp else None
            visit(src, message.kv[0], message.kv[1], message.finite())

    def pieces(
        self, k: Tensor, v: Tensor, grads: tuple[Tensor, Tensor], pieces: Sequence[slice | Tensor], visit: _PieceVisit
    ) -> None:
        items = [(src, index) for src in range(self.cp) for index in range(len(pieces))]
        rows = _largest_piece(pieces)
        fetched, partials = _BufferPair(k, rows, k.dtype), _BufferPair(k, rows, grads[0].dtype)
        pending, summing = self._fetch(0, k, v, pieces[0], fetched), None
        for position, (src, index) in enumerate(items):
            transfer, message = pending
            transfer.wait()
            kv = message.kv
            if position + 1 < len(items):
                following = items[position + 1]
                pending = self._fetch(following[0], k, v, pieces[following[1]], fetched)
            partial = partials.take(kv.shape[1]).zero_()
            previous, summing = summing, self._contribute(src, index, pieces[index], kv, partial, visit)
            self._land(previous, grads)  # the previous piece's sum ran during this one's compute
        self._land(summing, grads)

    def _contribute(
        self, src: int, index: int, rows: slice | Tensor, kv: Tensor, partial: Tensor, visit: _PieceVisit
    ) -> tuple[int, slice | Tensor, comm.Transfer]:
        """Add this rank's dK/dV for one piece into ``partial`` and start summing it onto the owner (in the inputs'
        dtype)."""
        visit(src, index, kv[0], kv[1], partial[0], partial[1])
        return src, rows, comm.reduce_sum_to(partial.to(kv.dtype), src, self.group)

    def _land(self, summing: tuple[int, slice | Tensor, comm.Transfer] | None, grads: tuple[Tensor, Tensor]) -> None:
        """Wait for a piece's sum; its owner keeps it."""
        if summing is None:
            return
        src, rows, transfer = summing
        total = transfer.wait()
        if src == self.rank:
            set_rows(grads[0], rows, total[0], 0)
            set_rows(grads[1], rows, total[1], 0)


class _RingKV:
    """``ring``: K/V passed to the next rank while the current source computes (two buffers); in the backward each
    key piece goes round the ring, its dK/dV travelling with it (accumulation dtype) and arriving home complete."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group, self.rank, self.cp = group, comm.group_rank(group), comm.group_size(group)

    def sources(self, k: Tensor, v: Tensor, visit: _SourceVisit, finite_flags: bool) -> None:
        rows = k.shape[0]
        buffers = _BufferPair(k, rows, k.dtype, flag_slot=finite_flags)
        current = buffers.message(rows)
        current.fill(k, v, slice(0, rows))
        for step in range(self.cp):
            following, transfer = None, None
            if step < self.cp - 1:  # into the other buffer, whose send finished with the previous step
                following = buffers.message(rows)
                transfer = comm.ring_shift(current.flat, self.group, _RING_KV_TAG, following.flat)
            visit((self.rank - step) % self.cp, current.kv[0], current.kv[1], current.finite())
            if transfer is not None:
                transfer.wait()
                current = following

    def pieces(
        self, k: Tensor, v: Tensor, grads: tuple[Tensor, Tensor], pieces: Sequence[slice | Tensor], visit: _PieceVisit
    ) -> None:
        # Fresh buffers per step, not ``_BufferPair``s: a step's K/V, its dK/dV and the sums in flight overlap
        # differently at the last step, and pairs would keep one more piece alive there.
        for index, rows in enumerate(pieces):
            kv, incoming = torch.stack([take_rows(k, rows, 0), take_rows(v, rows, 0)]), None
            for step in range(self.cp):
                transfer = comm.ring_shift(kv, self.group, _RING_BACKWARD_KV_TAG) if step < self.cp - 1 else None
                dkv = kv.new_zeros(kv.shape, dtype=grads[0].dtype)
                visit((self.rank - step) % self.cp, index, kv[0], kv[1], dkv[0], dkv[1])
                if incoming is not None:  # the sum so far arrived during this rank's compute
                    dkv += incoming.wait()
                incoming = comm.ring_shift(dkv, self.group, _RING_DKV_TAG)
                if transfer is not None:
                    kv = transfer.wait()
            own = incoming.wait()
            set_rows(grads[0], rows, own[0], 0)
            set_rows(grads[1], rows, own[1], 0)


class _EmulatedKV:
    """One rank of a CP group run alone in this process: every rank's K/V are given at once, in their local layout
    (``kv_all`` ``[cp, 2, ...]``); the dK/dV this rank computes for another rank's keys, which a group would send to
    their owner, are added into ``sent`` (the same shape), rounded to its dtype as the group's sum rounds them.
    ``kv_finite`` ``[cp]``: whether each rank's K and V are all finite, as their owners would send it (None: the
    forward checks them here)."""

    def __init__(self, rank: int, kv_all: Tensor, sent: Tensor, kv_finite: Tensor | None = None) -> None:
        self.rank, self.kv_all, self.sent, self.kv_finite = rank, kv_all, sent, kv_finite

    def _source(self, src: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Source ``src``'s K and V: this rank's own (the autograd inputs) or the given ones."""
        return (k, v) if src == self.rank else (self.kv_all[src, 0], self.kv_all[src, 1])

    def sources(self, k: Tensor, v: Tensor, visit: _SourceVisit, finite_flags: bool) -> None:
        for src in range(self.kv_all.shape[0]):
            sent_flag = finite_flags and src != self.rank and self.kv_finite is not None
            visit(src, *self._source(src, k, v), self.kv_finite[src] if sent_flag else None)

    def pieces(
        self, k: Tensor, v: Tensor, grads: tuple[Tensor, Tensor], pieces: Sequence[slice | Tensor], visit: _PieceVisit
    ) -> None:
        partials = _BufferPair(k, _largest_piece(pieces), grads[0].dtype)
        for src in range(self.kv_all.shape[0]):
            keys, values = self._source(src, k, v)
            owner = grads if src == self.rank else self.sent[src]
            for index, rows in enumerate(pieces):
                k_piece, v_piece = take_rows(keys, rows, 0), take_rows(values, rows, 0)
                partial = partials.take(k_piece.shape[0]).zero_()
                visit(src, index, k_piece, v_piece, partial[0], partial[1])
                add_rows(owner[0], rows, partial[0], 0)
                add_rows(owner[1], rows, partial[1], 0)


def emulated_rank_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_all: Tensor,
    sent: Tensor,
    plan: BlockPlan,
    *,
    scale: float,
    kernel: BlockKernel,
    kv_finite: Tensor | None = None,
) -> Tensor:
    """Rank ``plan.rank``'s attention exactly as ``allgather`` runs it (the same tiles, pieces and kernels), in this
    process without a group: for tests, benchmarks and the GPU check.

    ``kv_all`` ``[cp, 2, *k.shape]`` holds every rank's K and V; autograd returns this rank's dQ and its own share of
    dK/dV, and the shares of the other ranks' dK/dV are added into ``sent`` (zeros like ``kv_all``: the group's
    reduce sums them in the K/V dtype too), so summing both over the emulated ranks gives the group's gradients.
    ``kv_finite`` ``[cp]``: every rank's ``all_finite`` of its K and V, which a group's owners send with them, so
    this rank's forward checks only its own (None: it checks every source, as a rank without the flags would).
    """
    exchange = _EmulatedKV(plan.rank, kv_all, sent, kv_finite)
    return _ShardAttention.apply(q, k, v, plan, kernel, scale, exchange)


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
    perm, inverse = _device_perm(tokens[rank], q.device)
    qi, ki, vi = (_to_internal(x, packed, perm) for x in (q, k, v))
    kv = torch.stack([ki, vi])
    kv_all = kv.unsqueeze(0) if len(tokens) == 1 else comm.all_gather_stack(kv, cp_group)
    batch, heads, local, dim = qi.shape
    q_tokens = qi.permute(0, 2, 1, 3).reshape(batch * local, heads, dim)
    kv_tokens = kv_all.permute(1, 2, 0, 4, 3, 5).reshape(2, batch * len(tokens) * local, *kv_all.shape[3:4], dim)
    out = torch.zeros_like(q_tokens)
    for rows, keys, cu_q, cu_k, max_q, max_k in _varlen_pieces(tuple(tokens), rank, causal, batch, q.device):
        piece = varlen(
            q_tokens[rows], kv_tokens[0, keys], kv_tokens[1, keys], cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal,
        )  # fmt: skip
        out = out.index_copy(0, rows, piece)
    out = out.reshape(batch, local, heads, dim).permute(0, 2, 1, 3)
    return _from_internal(out, packed, inverse)


@functools.lru_cache(maxsize=4)
def _varlen_pieces(
    tokens: Sequence[RankTokens], rank: int, causal: bool, batch: int, device: torch.device
) -> list[tuple[Tensor, Tensor, Tensor, Tensor, int, int]]:
    """Per query half with valid tokens: query rows, key rows (document order), cu_seqlens, max lengths; built once
    per batch layout (every layer and the backward reuse it, no host work per layer)."""
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
    exchange: int,
    params: PackedSeqParams | None,
    mode: str,
    backend: str,
    softmax_scale: float | None,
) -> ZigzagGeometry:
    """Check everything before any collective; return the batch's zigzag geometry (over ``cp`` zigzag ranks, each
    shard shared by ``exchange`` ranks)."""
    check_attention_inputs(
        q, k, v, packed=params is not None, mode=mode, backend=backend, softmax_scale=softmax_scale,
        head_exchange=cp if mode == AttentionMode.ULYSSES.value else exchange,
    )  # fmt: skip
    if params is None:
        if (q.shape[0] * exchange) % 2:
            raise ValueError(f"dense q has S_local={q.shape[0]} tokens; a zigzag shard holds two equal chunks")
        return ZigzagGeometry.dense(cp, cp * exchange * q.shape[0])
    return _packed_geometry(q.shape[0] * exchange, cp, params)


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    packed: bool,
    mode: str,
    backend: str,
    softmax_scale: float | None,
    head_exchange: int = 1,
) -> None:
    """Check the options and the q/k/v shapes of one attention call (host-only; no metadata is read).

    ``head_exchange``: the ranks a head-parallel mode splits the heads over (their count must divide).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; expected one of {MODES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale!r}; expected a positive float or None")
    check_attention_shapes(q, k, v, packed=packed)
    if mode in (AttentionMode.ULYSSES.value, AttentionMode.HYBRID.value):
        kv_replication(q.shape[-2], k.shape[-2], head_exchange, mode)


ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attention_shapes(q: Tensor, k: Tensor, v: Tensor, packed: bool) -> None:
    """Reject tensors whose ranks, token counts, batch sizes, head counts, head dims, dtypes or devices disagree."""
    dims, layout = (3, "[T_local, H, D]") if packed else (4, "[S_local, B, H, D]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} is a {type(x).__name__}; expected a torch.Tensor")
        if x.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; expected one of float16, bfloat16, float32, float64")
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
    if q.shape[-1] == 0 or q.shape[-2] == 0:
        raise ValueError(f"q has shape {tuple(q.shape)}: {q.shape[-2]} heads of dimension {q.shape[-1]}; expected >= 1")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"Hq={q.shape[-2]} query heads, Hkv={k.shape[-2]} key heads; expected Hq a multiple of Hkv")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(
            f"q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, {v.device}; expected one each"
        )


def _packed_geometry(tokens: int, cp: int, params: PackedSeqParams) -> ZigzagGeometry:
    """Read and check the zigzag-side packed metadata; return the batch's geometry."""
    for field in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        value = getattr(params, field)
        if value is None:
            raise ValueError(
                f"packed_seq_params.{field} is None; expected the global cumulative "
                f"{'padded offsets (each sequence padded to a multiple of 2*cp)' if 'padded' in field else 'lengths'}"
            )
        if not isinstance(value, Tensor) or value.dtype != torch.int32 or value.dim() != 1 or value.numel() < 2:
            raise ValueError(f"packed_seq_params.{field} must be a 1-D int32 tensor of n + 1 offsets, got {value!r}")
    for q_field, kv_field in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        kv_value, q_value = getattr(params, kv_field), getattr(params, q_field)
        if kv_value is not None and kv_value is not q_value and host_offsets(kv_value) != host_offsets(q_value):
            raise ValueError(f"packed_seq_params.{kv_field}={kv_value.tolist()}; expected it to equal {q_field}")
    offsets, padded_offsets = host_offsets(params.cu_seqlens_q), host_offsets(params.cu_seqlens_q_padded)
    lengths = check_offsets("packed_seq_params.cu_seqlens_q", offsets).tolist()
    padded = check_offsets("packed_seq_params.cu_seqlens_q_padded", padded_offsets).tolist()
    if len(offsets) != len(padded_offsets):
        raise ValueError(f"cu_seqlens_q has {len(offsets)} entries, cu_seqlens_q_padded {len(padded_offsets)}")
    for index, (length, pad) in enumerate(zip(lengths, padded, strict=True)):
        if pad < length or pad % (2 * cp):
            raise ValueError(
                f"sequence {index} has length {length} and padded length {pad}; expected a padded length "
                f">= the length and divisible by 2*cp={2 * cp}"
            )
    if padded_offsets[-1] == 0:
        raise ValueError("packed_seq_params describe no tokens (cu_seqlens_q ends at 0); expected a non-empty batch")
    geometry = _packed_geometry_of(cp, tuple(lengths), tuple(padded))
    _check_local_token_count(tokens, geometry)
    return geometry


@functools.lru_cache(maxsize=16)
def _packed_geometry_of(cp: int, lengths: tuple[int, ...], padded: tuple[int, ...]) -> ZigzagGeometry:
    """One geometry object per batch layout, so every layer and the backward share its token descriptions."""
    return ZigzagGeometry(cp, lengths, padded)


def _choose_kernel(backend: str, mode: str, q: Tensor) -> str:
    """Resolve ``backend`` to a kernel name, rejecting choices this input cannot use."""
    flash_ok = flash_attn_varlen_func() is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    flash_ok = flash_ok and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)  # flash-attn 2
    flash_modes = (AttentionMode.ALLGATHER.value, AttentionMode.ULYSSES.value)
    sdpa_ok = q.is_cuda and q.dtype in _CUDA_SDPA_DTYPES and q.shape[-1] % 8 == 0
    if backend == "auto":
        if flash_ok and mode in flash_modes:
            return "flash_attn"
        if q.device.type == "cpu":
            return "cpu_flash"
        return "cuda_sdpa" if sdpa_ok and _efficient_cuda_kernel_runs(q.device, q.dtype, q.shape[-1]) else "math"
    if backend == "flash_attn" and (not flash_ok or mode not in flash_modes):
        raise ValueError(
            f"backend='flash_attn' with mode={mode!r}, {q.dtype} of head dim {q.shape[-1]} on {q.device}; expected "
            "flash-attn installed, CUDA float16/bfloat16 tensors of head dim <= 256 on an Ampere or newer GPU and "
            "mode='allgather' or 'ulysses'"
        )
    if backend == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"backend='cpu_flash' with tensors on {q.device}; expected CPU tensors")
    if backend == "cuda_sdpa" and not sdpa_ok:
        raise ValueError(
            f"backend='cuda_sdpa' with {q.dtype} tensors of head dim {q.shape[-1]} on {q.device}; expected CUDA "
            "float16, bfloat16 or float32 and a head dim divisible by 8"
        )
    return backend


@functools.cache
def _efficient_cuda_kernel_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's memory-efficient CUDA kernel takes ``dtype`` tiles of ``head_dim`` on this GPU (bf16 needs
    Ampere). Where it does not, ``cuda_sdpa`` would run its masked tiles, or all of them, in the math kernel at GPU
    tile sizes (gigabytes of scores per tile), so ``auto`` takes the math kernel with its own small tiles."""
    probe = torch.zeros(1, 1, 8, head_dim, device=device, dtype=dtype)
    params = torch.backends.cuda.SDPAParams(probe, probe, probe, None, 0.0, False, False)
    return bool(torch.backends.cuda.can_use_efficient_attention(params, False))


def _log_choice_once(kernel_name: str, mode: str, q: Tensor) -> None:
    """Log the kernel chosen for a (kernel, mode, device type) combination the first time it is used."""
    key = (kernel_name, mode, q.device.type)
    if key not in _LOGGED_CHOICES:
        _LOGGED_CHOICES.add(key)
        logger.info("zigzag_attention: backend %s, mode %s, device %s", kernel_name, mode, q.device.type)
