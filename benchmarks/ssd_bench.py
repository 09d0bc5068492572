"""What Mamba2's selective scan costs in ``cp_ssd_scan`` against Hugging Face's reference scan, side by side.

Forward + backward on one process, one thread, float32 (8 heads of 64, state 64, one group, chunks of 256 tokens),
each candidate timed in turn within every repetition:
- ``hf``: ``mamba2_chunk_scan`` of ``transformers``' Bamba (its torch scan; one sequence, no document starts);
- ``ours``: ``cp_ssd_scan`` on the same sequence without a step;
- ``ours packed``: ``cp_ssd_scan`` under a one-process step on documents of 1 to 4k tokens (2k on average), restarting
  at each document's start (what ``hf`` cannot do on a packed row).
The table shows medians and ratios to ``hf``, and each candidate's peak memory: the growth of the resident set during
one forward + backward, measured alone after the timings.

Run: ``python benchmarks/ssd_bench.py`` (``--quick`` for one size); the table is printed and saved to
``benchmarks/results/ssd_bench.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from convolution_bench import packed_batch
from memory_bench import proc_status_mib, reset_peak
from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

from lightning_cp import ContextParallelRuntime, ContextParallelSetting, cp_ssd_scan

RESULTS = Path(__file__).resolve().parent / "results" / "ssd_bench.md"
HEADS, HEAD_DIM, STATE, CHUNK = 8, 64, 64, 256
CANDIDATES = ("hf", "ours", "ours packed")


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    """x, dt (positive), A (negative), B, C for one row of ``tokens`` tokens."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, HEADS, HEAD_DIM, generator=generator)
    dt = torch.rand(1, tokens, HEADS, generator=generator) * 0.1 + 0.01
    A = -torch.rand(HEADS, generator=generator) - 0.5
    B, C = (torch.randn(1, tokens, 1, STATE, generator=generator) for _ in range(2))
    return x, dt, A, B, C


def _candidates(tokens: int) -> dict[str, Callable[[], None]]:
    """One forward + backward per candidate, on fresh leaf copies of the same inputs."""
    inputs = _inputs(tokens)
    runtime = ContextParallelRuntime(ContextParallelSetting())
    batch = packed_batch(tokens, seed=1)

    def leaves() -> list[torch.Tensor]:
        return [tensor.clone().requires_grad_() for tensor in inputs]

    def hf() -> None:
        x, dt, A, B, C = leaves()
        mamba2_chunk_scan(x, dt, A, B, C, chunk_size=CHUNK).sum().backward()

    def ours() -> None:
        cp_ssd_scan(*leaves(), chunk_size=CHUNK).sum().backward()

    def ours_packed() -> None:
        with runtime.step(dict(batch)):
            cp_ssd_scan(*leaves(), chunk_size=CHUNK).sum().backward()

    return {"hf": hf, "ours": ours, "ours packed": ours_packed}


def measure(tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds per candidate, the candidates interleaved within each repetition (after one warm-up)."""
    candidates = _candidates(tokens)
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for repeat in range(repeats + 1):
        for name in CANDIDATES:
            start = time.perf_counter()
            candidates[name]()
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_mib(tokens: int) -> dict[str, float]:
    """Each candidate's resident-set growth during one forward + backward, run alone after a reset of the peak."""
    candidates = _candidates(tokens)
    peaks = {}
    for name in CANDIDATES:
        reset_peak()
        before = proc_status_mib("VmRSS")
        candidates[name]()
        peaks[name] = proc_status_mib("VmHWM") - before
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k tokens only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = (4096,) if args.quick else (4096, 16384)
    lines = [
        "# Mamba2 selective scan: cp_ssd_scan against Hugging Face's reference scan",
        "",
        f"Forward + backward, one process, one thread, float32, {HEADS} heads x {HEAD_DIM}, state {STATE}, chunks of "
        f"{CHUNK}; medians of {args.repeats} ({platform.machine()}, torch {torch.__version__}).",
        "",
        "| tokens | hf (ms) | ours (ms) | ours packed (ms) | ours / hf | ours packed / hf | peak MiB hf / ours / ours "
        "packed |",
        "|---|---|---|---|---|---|---|",
    ]
    for tokens in sizes:
        times = measure(tokens, args.repeats)
        hf, ours, packed = (times[name] * 1e3 for name in CANDIDATES)
        peaks = " / ".join(f"{peak:.0f}" for peak in peak_mib(tokens).values())
        lines.append(
            f"| {tokens} | {hf:.1f} | {ours:.1f} | {packed:.1f} | {ours / hf:.2f} | {packed / hf:.2f} | {peaks} |"
        )
        print(lines[-1], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
