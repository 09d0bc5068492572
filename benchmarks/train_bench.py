"""Training-step benchmark of the reference model under ``cp_zigzag``: time, memory and communication per cp.

For each context-parallel size the driver starts one worker (``--worker``) on ``cp`` CPU processes through
Lightning's launcher. The worker trains the reference model on one synthetic document of ``S`` tokens for every
sequence length in ascending order and records, per rank: the median step time, the peak resident memory above the
worker's baseline, and the time spent in layout conversions (``layout_movers._move_segments`` / ``_move_tokens``,
forward and backward) and in attention communication (K/V all-gather forward/backward, ring transfers). A cp stops
growing ``S`` once a rank's peak memory passes ``--stop-mib`` or a step takes longer than ``--max-step-s``; the longest
sequence that trains under the per-rank cap ``--cap-mib`` is the longest measured one whose peak stays below it.

    python benchmarks/train_bench.py            # 4k..64k, cp 1, 2, 4
    python benchmarks/train_bench.py --quick    # 1k..8k, a minute or two

``benchmarks/memory_bench.py`` (ddp against fsdp: model state, peak memory, the largest model and the longest sequence
under a memory cap) writes the second part of the same report, below ``MEMORY_MARK``; each script keeps the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MEMORY_MARK = "<!-- memory_bench.py writes from here on -->"
MODEL = {
    "vocab_size": 257,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 176,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short sequences (1k..8k) and one timed step")
    ap.add_argument("--cps", default="1,2,4", help="context-parallel sizes")
    ap.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths, ascending")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up step)")
    ap.add_argument("--cap-mib", type=float, default=512.0, help="per-rank memory cap for the longest-sequence search")
    ap.add_argument("--max-step-s", type=float, default=40.0, help="stop growing a cp once a step takes longer")
    ap.add_argument("--stop-mib", type=float, default=3072.0, help="stop growing a cp once a rank's peak passes this")
    ap.add_argument("--attention-mode", default="allgather", choices=("allgather", "ring"))
    ap.add_argument("--out", type=Path, default=RESULTS / "train_bench.md", help="markdown table to write")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.steps, args.cap_mib, args.max_step_s = "1024,2048,4096,8192", 1, 96.0, 10.0
    return args


def rss_mib() -> float:
    """Return this process's current resident memory in MiB."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Return this process's peak resident memory so far in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Timers:
    """Accumulated seconds per category, filled by wrappers around the library's communication points."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` timed into ``category``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - start

        return timed

    def install(self) -> None:
        """Time layout conversions and attention communication (forward and backward)."""
        from lightning_cp.core import comm
        from lightning_cp.core.layout import movers as layout_movers

        layout_movers._move_segments = self.wrap("layout", layout_movers._move_segments)
        layout_movers._move_tokens = self.wrap("layout", layout_movers._move_tokens)
        gather = comm._AllGatherStack
        gather.forward = staticmethod(self.wrap("attention_comm", gather.forward))
        gather.backward = staticmethod(self.wrap("attention_comm", gather.backward))
        comm.ring_shift = self.wrap("attention_comm", comm.ring_shift)
        comm.Transfer.wait = self.wrap("attention_comm", comm.Transfer.wait)


def measure(cp: int, seq: int, steps: int, attention_mode: str, timers: Timers) -> dict[str, Any]:
    """Train ``1 + steps`` steps on one ``seq``-token document and return this rank's measurements."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_cp import CPZigzagStrategy
    from lightning_cp.train.models import LlamaLM

    step_times: list[float] = []
    comm_marks: list[dict[str, float]] = []

    class StepTimer(pl.Callback):
        """Record each training step's wall time and the communication time inside it."""

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = time.perf_counter()
            self.before = dict(timers.seconds)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step_times.append(time.perf_counter() - self.start)
            comm_marks.append({k: v - self.before.get(k, 0.0) for k, v in timers.seconds.items()})

    generator = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, 256, (1, seq), generator=generator)
    batch = {"input_ids": tokens, "labels": tokens, "cu_seqlens": torch.tensor([0, seq], dtype=torch.int32)}
    loader = DataLoader([batch] * (1 + steps), batch_size=None)
    pl.seed_everything(0, verbose=False)
    model = LlamaLM(**MODEL, warmup_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cp,
        strategy=CPZigzagStrategy(context_parallel_size=cp, attention_mode=attention_mode),
        max_steps=1 + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[StepTimer()],
    )
    trainer.fit(model, train_dataloaders=loader)
    timed, marks = step_times[1:], comm_marks[1:]
    total = sum(timed)
    return {
        "cp": cp,
        "seq": seq,
        "rank": trainer.global_rank,
        "step_s": statistics.median(timed),
        "peak_mib": peak_rss_mib(),
        "layout_share": sum(m.get("layout", 0.0) for m in marks) / total,
        "attention_comm_share": sum(m.get("attention_comm", 0.0) for m in marks) / total,
    }


def worker(args: argparse.Namespace) -> None:
    """Run every sequence length for one cp on this rank; write one JSON line per point."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cp))
    timers = Timers()
    timers.install()
    baseline = rss_mib()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    out = args.result_dir / f"cp{args.cp}_rank{rank}.jsonl"
    for seq in (int(s) for s in args.seqs.split(",")):
        point = measure(args.cp, seq, args.steps, args.attention_mode, timers)
        point["peak_mib"] -= baseline
        with out.open("a") as handle:
            handle.write(json.dumps(point) + "\n")
        if point["peak_mib"] > args.stop_mib or point["step_s"] > args.max_step_s:
            break


def run_cp(args: argparse.Namespace, cp: int, result_dir: Path) -> list[dict[str, Any]]:
    """Start the worker for ``cp`` and return its per-point results (max over ranks)."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", f"--cp={cp}", f"--seqs={args.seqs}"]
    command += [f"--steps={args.steps}", f"--stop-mib={args.stop_mib}", f"--max-step-s={args.max_step_s}"]
    command += [f"--attention-mode={args.attention_mode}", f"--result-dir={result_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp)), "PYTHONWARNINGS": "ignore"}
    log = result_dir / f"cp{cp}.log"
    with log.open("w") as handle:
        done = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        errors = [line for line in log.read_text().splitlines() if "Error" in line]
        print(f"cp={cp}: worker failed (exit {done.returncode}):\n" + "\n".join(errors[:10]), flush=True)
    by_seq: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in result_dir.glob(f"cp{cp}_rank*.jsonl"):
        for line in path.read_text().splitlines():
            point = json.loads(line)
            by_seq[point["seq"]].append(point)
    return [
        {
            "cp": cp,
            "seq": seq,
            "step_s": max(p["step_s"] for p in points),
            "peak_mib": max(p["peak_mib"] for p in points),
            "layout_share": statistics.mean(p["layout_share"] for p in points),
            "attention_comm_share": statistics.mean(p["attention_comm_share"] for p in points),
        }
        for seq, points in sorted(by_seq.items())
        if len(points) == cp
    ]


def longest_under_cap(points: list[dict[str, Any]], cap: float) -> int | None:
    """Return the longest measured sequence whose peak per-rank memory stays under ``cap``."""
    fitting = [p["seq"] for p in points if p["peak_mib"] <= cap]
    return max(fitting) if fitting else None


def interpolated_under_cap(points: list[dict[str, Any]], cap: float) -> int | None:
    """Return the sequence length where peak memory reaches ``cap``, linear between the two bracketing points."""
    for low, high in zip(points, points[1:], strict=False):
        if low["peak_mib"] <= cap < high["peak_mib"]:
            fraction = (cap - low["peak_mib"]) / (high["peak_mib"] - low["peak_mib"])
            return round(low["seq"] + fraction * (high["seq"] - low["seq"]))
    return None


def report(args: argparse.Namespace, results: dict[int, list[dict[str, Any]]], wall_s: float, load: float) -> str:
    """Return the markdown report."""
    lines = [
        "# train_bench: reference model under cp_zigzag on this machine",
        "",
        f"Model {MODEL}, one packed document of S tokens per step, AdamW, fp32, {args.attention_mode} attention.",
        f"CPU: {os.cpu_count()} cores, gloo; each rank uses max(1, cores / cp) threads. Median of {args.steps} timed "
        "step(s) after one warm-up step; step time is the slowest rank's, shares the mean over ranks, memory the "
        "largest rank's peak RSS above its worker's baseline (model, optimizer state and activations).",
        "Layout = time inside the layout conversions (index + all-to-all-v, forward and backward); attention comm = "
        "time inside K/V all-gather (forward) / reduce-scatter (backward) or waiting on ring transfers; both include "
        "waiting for a slower peer.",
        "",
        "| cp | seq | step time (s) | tokens/s | peak mem / rank (MiB) | layout conversion | attention comm |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cp, points in results.items():
        for p in points:
            lines.append(
                f"| {cp} | {p['seq']} | {p['step_s']:.3f} | {p['seq'] / p['step_s']:.0f} | {p['peak_mib']:.0f} "
                f"| {100 * p['layout_share']:.1f}% | {100 * p['attention_comm_share']:.1f}% |"
            )
    lines += ["", f"Longest sequence that trains under {args.cap_mib:.0f} MiB per rank (among the lengths tried):", ""]
    lines += [
        "| cp | longest seq under cap | interpolated | longest run | why the sweep stopped |",
        "| --- | --- | --- | --- | --- |",
    ]
    seqs = [int(s) for s in args.seqs.split(",")]
    for cp, points in results.items():
        last = points[-1] if points else None
        if last is None:
            why = "no point finished"
        elif last["peak_mib"] > args.stop_mib:
            why = f"{last['peak_mib']:.0f} MiB > {args.stop_mib:.0f} MiB safety stop at {last['seq']}"
        elif last["step_s"] > args.max_step_s and last["seq"] != seqs[-1]:
            why = f"step {last['step_s']:.0f} s > {args.max_step_s:.0f} s time budget at {last['seq']}"
        else:
            why = "all lengths ran"
        longest, estimate = longest_under_cap(points, args.cap_mib), interpolated_under_cap(points, args.cap_mib)
        lines.append(f"| {cp} | {longest or '-'} | {estimate or '-'} | {last['seq'] if last else '-'} | {why} |")
    if 1 in results:
        lines += [
            "",
            "cp=1 runs without CP: single-device attention per document (`lightning_cp.core.step.local_attention`).",
        ]
    lines += [
        "",
        f"Total wall time {wall_s:.0f} s; 5-minute load average at the end {load:.1f} on {os.cpu_count()} cores "
        "(other jobs shared the machine, so single points are noisy).",
        f"Command: `python benchmarks/train_bench.py {' '.join(sys.argv[1:])}`",
    ]
    return "\n".join(lines) + "\n"


def save_results(out: Path, key: str, data: Any, text: str) -> None:
    """Write ``text`` as one script's part of the report and ``data`` under ``key`` in the JSON beside it, keeping
    the other script's part: the sequence sweep (``key="sequence_sweep"``) above ``MEMORY_MARK``, the memory
    benchmark (``key="memory"``) from it on."""
    old = out.read_text() if out.exists() else ""
    sweep, mark, memory = old.partition(MEMORY_MARK)
    if key == "memory":
        text = (sweep.rstrip() + "\n\n" if sweep.strip() else "") + MEMORY_MARK + "\n\n" + text
    else:
        text = text + (f"\n{mark}{memory}" if mark else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    data_path = out.with_suffix(".json")
    everything = json.loads(data_path.read_text()) if data_path.exists() else {}
    data_path.write_text(json.dumps({**everything, key: data}, indent=1))


def main() -> None:
    """Run the driver or, with ``--worker``, one cp's measurements."""
    args = parse_args()
    if args.worker:
        worker(args)
        return
    start = time.perf_counter()
    results: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (int(c) for c in args.cps.split(",")):
            results[cp] = run_cp(args, cp, Path(tmp))
            print(f"cp={cp}: " + ", ".join(f"{p['seq']}: {p['step_s']:.2f}s" for p in results[cp]), flush=True)
    text = report(args, results, time.perf_counter() - start, os.getloadavg()[1])
    save_results(args.out, "sequence_sweep", results, text)
    print(text)


if __name__ == "__main__":
    main()
