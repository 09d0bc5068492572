"""Local attention for CP: the block plan (which query rows meet which key rows) and the kernels that run it.

A rank's tokens are described by document id and position (``RankTokens``, half-major order); ``build_block_plan``
cuts the local-queries x source-keys product into blocks of whole documents and leaves out empty ones, joins a
document's blocks from the two halves where that makes fewer, larger kernel calls, then cuts those into tiles
addressed in the ranks' *local* token order, so the attention runs on the caller's tensors without reordering
copies. A backward tile spans at most ``tile_rows`` rows and columns (1/16 of a rank's rows by default), a forward
tile a few times the rows, which bounds every buffer the kernels allocate per call; the backward also takes keys one
tile-sized piece at a time. How large tiles are, how causal squares are cut and when small documents share a masked
call depend on what the kernels cost (``PlanProfile``: measured for the CPU's, estimated for a GPU's). A masked tile
keeps its rows' and columns' documents and positions (``TileMask``), so a plan's masks cost vectors, not ``[rows,
cols]`` booleans: the boolean mask exists only during its kernel call.
``forward_source``/``backward_source`` run one source rank's blocks or tiles with a ``BlockKernel`` (``MATH``,
``CPU_FLASH``, ``CUDA_SDPA``), merging the forward by log-sum-exp and accumulating gradients in place.

Every kernel takes ``q`` ``[B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hkv, Sk, D]`` (``Hq`` a multiple of ``Hkv``), a
boolean ``mask`` ``[Sq, Sk]`` (``True``: the query sees the key; ``None``: it sees every key) and ``causal`` (a square
block where query ``i`` sees keys ``<= i``; then ``mask`` is ``None``). ``forward`` returns the
block output and its log-sum-exp ``[B, Hq, Sq]``, ``-inf`` (and a zero output) for rows that see no key.
``backward`` takes the *merged* output and log-sum-exp of all blocks (the latter through ``finite_lse``, 0 for rows
that see no key) and returns this block's share of the gradients.
Through ``forward_source``, NaN or infinite inputs give NaN rows, never wrong finite values (``zigzag_attention``
rejects them before this).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_cp.core.zigzag import RankTokens

_NEG_INF = -math.inf
_TILES_PER_RANK = 16


@dataclass(frozen=True)
class PlanProfile:
    """What a block plan assumes of the kernels that run it: a call's cost, forward + backward, in score pairs of a
    full tile (``call_pairs``; a masked call ``masked_call_pairs``, each of its pairs ``masked_pair_cost`` times a full
    one), which decides when small documents share a masked call (``_document_groups``); the fewest rows a tile takes;
    how many tiles' rows a forward tile spans; the largest causal square left whole (``None``: every one)."""

    call_pairs: float
    masked_call_pairs: float
    masked_pair_cost: float
    min_tile_rows: int
    forward_tiles: int
    causal_leaf_rows: int | None


# ATen's CPU flash kernel, fitted on 8 x 8 to 32 x 32 tiles (8 heads x 64 dims, one thread): a call costs about 500
# pairs, a masked call about 900 and its pairs 1.3x. Tiles take at least 512 rows: below 8192 rows per rank fewer,
# larger calls are faster (fewer collectives, bigger kernel blocks) and the attention's memory is small. Forward tiles
# span four tiles' rows: the forward holds no gradients, and the kernel uses its larger query blocks from 768 rows on.
# Causal squares are cut into squares of at most 128 rows and the full rectangles beside them: the kernel skips masked
# keys only in 512-key blocks, so a larger causal tile costs almost its whole square, while smaller squares cost more
# calls (64 rows: 5-7% slower on documents of 1-1024 tokens at cp 1, 2 and 4, the same on long ones). The math kernel
# plans the same way, which also bounds the score buffers it makes per call.
_CPU_PROFILE = PlanProfile(
    call_pairs=500, masked_call_pairs=900, masked_pair_cost=1.3, min_tile_rows=512, forward_tiles=4,
    causal_leaf_rows=128,
)  # fmt: skip
# torch's CUDA kernels (estimates for 32 heads x 128 in bf16; ``benchmarks/gpu_check.py`` fits them on a GPU): a call's
# fixed cost (kernel launches, the host's bookkeeping: about 100-200 us per tile forward + backward) is worth about a
# million score pairs, and the memory-efficient kernel with a mask takes 2-3x flash's time per pair. Tiles take at
# least 4096 rows, forward tiles no more (which bounds their outputs), and causal squares stay whole: flash skips the
# masked key blocks of a causal square itself.
_GPU_PROFILE = PlanProfile(
    call_pairs=1e6, masked_call_pairs=1.2e6, masked_pair_cost=2.5, min_tile_rows=4096, forward_tiles=1,
    causal_leaf_rows=None,
)  # fmt: skip


@dataclass(frozen=True)
class BlockKernel:
    """A named pair of block functions: ``forward(q, k, v, mask, causal, scale)`` and its explicit ``backward``.

    ``shares_kv_heads``: the functions attend ``Hq`` query heads to ``Hkv < Hq`` K/V heads without copies; if not,
    ``forward_source``/``backward_source`` repeat a source's K/V heads once for all its blocks, not once per block.
    ``needs_finite_inputs``: the forward may return wrong finite values for NaN or infinite inputs, so
    ``forward_source`` turns every output row NaN when q or a source's k or v holds one (checked on the device: q once
    per call, each source's k and v once, never per block; in a group by their owner, whose message carries the
    flag).
    ``tiling``: the ``PlanProfile`` its plans assume (``plan_profile``): ``"cpu"`` or ``"gpu"``.
    """

    name: str
    forward: Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    shares_kv_heads: bool = True
    needs_finite_inputs: bool = False
    tiling: str = "cpu"


def plan_profile(kernel: BlockKernel) -> PlanProfile:
    """The profile plans for ``kernel`` assume (looked up when asked)."""
    return _GPU_PROFILE if kernel.tiling == "gpu" else _CPU_PROFILE


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype partial results are accumulated in: float32 for half precisions, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``: itself when it already is (``Tensor.to`` costs a few microseconds even then, and the tile
    loops would pay that thousands of times per call)."""
    return x if x.dtype == dtype else x.to(dtype)


def finite_lse(lse: Tensor) -> Tensor:
    """Replace ``-inf`` (rows without keys) by 0 so ``exp(score - lse)`` stays 0 instead of NaN (NaN stays NaN)."""
    return lse.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0)


def all_finite(x: Tensor) -> Tensor:
    """A 0-dim bool on ``x``'s device: whether ``x`` holds no NaN or infinity (one min/max pass, which NaN reaches;
    about 10x cheaper than ``isfinite(x).all()`` on CPU)."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(_in_memory_order(x))
    return torch.isfinite(low) & torch.isfinite(high)


def _in_memory_order(x: Tensor) -> Tensor:
    """``x`` flattened in memory order when it is a permuted contiguous tensor (the kernels' heads-first views), else
    ``x``: for reductions that do not depend on the order, which run several times faster over adjacent elements."""
    permuted = x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))
    return permuted.view(-1) if permuted.is_contiguous() else x


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
    """Plain softmax attention in torch ops: any device, any dtype, exact in float64.

    A row that sees keys but whose every score is ``-inf`` (from infinite inputs) is 0/0: NaN, not an empty row's zero.
    """
    scores = _math_scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - finite_lse(lse).unsqueeze(-1))
    out, lse = (probs @ v.to(scores.dtype).unsqueeze(2)).flatten(1, 2), lse.flatten(1, 2)
    undefined = torch.isneginf(lse) if mask is None else torch.isneginf(lse) & mask.any(-1)
    return out.masked_fill(undefined.unsqueeze(-1), math.nan), lse.masked_fill(undefined, math.nan)


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
    probs = torch.exp(scores - _grouped(lse.to(acc), kv_heads).unsqueeze(-1))
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
    """ATen's tiled CPU flash kernel, which returns the log-sum-exp; rows without keys are fixed to ``-inf``/zero.

    With an infinite score that kernel returns wrong finite values: ``CPU_FLASH`` needs finite inputs, which
    ``forward_source`` guards.
    """
    groups = q.shape[1] // k.shape[1]
    k, v, additive = _repeat_kv(k, groups), _repeat_kv(v, groups), _additive_mask(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive, scale=scale
    )
    return _cleared_empty_rows(out, lse, mask)


def _cleared_empty_rows(out: Tensor, lse: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Give the rows ``mask`` leaves without keys the contract's zero output and ``-inf`` log-sum-exp (the fused
    kernels return whatever their arithmetic gives there)."""
    if mask is None:
        return out, lse
    empty = ~mask.any(-1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, _NEG_INF)


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
        as_dtype(dout, q.dtype),
        q,
        _repeat_kv(k, groups),
        _repeat_kv(v, groups),
        as_dtype(out, q.dtype),
        lse,
        0.0,
        causal,
        attn_mask=_additive_mask(mask, q.dtype),
        scale=scale,
    )
    if groups == 1:
        return dq, dk, dv
    return dq, _grouped(dk, kv_heads).sum(2), _grouped(dv, kv_heads).sum(2)


# The memory-efficient CUDA kernel returns its log-sum-exp with the rows padded to a multiple of this, and wants the
# row stride of its additive mask a multiple of ``_BIAS_ALIGNMENT`` elements.
_LSE_ROW_ALIGNMENT = 32
_BIAS_ALIGNMENT = 16


def _cuda_kernel_for(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> tuple[str, Tensor | None]:
    """Which of torch's CUDA kernels takes this tile, by torch's own checks (dtype, head dim, strides, the GPU's
    generation): ``"flash"`` (half precision without a mask; the op itself, unlike ``F.scaled_dot_product_attention``,
    does not pad the head dim to a multiple of 8), ``"efficient"``, or ``"math"`` where neither does; and the tile's
    additive mask (``_aligned_bias``)."""
    bias = _aligned_bias(mask, q, k.shape[2])
    params = torch.backends.cuda.SDPAParams(q, k, v, bias, 0.0, causal, False)
    if bias is None and q.shape[-1] % 8 == 0 and torch.backends.cuda.can_use_flash_attention(params, False):
        return "flash", bias
    return "efficient" if torch.backends.cuda.can_use_efficient_attention(params, False) else "math", bias


@functools.cache
def _unused_random_state(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The random state the CUDA backwards take (flash's pair, the memory-efficient kernel's pair), read only with
    dropout, which these tiles never use: zeros of the dtypes and shapes the forwards return, made once per device."""
    flash = (torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device))
    return (*flash, *(torch.zeros((), dtype=torch.int64, device=device) for _ in range(2)))


def _aligned_bias(mask: Tensor | None, q: Tensor, cols: int) -> Tensor | None:
    """The additive mask ``[B, H, Sq, Sk]`` for the memory-efficient kernel: its row stride padded to the kernel's
    alignment, and broadcast over batch and heads without a copy."""
    if mask is None:
        return None
    padded = -(-cols // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    bias = torch.zeros((mask.shape[0], padded), dtype=q.dtype, device=q.device)
    bias[:, :cols].masked_fill_(~mask, _NEG_INF)
    return bias[:, :cols].expand(q.shape[0], q.shape[1], mask.shape[0], cols)


def cuda_sdpa_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """torch's own CUDA attention kernels, which return the log-sum-exp: flash for unmasked half-precision tiles, the
    memory-efficient kernel (any mask, float32 too) for the others, ``math_forward`` where neither runs. Given one
    K/V head per query head (``CUDA_SDPA`` repeats them once per source)."""
    kernel, bias = _cuda_kernel_for(q, k, v, mask, causal)
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if kernel == "math":
        return math_forward(q, k, v, mask, causal, scale)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return _cleared_empty_rows(out, lse[..., : q.shape[2]], mask)


def cuda_sdpa_backward(
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
    """Backward of ``cuda_sdpa_forward`` for one tile given the merged ``out`` and ``lse``."""
    kernel, bias = _cuda_kernel_for(q, k, v, mask, causal)
    if kernel == "math":
        return math_backward(dout, q, k, v, out, lse, mask, causal, scale)
    dout, out = as_dtype(dout, q.dtype), as_dtype(out, q.dtype)
    rows, cols = q.shape[2], k.shape[2]
    flash_seed, flash_offset, seed, offset = _unused_random_state(q.device)
    if kernel == "flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, rows, cols, 0.0, causal, flash_seed, flash_offset,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    padded = lse.new_zeros((*lse.shape[:2], -(-rows // _LSE_ROW_ALIGNMENT) * _LSE_ROW_ALIGNMENT))
    padded[..., :rows] = lse
    # The kernel reads ``out`` as if its rows were ``H * D`` elements apart (a ``[B, S, H, D]`` layout), whatever its
    # strides: a gathered tile is ``[B, H, S, D]``-contiguous, so it gets that layout first.
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


MATH = BlockKernel("math", math_forward, math_backward)
CPU_FLASH = BlockKernel(
    "cpu_flash", cpu_flash_forward, cpu_flash_backward, shares_kv_heads=False, needs_finite_inputs=True
)
CUDA_SDPA = BlockKernel(
    "cuda_sdpa", cuda_sdpa_forward, cuda_sdpa_backward, shares_kv_heads=False, needs_finite_inputs=True, tiling="gpu"
)


@functools.cache
def flash_attn_varlen_func() -> Callable[..., Tensor] | None:
    """Return ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed, else ``None``."""
    try:
        from flash_attn import flash_attn_varlen_func as varlen
    except ImportError:
        return None
    return varlen


@dataclass(frozen=True)
class TileMask:
    """Which pairs of a tile attend, kept as its rows' and columns' document and position: query ``i`` sees key
    ``j`` iff ``q_doc[i] == k_doc[j] >= 0`` and, if ``causal``, ``k_pos[j] <= q_pos[i]``. Vectors instead of the
    boolean ``[rows, cols]`` (``dense``), which a large tile of small documents would make the bulk of a plan."""

    q_doc: Tensor
    q_pos: Tensor
    k_doc: Tensor
    k_pos: Tensor
    causal: bool

    @classmethod
    def triangle(cls, q_pos: Tensor, k_pos: Tensor) -> TileMask:
        """One document's pairs with the key not after the query."""
        return cls(torch.zeros_like(q_pos), q_pos, torch.zeros_like(k_pos), k_pos, True)

    def dense(self) -> Tensor:
        """The boolean mask ``[rows, cols]`` the kernels take (``True``: the query sees the key)."""
        return _visible(self.q_doc, self.q_pos, self.k_doc, self.k_pos, self.causal)

    def take(self, rows: Tensor, cols: Tensor) -> TileMask:
        """The mask of rows ``rows`` x columns ``cols`` of this tile."""
        return TileMask(self.q_doc[rows], self.q_pos[rows], self.k_doc[cols], self.k_pos[cols], self.causal)

    def any(self) -> bool:
        """Whether some pair attends: a document on both sides, whose earliest key (if causal) is not after its latest
        query (without building the pairs)."""
        q_valid, k_valid = self.q_doc >= 0, self.k_doc >= 0
        if not self.causal or not bool(q_valid.any()):
            return bool(torch.isin(self.q_doc[q_valid], self.k_doc[k_valid]).any())
        documents = int(torch.cat([self.q_doc, self.k_doc]).max()) + 1
        latest = torch.full((documents,), -1).scatter_reduce(0, self.q_doc[q_valid], self.q_pos[q_valid], "amax")
        earliest = torch.full((documents,), torch.iinfo(torch.int64).max).scatter_reduce(
            0, self.k_doc[k_valid], self.k_pos[k_valid], "amin"
        )
        return bool((earliest <= latest).any())

    def all(self) -> bool:
        """Whether every pair attends: one document on both sides, no key after any query."""
        doc = self.q_doc[:1]
        if not doc.numel() or not self.k_doc.numel() or int(doc) < 0:
            return False
        if not bool((self.q_doc == doc).all() & (self.k_doc == doc).all()):
            return False
        return not self.causal or int(self.k_pos.max()) <= int(self.q_pos.min())


def dense_mask(mask: TileMask | None) -> Tensor | None:
    """A tile's boolean mask for a kernel call (``None``: every pair attends)."""
    return None if mask is None else mask.dense()


@dataclass(frozen=True)
class Block:
    """Local query rows x source key rows that attend: a slice, or an index tensor where the rows are not adjacent.

    Every pair attends unless ``mask`` says otherwise or ``causal`` makes the square block lower-triangular. Plan
    blocks (``BlockPlan.blocks``) are slices in half-major order; tiles are in local order.
    """

    rows: slice | Tensor
    cols: slice | Tensor
    mask: TileMask | None = None
    causal: bool = False


@dataclass(frozen=True)
class BlockPlan:
    """The blocks one rank computes against each source rank's keys, empty ones left out, in two forms.

    ``blocks[src]``: whole document blocks per (query half, key half), half-major order (on the CPU: accounting).
    ``tiles[src]``: the same pairs in local order, a document's blocks joined across the halves, rows cut into tiles
    (causal blocks' columns too): the forward.
    ``pieces``: the key pieces every source's local rows are cut into (the same rows on every rank); ``piece_tiles[src]
    [j]``: the tiles meeting piece ``j`` of source ``src``, columns numbered within the piece: the backward.
    """

    cp: int
    rank: int
    blocks: tuple[tuple[Block, ...], ...]
    tiles: tuple[tuple[Block, ...], ...]
    pieces: tuple[slice | Tensor, ...]
    piece_tiles: tuple[tuple[tuple[Block, ...], ...], ...]


def tile_rows(local_rows: int, profile: PlanProfile) -> int:
    """Rows per tile for a rank holding ``local_rows`` rows: 1/16 of them, so the backward's piece buffers and
    per-call kernel outputs stay a fraction of the rank's own tensors, but at least the profile's ``min_tile_rows``."""
    return max(profile.min_tile_rows, -(-local_rows // _TILES_PER_RANK))


def build_block_plan(
    tokens: Sequence[RankTokens],
    rank: int,
    causal: bool,
    device: torch.device,
    tile: int | None = None,
    profile: PlanProfile | None = None,
) -> BlockPlan:
    """Find, per source rank and (query half, key half), the document-group sub-blocks with a visible pair, join each
    document's across the halves (``_joined``) and cut them into tiles in local order, the backward's within key
    pieces of at most ``tile`` rows (default ``tile_rows``), as ``profile`` says (default: the CPU kernels')."""
    profile = profile or _CPU_PROFILE
    half = tokens[rank].doc.shape[0] // 2
    tile = tile or tile_rows(2 * half, profile)
    leaf = profile.causal_leaf_rows
    documents = max((int(t.doc.max()) for t in tokens if t.doc.numel()), default=-1) + 1
    row_pieces = _key_pieces(tokens[rank], tile, mirrored=len(tokens) > 1)
    blocks, tiles, piece_tiles = [], [], []
    for source in tokens:
        source_blocks: list[Block] = []
        quadrants: dict[object, dict[tuple[int, int], Block]] = {}  # per document (or group block): its quadrants
        for q_half, query in enumerate(halves(tokens[rank])):
            for k_half, key in enumerate(halves(source)):
                for number, (doc, block) in enumerate(_document_blocks(query, key, causal, documents, profile, tile)):
                    shifted = _shifted(block, q_half * half, k_half * half)
                    source_blocks.append(shifted)
                    owner = (q_half, k_half, number) if doc is None else doc
                    quadrants.setdefault(owner, {})[q_half, k_half] = shifted
        col_pieces = _key_pieces(source, tile, mirrored=len(tokens) > 1)
        forward = _tiled_forward(
            _joined(quadrants, lambda rows: True), tokens[rank].perm, source.perm, profile.forward_tiles * tile, leaf
        )
        backward = _tiled_backward(
            _joined(quadrants, functools.partial(_in_one_piece, perm=tokens[rank].perm, pieces=row_pieces)),
            tokens[rank].perm,
            source.perm,
            tile,
            leaf,
            row_pieces,
            col_pieces,
        )
        blocks.append(tuple(source_blocks))
        tiles.append(tuple(forward))
        piece_tiles.append(tuple(tuple(piece) for piece in backward))
    tiles, piece_tiles, pieces = _on_device((tiles, piece_tiles, row_pieces.rows), device)
    return BlockPlan(len(tokens), rank, tuple(blocks), tuple(tiles), pieces, tuple(piece_tiles))


@dataclass(frozen=True)
class _Pieces:
    """A rank's local rows cut into key pieces: each piece's rows (ascending), and per local row its piece and its
    place within it."""

    rows: tuple[slice | Tensor, ...]
    piece: Tensor
    slot: Tensor


def _key_pieces(tokens: RankTokens, tile: int, mirrored: bool) -> _Pieces:
    """Cut a rank's local rows into pieces of at most ``tile`` rows. ``mirrored`` (several ranks): a piece holds
    half-major front rows with their mirror images within their own document's back chunk, so it holds early and late
    keys alike and costs every rank about the same work (a dense sequence: exactly), and ranks that pass pieces in
    lockstep seldom wait for each other. Pieces take ``tile / 2`` front rows each, but a document whose front chunk
    fits in one is never cut (``_piece_bounds``): a piece of whole documents is adjacent local rows, which the exchange
    moves without a gather and which cuts none of their tiles. Otherwise adjacent rows."""
    local = tokens.doc.shape[0]
    if mirrored:
        half = local // 2
        front_local = torch.arange(half) if tokens.perm is None else tokens.perm[:half]
        starts, stops = _front_chunks(front_local)
        chunk_start, chunk_stop = (torch.tensor(bounds, dtype=torch.int64) for bounds in (starts, stops))
        position = torch.arange(half)  # front position a + i of a chunk [a, b) mirrors to back position b - 1 - i
        mirror = half + (chunk_start + chunk_stop - 1).repeat_interleave(chunk_stop - chunk_start) - position
        groups = []
        for begin, end in _piece_bounds(starts, stops, max(1, tile // 2)):
            positions = torch.cat([position[begin:end], mirror[begin:end]])
            groups.append(torch.sort(positions if tokens.perm is None else tokens.perm[positions]).values)
    else:
        groups = [torch.arange(start, min(start + tile, local)) for start in range(0, local, tile)]
    piece, slot = torch.empty(local, dtype=torch.int64), torch.empty(local, dtype=torch.int64)
    for number, rows in enumerate(groups):
        piece[rows], slot[rows] = number, torch.arange(rows.numel())
    return _Pieces(tuple(_as_index(rows) for rows in groups), piece, slot)


def _front_chunks(front_local: Tensor) -> tuple[list[int], list[int]]:
    """The documents' front chunks as [start, stop) front-half positions: the runs of adjacent local rows (a
    document's back chunk, as long as its front chunk and in the same order, lies between two runs)."""
    if front_local.numel() == 0:
        return [], []
    breaks = torch.nonzero(front_local[1:] != front_local[:-1] + 1).squeeze(1) + 1
    bounds = [0, *breaks.tolist(), front_local.numel()]
    return bounds[:-1], bounds[1:]


def _piece_bounds(starts: list[int], stops: list[int], width: int) -> list[tuple[int, int]]:
    """Front-half [begin, end) of each piece, at most ``width`` rows each: a chunk that fits in one is never cut (the
    piece before it ends early instead); a larger chunk is cut where the rows run out, so its first and last runs
    share pieces with the chunks before and after it."""
    bounds: list[tuple[int, int]] = []
    begin = 0
    for start, stop in zip(starts, stops, strict=True):
        if stop - begin <= width:
            continue
        if start > begin and stop - start <= width:
            bounds.append((begin, start))
            begin = start
            continue
        while stop - begin > width:
            bounds.append((begin, begin + width))
            begin += width
    if stops and begin < stops[-1]:
        bounds.append((begin, stops[-1]))
    return bounds


def _in_one_piece(rows: Tensor, perm: Tensor | None, pieces: _Pieces) -> bool:
    """Whether half-major ``rows`` all lie in one key piece (a document's diagonal that the backward can join)."""
    ids = pieces.piece[_local_rows(rows, perm)]
    return bool((ids == ids[0]).all())


@dataclass(frozen=True)
class _Spans:
    """Per document of one half: first row, last row + 1, and number of tokens."""

    start: list[int]
    stop: list[int]
    count: list[int]


def _spans(doc: Tensor, documents: int) -> _Spans:
    """Locate every document's tokens in one half."""
    valid = doc >= 0
    ids, index = doc.masked_select(valid), torch.nonzero(valid).squeeze(1)
    start = torch.full((documents,), doc.shape[0], dtype=torch.int64).scatter_reduce(0, ids, index, "amin")
    stop = torch.zeros(documents, dtype=torch.int64).scatter_reduce(0, ids, index + 1, "amax")
    return _Spans(start.tolist(), stop.tolist(), torch.bincount(ids, minlength=documents).tolist())


def _document_blocks(
    query: tuple[Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    causal: bool,
    documents: int,
    profile: PlanProfile,
    span: int,
) -> list[tuple[int | None, Block]]:
    """Cut one half-by-half block into bounding boxes of document groups (``_document_groups``), dropping those
    without a visible pair; each with its document when it spans exactly one document's rows and columns (else
    None)."""
    q_spans, k_spans = _spans(query[0], documents), _spans(key[0], documents)
    blocks = []
    for group in _document_groups(q_spans, k_spans, profile, span):
        rows = slice(min(q_spans.start[d] for d in group), max(q_spans.stop[d] for d in group))
        cols = slice(min(k_spans.start[d] for d in group), max(k_spans.stop[d] for d in group))
        whole = rows.stop - rows.start == q_spans.count[group[0]] and cols.stop - cols.start == k_spans.count[group[0]]
        if len(group) == 1 and whole:
            block = _single_document_block(rows, cols, query[1][rows], key[1][cols], causal)
        else:
            block = _masked_block(rows, cols, query, key, causal, group)
        if block is not None:
            blocks.append((group[0] if len(group) == 1 and whole else None, block))
    return blocks


def _document_groups(q_spans: _Spans, k_spans: _Spans, profile: PlanProfile, span: int) -> list[list[int]]:
    """Documents on both sides, in order, alone or in runs of adjacent ones: a document joins the run before it when
    one masked call over the joined bounding box costs less than the run's calls and one more of its own (by
    ``profile``), and the box stays within ``span`` rows and columns (a tile: it bounds the mask).

    A run never spans a document it leaves out, so its bounding box stays small.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    cost = 0.0
    for doc, (q_count, k_count) in enumerate(zip(q_spans.count, k_spans.count, strict=True)):
        if not q_count and not k_count:  # no rows on either side: nothing between the run and the next document
            continue
        alone = profile.call_pairs + q_count * k_count
        if current and q_count and k_count:
            rows = q_spans.stop[doc] - q_spans.start[current[0]]
            cols = k_spans.stop[doc] - k_spans.start[current[0]]
            joined = profile.masked_call_pairs + profile.masked_pair_cost * rows * cols
            if joined <= cost + alone and max(rows, cols) <= span:
                current.append(doc)
                cost = joined
                continue
        if current:
            groups.append(current)
        current, cost = ([doc], alone) if q_count and k_count else ([], 0.0)
    return groups + [current] if current else groups


def _single_document_block(rows: slice, cols: slice, q_pos: Tensor, k_pos: Tensor, causal: bool) -> Block | None:
    """Classify one document's rows x cols by position alone: full, empty, the causal diagonal, or masked."""
    if not causal or int(q_pos.min()) >= int(k_pos.max()):
        return Block(rows, cols)
    if int(q_pos.max()) < int(k_pos.min()):
        return None
    if torch.equal(q_pos, k_pos) and bool((q_pos[1:] > q_pos[:-1]).all()):
        return Block(rows, cols, causal=True)
    return Block(rows, cols, TileMask.triangle(q_pos, k_pos))


def _masked_block(
    rows: slice,
    cols: slice,
    query: tuple[Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    causal: bool,
    group: list[int],
) -> Block | None:
    """The mask of a document group's bounding box, restricted to the group's documents (the others' rows marked as
    seeing nothing)."""
    q_doc = query[0][rows].masked_fill(~torch.isin(query[0][rows], torch.tensor(group)), -1)
    mask = TileMask(q_doc, query[1][rows], key[0][cols], key[1][cols], causal)
    if not mask.any():
        return None
    return Block(rows, cols, None if mask.all() else mask)


def _joined(
    quadrants: dict[object, dict[tuple[int, int], Block]], diagonal_joins: Callable[[Tensor], bool]
) -> list[Block]:
    """One source's blocks with each document's (query half, key half) quadrants joined into fewer, larger blocks:
    two fully visible quadrants side by side (the same columns, or the same rows) into one, and a document's causal
    diagonal (two causal quadrants and the full one between them) into one causal block where ``diagonal_joins`` of
    its rows says so. In local order a document's two halves are adjacent, so a joined block is one larger kernel
    call. The backward joins a diagonal only within one key piece: its causal rows are cut by piece, and a joined
    diagonal across pieces would need masked tiles."""
    joined: list[Block] = []
    for parts in quadrants.values():
        parts = dict(parts)
        front, between, back = parts.get((0, 0)), parts.get((1, 0)), parts.get((1, 1))
        if (0, 1) not in parts and _is_causal(front) and _is_full(between) and _is_causal(back):
            rows = _union(front.rows, back.rows)
            if diagonal_joins(rows):
                joined.append(Block(rows, _union(front.cols, back.cols), causal=True))
                continue
        for k_half in (0, 1):
            top, bottom = parts.get((0, k_half)), parts.get((1, k_half))
            if _is_full(top) and _is_full(bottom):
                parts[0, k_half] = Block(_union(top.rows, bottom.rows), top.cols)
                del parts[1, k_half]
        for q_half in (0, 1):
            left, right = parts.get((q_half, 0)), parts.get((q_half, 1))
            if _is_full(left) and _is_full(right) and _same_rows(left.rows, right.rows):
                parts[q_half, 0] = Block(left.rows, _union(left.cols, right.cols))
                del parts[q_half, 1]
        joined += parts.values()
    return joined


def _is_full(block: Block | None) -> bool:
    """Whether ``block`` exists and every pair in it attends."""
    return block is not None and block.mask is None and not block.causal


def _is_causal(block: Block | None) -> bool:
    """Whether ``block`` exists and is a causal square."""
    return block is not None and block.causal


def _union(first: slice | Tensor, second: slice | Tensor) -> Tensor:
    """Half-major positions of two row sets, the first's before the second's."""
    return torch.cat([_positions(first), _positions(second)])


def _positions(rows: slice | Tensor) -> Tensor:
    """Rows as an index tensor."""
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def _same_rows(first: slice | Tensor, second: slice | Tensor) -> bool:
    """Whether two row sets are the same rows in the same order."""
    return torch.equal(_positions(first), _positions(second))


def _shifted(block: Block, row_offset: int, col_offset: int) -> Block:
    """Shift a half-relative block to half-major rows and columns."""
    rows = slice(block.rows.start + row_offset, block.rows.stop + row_offset)
    cols = slice(block.cols.start + col_offset, block.cols.stop + col_offset)
    return Block(rows, cols, block.mask, block.causal)


def _on_device(nested: Any, device: torch.device) -> Any:
    """``nested`` (tuples and lists of blocks, index tensors and slices) with its tensors on ``device``, through one
    copy per dtype (from pinned memory, asynchronous, to a GPU): a plan holds hundreds of index tensors and masks,
    and a copy of each would wait for the device every time."""
    if device.type == "cpu":
        return nested
    tensors: list[Tensor] = []
    _visit_tensors(nested, tensors.append)
    moved = iter(_copied(tensors, device))
    return _visit_tensors(nested, lambda tensor: next(moved))


def _visit_tensors(nested: Any, visit: Callable[[Tensor], Any]) -> Any:
    """Call ``visit`` on every tensor of ``nested`` in order and return ``nested`` with each replaced by its result."""
    if isinstance(nested, Tensor):
        return visit(nested)
    if isinstance(nested, Block):
        rows, cols = _visit_tensors(nested.rows, visit), _visit_tensors(nested.cols, visit)
        return Block(rows, cols, _visit_tensors(nested.mask, visit), nested.causal)
    if isinstance(nested, TileMask):
        vectors = (_visit_tensors(x, visit) for x in (nested.q_doc, nested.q_pos, nested.k_doc, nested.k_pos))
        return TileMask(*vectors, nested.causal)
    if isinstance(nested, (tuple, list)):
        return type(nested)(_visit_tensors(item, visit) for item in nested)
    return nested


def _copied(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Host ``tensors`` on ``device``, one flat copy per dtype (pinned and non-blocking to a CUDA device)."""
    copies: list[Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        flat = flat.pin_memory() if device.type == "cuda" else flat
        parts = flat.to(device, non_blocking=True).split([tensors[i].numel() for i in indices])
        for i, part in zip(indices, parts, strict=True):
            copies[i] = part.view(tensors[i].shape)
    return copies  # type: ignore[return-value]


def _tiled_forward(
    blocks: Sequence[Block], row_perm: Tensor | None, col_perm: Tensor | None, forward_rows: int, leaf: int | None
) -> list[Block]:
    """Cut one source's blocks into the forward's local-order tiles: rows in runs of at most ``forward_rows``
    (``_row_chunks``), columns whole except where a causal block's diagonal needs them cut (causal squares into
    squares of at most ``leaf`` rows, if given)."""
    forward: list[Block] = []
    for block in blocks:
        rows, cols = _local_rows(block.rows, row_perm), _local_rows(block.cols, col_perm)
        for i in _row_chunks(rows.numel(), forward_rows):
            for j in _forward_columns(block, i, cols.numel()):
                forward += _sub_block(block, rows, cols, i, j, leaf)
    return forward


def _tiled_backward(
    blocks: Sequence[Block],
    row_perm: Tensor | None,
    col_perm: Tensor | None,
    tile: int,
    leaf: int | None,
    row_pieces: _Pieces,
    col_pieces: _Pieces,
) -> list[list[Block]]:
    """Cut one source's blocks, per key piece, into the backward's tiles: columns cut by piece, relative to it; rows
    in runs of at most ``tile``, or by piece where a causal block needs the same cuts on both sides."""
    backward: list[list[Block]] = [[] for _ in col_pieces.rows]
    for block in blocks:
        rows, cols = _local_rows(block.rows, row_perm), _local_rows(block.cols, col_perm)
        if block.causal:
            row_groups = [i for _, i in _groups(row_pieces.piece[rows])]
        else:
            row_groups = _row_chunks(rows.numel(), tile)
        col_groups, slots = _groups(col_pieces.piece[cols]), col_pieces.slot[cols]
        for i in row_groups:
            for piece, j in col_groups:
                backward[piece] += _sub_block(block, rows, slots, i, j, leaf)
    return backward


def _local_rows(rows: slice | Tensor, perm: Tensor | None) -> Tensor:
    """The local rows of half-major rows (a slice or positions), in their order (``half_major = local[perm]``)."""
    positions = _positions(rows)
    return positions if perm is None else perm[positions]


def _groups(ids: Tensor) -> list[tuple[int, Tensor]]:
    """Group a block's rows by id (a tile or piece number): (id, positions within the block), ids ascending."""
    return [(int(t), torch.nonzero(ids == t).squeeze(1)) for t in torch.unique(ids)]


def _row_chunks(count: int, limit: int) -> list[Tensor]:
    """A block's row positions in as few runs of adjacent positions as keep each within ``limit`` rows, of near-equal
    size (a block smaller than a tile stays whole wherever it lies)."""
    parts = -(-count // limit)
    return [chunk for chunk in torch.arange(count).tensor_split(parts) if chunk.numel()]


def _forward_columns(block: Block, i: Tensor, count: int) -> list[Tensor]:
    """The column groups the forward pairs with rows ``i``: all columns at once, or for a causal block those before
    the rows (fully visible) and those beside them (the diagonal)."""
    if not block.causal:
        return [torch.arange(count)]
    first, last = int(i.min()), int(i.max())
    return [j for j in (torch.arange(0, first), torch.arange(first, last + 1)) if j.numel()]


def _sub_block(block: Block, rows: Tensor, cols: Tensor, i: Tensor, j: Tensor, leaf: int | None) -> list[Block]:
    """Positions ``i`` x ``j`` of ``block`` as a tile addressing ``rows[i]`` x ``cols[j]`` (a causal square as
    ``_causal_tiles``), or none if no pair there attends."""
    mask = None
    if block.causal:  # query i sees key j iff j <= i, positions within the block
        if torch.equal(i, j):
            return _causal_tiles(rows[i], cols[j], leaf)
        if int(i.min()) < int(j.max()):
            if int(i.max()) < int(j.min()):
                return []
            mask = TileMask.triangle(i, j)
    elif block.mask is not None:
        mask = block.mask.take(i, j)
        if not mask.any():
            return []
        mask = None if mask.all() else mask
    return [Block(_as_index(rows[i]), _as_index(cols[j]), mask)]


def _causal_tiles(rows: Tensor, cols: Tensor, leaf: int | None) -> list[Block]:
    """A causal square (row ``n`` sees columns ``<= n``) as causal squares of at most ``leaf`` rows along its diagonal
    and, halving, the full rectangles below them (``None``: whole)."""
    if leaf is None or rows.numel() <= leaf:
        return [Block(_as_index(rows), _as_index(cols), causal=True)]
    half = rows.numel() // 2
    below = Block(_as_index(rows[half:]), _as_index(cols[:half]))
    return [*_causal_tiles(rows[:half], cols[:half], leaf), below, *_causal_tiles(rows[half:], cols[half:], leaf)]


def index_count(index: slice | Tensor) -> int:
    """How many rows a slice or an index tensor addresses."""
    return index.stop - index.start if isinstance(index, slice) else index.numel()


def _as_index(local: Tensor) -> slice | Tensor:
    """A slice for increasing adjacent rows, else the index tensor itself."""
    count = local.numel()
    if count and int(local[-1]) - int(local[0]) == count - 1 and bool((local[1:] > local[:-1]).all()):
        return slice(int(local[0]), int(local[-1]) + 1)
    return local


def halves(tokens: RankTokens) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Split a rank's half-major token metadata into its front and back halves."""
    half = tokens.doc.shape[0] // 2
    return (tokens.doc[:half], tokens.pos[:half]), (tokens.doc[half:], tokens.pos[half:])


def _visible(q_doc: Tensor, q_pos: Tensor, k_doc: Tensor, k_pos: Tensor, causal: bool) -> Tensor:
    """Boolean ``[Sq, Sk]``: same document, query not padding, and (if causal) key not after the query."""
    mask = (q_doc.unsqueeze(1) == k_doc.unsqueeze(0)) & (q_doc >= 0).unsqueeze(1)
    return mask & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) if causal else mask


def take_rows(x: Tensor, index: slice | Tensor, dim: int) -> Tensor:
    """Rows ``index`` of ``x`` along ``dim``: a view for a slice, else a gather (``index_select``, on CPU several
    times faster than indexing with a tensor)."""
    return (
        x.narrow(dim, index.start, index.stop - index.start) if isinstance(index, slice) else x.index_select(dim, index)
    )


def copy_rows(out: Tensor, x: Tensor, index: slice | Tensor) -> None:
    """Write rows ``index`` of ``x`` (along dim 0) into ``out``, without the intermediate copy ``take_rows`` makes
    for a tensor index."""
    if isinstance(index, slice):
        out.copy_(take_rows(x, index, 0))
    else:
        torch.index_select(x, 0, index, out=out)


def add_rows(x: Tensor, index: slice | Tensor, value: Tensor, dim: int) -> None:
    """Add ``value``, rounded to ``x``'s dtype first, to rows ``index`` of ``x`` along ``dim`` in place."""
    if isinstance(index, slice):
        take_rows(x, index, dim).add_(as_dtype(value, x.dtype))
    else:
        x.index_add_(dim, index, as_dtype(value, x.dtype))


def set_rows(x: Tensor, index: slice | Tensor, value: Tensor, dim: int) -> None:
    """Write ``value`` into rows ``index`` of ``x`` along ``dim`` in place."""
    if isinstance(index, slice):
        take_rows(x, index, dim).copy_(value)
    else:
        x.index_copy_(dim, index, as_dtype(value, x.dtype))


def _merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Combine a block's partial softmax result into ``out``/``lse`` in place by log-sum-exp; rows empty in both stay
    zero. The block's share of the merged softmax, ``exp(block_lse - logaddexp(lse, block_lse))``, is
    ``sigmoid(block_lse - lse)`` (1 for a row's first keys, 0 for none, so ``lerp_`` copies or keeps exactly). Where
    that is NaN the weight is 0: both -inf (no keys yet), or a non-finite row, whose output is NaN and stays NaN."""
    weight = torch.sub(block_lse, lse).sigmoid_().nan_to_num_(0.0)
    out.lerp_(as_dtype(block_out, out.dtype), weight.unsqueeze(-1))
    torch.logaddexp(lse, block_lse, out=lse)


def forward_source(
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Sequence[Block],
    kernel: BlockKernel,
    scale: float,
    queries_finite: Tensor | None = None,
    keys_finite: Tensor | None = None,
) -> None:
    """Attend the ``[B, H, S, D]`` queries to one source's K/V block by block, merging into ``out``/``lse`` in
    place (``out`` in the accumulation dtype). ``queries_finite``: ``all_finite(q)`` when the caller has it (one
    check for all sources); ``keys_finite``: ``all_finite(k) & all_finite(v)`` when the source sent it with them."""
    if not blocks:
        return
    finite = None
    if kernel.needs_finite_inputs:
        queries_finite = all_finite(q) if queries_finite is None else queries_finite
        finite = queries_finite & (all_finite(k) & all_finite(v) if keys_finite is None else keys_finite)
    if not kernel.shares_kv_heads:
        k, v = _repeat_kv(k, q.shape[1] // k.shape[1]), _repeat_kv(v, q.shape[1] // v.shape[1])
    for block in blocks:
        _forward_block(out, lse, q, k, v, block, kernel, scale)
    if finite is not None and (finite.device.type != "cpu" or not bool(finite)):  # host: read it, skip a needless fill
        out.masked_fill_(~finite, math.nan)
        lse.masked_fill_(~finite, math.nan)


def _forward_block(
    out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, block: Block, kernel: BlockKernel, scale: float
) -> None:
    """One block of ``forward_source`` (its own function, so the kernel's outputs are freed before the next call)."""
    rows, cols = block.rows, block.cols
    block_out, block_lse = kernel.forward(
        take_rows(q, rows, 2), take_rows(k, cols, 2), take_rows(v, cols, 2), dense_mask(block.mask), block.causal, scale
    )
    out_rows, lse_rows = take_rows(out, rows, 2), take_rows(lse, rows, 2)  # views for a slice, else copies
    _merge_into(out_rows, lse_rows, block_out, block_lse)
    if not isinstance(rows, slice):
        set_rows(out, rows, out_rows, 2)
        set_rows(lse, rows, lse_rows, 2)


def backward_source(
    grads: tuple[Tensor, Tensor, Tensor],
    tensors: tuple[Tensor, Tensor, Tensor, Tensor],
    k: Tensor,
    v: Tensor,
    blocks: Sequence[Block],
    kernel: BlockKernel,
    scale: float,
) -> None:
    """Add one source's blocks to ``grads`` = (dQ, dK, dV) in place, given ``tensors`` = (dout, q, out,
    ``finite_lse(lse)``) of the local queries; dK/dV are the source's (or its piece's, with the blocks' columns
    relative to it)."""
    groups = tensors[1].shape[1] // k.shape[1]
    if not blocks or kernel.shares_kv_heads or groups == 1:
        for block in blocks:
            _backward_block(grads, tensors, k, v, block, kernel, scale)
        return
    dq, dk, dv = grads
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    dk_heads, dv_heads = torch.zeros_like(k, dtype=dk.dtype), torch.zeros_like(v, dtype=dv.dtype)
    for block in blocks:
        _backward_block((dq, dk_heads, dv_heads), tensors, k, v, block, kernel, scale)
    dk.add_(_grouped(dk_heads, dk.shape[1]).sum(2))
    dv.add_(_grouped(dv_heads, dv.shape[1]).sum(2))


def _backward_block(
    grads: tuple[Tensor, Tensor, Tensor],
    tensors: tuple[Tensor, Tensor, Tensor, Tensor],
    k: Tensor,
    v: Tensor,
    block: Block,
    kernel: BlockKernel,
    scale: float,
) -> None:
    """One block of ``backward_source`` (its own function, so the kernel's gradients are freed before the next call)."""
    dq, dk, dv = grads
    dout, q, out, lse = tensors
    rows, cols = block.rows, block.cols
    row_tensors = (take_rows(x, rows, 2) for x in (dout, q))
    col_tensors = (take_rows(x, cols, 2) for x in (k, v))
    merged = (take_rows(x, rows, 2) for x in (out, lse))
    mask = dense_mask(block.mask)
    gq, gk, gv = kernel.backward(*row_tensors, *col_tensors, *merged, mask, block.causal, scale)
    add_rows(dq, rows, gq, 2)
    add_rows(dk, cols, gk, 2)
    add_rows(dv, cols, gv, 2)
