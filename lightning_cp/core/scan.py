"""Chunked scans of linear recurrences on one shard, restarting at document starts: Mamba2's selective state-space
scan (state space duality; the local part of ``cp_ssd_scan``), Mamba's selective scan (the local part of
``cp_selective_scan``) and the gated delta rule (Gated DeltaNet; the local part of ``cp_gated_delta_rule``). Each CP
function adds the state entering the shard from the shards before."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, starts: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Scan ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t`` from a zero state, per document.

    ``x`` ``[b, s, h, p]``, ``dt`` ``[b, s, h]`` (step sizes, already positive), ``A`` ``[h]`` (negative), ``B`` and
    ``C`` ``[b, s, h, n]`` (one per head), ``starts`` ``[s]`` (a document starts at the token: the state before it is
    dropped), all in the dtype to compute in. Returns the outputs ``y`` ``[b, s, h, p]``, the last state ``[b, h, p,
    n]``, and ``entry_decay`` ``[b, s, h]``: the factor by which a state entering the shard reaches each token (0 from
    the first document start on), so that ``y_t + entry_decay_t * (state C_t)`` is the scan from that state.
    Chunks of ``chunk_size`` tokens attend to each other within a chunk and pass states between chunks, as Mamba2's
    reference; every product of decays is the exponential of log decays summed over tokens of one document run (over
    a chunk at most, or over whole chunks between two), masked before the exponential.
    """
    batch, length, heads, _ = x.shape
    padding = (-length) % chunk_size
    log_decay = F.pad(dt * A, (0, 0, 0, padding))  # padded tokens decay nothing and add nothing
    inputs = F.pad(x * dt.unsqueeze(-1), (0, 0, 0, 0, 0, padding))
    B, C = (F.pad(tensor, (0, 0, 0, 0, 0, padding)) for tensor in (B, C))
    segment = torch.cumsum(starts.long(), 0)  # which document run a token is in; padding continues the last
    segment = torch.cat([segment, segment[-1:].expand(padding)])
    chunks = (length + padding) // chunk_size

    def chunked(tensor: Tensor) -> Tensor:
        return tensor.reshape(batch, chunks, chunk_size, *tensor.shape[2:])

    log_decay, inputs, B, C = (chunked(tensor) for tensor in (log_decay, inputs, B, C))
    segment = segment.view(chunks, chunk_size)
    cumulative = torch.cumsum(log_decay, dim=2)  # [b, c, l, h] within each chunk

    # 1. within chunks: token l reads token s <= l of its own document run, decayed over (s, l]
    pairs = (segment.unsqueeze(2) == segment.unsqueeze(1)) & torch.ones(
        chunk_size, chunk_size, dtype=torch.bool, device=x.device
    ).tril()
    within = _masked_exp(_segment_sums(log_decay.transpose(2, 3)).permute(0, 1, 3, 4, 2), pairs[None, :, :, :, None])
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * within
    y = torch.einsum("bclsh,bcshp->bclhp", scores, inputs)

    # 2. each chunk's last state from a zero state at its start
    to_end = _masked_exp(cumulative[:, :, -1:] - cumulative, (segment == segment[:, -1:])[None, :, :, None])
    chunk_states = torch.einsum("bclhn,bclh,bclhp->bchpn", B, to_end, inputs)

    # 3. the state entering each chunk (and after the last), from every earlier chunk of the same document run,
    # decayed over the chunks in between (sums over them, not differences of sums over the whole shard)
    between = _segment_sums(F.pad(cumulative[:, :, -1].transpose(1, 2), (1, 0)))[..., 1:]  # [b, h, target, source]
    ends = segment[:, -1]
    earlier = torch.ones(chunks + 1, chunks, dtype=torch.bool, device=x.device).tril(-1)
    reaching = earlier & (F.pad(ends, (1, 0), value=-1).unsqueeze(1) == ends.unsqueeze(0))  # [target, source]
    weights = _masked_exp(between.permute(0, 2, 3, 1), reaching[None, :, :, None])
    entering = torch.einsum("btzh,bzhpn->bthpn", weights, chunk_states)
    final_state = entering[:, -1]

    # 4. each token reads the state entering its chunk while no document started in between
    alive = (segment == F.pad(ends[:-1], (1, 0), value=-1).unsqueeze(1))[None, :, :, None]
    from_start = _masked_exp(cumulative, alive)
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, entering[:, :-1]) * from_start.unsqueeze(-1)

    first_document = (segment == 0).flatten()[None, :, None]  # no document start at or before the token
    entry_decay = _masked_exp(torch.cumsum(log_decay.flatten(1, 2), dim=1), first_document)
    y = y.flatten(1, 2)[:, :length]
    return y, final_state, entry_decay[:, :length]


def selective_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    starts: Tensor,
    chunk_size: int,
    entering_state: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Scan ``h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t^T`` (elementwise decays, one per channel and state),
    ``y_t = h_t C_t`` per document, from the state entering the shard.

    ``x`` and ``dt`` ``[b, s, d]`` (step sizes, already positive), ``A`` ``[d, n]`` (negative), ``B`` and ``C`` ``[b,
    s, n]``, ``starts`` ``[s]`` (a document starts at the token: the state before it is dropped), all in the dtype to
    compute in. ``entering_state(last, decay)`` is given the shard's last state from a zero state and the decay from
    the shard's start to its end (0 past a document start), both ``[b, d, n]``, and returns the state entering the
    shard (``cp_selective_scan`` gathers them over the ranks); None: a zero state. Returns ``y`` ``[b, s, d]`` and the
    last state. The decays differ per state entry, so there is no attention-like form within a chunk: a first pass
    scans each chunk's tokens one after another (all chunks at once) for the chunk's last state and decay, the chunks
    pass their states on in turn, and a second pass scans every chunk again from the state entering it, keeping only
    the outputs (about ``s / chunk_size + 2 chunk_size`` steps; every decay a running product of factors in [0, 1]).
    Both passes are recomputed in the backward rather than kept (as ``mamba_ssm``'s kernel does), so between forward
    and backward the scan holds ``[b, s, d]`` tensors, not a ``d x n`` state per token."""
    batch, length, channels = x.shape
    padding = (-length) % chunk_size  # padded tokens take a zero step: no decay, no input
    chunks = (length + padding) // chunk_size
    x, dt, B, C = (F.pad(tensor, (0, 0, 0, padding)).view(batch, chunks, chunk_size, -1) for tensor in (x, dt, B, C))
    restarts = F.pad(starts, (0, padding)).view(chunks, chunk_size).unbind(1)

    def tokens(x: Tensor, dt: Tensor, A: Tensor, B: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """Each token of every chunk in turn: its decay (0 at a document start) and its input, ``[b, c, d, n]``."""
        for token_x, token_dt, token_B, restart in zip(x.unbind(2), dt.unbind(2), B.unbind(2), restarts, strict=True):
            decay = torch.exp(token_dt.unsqueeze(-1) * A).masked_fill(restart[None, :, None, None], 0)
            yield decay, (token_dt * token_x).unsqueeze(-1) * token_B.unsqueeze(2)

    def chunk_ends(x: Tensor, dt: Tensor, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
        """Each chunk's last state from a zero state at its start, and its decay from start to end."""
        state = x.new_zeros(batch, chunks, channels, A.shape[1])
        reach = torch.ones_like(state)
        for token_decay, token_input in tokens(x, dt, A, B):
            state, reach = token_decay * state + token_input, token_decay * reach
        return state, reach

    def outputs(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor) -> Tensor:
        """Every chunk scanned from the state entering it: ``y`` ``[b, c, l, d]``."""
        read = []
        for (token_decay, token_input), token_C in zip(tokens(x, dt, A, B), C.unbind(2), strict=True):
            state = token_decay * state + token_input
            read.append(torch.einsum("bcdn,bcn->bcd", state, token_C))
        return torch.stack(read, dim=2)

    chunk_last, chunk_decay = checkpoint(chunk_ends, x, dt, A, B, use_reentrant=False)

    def carried(start: Tensor) -> tuple[list[Tensor], Tensor]:
        """The state entering each chunk from ``start`` entering the shard, and the state after the last chunk."""
        entering, entered = start, []
        for last_state, through in zip(chunk_last.unbind(1), chunk_decay.unbind(1), strict=True):
            entered.append(entering)
            entering = through * entering + last_state
        return entered, entering

    start = torch.zeros_like(chunk_last[:, 0])
    if entering_state is not None:
        start = entering_state(carried(start)[1], torch.prod(chunk_decay, dim=1))
    entered, last = carried(start)
    y = checkpoint(outputs, x, dt, A, B, C, torch.stack(entered, dim=1), use_reentrant=False)
    return y.flatten(1, 2)[:, :length], last


def gated_delta_scan(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor, chunk_size: int, initial_state: Tensor
) -> tuple[Tensor, Tensor]:
    """Scan the gated delta rule ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, ``o_t =
    S_t^T q_t`` from ``initial_state`` ``[b, h, dk, dv]``, per document.

    ``q``, ``k`` ``[b, s, h, dk]``, ``v`` ``[b, s, h, dv]``, ``g`` (log decays, <= 0) ``[b, s, h]`` (one per head:
    Gated DeltaNet) or ``[b, s, h, dk]`` (one per key channel: Kimi delta attention), ``beta`` ``[b, s, h]``,
    ``starts`` ``[s]`` (a document starts at the token: the state before it is dropped), all in the dtype to compute in.
    Returns ``o`` ``[b, s, h, dv]`` and the last state. Within a chunk of ``chunk_size`` tokens the delta rule's updates
    are one triangular solve (the UT transform of DeltaNet), masked per document run; the chunks then pass the state on
    in turn. The columns of the state evolve independently, so extra value columns carry extra states
    (``cp_gated_delta_rule`` carries the shard's transition so)."""
    batch, length, heads, _ = k.shape
    padding = (-length) % chunk_size
    g = g if g.dim() == 4 else g.unsqueeze(-1)  # [b, s, h, channels]: one channel stands for all of a head's
    q, k, v, g = (F.pad(tensor.transpose(1, 2), (0, 0, 0, padding)) for tensor in (q, k, v, g))  # [b, h, s, d]
    beta = F.pad(beta.transpose(1, 2), (0, padding))  # padding: no decay, no update
    segment = torch.cumsum(starts.long(), 0)
    segment = torch.cat([segment, segment[-1:].expand(padding)])
    chunks = (length + padding) // chunk_size
    q, k, v, g = (tensor.reshape(batch, heads, chunks, chunk_size, -1) for tensor in (q, k, v, g))
    beta = beta.reshape(batch, heads, chunks, chunk_size)
    segment = segment.view(chunks, chunk_size)
    cumulative = torch.cumsum(g, dim=-2)  # [b, h, c, l, channels]

    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [c, i, j]: one document run
    pair_decay = _masked_exp(_segment_sums(g.mT).movedim(-3, -1), (same & lower)[..., None])  # decays over (j, i]

    def decayed_products(left: Tensor, right: Tensor) -> Tensor:
        """``[..., i, j]``: ``left_i . right_j`` with each channel decayed over (j, i]."""
        if pair_decay.shape[-1] == 1:
            return (left @ right.mT) * pair_decay[..., 0]
        return (left.unsqueeze(-2) * right.unsqueeze(-3) * pair_decay).sum(-1)

    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    updates = decayed_products(k_beta, k)  # the solve reads its strictly lower part
    entering_run = F.pad(segment[:-1, -1], (1, 0), value=0).unsqueeze(1)  # the run the chunk's state belongs to
    from_start = _masked_exp(cumulative, (segment == entering_run)[..., None])  # the chunk's state reaches token l
    solved = torch.linalg.solve_triangular(
        updates, torch.cat([v_beta, k_beta * from_start], dim=-1), upper=False, unitriangular=True
    )
    new_values, state_reads = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    q_reads = q * from_start
    to_end = _masked_exp(cumulative[..., -1:, :] - cumulative, (segment == segment[:, -1:])[..., None])
    k_to_end = k * to_end
    chunk_decay = _masked_exp(cumulative[..., -1, :], (segment[:, -1] == entering_run[:, 0])[:, None])[..., None]
    within = decayed_products(q, k)
    state, outputs = initial_state, []
    per_chunk = (tensor.unbind(2) for tensor in (new_values, state_reads, q_reads, within, k_to_end, chunk_decay))
    for values, reads, queries, attended, keys, decay in zip(*per_chunk, strict=True):  # unbind: a linear backward
        corrected = values - reads @ state
        outputs.append(queries @ state + attended @ corrected)
        state = state * decay + keys.transpose(-1, -2) @ corrected
    o = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length]
    return o.transpose(1, 2), state


def _segment_sums(values: Tensor) -> Tensor:
    """``[..., n, n]``: entry ``[i, j]`` is the sum of ``values[..., k]`` over ``j < k <= i`` (0 where ``j >= i``), each
    summed on its own rather than as a difference of running sums, which loses digits once those grow large."""
    length = values.shape[-1]
    expanded = values.unsqueeze(-1).expand(*values.shape, length)  # [..., k, j]
    after = torch.ones(length, length, dtype=torch.bool, device=values.device).tril(-1)  # k > j
    return expanded.masked_fill(~after, 0).cumsum(dim=-2)


def _masked_exp(exponent: Tensor, keep: Tensor) -> Tensor:
    """``exp(exponent)`` where ``keep``, else 0; no overflow where it is not kept (those exponents may be positive)."""
    never = torch.full((), float("-inf"), dtype=exponent.dtype, device=exponent.device)
    return torch.where(keep, exponent, never).exp()
