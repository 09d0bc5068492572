"""The ``cuda_sdpa`` kernel's use of torch's CUDA attention ops, checked on the CPU.

Those four ops have no CPU kernels, so this module registers plain-torch stand-ins for them on the CPU dispatch key.
Each stand-in keeps the CUDA kernel's contract as torch states it (its outputs' shapes and dtypes are checked against
the op's own meta kernel on every call: the memory-efficient kernel's log-sum-exp has its rows padded to a multiple of
32) and refuses what the CUDA kernel refuses (flash: half precision only; strides; mask alignment). torch's checks of
which kernel can run (``can_use_flash_attention`` and ``can_use_efficient_attention``, false for every CPU tensor) get
stand-ins that apply the CUDA kernels' dtype and head rules. Through them, ``zigzag_attention`` with
``backend="cuda_sdpa"`` must match the float64 single-device reference in both modes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention import kernels
from tests.attention_helpers import Case, check_case
from tests.distributed_harness import run_on_ranks

torch.set_num_threads(1)

CALLS: Counter[str] = Counter()
_LSE_ROWS = 32
_ALIGNMENT = 16


def _scores(q, k, bias, causal, scale):
    """Scaled scores ``[B, H, Sq, Sk]`` in float32, masked as the kernels mask them."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:  # top-left aligned: query i sees keys <= i
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, -math.inf)
    return scores


def _forward(q, k, v, bias, causal, scale):
    """Output (q's dtype) and log-sum-exp; rows without keys get NaN, as a fused kernel's 0/0 may."""
    scores = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(scores.dtype)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, bias, causal, scale):
    """Flash-style gradients from the given (merged) ``out`` and ``lse``, as the CUDA kernels compute them."""
    scores = _scores(q, k, bias, causal, scale)
    acc = scores.dtype
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    dout, out = dout.to(acc), out.to(acc)
    dscores = probs * (dout @ v.to(acc).transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * scale
    return (
        (dscores @ k.to(acc)).to(q.dtype),
        (dscores.transpose(-1, -2) @ q.to(acc)).to(k.dtype),
        (probs.transpose(-1, -2) @ dout).to(v.dtype),
    )


def _check_inputs(*tensors):
    for x in tensors:
        assert x.stride(-1) == 1, "the CUDA kernels need the head dim contiguous"


def _same_as_meta(op, results, *args, **kwargs):
    """Assert the stand-in's tensor outputs have the shapes and dtypes of the op's meta kernel."""
    meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    expected = op(*meta_args, **kwargs)
    for got, want in zip(results, expected, strict=True):
        if isinstance(want, torch.Tensor) and want.numel():
            assert got.shape == want.shape, (op, got.shape, want.shape)
            assert got.dtype == want.dtype, (op, got.dtype, want.dtype)
    return results


def flash_forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    CALLS["flash"] += 1
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype and dropout_p == 0.0
    assert q.shape[1] == k.shape[1] == v.shape[1] and q.shape[-1] % 8 == 0
    _check_inputs(q, k, v)
    out, lse = _forward(q, k, v, None, is_causal, scale)
    rng_state, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    results = (out, lse, None, None, q.shape[2], k.shape[2], rng_state, unused, torch.empty(0, dtype=q.dtype))
    return _same_as_meta(
        torch.ops.aten._scaled_dot_product_flash_attention, results, q, k, v, dropout_p, is_causal, scale=scale
    )


def flash_backward(
    grad_out, q, k, v, out, logsumexp, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
):
    CALLS["flash_backward"] += 1
    assert grad_out.dtype == out.dtype == q.dtype and logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    assert logsumexp.shape == q.shape[:3] and (max_q, max_k) == (q.shape[2], k.shape[2])
    _check_inputs(grad_out, q, k, v, out)
    return _backward(grad_out, q, k, v, out, logsumexp, None, is_causal, scale)


def _check_bias(bias, q, k):
    if bias is not None:
        assert bias.shape == (*q.shape[:3], k.shape[2]) and bias.dtype == q.dtype
        assert q.shape[2] == 1 or bias.stride(-2) % _ALIGNMENT == 0, "the mask's rows must be 16-aligned"


def efficient_forward(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    CALLS["efficient" if attn_bias is None else "efficient_masked"] += 1
    assert compute_log_sumexp and dropout_p == 0.0 and q.shape[1] == k.shape[1] == v.shape[1]
    _check_inputs(q, k, v)
    _check_bias(attn_bias, q, k)
    out, lse = _forward(q, k, v, attn_bias, is_causal, scale)
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // _LSE_ROWS) * _LSE_ROWS), math.inf, dtype=lse.dtype)
    padded[..., : lse.shape[2]] = lse  # the padding rows hold garbage a caller must not read
    results = (out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    return _same_as_meta(
        torch.ops.aten._scaled_dot_product_efficient_attention, results, q, k, v, attn_bias, True, dropout_p,
        is_causal, scale=scale,
    )  # fmt: skip


def efficient_backward(
    grad_out, q, k, v, attn_bias, out, logsumexp, seed, offset, dropout_p, grad_input_mask, is_causal=False, *,
    scale=None,
):  # fmt: skip
    CALLS["efficient_backward"] += 1
    assert grad_out.dtype == out.dtype == q.dtype and list(grad_input_mask) == [True, True, True, False]
    assert logsumexp.shape == (*q.shape[:2], -(-q.shape[2] // _LSE_ROWS) * _LSE_ROWS), "lse rows padded to 32"
    rows_apart = out.shape[2] == 1 or out.stride(2) == out.shape[1] * out.shape[3]
    assert rows_apart, "the kernel reads out's rows as H * D elements apart"
    _check_inputs(grad_out, q, k, v, out)
    _check_bias(attn_bias, q, k)
    lse = logsumexp[..., : q.shape[2]]
    return (*_backward(grad_out, q, k, v, out, lse, attn_bias, is_causal, scale), None)


def can_use_flash(params, debug):
    """torch's rule: float16/bfloat16, no mask, one K/V head per query head, a head dim up to 256 (any multiple: the
    front end pads it, the op itself then refuses one that is not a multiple of 8)."""
    q, k = params.query, params.key
    half = q.dtype in (torch.float16, torch.bfloat16)
    return half and params.attn_mask is None and q.shape[1] == k.shape[1] and q.shape[-1] <= 256


def can_use_efficient(params, debug):
    """Memory-efficient: float16/bfloat16/float32, one K/V head per query head, a head dim that is a multiple of 8."""
    q, k = params.query, params.key
    return (
        q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[1] == k.shape[1] and q.shape[-1] % 8 == 0
    )


@pytest.fixture(scope="module", autouse=True)
def cpu_standins():
    """Register the stand-ins for the module's tests (forked ranks inherit them)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", flash_forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    library.impl("_scaled_dot_product_efficient_attention", efficient_forward, "CPU")
    library.impl("_scaled_dot_product_efficient_attention_backward", efficient_backward, "CPU")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use_flash)
        patch.setattr(torch.backends.cuda, "can_use_efficient_attention", can_use_efficient)
        yield
    library._destroy()


@pytest.fixture
def cuda_sdpa_on_cpu(monkeypatch):
    """Let ``backend="cuda_sdpa"`` run on CPU tensors (it is refused there otherwise)."""
    choose = attention._choose_kernel
    monkeypatch.setattr(attention, "_choose_kernel", lambda b, m, q: b if b == "cuda_sdpa" else choose(b, m, q))


def _cases() -> list[Case]:
    """Dense and packed, causal or not, both modes, MHA/GQA/MQA: float32 (the memory-efficient kernel) and bfloat16
    (flash for unmasked tiles)."""
    heads = [(2, 2), (4, 2), (3, 1)]
    combos = [(p, c, m) for p in (False, True) for c in (True, False) for m in ("allgather", "ring")]
    cases = [Case(p, c, m, "cuda_sdpa", heads[n % 3], torch.float32) for n, (p, c, m) in enumerate(combos)]
    half = [Case(p, True, m, "cuda_sdpa", (4, 2), torch.bfloat16) for p in (False, True) for m in ("allgather", "ring")]
    return cases + half


def _check_cases_counting_calls(cases: list[Case]) -> tuple[list[str], Counter[str]]:
    """Rank body: every case over the default group; the failures and this rank's calls of each stand-in."""
    CALLS.clear()
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    failures = [failure for seed, case in enumerate(cases) for failure in check_case(case, cp, rank, group, seed)]
    return failures, Counter(CALLS)


@pytest.mark.parametrize("small_tiles", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cuda_sdpa_matches_the_single_device_reference(cp, small_tiles, cuda_sdpa_on_cpu, monkeypatch):
    """Through GPU plans: whole tiles at these sizes, or (``small_tiles``) tiles of 2 rows and up, so causal squares,
    forward tiles, key pieces and grouped documents' boxes are cut as a GPU plan cuts them at scale."""
    if small_tiles:
        monkeypatch.setattr(kernels, "_GPU_PROFILE", dataclasses.replace(kernels._GPU_PROFILE, min_tile_rows=2))
    outcomes = run_on_ranks(_check_cases_counting_calls, cp, _cases(), timeout=240)
    failures = [failure for rank_failures, _ in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures)
    calls = sum((counts for _, counts in outcomes), Counter())
    assert calls["flash"] and calls["flash_backward"] and calls["efficient"] and calls["efficient_backward"]
    assert calls["efficient_masked"], "the packed cases must reach a masked tile"


def test_each_tile_goes_to_the_first_kernel_torch_says_can_run_it():
    torch.manual_seed(0)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[3] = False  # a row without keys
    for dtype, dim, tile_mask, expected in (
        (torch.bfloat16, 8, None, "flash"),
        (torch.bfloat16, 8, mask, "efficient_masked"),
        (torch.float32, 8, None, "efficient"),
        (torch.float32, 6, mask, None),  # neither kernel takes a head dim of 6: plain torch
        (torch.bfloat16, 12, None, None),  # nor of 12 (torch's flash check would let it through to the op)
    ):
        q, k, v = (torch.randn(1, 2, 5, dim, dtype=torch.float64) for _ in range(3))
        CALLS.clear()
        out, lse = kernels.CUDA_SDPA.forward(q.to(dtype), k.to(dtype), v.to(dtype), tile_mask, False, 0.5)
        assert set(CALLS) == ({expected} if expected else set())
        reference_out, reference_lse = kernels.math_forward(q, k, v, tile_mask, False, 0.5)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(out.double(), reference_out, atol=tolerance) and lse.shape == (1, 2, 5)
        assert torch.allclose(lse.double(), reference_lse, atol=tolerance)  # -inf where the row has no keys
        if tile_mask is not None:  # that row: zero output and -inf, as the kernel contract says
            assert bool((out[:, :, 3] == 0).all()) and bool(torch.isneginf(lse[:, :, 3]).all())


def test_a_document_mask_is_padded_to_the_kernels_alignment_without_copies_per_head():
    mask = torch.rand(7, 21) > 0.5
    q = torch.zeros(2, 3, 7, 8)
    bias = kernels._aligned_bias(mask, q, 21)
    assert bias.shape == (2, 3, 7, 21) and bias.stride()[:2] == (0, 0) and bias.stride(-2) % 16 == 0
    assert torch.equal(torch.isneginf(bias[0, 0]), ~mask) and bool((bias[1, 2][mask] == 0).all())


def test_plans_for_cuda_sdpa_keep_causal_squares_whole_in_larger_tiles():
    """A plan for ``cuda_sdpa`` takes tiles of at least 4096 rows, forward tiles no larger, and leaves causal squares
    whole."""
    tokens, cpu_device = zigzag.ZigzagGeometry.dense(2, 8192).rank_tokens, torch.device("cpu")
    gpu_profile = kernels.plan_profile(kernels.CUDA_SDPA)
    cpu = kernels.build_block_plan(tokens, 0, True, cpu_device)
    gpu = kernels.build_block_plan(tokens, 0, True, cpu_device, profile=gpu_profile)
    largest_causal = {
        name: max(kernels.index_count(tile.rows) for source in plan.tiles for tile in source if tile.causal)
        for name, plan in (("cpu", cpu), ("gpu", gpu))
    }
    # A rank's two 2048-row chunks of the one document join into one causal square of 4096 rows.
    assert largest_causal == {"cpu": kernels._CPU_PROFILE.causal_leaf_rows, "gpu": 4096}
    assert len(gpu.pieces) == 1 and len(cpu.pieces) == 8  # 4096 rows: one GPU tile, 8 CPU tiles of 512
    assert sum(map(len, gpu.tiles)) < sum(map(len, cpu.tiles)) / 10
    # 16384 rows a rank: the joined 16384-row diagonal in forward tiles of 4096 rows, each ending in a whole square.
    longer_tokens = zigzag.ZigzagGeometry.dense(2, 32768).rank_tokens
    longer = kernels.build_block_plan(longer_tokens, 0, True, cpu_device, profile=gpu_profile)
    forward = [tile for source in longer.tiles for tile in source]
    assert max(kernels.index_count(tile.rows) for tile in forward) == 4096
    assert sorted(kernels.index_count(tile.rows) for tile in forward if tile.causal) == [4096] * 4


def test_cuda_sdpa_is_refused_off_cuda_with_a_clear_error():
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"backend='cuda_sdpa' with torch.float32 tensors of head dim 8 on cpu; exp"):
        attention.zigzag_attention(q, q, q, None, backend="cuda_sdpa")


@pytest.mark.parametrize(
    ("capability", "head_dim", "expected"),
    [((8, 0), 128, "flash_attn"), ((9, 0), 256, "flash_attn"), ((7, 5), 128, "cuda_sdpa"), ((8, 0), 512, "cuda_sdpa")],
)
def test_auto_takes_flash_attn_only_where_it_runs(capability, head_dim, expected, monkeypatch) -> None:
    """flash-attn 2 needs an Ampere or newer GPU and head dims up to 256; elsewhere ``auto`` takes torch's kernels."""
    monkeypatch.setattr(attention, "flash_attn_varlen_func", lambda: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention, "_efficient_cuda_kernel_runs", lambda device, dtype, head_dim: True)
    q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(8, 1, 4, head_dim), device=torch.device("cuda"))
    assert attention._choose_kernel("auto", "allgather", q) == expected
    if expected != "flash_attn":
        with pytest.raises(ValueError, match="head dim <= 256 on an Ampere or newer GPU"):
            attention._choose_kernel("flash_attn", "allgather", q)


def test_auto_takes_the_math_kernel_and_its_small_tiles_where_torch_has_no_fused_kernel(monkeypatch) -> None:
    """Without flash-attn, on a GPU whose memory-efficient kernel refuses the dtype (bf16 before Ampere), ``auto``
    picks the math kernel, whose plans cut small tiles, not ``cuda_sdpa``'s GPU tiles that would fall back to it."""
    monkeypatch.setattr(attention, "flash_attn_varlen_func", lambda: None)
    q = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(8, 1, 4, 64), device=torch.device("cuda"))
    monkeypatch.setattr(attention, "_efficient_cuda_kernel_runs", lambda device, dtype, head_dim: False)
    assert attention._choose_kernel("auto", "allgather", q) == "math"
    assert (
        kernels.plan_profile(attention._KERNELS["math"]).min_tile_rows
        < kernels.plan_profile(kernels.CUDA_SDPA).min_tile_rows
    )
    monkeypatch.setattr(attention, "_efficient_cuda_kernel_runs", lambda device, dtype, head_dim: True)
    assert attention._choose_kernel("auto", "allgather", q) == "cuda_sdpa"
