"""Memory benchmark of the reference model under ``cp_zigzag``: ddp against fsdp at cp 1, 2 and 4 on CPU.

Every trial trains ``LlamaLM`` (float32, AdamW) on one synthetic document per step in ``cp`` processes forked from
this one (gloo), each a fresh process, so a trial's peak memory is its own. Per rank it records:

- model state: the bytes of this rank's parameters, gradients and AdamW moments, from the local tensors
  (``DTensor.to_local()`` under fsdp);
- peak memory: the resident-set high-water mark (``VmHWM``) during training above the idle process (torch and
  Lightning imported, no model). The mark is reset (``/proc/self/clear_refs``) once the model is set up, so it leaves
  out the initialisation, where every rank builds the whole model before FSDP shards it (reported separately). The
  ranks fix glibc's mmap threshold, so every tensor above it is its own mapping, returned when freed: the resident
  set then follows what torch holds instead of what glibc's heap kept;
- step time: the median wall time of the timed steps.

Part 1 measures a 12-layer, 76M-parameter model at every (cp, ddp|fsdp). Part 2 searches, under a per-rank cap on the
peak, the most layers of that width (the largest model) and the longest sequence of a 2-layer model of that width.
Part 3 (``--vocab-search``) searches the longest sequence of a model with a large vocabulary (32768 tokens) under
fsdp, with the chunked loss (``loss_chunk_tokens``: the logits made a chunk at a time) and with the whole logits:
the tokens x vocab logits, not the model, then set the length. Each search runs a few trials, each guessed by a
straight line through the trials so far (memory is affine in both the layer count and the sequence length) and kept
inside the bracket of the largest fitting and the smallest failing trial; a trial stops as soon as a rank's peak
passes the cap.

    python benchmarks/memory_bench.py                 # parts 1 and 2: about 15 minutes on 2 cores
    python benchmarks/memory_bench.py --vocab-only    # part 3 alone: about 15 minutes
    python benchmarks/memory_bench.py --quick         # smaller model, cap and sequences: a few minutes

The tables replace the memory section of ``benchmarks/results/train_bench.md`` (the sequence sweep of
``train_bench.py`` above it is kept) and the ``memory`` entry of ``train_bench.json``; a run of some parts keeps the
others' tables and data.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from train_bench import save_results

from lightning_cp import CPZigzagStrategy
from lightning_cp.train.models import LlamaLM

RESULTS = Path(__file__).resolve().parent / "results"
SECTION = "<!-- memory_bench.py writes from here on -->"
MIB = 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
WIDE = {"vocab_size": 257, "hidden_size": 768, "num_heads": 12, "num_kv_heads": 4, "intermediate_size": 2048}
QUICK_WIDE = {"vocab_size": 257, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 704}
VOCAB_MARK = "<!-- memory_bench.py part 3: large vocabulary -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small model, cap and sequences (a few minutes)")
    ap.add_argument("--cps", default="1,2,4", help="context-parallel sizes")
    ap.add_argument("--modes", default="ddp,fsdp", help="data-parallel modes")
    ap.add_argument("--layers", type=int, default=12, help="layers of the part-1 model")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per step in part 1 and in the model-size search")
    ap.add_argument("--steps", type=int, default=2, help="timed steps in part 1 (after one warm-up step)")
    ap.add_argument("--cap-mib", type=float, default=512.0, help="per-rank cap on the training peak in part 2")
    ap.add_argument("--seq-layers", type=int, default=2, help="layers of the model in the sequence-length search")
    ap.add_argument("--seq-start", type=int, default=1024, help="first sequence length tried (times cp)")
    ap.add_argument("--max-trials", type=int, default=6, help="trials per search at most")
    ap.add_argument("--skip-search", action="store_true", help="part 1 only")
    ap.add_argument("--vocab-search", action="store_true", help="also part 3: longest sequence, large vocabulary")
    ap.add_argument("--vocab-only", action="store_true", help="part 3 only (the report keeps parts 1 and 2)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary of the part-3 model")
    ap.add_argument("--vocab-hidden", type=int, default=256, help="hidden size of the part-3 model (64 per head)")
    ap.add_argument("--vocab-layers", type=int, default=2, help="layers of the part-3 model")
    ap.add_argument("--vocab-cap-mib", type=float, default=768.0, help="per-rank cap on the training peak in part 3")
    ap.add_argument("--vocab-cps", default="1,2,4", help="context-parallel sizes of part 3")
    ap.add_argument("--vocab-modes", default="fsdp", help="data-parallel modes of part 3")
    ap.add_argument("--vocab-seq-start", type=int, default=2048, help="first sequence length tried at cp=1 in part 3")
    ap.add_argument(
        "--loss-chunk-tokens",
        default="1024,0",
        help="part-3 loss settings: tokens per logits chunk, 0 for the whole logits at once",
    )
    ap.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial counts as hung")
    ap.add_argument(
        "--mmap-threshold-kib",
        type=int,
        default=128,
        help="glibc mmap threshold in the ranks: every larger tensor is its own mapping, unmapped when freed, so the "
        "resident set follows what torch holds; 0 keeps glibc's default, whose heap keeps freed memory",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "train_bench.md", help="markdown report to update")
    args = ap.parse_args(argv)
    args.width = QUICK_WIDE if args.quick else WIDE
    if args.quick:
        args.layers, args.seq, args.steps, args.cap_mib = 4, 512, 1, 320.0
        args.vocab, args.vocab_hidden, args.vocab_cap_mib, args.loss_chunk_tokens = 8192, 128, 192.0, "256,0"
    args.vocab_search = args.vocab_search or args.vocab_only
    heads = max(1, args.vocab_hidden // 64)
    args.vocab_width = {
        "vocab_size": args.vocab,
        "hidden_size": args.vocab_hidden,
        "num_heads": heads,
        "num_kv_heads": max(1, heads // 2),
        "intermediate_size": 11 * args.vocab_hidden // 4,
    }
    return args


def proc_status_mib(field: str) -> float:
    """Return a ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Return freed heap to the system and reset the high-water mark to the current resident set."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def local_bytes(tensor: torch.Tensor) -> int:
    """Return the bytes of this rank's part of ``tensor``."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class Trial:
    """One training run: the parallel setting, the model depth, the tokens per step and the memory cap."""

    cp: int
    data_parallel: str
    num_layers: int
    seq: int
    steps: int
    width: dict[str, int]
    cap_mib: float | None = None

    def model(self) -> LlamaLM:
        """Return the model of the trial (seeded: every trial of a depth starts from the same weights)."""
        torch.manual_seed(0)
        return LlamaLM(**self.width, num_layers=self.num_layers, warmup_steps=1)


class Probe(pl.Callback):
    """Reset the peak once the model is set up, time the steps, record the model state and stop a trial over cap."""

    def __init__(self, baseline_mib: float, cap_mib: float | None, report: Callable[[dict[str, Any]], None]) -> None:
        self.baseline = baseline_mib
        self.cap = cap_mib
        self.report = report
        self.step_s: list[float] = []
        self.parameter_and_gradient_bytes = 0
        self.done = threading.Event()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the initialisation's peak, reset the mark and start the cap watch."""
        self.init_peak = proc_status_mib("VmHWM") - self.baseline
        reset_peak()
        self.start_rss = proc_status_mib("VmRSS") - self.baseline
        if self.cap is not None:
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            peak = proc_status_mib("VmHWM") - self.baseline
            if peak > self.cap:
                self.report({"exceeded": True, "peak_mib": peak, "steps_done": len(self.step_s)})
                os._exit(0)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Start the step's clock."""
        self.start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Record the local bytes of parameters and gradients while both exist."""
        parameters = list(pl_module.parameters())
        tensors = parameters + [p.grad for p in parameters if p.grad is not None]
        self.parameter_and_gradient_bytes = sum(local_bytes(t) for t in tensors)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Stop the step's clock."""
        self.step_s.append(time.perf_counter() - self.start)


def train_on_rank(trial: Trial, baseline_mib: float, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Train the trial's model for ``1 + steps`` steps on this rank and return its measurements."""
    generator = torch.Generator().manual_seed(trial.seq)
    tokens = torch.randint(0, trial.width["vocab_size"], (1, trial.seq), generator=generator)
    batch = {"input_ids": tokens, "labels": tokens, "cu_seqlens": torch.tensor([0, trial.seq], dtype=torch.int32)}
    loader = DataLoader([batch] * (1 + trial.steps), batch_size=None)
    model = trial.model()
    probe = Probe(baseline_mib, trial.cap_mib, report)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=trial.cp,
        strategy=CPZigzagStrategy(context_parallel_size=trial.cp, data_parallel=trial.data_parallel),
        max_steps=1 + trial.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[probe],
    )
    trainer.fit(model, train_dataloaders=loader)
    probe.done.set()
    optimizer_state = trainer.optimizers[0].state.values()
    state_bytes = sum(local_bytes(v) for entry in optimizer_state for v in entry.values() if v.dim())
    return {
        "exceeded": False,
        "peak_mib": proc_status_mib("VmHWM") - baseline_mib,
        "init_peak_mib": probe.init_peak,
        "start_mib": probe.start_rss,
        "step_s": statistics.median(probe.step_s[1:]) if trial.steps else probe.step_s[0],
        "model_state_bytes": probe.parameter_and_gradient_bytes + state_bytes,
        "whole_model_state_bytes": 4 * sum(p.numel() * p.element_size() for p in model.parameters()),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def rank_main(rank: int, port: int, threads: int, mmap_kib: int, trial: Trial, connection: Connection) -> None:
    """Entry point of one forked rank: environment, allocator, threads, baseline, training; send one result dict."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(trial.cp),
        LOCAL_WORLD_SIZE=str(trial.cp),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    torch.set_num_threads(threads)
    if mmap_kib:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, mmap_kib * 1024)  # a fixed threshold: no dynamic raise
    reset_peak()
    baseline = proc_status_mib("VmRSS")
    try:
        result = train_on_rank(trial, baseline, connection.send)
    except BaseException:  # noqa: BLE001 - every failure must reach the driver
        result = {"error": traceback.format_exc()}
    connection.send(result)
    connection.close()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush and gloo threads may still wait


def free_port() -> int:
    """Return a free local TCP port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_trial(trial: Trial, timeout: float, mmap_kib: int) -> dict[str, Any]:
    """Fork the trial's ranks and return its result: the largest rank's peak and step time, rank 0's counts."""
    context = mp.get_context("fork")
    threads = max(1, (os.cpu_count() or 1) // trial.cp)
    port = free_port()
    pipes = [context.Pipe(duplex=False) for _ in range(trial.cp)]
    processes = [
        context.Process(target=rank_main, args=(rank, port, threads, mmap_kib, trial, pipes[rank][1]), daemon=True)
        for rank in range(trial.cp)
    ]
    start = time.perf_counter()
    for process in processes:
        process.start()
    for _, sender in pipes:
        sender.close()
    results: dict[int, dict[str, Any]] = {}
    pending = {pipes[rank][0]: rank for rank in range(trial.cp)}
    try:
        while pending and not any(r.get("exceeded") or "error" in r for r in results.values()):
            ready = wait(list(pending), timeout=max(0.0, timeout - (time.perf_counter() - start)))
            if not ready:
                raise TimeoutError(f"{trial} took longer than {timeout:.0f} s")
            for receiver in ready:
                rank = pending.pop(receiver)
                try:
                    results[rank] = receiver.recv()
                except EOFError:
                    results[rank] = {"error": f"rank {rank} died (exit code {processes[rank].exitcode})"}
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    wall = time.perf_counter() - start
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{trial} failed:\n{errors[0]}")
    exceeded = [r for r in results.values() if r["exceeded"]]
    if exceeded:
        return {**asdict(trial), "fits": False, "complete": False, "peak_mib": max(r["peak_mib"] for r in exceeded)}
    ranks = [results[rank] for rank in range(trial.cp)]
    peak = max(r["peak_mib"] for r in ranks)
    return {
        **asdict(trial),
        "fits": trial.cap_mib is None or peak <= trial.cap_mib,
        "complete": True,
        "wall_s": wall,
        "peak_mib": peak,
        "init_peak_mib": max(r["init_peak_mib"] for r in ranks),
        "start_mib": max(r["start_mib"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "model_state_mib": max(r["model_state_bytes"] for r in ranks) / MIB,
        "whole_model_state_mib": ranks[0]["whole_model_state_bytes"] / MIB,
        "parameters": ranks[0]["parameters"],
    }


def next_guess(
    points: dict[int, dict[str, Any]], cap: float, first: int, grain: int, step: int, slope: float | None = None
) -> int | None:
    """Return the next value to try, or ``None`` once the bracket is ``step`` wide.

    The guess is where the straight line through two completed trials (the largest two, or the two nearest the
    bracket once it has both ends; with one trial, a line of the given ``slope`` in MiB per unit, else through the
    origin; with none, half the smallest failure) reaches the cap, rounded down to ``grain`` and kept strictly inside
    (largest fit, smallest failure), at most four times the largest fit.
    """
    fits = [x for x, p in points.items() if p["fits"]]
    fails = [x for x, p in points.items() if not p["fits"]]
    low, high = max(fits, default=None), min(fails, default=None)
    if low is not None and high is not None and high - low <= step:
        return None
    complete = sorted((x, p["peak_mib"]) for x, p in points.items() if p["complete"])
    if len(complete) >= 2:
        (x0, y0), (x1, y1) = complete[-2:] if low is None or high is None else nearest_pair(complete, low, high)
        guess = x1 + (cap - y1) * (x1 - x0) / (y1 - y0) if y1 > y0 else 2 * x1
    elif complete:
        [(x0, y0)] = complete
        guess = x0 + (cap - y0) / slope if slope else x0 * cap / y0
    elif high is not None:
        guess = high / 2
    else:
        return first
    guess = max(grain, int(guess) // grain * grain)
    if low is not None:
        guess = min(max(guess, low + step), 4 * low)
    if high is not None:
        guess = min(guess, high - step) if low is None else min(max(guess, low + grain), high - grain)
    return guess if guess not in points else None


def nearest_pair(complete: list[tuple[int, float]], low: int, high: int) -> tuple[tuple[int, float], ...]:
    """Return the two completed trials nearest the bracket (the line between them interpolates best)."""
    ranked = sorted(complete, key=lambda point: min(abs(point[0] - low), abs(point[0] - high)))
    return tuple(sorted(ranked[:2]))


def search(
    measure: Callable[[int], dict[str, Any]],
    known: dict[int, dict[str, Any]],
    cap: float,
    first: int,
    grain: int,
    relative_step: float,
    max_trials: int,
    slope: float | None = None,
) -> dict[str, Any]:
    """Search the largest value whose trial fits under ``cap``; return it, the trials and the bracket.

    ``slope`` (MiB per unit, if known) guides the second trial, which otherwise follows a line through the origin.
    """
    points = dict(known)
    trials = 0
    while trials < max_trials:
        low = max((x for x, p in points.items() if p["fits"]), default=0)
        step = max(grain, math.ceil(low * relative_step / grain) * grain)
        guess = next_guess(points, cap, first, grain, step, slope)
        if guess is None:
            break
        points[guess] = measure(guess)
        trials += 1
        print(f"    {guess}: peak {points[guess]['peak_mib']:.0f} MiB, fits {points[guess]['fits']}", flush=True)
    fits = [x for x, p in points.items() if p["fits"]]
    fails = [x for x, p in points.items() if not p["fits"]]
    return {
        "largest_fit": max(fits, default=None),
        "smallest_failure": min(fails, default=None),
        "trials": trials,
        "points": {str(x): points[x] for x in sorted(points)},
    }


def part1(args: argparse.Namespace, configs: list[tuple[int, str]]) -> dict[str, dict[str, Any]]:
    """Measure the part-1 model at every setting, uncapped."""
    results = {}
    for cp, mode in configs:
        trial = Trial(cp, mode, args.layers, args.seq, args.steps, args.width)
        results[f"{cp}/{mode}"] = result = run_trial(trial, args.trial_timeout, args.mmap_threshold_kib)
        print(
            f"part 1 cp={cp} {mode}: state {result['model_state_mib']:.0f} MiB, peak {result['peak_mib']:.0f} MiB, "
            f"step {result['step_s']:.2f} s",
            flush=True,
        )
    return results


def part2(
    args: argparse.Namespace, configs: list[tuple[int, str]], measured: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Search the most layers (at ``--seq`` tokens) and the longest sequence (at ``--seq-layers``) under the cap."""
    searches: dict[str, dict[str, Any]] = {"layers": {}, "seq": {}}
    for cp, mode in configs:
        key = f"{cp}/{mode}"
        start = {args.layers: {**measured[key], "fits": measured[key]["peak_mib"] <= args.cap_mib}}
        print(f"part 2 cp={cp} {mode}: layers", flush=True)
        layers = functools.partial(capped_trial, args, cp, mode, "num_layers")
        searches["layers"][key] = guarded(layers, start, args.cap_mib, args.layers, 1, 0.0, args.max_trials)
        print(f"part 2 cp={cp} {mode}: sequence length", flush=True)
        seq = functools.partial(capped_trial, args, cp, mode, "seq")
        searches["seq"][key] = guarded(seq, {}, args.cap_mib, args.seq_start * cp, 256, 1 / 16, args.max_trials)
    return searches


def capped_trial(args: argparse.Namespace, cp: int, mode: str, field: str, value: int) -> dict[str, Any]:
    """Run one search trial (a warm-up and one more step under the cap) with ``field`` (layers or seq) set."""
    sizes = {"num_layers": args.layers if field == "num_layers" else args.seq_layers, "seq": args.seq, field: value}
    trial = Trial(cp, mode, sizes["num_layers"], sizes["seq"], 1, args.width, args.cap_mib)
    return run_trial(trial, args.trial_timeout, args.mmap_threshold_kib)


def part3(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Search the longest sequence of the large-vocabulary model under its cap, per loss setting, mode and cp.

    The first trial at a larger cp is the ideal scaling, ``cp / first_cp`` times the first cp's longest sequence,
    and the second follows the first cp's memory per token per rank.
    """
    cps = [int(cp) for cp in args.vocab_cps.split(",")]
    searches: dict[str, dict[str, Any]] = {}
    for chunk in (int(c) for c in args.loss_chunk_tokens.split(",")):
        for mode in args.vocab_modes.split(","):
            base = searches_key(chunk, cps[0], mode)
            for cp in cps:
                reference = searches.get(base, {})
                best = reference.get("largest_fit")
                first = best * cp // cps[0] if best else args.vocab_seq_start * cp
                line = fitted_line(reference, args.vocab_cap_mib) if best else None
                slope = line[0] * cps[0] / cp if line else None
                print(f"part 3 loss chunk {chunk} cp={cp} {mode}: sequence length", flush=True)
                measure = functools.partial(vocab_trial, args, cp, mode, chunk)
                searches[searches_key(chunk, cp, mode)] = guarded(
                    measure, {}, args.vocab_cap_mib, first, 256, 1 / 16, args.max_trials, slope
                )
    return searches


def searches_key(chunk: int, cp: int, mode: str) -> str:
    """Return the key of one part-3 search."""
    return f"{chunk}/{cp}/{mode}"


def vocab_trial(args: argparse.Namespace, cp: int, mode: str, chunk: int, seq: int) -> dict[str, Any]:
    """Run one part-3 trial (a warm-up and one more step under the cap) of ``seq`` tokens."""
    width = {**args.vocab_width, "loss_chunk_tokens": chunk}
    trial = Trial(cp, mode, args.vocab_layers, seq, 1, width, args.vocab_cap_mib)
    return run_trial(trial, args.trial_timeout, args.mmap_threshold_kib)


def fitted_line(found: dict[str, Any], cap: float) -> tuple[float, float, float] | None:
    """Return the slope (MiB per unit), the intercept and where it meets ``cap`` (inside the bracket) of the line
    through the two completed trials nearest a search's bracket, or ``None`` with fewer than two."""
    points = {int(x): p for x, p in found.get("points", {}).items()}
    complete = sorted((x, p["peak_mib"]) for x, p in points.items() if p["complete"])
    low, high = found.get("largest_fit"), found.get("smallest_failure")
    if len(complete) < 2 or low is None:
        return None
    (x0, y0), (x1, y1) = nearest_pair(complete, low, high if high is not None else low)
    if y1 <= y0:
        return None
    slope = (y1 - y0) / (x1 - x0)
    intercept = y0 - slope * x0
    at_cap = max(low, (cap - intercept) / slope)
    return slope, intercept, at_cap if high is None else min(at_cap, high)


def guarded(measure: Callable[[int], dict[str, Any]], *search_args: Any) -> dict[str, Any]:
    """Return the search's result, or its error (a trial that failed or hung) so the other settings still run."""
    try:
        return search(measure, *search_args)
    except (RuntimeError, TimeoutError) as error:
        print(f"    search failed: {str(error).splitlines()[0]}", flush=True)
        return {"error": str(error)}


def ratio(value: float | None, reference: float | None) -> str:
    """Return ``value / reference`` as ``x1.00``, or ``-`` when either is missing."""
    return f"x{value / reference:.2f}" if value and reference else "-"


def search_rows(
    searches: dict[str, dict[str, Any]], configs: list[tuple[int, str]], describe: Callable[[dict[str, Any]], str]
) -> list[str]:
    """Return the table rows of one search: the largest fit, its peak, the first failure and the ratios."""
    rows = []
    for cp, mode in configs:
        found = searches[f"{cp}/{mode}"]
        if "error" in found:
            rows.append(f"| {cp} | {mode} | search failed: {found['error'].splitlines()[0]} | | | | | | |")
            continue
        best, failure = found["largest_fit"], found["smallest_failure"] or "-"
        if best is None:
            rows.append(f"| {cp} | {mode} | none | - | - | {failure} | - | - | {found['trials']} |")
            continue
        point = found["points"][str(best)]
        base = searches.get(f"1/{mode}", {}).get("largest_fit")
        ddp = searches.get(f"{cp}/ddp", {}).get("largest_fit")
        rows.append(
            f"| {cp} | {mode} | {best} | {describe(point)} | {point['peak_mib']:.0f} | {failure} "
            f"| {ratio(best, base)} | {ratio(best, ddp)} | {found['trials']} |"
        )
    return rows


def report(args: argparse.Namespace, configs: list[tuple[int, str]], results: dict[str, Any], wall_s: float) -> str:
    """Return the markdown of the memory benchmark."""
    first = results["part1"][f"{configs[0][0]}/{configs[0][1]}"]
    allocator = (
        f"glibc's mmap threshold fixed at {args.mmap_threshold_kib} KiB in the ranks, so every larger tensor is its "
        "own mapping and leaves the resident set when freed (the resident set follows torch's allocations)"
        if args.mmap_threshold_kib
        else "glibc's default allocator (its heap keeps freed memory resident)"
    )
    lines = [
        "## Memory per rank: ddp against fsdp (`memory_bench.py`)",
        "",
        f"Reference model `LlamaLM` of width {args.width}, float32, AdamW; one packed document of S tokens per step. "
        f"Each trial forks its cp ranks afresh (gloo, max(1, {os.cpu_count()} cores / cp) threads each). Model state "
        "= this rank's parameters + gradients + AdamW moments from the local tensors (`DTensor.to_local()`); peak = "
        "the largest rank's resident-set high-water mark during training above an idle process (torch and "
        f"Lightning imported), with {allocator}. The mark is reset once the model is set up; the initialisation's "
        "peak (every rank builds the whole model before FSDP shards it) is shown apart. Under ddp the peak also "
        "holds DDP's gradient buckets (a second copy of the gradients).",
        "",
        f"### Model state, peak and step time: {args.layers} layers ({first['parameters'] / 1e6:.1f}M parameters), "
        f"S = {args.seq}",
        "",
        f"Step time: the slowest rank's median of {args.steps} step(s) after a warm-up step.",
        "",
        "| cp | data parallel | model state / rank (MiB) | whole / per rank | init peak (MiB) | training peak / rank "
        "(MiB) | step time (s) | tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cp, mode in configs:
        p = results["part1"][f"{cp}/{mode}"]
        lines.append(
            f"| {cp} | {mode} | {p['model_state_mib']:.1f} | {p['whole_model_state_mib'] / p['model_state_mib']:.2f} "
            f"| {p['init_peak_mib']:.0f} | {p['peak_mib']:.0f} | {p['step_s']:.2f} | {args.seq / p['step_s']:.0f} |"
        )
    if "layers" in results:
        header = "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        lines += [
            "",
            f"### Largest model under {args.cap_mib:.0f} MiB per rank (S = {args.seq}; layers of the width above)",
            "",
            "Searched over the layer count; the first trial is the measurement above. Peak of the largest fitting "
            "trial (one warm-up and one more step).",
            "",
            "| cp | data parallel | layers | parameters | peak (MiB) | first failing layers | vs cp=1 | vs ddp "
            "| trials |",
            header,
            *search_rows(results["layers"], configs, lambda p: f"{p['parameters'] / 1e6:.1f}M"),
            "",
            f"### Longest sequence under {args.cap_mib:.0f} MiB per rank ({args.seq_layers} layers of the width above)",
            "",
            "Searched over S in steps of 256 tokens, to within 1/16.",
            "",
            "| cp | data parallel | longest S | tokens / rank | peak (MiB) | first failing S | vs cp=1 | vs ddp "
            "| trials |",
            header,
            *search_rows(results["seq"], configs, lambda p: f"{p['seq'] // p['cp']}"),
        ]
    lines += [
        "",
        f"Total wall time {wall_s:.0f} s; 5-minute load average at the end {os.getloadavg()[1]:.1f} on "
        f"{os.cpu_count()} cores (the machine is shared: step times are noisy, memory is not).",
        f"Command: `python benchmarks/memory_bench.py{''.join(' ' + arg for arg in sys.argv[1:])}`",
    ]
    return "\n".join(lines) + "\n"


def vocab_report(args: argparse.Namespace, searches: dict[str, dict[str, Any]], wall_s: float) -> str:
    """Return the markdown of part 3."""
    cps = [int(cp) for cp in args.vocab_cps.split(",")]
    chunks = [int(c) for c in args.loss_chunk_tokens.split(",")]
    modes = args.vocab_modes.split(",")
    cap = args.vocab_cap_mib
    any_point = next((p for f in searches.values() for p in f.get("points", {}).values() if p["complete"]), None)
    size = f" ({any_point['parameters'] / 1e6:.1f}M parameters" if any_point else " ("
    embedding = args.vocab * args.vocab_hidden
    lines = [
        f"### Longest sequence with a {args.vocab}-token vocabulary under {cap:.0f} MiB per rank",
        "",
        f"Model `LlamaLM` {args.vocab_width}, {args.vocab_layers} layers{size}, {embedding / 1e6:.1f}M of them the "
        f"tied embedding / output head), {', '.join(modes)}, float32, AdamW, one packed document of S tokens per step "
        "(S / cp per rank); each trial, a warm-up and one more training step, forks its cp ranks afresh (gloo). Peak = "
        "the largest rank's resident-set high-water mark during training above an idle process (mark reset once the "
        f"model is set up; glibc's mmap threshold {args.mmap_threshold_kib or 'default'} KiB in the ranks). Loss: "
        "`loss_chunk_tokens = N` makes each rank's "
        "logits N tokens at a time (`cp_chunked_cross_entropy`, recomputed in backward); `0` (whole logits) makes the "
        "rank's `[S / cp, vocab]` logits at once. Searched over S in steps of 256 tokens, to within 1/16; a larger cp "
        "starts at cp x the cp=1 result (the ideal scaling), so the ratio column reads 1.00 for length growing exactly "
        "with cp. The line through the two completed trials nearest the bracket gives the memory per 1k tokens per "
        "rank, the peak at 0 tokens (model state, the loss's fixed working set, buffers) and S at the cap (the "
        "interpolated longest S).",
        "",
        "| loss chunk (tokens) | cp | data parallel | longest S | tokens / rank | peak (MiB) | first failing S "
        "| model state / rank (MiB) | MiB per 1k tokens / rank | peak at 0 tokens (MiB) | S at cap (line) "
        "| longest S / (cp x longest S at cp=1) | same, S at cap | trials |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for chunk in chunks:
        for mode in modes:
            base = searches.get(searches_key(chunk, cps[0], mode), {})
            base_line = fitted_line(base, cap)
            for cp in cps:
                lines.append(
                    vocab_row(searches[searches_key(chunk, cp, mode)], chunk, cp, mode, cap, cps[0], base, base_line)
                )
    lines += [
        "",
        f"Part 3 wall time {wall_s:.0f} s; 5-minute load average at the end {os.getloadavg()[1]:.1f} on "
        f"{os.cpu_count()} cores.",
        f"Command: `python benchmarks/memory_bench.py{''.join(' ' + arg for arg in sys.argv[1:])}`",
    ]
    return "\n".join(lines) + "\n"


def vocab_row(
    found: dict[str, Any],
    chunk: int,
    cp: int,
    mode: str,
    cap: float,
    base_cp: int,
    base: dict[str, Any],
    base_line: tuple[float, float, float] | None,
) -> str:
    """Return one table row of part 3: the search's result, its fitted line and the scaling against ``base_cp``."""
    head = f"| {chunk or 'whole logits'} | {cp} | {mode} |"
    if "error" in found:
        return f"{head} search failed: {found['error'].splitlines()[0]} |" + " |" * 10
    best, failure = found["largest_fit"], found["smallest_failure"] or "-"
    if best is None:
        return f"{head} none | - | - | {failure} |" + " - |" * 6 + f" {found['trials']} |"
    point = found["points"][str(best)]
    line = fitted_line(found, cap)
    per_1k = f"{line[0] * cp * 1024:.1f}" if line else "-"
    intercept = f"{line[1]:.0f}" if line else "-"
    at_cap = f"{line[2]:.0f}" if line else "-"
    scale = cp / base_cp
    measured = scaling(best, base.get("largest_fit"), scale)
    interpolated = scaling(line[2] if line else None, base_line[2] if base_line else None, scale)
    return (
        f"{head} {best} | {best // cp} | {point['peak_mib']:.0f} | {failure} | {point['model_state_mib']:.1f} "
        f"| {per_1k} | {intercept} | {at_cap} | {measured} | {interpolated} | {found['trials']} |"
    )


def scaling(value: float | None, reference: float | None, factor: float) -> str:
    """Return ``value / (factor x reference)`` to two decimals, or ``-`` when either is missing."""
    return f"{value / (factor * reference):.2f}" if value and reference else "-"


def merged_section(out: Path, main_text: str | None, vocab_text: str | None) -> str:
    """Return the memory section: the new text of the parts that ran, the report's old text of the others."""
    old = out.read_text().partition(SECTION)[2] if out.exists() else ""
    old_main, _, old_vocab = old.partition(VOCAB_MARK)
    main_part = (old_main if main_text is None else main_text).strip()
    vocab_part = (old_vocab if vocab_text is None else vocab_text).strip()
    text = main_part + ("\n\n" if main_part and vocab_part else "")
    return text + (f"{VOCAB_MARK}\n\n{vocab_part}" if vocab_part else "") + "\n"


def merged_data(out: Path, main: dict[str, Any] | None, vocab: dict[str, Any] | None) -> dict[str, Any]:
    """Return the ``memory`` entry of the JSON: the new results of the parts that ran, the old ones of the others."""
    path = out.with_suffix(".json")
    old = json.loads(path.read_text()).get("memory", {}) if path.exists() else {}
    data = {k: v for k, v in old.items() if k != "vocab"} if main is None else dict(main)
    vocab = old.get("vocab") if vocab is None else vocab
    return {**data, "vocab": vocab} if vocab else data


def main() -> None:
    """Run the selected parts and update the report (keeping the tables of the parts that did not run)."""
    args = parse_args()
    settings = {k: str(v) for k, v in vars(args).items()}
    main_text = vocab_text = results = vocab = None
    if not args.vocab_only:
        configs = [(int(cp), mode) for cp in args.cps.split(",") for mode in args.modes.split(",")]
        start = time.perf_counter()
        results = {"settings": settings, "part1": part1(args, configs)}
        if not args.skip_search:
            results.update(part2(args, configs, results["part1"]))
        main_text = report(args, configs, results, time.perf_counter() - start)
    if args.vocab_search:
        start = time.perf_counter()
        vocab = {"settings": settings, "seq": part3(args)}
        vocab_text = vocab_report(args, vocab["seq"], time.perf_counter() - start)
    text = merged_section(args.out, main_text, vocab_text)
    save_results(args.out, "memory", merged_data(args.out, results, vocab), text)
    print(text)


if __name__ == "__main__":
    main()
