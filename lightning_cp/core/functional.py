"""What model code calls: ``cp_attention``, exact attention under the active step (or on one device without one);
``cp_gather_sequence``, a per-token output of the whole replica batch on every rank; ``cp_causal_conv1d``, a short
causal convolution per document in any layout; ``cp_ssd_scan``, ``cp_selective_scan`` and ``cp_gated_delta_rule``,
Mamba2's and Mamba's selective scans and the gated delta rule per document in any layout; ``cp_previous_tokens`` and
``cp_previous_state``, what a convolution or a recurrence on contiguous shards needs from the shards before."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from lightning_cp.core import comm
from lightning_cp.core.attention.api import (
    AttentionMode,
    attend_on_shards,
    check_attention_inputs,
    check_attention_shapes,
)
from lightning_cp.core.packed import host_offsets
from lightning_cp.core.scan import gated_delta_scan, selective_scan, ssd_scan
from lightning_cp.core.step import ContextParallelStep, active_step
from lightning_cp.core.zigzag import CPLayout, contiguous_padding_multiple


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-device attention on batch-first ``[B, S, H, D]``; with ``cu_seqlens`` tokens attend within documents.

    Packed rows run one fused attention call per document (tokens past ``cu_seqlens[-1]`` form one more segment).
    """
    check_attention_shapes(q, k, v, packed=False)
    query, key, value = (tensor.transpose(1, 2) for tensor in (q, k, v))
    if cu_seqlens is None:
        segments = [(query, key, value)]
    else:
        offsets = host_offsets(cu_seqlens)
        lengths = [end - start for start, end in zip(offsets, offsets[1:], strict=False)] + [q.shape[1] - offsets[-1]]
        lengths = [length for length in lengths if length > 0]
        segments = list(zip(*(tensor.split(lengths, dim=2) for tensor in (query, key, value)), strict=True))
    outputs = [
        F.scaled_dot_product_attention(
            segment_q, segment_k, segment_v, is_causal=causal, scale=softmax_scale, enable_gqa=True
        )
        for segment_q, segment_k, segment_v in segments
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)


@comm.eager_under_compile
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention for model code on batch-first ``[B, S_local, H, D]`` shards (packed: ``B == 1``).

    Under autocast q, k, v are cast to its dtype first, as SDPA casts them (a model's rotary embedding in float32
    can leave q, k in float32 next to a bf16 v). Under an active CP step it runs CP attention over the CP group with
    the step's attention mode and geometry,
    converting q/k/v to zigzag (and the output back) when the layer it runs in is not zigzag (``ulysses`` takes any
    layout and converts nothing). Without CP it is single-device attention, masked per document for packed batches.
    """
    step = active_step()
    if step is not None:
        step.attention_calls += 1
        step.require_stream_at_boundary("cp_attention outside the wrapped layers")
    if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: one dtype, the autocast's
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (tensor.to(dtype) for tensor in (q, k, v))
    if step is not None and not causal and not step.is_packed and step.dense_padding:
        multiple = contiguous_padding_multiple(step.cp_size, step.setting.mesh.tp_size, packed=False)
        raise ValueError(
            f"bidirectional dense attention would see the batch's {step.dense_padding} padding tokens: make the "
            f"sequence length divisible by {multiple} or use packed batches"
        )
    if step is None or step.cp_size == 1:
        cu_seqlens = step.contiguous_packed_seq_params.cu_seqlens_q if step is not None and step.is_packed else None
        return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    layout = step.current_layout
    mode = step.attention_mode
    head_exchange = mode == AttentionMode.ULYSSES.value  # attends in any layout: no conversion
    if layout != CPLayout.ZIGZAG and not head_exchange:
        q, k, v = (step.convert(tensor, layout, CPLayout.ZIGZAG) for tensor in (q, k, v))
    packed = step.is_packed  # packed: [1, T, H, D] -> [T, H, D]; dense: [B, S, H, D] -> [S, B, H, D]
    q, k, v = (tensor[0] if packed else tensor.transpose(0, 1) for tensor in (q, k, v))
    mesh = step.setting.mesh
    check_attention_inputs(
        q, k, v, packed=packed, mode=mode, backend="auto", softmax_scale=softmax_scale,
        head_exchange=step.setting.head_exchange,
    )  # fmt: skip
    output = attend_on_shards(
        q, k, v, step.cp_group, step.geometry, packed=packed, causal=causal, softmax_scale=softmax_scale, mode=mode,
        ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group,
        layout=layout if head_exchange else CPLayout.ZIGZAG,
        stream_length=step.stream_length if head_exchange else None,
    )  # fmt: skip
    output = output.unsqueeze(0) if packed else output.transpose(0, 1)
    if layout != CPLayout.ZIGZAG and not head_exchange:
        output = step.convert(output, CPLayout.ZIGZAG, layout)
    return output


@comm.eager_under_compile
def cp_gather_sequence(tensor: torch.Tensor) -> torch.Tensor:
    """Return the replica batch's whole ``[B, S, ...]`` per-token tensor (logits, hidden states, predictions) from this
    rank's shard of it: in the batch's own token order, without the padding sharding added, on every rank of the
    replica (what ``predict_step`` returns so predictions match one device's). Without an active step: as it is.
    """
    step = active_step()
    if step is None:
        return tensor
    step.require_stream_at_boundary("cp_gather_sequence")
    group = step.loss_group
    if group is not None:
        contiguous = step.convert(tensor, step.boundary_layout, CPLayout.CONTIGUOUS)
        shards = comm.all_gather_stack(contiguous.transpose(0, 1), group)  # [ranks, S / ranks, B, ...]
        tensor = shards.flatten(0, 1).transpose(0, 1)
    return tensor[:, : step.sequence_length]


def _contiguous_shard_group(name: str) -> ProcessGroup | None:
    """The group whose ranks hold the batch's contiguous shards in sequence order (CP ranks, or TP x CP ones under
    sequence parallelism), for ``name`` called in a block on contiguous shards; None on one shard or without a step."""
    _, group, layout = _recurrence_shards(name)
    if group is not None and layout is not CPLayout.CONTIGUOUS:
        raise ValueError(
            f"{name} needs the contiguous layout, but this block runs in {layout.value}: name it in contiguous_layers"
        )
    return group


@comm.eager_under_compile
def cp_previous_tokens(hidden_states: torch.Tensor, count: int = 1) -> torch.Tensor:
    """Return the ``count`` tokens that precede this rank's contiguous shard ``[B, S_local, ...]`` in the sequence:
    ``[B, count, ...]`` from the shards before it (the previous CP rank's, or under sequence parallelism TP x CP
    rank's; from several ranks when ``count`` exceeds a shard; zeros before the sequence's start, on one shard or
    without an active step), differentiably. What a token shift or a causal convolution (``count`` = kernel - 1)
    needs from across the shard boundary; call it in a block that runs on contiguous shards, and mask what lies before
    a document's start with ``position_ids``, as on one device."""
    rows, local = hidden_states.shape[0], hidden_states.shape[1]
    shape = (rows, count, *hidden_states.shape[2:])
    group = _contiguous_shard_group("cp_previous_tokens")
    if group is None:
        return hidden_states.new_zeros(shape)
    rank, size = comm.group_rank(group), comm.group_size(group)
    if count > local:  # every shard before this one, gathered: what precedes it is their concatenation
        shards = comm.all_gather_stack(hidden_states, group)  # [ranks, B, S_local, ...]
        before = shards[:rank].transpose(0, 1).flatten(1, 2)  # [B, rank * S_local, ...]
        padding = hidden_states.new_zeros((rows, max(count - before.shape[1], 0), *hidden_states.shape[2:]))
        # a slice of the gather on every rank, empty on the first: every rank takes part in its backward
        return torch.cat([padding, before[:, max(before.shape[1] - count, 0) :]], dim=1)
    tail = hidden_states[:, local - count :].reshape(rows * count, *hidden_states.shape[2:])
    send = [tail.shape[0] if peer == (rank + 1) % size else 0 for peer in range(size)]
    receive = [tail.shape[0] if peer == (rank - 1) % size else 0 for peer in range(size)]
    received = comm.all_to_all_v(tail.contiguous(), receive, send, group).view(shape)
    if rank == 0:  # it sends too (to rank 1), and so takes part in the backward's all-to-all as well
        received = received.masked_fill(torch.ones((), dtype=torch.bool, device=received.device), 0)
    return received


@comm.eager_under_compile
def cp_previous_state(final_state: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """Return the state with which a linear recurrence ``h_t = a_t * h_{t-1} + x_t`` enters this rank's contiguous
    shard, from each shard's own run started at zero: ``final_state`` is this shard's last state so computed and
    ``decay`` the product of its ``a_t`` (broadcastable to the state). The state entering rank ``r`` is
    ``S_{r-1} + D_{r-1} * (the state entering r - 1)``: zeros on the first rank, on one shard or without an active
    step; differentiable in both arguments. Adding ``cumprod(a)_t * state`` to the shard's states from zero (or
    running the shard's scan again from it) gives one device's states; ``a_t = 0`` at a document's start keeps state
    from crossing documents. One all-gather of state and decay over the ranks holding contiguous shards, in the
    wider of their dtypes (the result comes back in the state's)."""
    try:
        broadcast = torch.broadcast_shapes(decay.shape, final_state.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != final_state.shape:
        raise ValueError(
            f"cp_previous_state: the decay's shape {tuple(decay.shape)} does not broadcast to the state's shape "
            f"{tuple(final_state.shape)}"
        )
    group = _contiguous_shard_group("cp_previous_state")
    return torch.zeros_like(final_state) if group is None else _state_entering_shard(final_state, decay, group)


def _state_entering_shard(
    final_state: torch.Tensor,
    decay: torch.Tensor,
    group: ProcessGroup,
    carry: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mul,
) -> torch.Tensor:
    """The state entering this rank's contiguous shard of ``group``: every earlier shard's ``final_state`` carried over
    the shards after it by their ``decay`` (``carry(decay, state)``: a product, or a transition matrix's for the delta
    rule), in one all-gather of both, in the wider of their dtypes."""
    dtype = torch.promote_types(final_state.dtype, decay.dtype)
    both = torch.cat([final_state.to(dtype).flatten(), decay.to(dtype).flatten()])  # the decay as small as given
    shards = comm.all_gather_stack(both, group)  # [ranks, state + decay values]
    states = shards[:, : final_state.numel()].reshape(-1, *final_state.shape)
    decays = shards[:, final_state.numel() :].reshape(-1, *decay.shape)
    # zeros that depend on the gather, so that every rank (the first included) takes part in its backward
    entering = states[0].masked_fill(torch.ones((), dtype=torch.bool, device=both.device), 0)
    rank = comm.group_rank(group)
    for state, shard_decay in zip(states[:rank], decays[:rank], strict=True):
        entering = state + carry(shard_decay, entering)
    return entering.to(final_state.dtype)


@comm.eager_under_compile
def cp_ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *, chunk_size: int = 256
) -> torch.Tensor:
    """Mamba2's selective scan (state space duality) per document: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``,
    ``y_t = h_t C_t``, from a zero state at each document's start, as one device scans that document alone.

    ``x`` ``[b, S_local, heads, head_dim]``, ``dt`` ``[b, S_local, heads]`` (step sizes after bias, softplus and
    limits), ``A`` ``[heads]`` (negative), ``B`` and ``C`` ``[b, S_local, groups, state]`` (``heads`` divisible by
    ``groups``); returns ``y`` ``[b, S_local, heads, head_dim]`` without the ``D`` skip, computed (also under
    autocast) and returned in the widest of the inputs' dtypes and float32. Under an active step each rank scans its
    contiguous shard in chunks of ``chunk_size`` tokens, then adds the state entering it from the shards before (one
    all-gather of one state per rank); in a block that runs in another layout the inputs are converted to contiguous
    shards and the output back. Without a step each row is one document."""
    rows, length, heads = x.shape[:3] if x.dim() == 4 else (0, 0, 0)
    groups = B.shape[2] if B.dim() == 4 else 0
    if (
        x.dim() != 4 or tuple(dt.shape) != (rows, length, heads) or tuple(A.shape) != (heads,) or B.shape != C.shape
        or B.dim() != 4 or tuple(B.shape[:2]) != (rows, length) or groups == 0 or heads % groups or chunk_size < 1
    ):  # fmt: skip
        raise ValueError(
            f"cp_ssd_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
            f"C {tuple(C.shape)}, chunk_size={chunk_size}; expected x [b, S, heads, head_dim], dt [b, S, heads], "
            "A [heads], B and C [b, S, groups, state] with heads divisible by groups, chunk_size >= 1"
        )

    def scan(
        x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, *, starts: torch.Tensor,
        group: ProcessGroup | None,
    ) -> torch.Tensor:  # fmt: skip
        B, C = (tensor.repeat_interleave(heads // groups, dim=2) for tensor in (B, C))
        y, final_state, entry_decay = ssd_scan(x, dt, A, B, C, starts, chunk_size)
        if group is None:
            return y
        entering = _state_entering_shard(final_state, entry_decay[:, -1, :, None, None], group)
        return y + torch.einsum("bshn,bhpn->bshp", C, entering) * entry_decay.unsqueeze(-1)

    return _scan_on_contiguous_shards("cp_ssd_scan", ((x, B, C), (dt,)), (A,), scan)


@comm.eager_under_compile
def cp_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *, chunk_size: int = 64
) -> torch.Tensor:
    """Mamba's selective scan (Mamba1, Jamba, Falcon Mamba) per document: ``h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t)
    B_t^T`` with a decay per channel and state entry, ``y_t = h_t C_t``, from a zero state at each document's start,
    as one device scans that document alone.

    ``x`` ``[b, S_local, channels]``, ``dt`` ``[b, S_local, channels]`` (step sizes after bias and softplus), ``A``
    ``[channels, state]`` (negative), ``B`` and ``C`` ``[b, S_local, state]``; returns ``y`` ``[b, S_local, channels]``
    without the ``D`` skip, computed (also under autocast) and returned in the widest of the inputs' dtypes and
    float32. Under an active step each rank scans its contiguous shard (``chunk_size`` tokens one after another, all
    chunks at once, then chunk after chunk) from the state entering it, which every earlier shard's last state and
    decay compose (one all-gather of one state per rank); in a block that runs in another layout the inputs are
    converted to contiguous shards and the output back. The per-token states are recomputed in the backward, not
    kept. Without a step each row is one document."""
    rows, length, channels = x.shape if x.dim() == 3 else (0, 0, 0)
    if (
        x.dim() != 3 or dt.shape != x.shape or A.dim() != 2 or A.shape[0] != channels or B.shape != C.shape
        or tuple(B.shape) != (rows, length, A.shape[1]) or chunk_size < 1
    ):  # fmt: skip
        raise ValueError(
            f"cp_selective_scan: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
            f"C {tuple(C.shape)}, chunk_size={chunk_size}; expected x and dt [b, S, channels], A [channels, state], "
            "B and C [b, S, state], chunk_size >= 1"
        )

    def scan(
        x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, *, starts: torch.Tensor,
        group: ProcessGroup | None,
    ) -> torch.Tensor:  # fmt: skip
        entering = None if group is None else functools.partial(_state_entering_shard, group=group)
        return selective_scan(x, dt, A, B, C, starts, chunk_size, entering)[0]

    return _scan_on_contiguous_shards("cp_selective_scan", ((x, B, C), (dt,)), (A,), scan)


@comm.eager_under_compile
def cp_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    l2_normalize_qk: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The gated delta rule per document: ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T q_t``, from a zero state at each document's start, as one device runs each alone; a decay per head
    (Gated DeltaNet) or per key channel (Kimi delta attention).

    ``q``, ``k`` ``[b, S_local, key_heads, dk]`` (``key_heads`` dividing ``heads``: each serves that many neighbouring
    value heads), ``v`` ``[b, S_local, heads, dv]``, ``g`` (log decays, <= 0) ``[b, S_local, heads]`` or ``[b,
    S_local, heads, dk]``, ``beta`` ``[b, S_local, heads]``; ``q`` and ``k`` are L2-normalised first if
    ``l2_normalize_qk`` (``x / sqrt(|x|^2 + 1e-6)``), then ``q`` is scaled by ``scale`` (default ``dk ** -0.5``), as
    Hugging Face's and FLA's kernels do. Returns ``o`` ``[b, S_local, heads, dv]``, computed (also under autocast) and
    returned in the widest of the inputs' dtypes and float32. It runs in chunks of ``chunk_size`` tokens (by default 64
    with a decay per head, 8 with a decay per key channel, whose pairwise decays take ``chunk_size x dk`` values per
    token and head, so that these chunks are recomputed in the backward rather than kept). Under an active step each
    rank runs its contiguous shard chunk by chunk, carrying next to the state, in ``dk`` more columns, the shard's
    transition (the product of its ``(I - beta_t k_t k_t^T) Diag(exp(g_t))``); the state entering the shard is composed
    from every earlier shard's last state and transition (one all-gather), and each output adds that state's read-out.
    In a block that runs in another layout the inputs are converted to contiguous shards as given (before the heads are
    repeated and the dtypes widened) and the output back. Without a step each row is one document."""
    rows, length, key_heads, key_dim = k.shape if k.dim() == 4 else (0, 0, 0, 0)
    heads = v.shape[2] if v.dim() == 4 else 0
    if (
        k.dim() != 4 or q.shape != k.shape or v.dim() != 4 or tuple(v.shape[:2]) != (rows, length) or key_heads == 0
        or heads % key_heads or tuple(beta.shape) != (rows, length, heads)
        or tuple(g.shape) not in ((rows, length, heads), (rows, length, heads, key_dim))
        or (chunk_size is not None and chunk_size < 1)
    ):  # fmt: skip
        raise ValueError(
            f"cp_gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, chunk_size={chunk_size}; expected q and k [b, S, key_heads, dk], v [b, S, "
            "heads, dv] with heads divisible by key_heads, g [b, S, heads] or [b, S, heads, dk], beta [b, S, heads], "
            "chunk_size None or >= 1"
        )

    def rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
        starts: torch.Tensor, group: ProcessGroup | None,
    ) -> torch.Tensor:  # fmt: skip
        value_dim = v.shape[-1]
        q, k = (tensor.repeat_interleave(heads // key_heads, dim=2) for tensor in (q, k))
        if l2_normalize_qk:
            q, k = (tensor * torch.rsqrt((tensor * tensor).sum(-1, keepdim=True) + 1e-6) for tensor in (q, k))
        q = q * (key_dim**-0.5 if scale is None else scale)
        state = v.new_zeros(rows, heads, key_dim, value_dim)
        if group is not None:  # the transition rides along: zero values, the identity as its initial state
            v = torch.cat([v, v.new_zeros(*v.shape[:3], key_dim)], dim=-1)
            identity = torch.eye(key_dim, dtype=v.dtype, device=v.device).expand(rows, heads, key_dim, key_dim)
            state = torch.cat([state, identity], dim=-1)
        chunk = chunk_size if chunk_size is not None else 8 if g.dim() == 4 else 64
        if g.dim() == 3:
            o, last = gated_delta_scan(q, k, v, g, beta, starts, chunk, state)
        else:  # recomputed in the backward rather than kept: pairwise decays of `chunk x dk` values per token and head
            o, last = checkpoint(gated_delta_scan, q, k, v, g, beta, starts, chunk, state, use_reentrant=False)
        if group is None:
            return o
        (o, reads), (last, transition) = o.split([value_dim, key_dim], -1), last.split([value_dim, key_dim], -1)
        entering = _state_entering_shard(last, transition, group, carry=torch.matmul)
        return o + torch.einsum("bshk,bhkv->bshv", reads, entering)

    return _scan_on_contiguous_shards("cp_gated_delta_rule", ((q, k, v), (g, beta)), (), rule)


def _scan_on_contiguous_shards(
    name: str,
    conversions: tuple[tuple[torch.Tensor, ...], ...],
    others: tuple[torch.Tensor, ...],
    scan: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Run ``scan(*per_token, *others, starts=..., group=...)`` of the CP function ``name`` on this rank's contiguous
    shard: each group of ``conversions`` (per-token tensors ``[b, S_local, ...]``) goes there in one conversion, its
    tensors keeping their dtypes (step sizes and gates travel apart from bf16 activations); then all of them and
    ``others`` are widened to the widest of their dtypes and float32, and ``scan`` runs with autocast off (products and
    sums in that dtype, whatever autocast's is), given the shard's document starts and the group whose ranks hold the
    contiguous shards in order (None: one shard). Its output goes back to the block's layout."""
    step, group, layout = _recurrence_shards(name)
    per_token = [
        tensor
        for tensors in conversions
        for tensor in (tensors if layout is CPLayout.CONTIGUOUS else _to_contiguous(step, layout, tensors))
    ]
    tensors = (*per_token, *others)
    dtype = functools.reduce(torch.promote_types, (tensor.dtype for tensor in tensors), torch.float32)
    device = per_token[0].device
    starts = _document_starts(per_token[0].shape[1], device)
    with torch.autocast(device.type, enabled=False):
        output = scan(*(tensor.to(dtype) for tensor in tensors), starts=starts, group=group)
    return output if layout is CPLayout.CONTIGUOUS else step.convert(output, CPLayout.CONTIGUOUS, layout)


def _recurrence_shards(name: str) -> tuple[ContextParallelStep | None, ProcessGroup | None, CPLayout]:
    """For a function called ``name`` that passes state along contiguous shards: the active step, the group whose
    ranks hold the batch's contiguous shards in rank order (None: one shard, or no step) and the layout the block runs
    in (contiguous without CP, where the two layouts are one)."""
    step = active_step()
    if step is None:
        return None, None, CPLayout.CONTIGUOUS
    step.require_stream_at_boundary(f"{name} outside the wrapped layers")
    group = step.loss_group
    layout = step.current_layout if step.cp_size > 1 else CPLayout.CONTIGUOUS
    return step, (group if group is not None and comm.group_size(group) > 1 else None), layout


def _to_contiguous(
    step: ContextParallelStep, layout: CPLayout, tensors: tuple[torch.Tensor, ...]
) -> list[torch.Tensor]:
    """``tensors`` ``[b, S_local, ...]`` moved from ``layout`` to contiguous shards in one conversion (side by side in
    their widest dtype, each back in its own); a contiguous shard may hold another number of tokens."""
    rows, length = tensors[0].shape[:2]
    flat = [tensor.reshape(rows, length, -1) for tensor in tensors]
    wide = functools.reduce(torch.promote_types, (tensor.dtype for tensor in tensors))
    moved = step.convert(torch.cat([part.to(wide) for part in flat], dim=-1), layout, CPLayout.CONTIGUOUS)
    parts = moved.split([part.shape[-1] for part in flat], dim=-1)
    return [
        part.reshape(rows, moved.shape[1], *tensor.shape[2:]).to(tensor.dtype)
        for part, tensor in zip(parts, tensors, strict=True)
    ]


def _document_starts(local_tokens: int, device: torch.device) -> torch.Tensor:
    """``[S_local]`` booleans: a document starts at the token of this rank's contiguous shard (without a step: the
    row's first token)."""
    step = active_step()
    if step is None:
        return torch.arange(local_tokens, device=device) == 0
    return step.document_starts(local_tokens, device)


@comm.eager_under_compile
def cp_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[B, S_local, D]`` with ``weight`` ``[D, K]`` (oldest tap first:
    ``nn.Conv1d(D, D, K, groups=D).weight[:, 0]``) and an optional ``bias`` ``[D]``, each document on its own: a token
    sees the ``K - 1`` tokens before it in its document and zeros before the document's start, as the convolution of
    that document alone on one device. Under an active step it runs in whatever layout the block runs in (zigzag or
    contiguous): every piece of a document on this rank is laid out behind the ``K - 1`` tokens before it, from the
    ranks holding them (one all-to-all-v of at most ``K - 1`` tokens per piece, planned once per batch). Without a step
    each row is one document. Inputs are in the wider of ``x``'s and the weight's dtypes (autocast's under autocast,
    unless one is float64), the taps accumulate in at least float32, token-major (no transposed copy), and the result
    has ``x``'s dtype."""
    channels = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1 or x.dim() != 3:
        raise ValueError(
            f"cp_causal_conv1d: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected x [B, S, D] and a "
            "weight [D, K >= 1] (a depthwise Conv1d's weight without its middle dimension)"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"cp_causal_conv1d: bias {tuple(bias.shape)}; expected [D] = ({channels},)")
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if torch.is_autocast_enabled(x.device.type) and dtype != torch.float64:
        dtype = torch.get_autocast_dtype(x.device.type)
    kernel, weight = weight.shape[1], weight.to(dtype)
    windows, output_positions = _convolution_windows(x.to(dtype), kernel - 1)
    length = windows.shape[1] - (kernel - 1)
    output = windows.new_zeros((windows.shape[0], length, channels), dtype=torch.promote_types(dtype, torch.float32))
    if bias is not None:
        output = output + bias.to(output.dtype)
    for tap in range(kernel):  # products formed in the accumulator's precision, as a convolution's
        output = torch.addcmul(output, windows[:, tap : tap + length], weight[:, tap])
    if output_positions is not None:
        output = output.index_select(1, output_positions)
    return output.to(x.dtype)


def _convolution_windows(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, S', D]``: every piece of a document in ``x`` ``[B, S_local, D]`` preceded by the ``count`` tokens before
    it (zeros before a document's start), and where each token's output lies in a convolution of it without padding
    (None: in order). Without a step, each row preceded by zeros."""
    step = active_step()
    if step is None or count == 0:
        return F.pad(x, (0, 0, count, 0)), None
    step.require_stream_at_boundary("cp_causal_conv1d outside the wrapped layers")
    plan, group = step.causal_window_plan(count, x.shape[1], x.device)
    rows = x.transpose(0, 1)  # [S_local, B, D]: the exchange and the windows move whole tokens
    received = rows[:0]
    if group is not None:
        sent = rows.index_select(0, plan.send_slots)
        received = comm.all_to_all_v(sent, plan.receive_counts, plan.send_counts, group)
    extended = torch.cat([rows, received, rows.new_zeros((1, *rows.shape[1:]))])
    return extended.index_select(0, plan.window_rows).transpose(0, 1), plan.output_positions
