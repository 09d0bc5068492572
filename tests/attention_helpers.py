"""Test helpers for attention: cases, an independent single-process reference, sharding and comparison."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention.api import zigzag_attention
from lightning_cp.packed import PackedSeqParams


@dataclass(frozen=True)
class Case:
    """One attention configuration to check."""

    packed: bool
    causal: bool
    mode: str
    backend: str
    heads: tuple[int, int]
    dtype: torch.dtype = torch.float64

    @property
    def name(self) -> str:
        """Readable id for failure messages."""
        layout = "packed" if self.packed else "dense"
        return f"{layout}-causal={self.causal}-{self.mode}-{self.backend}-heads={self.heads}-{self.dtype}"


def zigzag_index(lengths: list[int], cp: int, rank: int) -> list[int]:
    """Global token index of every slot CP rank ``rank`` holds (``-1`` for padding), written out by hand."""
    index, offset = [], 0
    for length in lengths:
        chunk = -(-length // (2 * cp))
        for chunk_id in (rank, 2 * cp - 1 - rank):
            for j in range(chunk):
                position = chunk_id * chunk + j
                index.append(offset + position if position < length else -1)
        offset += length
    return index


def packed_params(lengths: list[int], cp: int) -> PackedSeqParams:
    """Zigzag-side metadata: actual cumulative lengths and offsets padded per sequence to a multiple of 2*cp."""
    padded = [-(-length // (2 * cp)) * (2 * cp) for length in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu.clone(),
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded.clone(),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        pad_between_seqs=padded != lengths,
    )


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, causal: bool):
    """Softmax attention over ``[S, B, H, D]`` tensors, masked to the same document (and the past if causal)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    mask = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        mask &= torch.ones_like(mask).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def case_lengths(case: Case, cp: int, seed: int) -> list[int]:
    """Dense: one sequence of 6*cp tokens. Packed: seeded random lengths including 1 and one below 2*cp."""
    if not case.packed:
        return [6 * cp]
    rng = random.Random(seed)
    lengths = [1, max(1, 2 * cp - 1), rng.randint(1, 3), *(rng.randint(1, 19) for _ in range(3)), 2 * cp + 1]
    rng.shuffle(lengths)
    return lengths


def shard_slots(x: torch.Tensor, index: torch.Tensor, case: Case) -> torch.Tensor:
    """Take this rank's slots of a global ``[S, B, H, D]`` tensor; zeros in padding; ``[T, H, D]`` when packed."""
    valid = index >= 0
    local = x.new_zeros((index.shape[0], *x.shape[1:]))
    local[valid] = x[index[valid]]
    return local.squeeze(1) if case.packed else local


def compare_slots(name: str, got: torch.Tensor, ref: torch.Tensor, index: torch.Tensor, case: Case) -> str:
    """Describe a mismatch between this rank's values and the reference slots, or return an empty string."""
    got = got.double()
    if case.packed:
        got = got.unsqueeze(1)
    if not torch.isfinite(got).all():
        return f"{name} has non-finite values"
    valid = index >= 0
    if bool((got[~valid] != 0).any()):
        return f"{name} is nonzero in padding slots"
    error = (got[valid] - ref[index[valid]]).abs().max().item()
    relative = {torch.float64: 0.0, torch.float32: 1e-5, torch.bfloat16: 2e-2}[case.dtype]
    tolerance = 1e-10 if case.dtype == torch.float64 else relative * ref.abs().max().item()
    return f"{name} max error {error:.3g} > {tolerance:.3g}" if error > tolerance else ""


def reference_case(case: Case, lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Global float64 ``q, k, v, dout`` ``[S, B, H, D]`` of a case, the reference output, and the reference gradients
    of ``q, k, v`` (from ``dout``)."""
    batch = 1 if case.packed else 2
    hq, hkv = case.heads
    total = sum(lengths)
    q, k, v = (torch.randn(total, batch, h, 8, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(total, batch, hq, 8, dtype=torch.float64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*leaves, doc, case.causal)
    expected.backward(dout)
    return [q, k, v, dout], expected, [x.grad for x in leaves]


MODES = ("allgather", "ring")
KERNELS = ("cpu_flash", "math")


def check_case(case: Case, cp: int, rank: int, group, seed: int) -> list[str]:
    """Run one case on this rank and return the failures (empty when outputs and gradients match)."""
    torch.manual_seed(seed)
    lengths = case_lengths(case, cp, seed)
    (q, k, v, dout), expected, reference_grads = reference_case(case, lengths)
    index = torch.tensor(zigzag_index(lengths, cp, rank))
    valid = index >= 0
    local = [shard_slots(x, index, case) for x in (q, k, v, dout)]
    for x in local:
        x[~valid] = 3.0  # padding should arrive as zeros; garbage there must not leak anywhere either
    *local, local_dout = (x.to(case.dtype) for x in local)
    local = [x.requires_grad_() for x in local]
    out = _attend(case, local, group, lengths, cp, rank)
    out.backward(local_dout)
    names = ("out", "dq", "dk", "dv")
    got = (out, *(x.grad for x in local))
    want = (expected, *reference_grads)
    failures = (compare_slots(*args, index, case) for args in zip(names, got, want, strict=True))
    return [f"{case.name} cp={cp} rank={rank}: {failure}" for failure in failures if failure]


def _attend(case: Case, local: list[torch.Tensor], group, lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Call ``zigzag_attention``, or its flash-attn path with a pure-torch stand-in for the varlen kernel."""
    params = packed_params(lengths, cp) if case.packed else None
    if case.backend != "fake_flash":
        return zigzag_attention(
            *local, group, packed_seq_params=params, causal=case.causal, mode=case.mode, backend=case.backend
        )
    padded = list(zigzag.ZigzagGeometry.packed(cp, lengths).padded_lengths)
    tokens = [zigzag.zigzag_rank_tokens(lengths, padded, cp, src) for src in range(cp)]
    scale = local[0].shape[-1] ** -0.5
    return attention._flash_attention(*local, group, tokens, rank, case.packed, case.causal, scale, fake_varlen)


def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):
    """flash-attn's ``flash_attn_varlen_func`` semantics in plain torch: per sequence, bottom-right causal."""
    assert dropout_p == 0.0 and cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    outs = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        assert 0 < qi.shape[0] <= max_q and 0 < ki.shape[0] <= max_k
        ki, vi = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (ki, vi))
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale
        if causal:
            shift = ki.shape[0] - qi.shape[0]
            visible = torch.arange(ki.shape[0]).unsqueeze(0) <= torch.arange(qi.shape[0]).unsqueeze(1) + shift
            scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vi))
    return torch.cat(outs)


def all_cases() -> list[Case]:
    """Dense and packed, causal or not, both modes, both CPU kernels, MHA/GQA/MQA; float32, bfloat16, flash path."""
    heads = [(2, 2), (4, 2), (3, 1)]
    cases = []
    combinations = [(p, c, m, b) for p in (False, True) for c in (True, False) for m in MODES for b in KERNELS]
    for number, (packed, causal, mode, backend) in enumerate(combinations):
        cases.append(Case(packed, causal, mode, backend, heads[number % 3]))
    cases += [Case(True, True, mode, "auto", (4, 2), torch.float32) for mode in MODES]
    cases += [Case(False, True, mode, "math", (2, 1), torch.float32) for mode in MODES]
    cases += [Case(p, c, "allgather", "fake_flash", (4, 2)) for p in (False, True) for c in (True, False)]
    cases += [Case(True, True, mode, "auto", (4, 2), torch.bfloat16) for mode in MODES]
    return cases


def check_all_cases(cases: list[Case]) -> list[str]:
    """Rank body: run every case over the default group and collect failures."""
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    failures = []
    for seed, case in enumerate(cases):
        failures += check_case(case, cp, rank, group, seed)
    return failures
