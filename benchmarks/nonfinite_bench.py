"""Cost of the non-finite input handling of CP attention, side by side with what it guards, in one run.

- ``zigzag_attention``'s rejection check (``non_finite_inputs``: one pass over q, k, v and one host read) against the
  whole checked call (cp=1, forward);
- the guard that ``forward_source`` adds for the ``cpu_flash`` kernel to a source rank's forward (three
  ``all_finite``; on the host one read of the flag, the two ``masked_fill`` only running when a value is not finite;
  the attention checks q once per call, not per source) against that source's forward it guards: one whole-document
  causal block, a masked block of the same size, and the tiles of a packed batch.

Run from the repository root: ``python benchmarks/nonfinite_bench.py``. One CPU thread; the table is printed and
saved to ``benchmarks/results/nonfinite_bench.md``.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_cp.core.attention import api, kernels
from lightning_cp.core.packed import PackedSeqParams
from lightning_cp.core.zigzag import ZigzagGeometry

RESULTS = Path(__file__).resolve().parent / "results" / "nonfinite_bench.md"


def median_ms(fn: Callable[[], object], repeats: int = 15) -> float:
    """Median wall time of ``fn`` in milliseconds, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def guard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> object:
    """The ops ``forward_source`` adds to one source's blocks for a kernel that needs finite inputs, run alone (on
    the host, with finite inputs: the checks and one read of the flag)."""
    finite = kernels.all_finite(q) & kernels.all_finite(k) & kernels.all_finite(v)
    if not bool(finite):
        out.masked_fill_(~finite, math.nan)
        lse.masked_fill_(~finite, math.nan)
    return finite


def source_forward(q, k, v, blocks, out: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    """One source's forward with the guard, as the attention runs it."""
    kernels.forward_source(out, lse, q, k, v, blocks, kernels.CPU_FLASH, scale)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = ["| what | guarded work (ms) | added check (ms) | ratio |", "| --- | ---: | ---: | ---: |"]
    tokens, heads, kv_heads, dim = 4096, 8, 4, 64
    q = torch.randn(tokens, heads, dim)
    k, v = (torch.randn(tokens, kv_heads, dim) for _ in range(2))
    cu = torch.tensor([0, 1000, 2500, 4096], dtype=torch.int32)
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    call = median_ms(lambda: api.zigzag_attention(q, k, v, None, packed_seq_params=params, backend="cpu_flash"))
    check = median_ms(lambda: api.non_finite_inputs(q, k, v))
    rows.append(f"| zigzag_attention, packed {tokens} tokens, {heads}/{kv_heads} heads x {dim}: rejection check | "
                f"{call:.2f} | {check:.3f} | {check / call:.4f} |")  # fmt: skip
    block = 1024
    qb = torch.randn(1, heads, block, dim)
    kb, vb = (torch.randn(1, kv_heads, block, dim) for _ in range(2))
    positions = torch.arange(block)  # two documents interleaved at random: half the pairs attend
    mask = kernels.TileMask(torch.randint(0, 2, (block,)), positions, torch.randint(0, 2, (block,)), positions, False)
    scale = dim**-0.5
    whole = slice(0, block)
    tiles = ZigzagGeometry.packed(1, cu.diff().tolist()).rank_tokens
    packed = (
        (f"causal block {block} x {block}", (qb, kb, vb), [kernels.Block(whole, whole, causal=True)]),
        (f"masked block {block} x {block}", (qb, kb, vb), [kernels.Block(whole, whole, mask)]),
        (
            f"packed {tokens} tokens, {len(cu) - 1} documents",
            tuple(x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v)),
            kernels.build_block_plan(tiles, 0, True, torch.device("cpu")).tiles[0],
        ),
    )
    for name, (qs, ks, vs), blocks in packed:
        out = torch.zeros_like(qs)
        lse = torch.full(qs.shape[:3], -math.inf)
        kernel = median_ms(lambda a=(qs, ks, vs), b=blocks, o=out, s=lse: source_forward(*a, b, o, s, scale))
        added = median_ms(lambda a=(qs, ks, vs), o=out, s=lse: guard(*a, o, s))
        rows.append(f"| cpu_flash forward_source, {name} ({len(blocks)} tiles), {heads}/{kv_heads} heads x {dim}: "
                    f"device guard | {kernel:.2f} | {added:.3f} | {added / kernel:.4f} |")  # fmt: skip
    table = "\n".join(rows)
    header = f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread, median of 15\n\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("# Non-finite input handling: cost\n\n" + header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
