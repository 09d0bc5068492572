"""What the library's chunked scans cost against Hugging Face's reference scans, side by side.

Forward + backward on one process, one thread, float32, each candidate timed in turn within every repetition:
- Mamba2's selective scan (8 heads of 64, state 64, one group, chunks of 256 tokens): ``hf`` is ``mamba2_chunk_scan``
  of ``transformers``' Bamba. Mamba's selective scan (512 channels, state 16, chunks of 64): ``hf`` is
  ``mamba_selective_scan`` of ``transformers``' Jamba (its PyTorch path, token by token, whose backward takes time at
  least quadratic in the length: each token's slice hands back a gradient the size of the whole sequence, so this
  scan is measured at 1k tokens only). The gated delta rule (8 heads, dk = dv = 64, chunks of 64): ``hf`` is
  ``torch_chunk_gated_delta_rule`` of ``transformers``' Qwen3.5; with a decay per key channel (Kimi delta attention,
  at 4k tokens only: Hugging Face's pairwise decays are 2 GiB a tensor at 16k) ``chunk_kimi_delta_attention`` of its
  Kimi Linear, ours in its default chunks of 8. Each on one sequence, no document starts;
- ``ours``: ``cp_ssd_scan`` / ``cp_selective_scan`` / ``cp_gated_delta_rule`` on the same sequence without a step;
- ``ours packed``: the same under a one-process step on documents of 1 to 4k tokens (2k on average), restarting at
  each document's start (what ``hf`` cannot do on a packed row).
The tables show medians and ratios to ``hf``, and each candidate's peak memory: the growth of the resident set during
one forward + backward, measured alone after the timings.

Run: ``python benchmarks/scan_bench.py`` (``--quick`` for one size); the tables are printed and saved to
``benchmarks/results/scan_bench.md``. ``--delta-rule-choices`` measures instead what ``cp_gated_delta_rule``'s
defaults rest on: the Kimi delta rule in chunks of 8 to 64 tokens, and the local rule kept or recomputed in the
backward (``benchmarks/results/scan_bench_delta_rule_choices.md``).
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from convolution_bench import packed_batch
from memory_bench import proc_status_mib, reset_peak
from torch.utils.checkpoint import checkpoint
from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
from transformers.models.jamba.modeling_jamba import mamba_selective_scan
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from lightning_cp import (
    ContextParallelRuntime,
    ContextParallelSetting,
    cp_gated_delta_rule,
    cp_selective_scan,
    cp_ssd_scan,
)
from lightning_cp.core.scan import gated_delta_scan

RESULTS = Path(__file__).resolve().parent / "results" / "scan_bench.md"
CHOICES_RESULTS = RESULTS.with_name("scan_bench_delta_rule_choices.md")
HEADS, HEAD_DIM, STATE = 8, 64, 64
MAMBA_STATE = 16
CANDIDATES = ("hf", "ours", "ours packed")
SCANS = ("mamba2", "mamba", "gated delta rule", "kimi delta rule")


def _inputs(scan: str, tokens: int) -> tuple[torch.Tensor, ...]:
    """One row of ``tokens`` tokens: x, dt (positive), A (negative), B, C for Mamba2 and Mamba; q, k (unit length), v,
    g (log decays, per head or, for the Kimi delta rule, per key channel), beta for the gated delta rules."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator)

    if scan == "mamba2":
        return normal(1, tokens, HEADS, HEAD_DIM), uniform(1, tokens, HEADS) * 0.1 + 0.01, -uniform(HEADS) - 0.5, \
            normal(1, tokens, 1, STATE), normal(1, tokens, 1, STATE)  # fmt: skip
    if scan == "mamba":
        channels = HEADS * HEAD_DIM
        B, C = (normal(1, tokens, MAMBA_STATE) for _ in range(2))
        return (
            normal(1, tokens, channels),
            uniform(1, tokens, channels) * 0.1 + 0.01,
            -uniform(channels, MAMBA_STATE) - 0.5,
            B,
            C,
        )
    q, k = (F.normalize(normal(1, tokens, HEADS, HEAD_DIM), dim=-1) for _ in range(2))
    gates = (HEADS, HEAD_DIM) if scan == "kimi delta rule" else (HEADS,)  # a decay per key channel, or per head
    return q, k, normal(1, tokens, HEADS, HEAD_DIM), -uniform(1, tokens, *gates) * 0.1, uniform(1, tokens, HEADS)


def _candidates(scan: str, tokens: int) -> dict[str, Callable[[], None]]:
    """One forward + backward per candidate, on fresh leaf copies of the same inputs."""
    inputs = _inputs(scan, tokens)
    runtime = ContextParallelRuntime(ContextParallelSetting())
    batch = packed_batch(tokens, seed=1)

    def leaves() -> list[torch.Tensor]:
        return [tensor.clone().requires_grad_() for tensor in inputs]

    def hf() -> None:
        if scan == "mamba2":
            mamba2_chunk_scan(*leaves(), chunk_size=256).sum().backward()
        elif scan == "mamba":  # channels and tokens as Hugging Face's mixers lay them out
            x, dt, A, B, C = leaves()
            mamba_selective_scan(*(tensor.transpose(1, 2) for tensor in (x, dt)), A, B.mT, C.mT).sum().backward()
        else:
            rule = chunk_kimi_delta_attention if scan == "kimi delta rule" else torch_chunk_gated_delta_rule
            q, k, v, g, beta = leaves()
            rule(q, k, v, g=g, beta=beta, chunk_size=64)[0].sum().backward()

    def ours() -> None:
        if scan == "mamba2":
            cp_ssd_scan(*leaves(), chunk_size=256).sum().backward()
        elif scan == "mamba":
            cp_selective_scan(*leaves(), chunk_size=64).sum().backward()
        else:
            q, k, v, g, beta = leaves()
            cp_gated_delta_rule(q, k, v, g, beta).sum().backward()  # its own chunks: 64, or 8 per key channel

    def ours_packed() -> None:
        with runtime.step(dict(batch)):
            ours()

    return {"hf": hf, "ours": ours, "ours packed": ours_packed}


def measure(scan: str, tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds per candidate, the candidates interleaved within each repetition (after one warm-up)."""
    candidates = _candidates(scan, tokens)
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for repeat in range(repeats + 1):
        for name in CANDIDATES:
            start = time.perf_counter()
            candidates[name]()
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_mib(scan: str, tokens: int) -> dict[str, float]:
    """Each candidate's resident-set growth during one forward + backward, run alone after a reset of the peak."""
    candidates = _candidates(scan, tokens)
    peaks = {}
    for name in CANDIDATES:
        reset_peak()
        before = proc_status_mib("VmRSS")
        candidates[name]()
        peaks[name] = proc_status_mib("VmHWM") - before
    return peaks


def delta_rule_choices(tokens: int, chunk_sizes: tuple[int, ...] = (8, 16, 32, 64)) -> list[str]:
    """The choices behind ``cp_gated_delta_rule``'s defaults, one forward + backward each after an untimed call: the
    Kimi delta rule (a decay per key channel) in chunks of each size, seconds and resident-set growth; then the local
    rule with either decay kept or recomputed in the backward (``torch.utils.checkpoint``), side by side."""
    lines = [
        f"# The delta rule's choices ({tokens} tokens, {HEADS} heads, dk = dv = {HEAD_DIM}, float32, one thread, "
        f"forward + backward; {platform.machine()}, torch {torch.__version__})",
        "",
        "`cp_gated_delta_rule` with a decay per key channel in chunks of each size:",
        "",
        "| chunk | seconds | peak MiB |",
        "|---|---|---|",
    ]
    kimi = _inputs("kimi delta rule", tokens)
    for chunk in chunk_sizes:

        def rule(size: int = chunk) -> None:
            q, k, v, g, beta = (tensor.clone().requires_grad_() for tensor in kimi)
            cp_gated_delta_rule(q, k, v, g, beta, chunk_size=size).sum().backward()

        rule()
        reset_peak()
        before = proc_status_mib("VmRSS")
        start = time.perf_counter()
        rule()
        lines.append(f"| {chunk} | {time.perf_counter() - start:.2f} | {proc_status_mib('VmHWM') - before:.0f} |")
        print(lines[-1], flush=True)
    lines += ["", "The local rule (`gated_delta_scan`) kept or recomputed, median of 3 interleaved:", "",
              "| decay | chunk | kept (s) | recomputed (s) | recomputed / kept |", "|---|---|---|---|---|"]  # fmt: skip
    starts = torch.arange(tokens) == 0
    for scan, chunk in (("gated delta rule", 64), ("kimi delta rule", 8)):
        inputs = _inputs(scan, tokens)

        def local(recompute: bool, inputs: tuple[torch.Tensor, ...] = inputs, chunk: int = chunk) -> None:
            args = [tensor.clone().requires_grad_() for tensor in inputs]
            state = torch.zeros(1, HEADS, HEAD_DIM, HEAD_DIM)
            run = (
                functools.partial(checkpoint, gated_delta_scan, use_reentrant=False) if recompute else gated_delta_scan
            )
            run(*args, starts, chunk, state)[0].sum().backward()

        times: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(4):
            for recompute in (False, True):
                start = time.perf_counter()
                local(recompute)
                if repeat:
                    times[recompute].append(time.perf_counter() - start)
        kept, recomputed = (statistics.median(times[recompute]) for recompute in (False, True))
        decay = "per key channel" if scan == "kimi delta rule" else "per head"
        lines.append(f"| {decay} | {chunk} | {kept:.3f} | {recomputed:.3f} | {recomputed / kept:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4k tokens only (Mamba: 1k)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--delta-rule-choices", action="store_true", help=f"only the delta rule's chunk and recompute choices, into "
        f"{CHOICES_RESULTS.name}",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.delta_rule_choices:
        CHOICES_RESULTS.write_text("\n".join(delta_rule_choices(4096)) + "\n")
        return
    sizes = (4096,) if args.quick else (4096, 16384)
    sizes_of = {scan: (1024,) if scan == "mamba" else sizes for scan in SCANS}
    sizes_of["kimi delta rule"] = sizes[:1]
    lines = [
        "# Chunked scans: the library's against Hugging Face's reference scans",
        "",
        f"Forward + backward, one process, one thread, float32, {HEADS} heads of {HEAD_DIM} (Mamba2: state {STATE}, "
        f"chunks of 256; Mamba: {HEADS * HEAD_DIM} channels, state {MAMBA_STATE}, chunks of 64; gated and Kimi "
        f"delta rules: dk = dv = {HEAD_DIM}, chunks of 64, the library's of 8 with a decay per key channel); medians "
        f"of {args.repeats} "
        f"({platform.machine()}, torch {torch.__version__}).",
        "",
        "| scan | tokens | hf (ms) | ours (ms) | ours packed (ms) | ours / hf | ours packed / hf | peak MiB hf / ours "
        "/ ours packed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scan in SCANS:
        for tokens in sizes_of[scan]:
            times = measure(scan, tokens, args.repeats)
            hf, ours, packed = (times[name] * 1e3 for name in CANDIDATES)
            peaks = " / ".join(f"{peak:.0f}" for peak in peak_mib(scan, tokens).values())
            lines.append(
                f"| {scan} | {tokens} | {hf:.1f} | {ours:.1f} | {packed:.1f} | {ours / hf:.2f} | {packed / hf:.2f} "
                f"| {peaks} |"
            )
            print(lines[-1], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
