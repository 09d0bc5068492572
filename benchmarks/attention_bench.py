"""Benchmark CP attention: zigzag versus contiguous load balance; all-gather, ring, Ulysses and hybrid at cp 2 and 4
(time, bytes sent, memory, balance); peak memory per rank and parallel efficiency against single-process SDPA at
cp 1, 2 and 4; what a GPU's block plans hold for packed batches; and which mode sends the fewest bytes for common GPU
models.

Run from the repository root: ``python benchmarks/attention_bench.py [--quick] [--baseline CHECKOUT]``. Everything
runs on CPU with one thread per rank (gloo for the process groups); tables are printed and saved to
``benchmarks/results/``. ``--baseline`` names another checkout of the project (e.g. ``git worktree add /tmp/before
HEAD`` before a change): the memory and efficiency table then measures its code too (with its own copy of this
script), config by config in the same run, for before/after columns.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.core import comm, zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention import cost, kernels
from lightning_cp.core.packed import PackedSeqParams

RESULTS = Path(__file__).resolve().parent / "results" / "attention_bench.md"
HEAD_DIM = 64
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc mallopt parameters


@dataclass(frozen=True)
class Workload:
    """A named batch: document lengths (one entry for a dense sequence)."""

    name: str
    lengths: tuple[int, ...]
    packed: bool


def workloads(total: int, seed: int = 0) -> list[Workload]:
    """A dense sequence and two packed batches of about ``total`` tokens: long+short documents, and short only."""
    rng = random.Random(seed)
    mixed: list[int] = []
    while sum(mixed) < total:
        mixed.append(rng.randint(total // 8, total // 4) if rng.random() < 0.25 else rng.randint(1, 512))
    short: list[int] = []
    while sum(short) < total:
        short.append(rng.randint(1, 1024))
    return [
        Workload(f"dense {total // 1024}k", (total,), False),
        Workload(f"packed long+short ({len(mixed)} docs)", tuple(mixed), True),
        Workload(f"packed short ({len(short)} docs)", tuple(short), True),
    ]


def _layout_tokens(workload: Workload, cp: int, layout: str) -> list[zigzag.RankTokens]:
    """Every rank's token metadata for ``layout`` (zigzag: per-document chunks; contiguous: even split)."""
    if layout == "zigzag":
        padded = list(zigzag.ZigzagGeometry.packed(cp, workload.lengths).padded_lengths)
        return [zigzag.zigzag_rank_tokens(workload.lengths, padded, cp, rank) for rank in range(cp)]
    return [zigzag.contiguous_rank_tokens(workload.lengths, cp, rank) for rank in range(cp)]


def _shard(x: torch.Tensor, tokens: zigzag.RankTokens, offsets: torch.Tensor) -> torch.Tensor:
    """One rank's slots of a flat ``[N, H, D]`` tensor in its local token order, ``[T, H, D]`` (zeros in padding)."""
    valid = tokens.doc >= 0
    index = torch.where(valid, offsets[tokens.doc.clamp(min=0)] + tokens.pos, 0)
    half_major = x.index_select(0, index) * valid.view(-1, 1, 1)
    return half_major if tokens.perm is None else half_major.index_select(0, torch.argsort(tokens.perm))


def _rank_time(workload: Workload, tokens: list[zigzag.RankTokens], rank: int, tensors: tuple) -> tuple[float, float]:
    """CPU seconds of one rank's forward + backward against every rank's K/V, run as ``allgather`` runs it (the same
    tiles and key pieces, the other ranks' finite flags given as their messages carry them) without a group, and the
    share of them spent inside the block kernels' calls. The call is timed after an identical untimed one, so that its
    outputs and gradients land on memory that call freed, as in a training loop: on a virtual machine that hands freed
    memory back to its host, fresh pages can cost about 3 ms per MiB to fault in (0.4 s for the four 32 MiB outputs
    and gradients of a 16k-row rank), which the per-document SDPA reference, with its small buffers, never pays."""
    offsets = torch.tensor([0, *workload.lengths]).cumsum(0)
    plan = kernels.build_block_plan(tokens, rank, True, torch.device("cpu"))
    shards = [[_shard(x, t, offsets) for x in tensors] for t in tokens]
    kv_all = torch.stack([torch.stack(shard[1:]) for shard in shards]).detach()
    kv_finite = torch.stack([kernels.all_finite(kv) for kv in kv_all])  # each owner's flag, sent with its K/V
    sent = torch.zeros_like(kv_all)
    for _ in range(2):  # the last call counts
        q, k, v = (x.detach().requires_grad_() for x in shards[rank])
        in_kernels = [0.0]
        kernel = _timed_kernel(kernels.CPU_FLASH, in_kernels)
        start = time.thread_time()
        out = attention.emulated_rank_attention(
            q, k, v, kv_all, sent, plan, scale=HEAD_DIM**-0.5, kernel=kernel, kv_finite=kv_finite
        )
        out.backward(torch.ones_like(out))
        seconds = time.thread_time() - start
        del out, q, k, v
    return seconds, in_kernels[0]


def _timed_kernel(kernel: kernels.BlockKernel, seconds: list[float]) -> kernels.BlockKernel:
    """``kernel`` with every forward and backward call adding its CPU seconds to ``seconds[0]``: what the kernels
    alone cost, against which the rest of a rank's time is bookkeeping (views, merges, gradient sums, checks)."""

    def timed(function: Callable) -> Callable:
        def call(*args: Any) -> Any:
            start = time.thread_time()
            result = function(*args)
            seconds[0] += time.thread_time() - start
            return result

        return call

    return replace(kernel, forward=timed(kernel.forward), backward=timed(kernel.backward))


def balance_table(total: int, cp: int, repeats: int) -> str:
    """Unmasked pairs and measured forward+backward time per rank, zigzag versus contiguous, causal."""
    lines = [
        f"### Work balance, causal, cp={cp} (time: forward+backward per rank, 1 head x {HEAD_DIM}, float32, "
        f"cpu_flash, min of {repeats}, CPU time, ranks run one after another on one thread)",
        "",
        "| workload | layout | query-key pairs per rank (M) | pairs max/mean | time per rank (ms) | time max/mean |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    torch.manual_seed(0)
    for workload in workloads(total):
        n = sum(workload.lengths)
        tensors = tuple(torch.randn(n, 1, HEAD_DIM) for _ in range(3))
        layouts = {name: _layout_tokens(workload, cp, name) for name in ("zigzag", "contiguous")}
        times: dict[str, list[list[float]]] = {name: [[] for _ in range(cp)] for name in layouts}
        _rank_time(workload, layouts["zigzag"], 0, tensors)  # warm-up
        for _ in range(repeats):
            for name, tokens in layouts.items():
                for rank in range(cp):
                    times[name][rank].append(_rank_time(workload, tokens, rank, tensors)[0])
        cu = [0, *torch.tensor(workload.lengths).cumsum(0).tolist()]
        for name in layouts:
            pairs = attention.attention_work_per_rank(cp, cu_seqlens=cu, layout=name)
            best = [1000 * min(rank_times) for rank_times in times[name]]
            lines.append(
                f"| {workload.name} | {name} | {' / '.join(f'{p / 1e6:.1f}' for p in pairs)} | {_imbalance(pairs):.3f} "
                f"| {' / '.join(f'{t:.0f}' for t in best)} | {_imbalance(best):.3f} |"
            )
    return "\n".join(lines)


def _imbalance(values: Sequence[float]) -> float:
    """max / mean across ranks."""
    return max(values) / statistics.mean(values)


def _memory_kib(field: str) -> int:
    """Read ``VmRSS`` or ``VmHWM`` (KiB) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _modes_at(cp: int) -> list[tuple[str, int | None]]:
    """The modes measured at ``cp``: all-gather, ring, Ulysses, and hybrid with u = 2 when cp allows it."""
    modes: list[tuple[str, int | None]] = [("allgather", None), ("ring", None), ("ulysses", None)]
    if cp >= 4 and cp % 2 == 0:
        modes.append(("hybrid", 2))
    return modes


def _hybrid_groups(cp: int, ulysses: int) -> dict[str, Any]:
    """Ulysses groups of neighbouring ranks and ring groups across them (every rank creates all of them)."""
    rank, ring = dist.get_rank(), cp // ulysses
    ulysses_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)]) for r in range(ring)]
    ring_groups = [dist.new_group([r * ulysses + u for r in range(ring)]) for u in range(ulysses)]
    return {"ulysses_group": ulysses_groups[rank // ulysses], "ring_group": ring_groups[rank % ulysses]}


def _mode_inputs(workload: Workload, heads: tuple[int, int], ring: int, split: int) -> tuple[list, Any]:
    """This rank's zigzag shards (zigzag over ``ring`` positions, each split over ``split`` ranks) and metadata."""
    rank = dist.get_rank()
    lengths = torch.tensor(workload.lengths)
    padded = zigzag.zigzag_padded_lengths(lengths, ring, split)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)]).to(torch.int32)
    physical_offsets = cu.to(torch.int64)
    slots = zigzag.zigzag_source_indices(physical_offsets, lengths, padded, ring)
    per_rank = slots.numel() // (ring * split)
    mine = slots[rank * per_rank : (rank + 1) * per_rank]
    torch.manual_seed(0)
    n = int(lengths.sum())
    full = [torch.randn(n, h, HEAD_DIM) for h in (heads[0], heads[1], heads[1])]
    local = [torch.where((mine >= 0)[:, None, None], x[mine.clamp(min=0)], 0.0) for x in full]
    if not workload.packed:
        return [x.unsqueeze(1) for x in local], None
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=int(padded.max()))
    return local, params


def _measure_modes(workload: Workload, heads: tuple[int, int], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Rank body: interleave the modes, timing forward and backward, counting the bytes sent and the peak memory."""
    cp = dist.get_world_size()
    modes = _modes_at(cp)
    prepared = {}
    for mode, ulysses in modes:
        ring, split = (cp // ulysses, ulysses) if mode == "hybrid" else (cp, 1)
        groups = _hybrid_groups(cp, ulysses) if mode == "hybrid" else {}
        prepared[mode] = (*_mode_inputs(workload, heads, ring, split), groups)
    results: dict[str, dict[str, list[float]]] = {
        mode: {"fwd": [], "bwd": [], "peak": [], "bytes": []} for mode, _ in modes
    }
    for repeat in range(repeats + 1):  # the first round warms up kernels and gloo connections and is not kept
        for mode, _ in modes:
            local, params, groups = prepared[mode]
            leaves = [x.clone().requires_grad_() for x in local]
            dist.barrier()
            Path("/proc/self/clear_refs").write_text("5")
            resident = _memory_kib("VmRSS")
            with comm.counting_sent_bytes() as sent:
                start = time.perf_counter()
                out = attention.zigzag_attention(
                    *leaves, dist.group.WORLD, packed_seq_params=params, mode=mode, **groups
                )
                middle = time.perf_counter()
                out.backward(torch.ones_like(out))
                end = time.perf_counter()
            if repeat:
                results[mode]["fwd"].append(middle - start)
                results[mode]["bwd"].append(end - middle)
                results[mode]["peak"].append((_memory_kib("VmHWM") - resident) / 1024)
                results[mode]["bytes"].append(sent.total)
    return results


def modes_table(total: int, cps: Sequence[int], repeats: int) -> str:
    """Every mode side by side in one run: time, bytes sent per layer, peak extra memory and work balance per rank."""
    heads = (8, 2)
    lines = [
        f"### attention modes (causal, Hq={heads[0]}, Hkv={heads[1]}, D={HEAD_DIM}, float32, cpu_flash, gloo, "
        f"1 thread per rank, {os.cpu_count()} CPU cores shared by all ranks; time = slowest rank's min of {repeats}; "
        "bytes = what each rank sends for one layer's forward + backward, counted in the collectives (slowest rank); "
        "memory = peak resident growth during the call; balance = max / mean attention work over ranks)",
        "",
        "| workload | cp | mode | forward (ms) | backward (ms) | MiB sent per rank | peak MiB per rank | balance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload in workloads(total)[:2]:
        for cp in cps:
            outcomes = launch(_measure_modes, cp, workload, heads, repeats)
            cu = None if not workload.packed else [0, *torch.tensor(workload.lengths).cumsum(0).tolist()]
            for mode, ulysses in _modes_at(cp):
                fwd = max(1000 * min(rank[mode]["fwd"]) for rank in outcomes)
                bwd = max(1000 * min(rank[mode]["bwd"]) for rank in outcomes)
                sent = max(max(rank[mode]["bytes"]) for rank in outcomes) / 2**20
                peaks = " / ".join(f"{max(rank[mode]['peak']):.1f}" for rank in outcomes)
                sizes = {"cu_seqlens": cu} if cu else {"seq_len": total}
                work = attention.attention_work_per_rank(cp, **sizes, mode=mode, ulysses_size=ulysses)
                name = mode if ulysses is None else f"{mode} u={ulysses}"
                lines.append(
                    f"| {workload.name} | {cp} | {name} | {fwd:.0f} | {bwd:.0f} | {sent:.2f} | {peaks} | "
                    f"{_imbalance(work):.3f} |"
                )
    return "\n".join(lines)


EFFICIENCY_HEADS = 8


def _sdpa_reference(workload: Workload, track_memory: bool) -> dict[str, float]:
    """Single process, one thread, after a warm-up call on a quarter of the tokens: with ``track_memory`` SDPA's peak
    resident growth for forward + backward over all the workload's tokens (the flash kernel's buffers do not depend
    on the mask), else its CPU seconds for the same work as the workload (packed: each document on its own, the
    cheapest exact way), each call timed after an identical untimed one."""

    def run(length: int) -> tuple[float, float]:
        q, k, v = (torch.randn(length, 1, EFFICIENCY_HEADS, HEAD_DIM).requires_grad_() for _ in range(3))
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        resident, start = _memory_kib("VmRSS"), time.process_time()
        out = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True)
        out.backward(torch.ones_like(out))
        return time.process_time() - start, (_memory_kib("VmHWM") - resident) / 1024

    run(sum(workload.lengths) // 4)
    if track_memory:
        return {"peak": run(sum(workload.lengths))[1]}
    lengths = workload.lengths if workload.packed else (sum(workload.lengths),)

    def second_call(length: int) -> float:
        run(length)
        return run(length)[0]

    return {"seconds": sum(second_call(length) for length in lengths)}


def _shard_trial(workload: Workload, mode: str, track_memory: bool) -> dict[str, float]:
    """Rank body: the peak resident growth (``track_memory``) or the CPU seconds (all threads, and the calling thread
    alone) of one ``zigzag_attention`` forward + backward with the public defaults, after a warm-up call on a
    quarter-size batch (first calls of a size grow buffers that later calls reuse) or, timed, after an identical
    untimed call (so its buffers land on memory that call freed, as in a training loop), and with the batch's block
    plan built (once per batch in training, shared by every layer and the backward)."""
    cp = dist.get_world_size()
    heads = (EFFICIENCY_HEADS, EFFICIENCY_HEADS)
    warm = Workload("warm-up", tuple(max(1, length // 4) for length in workload.lengths), workload.packed)
    total = sum(workload.lengths)
    geometry = (
        zigzag.ZigzagGeometry.packed(cp, workload.lengths)
        if workload.packed
        else zigzag.ZigzagGeometry.dense(cp, total)
    )
    attention._block_plan(geometry, dist.get_rank(), True, torch.device("cpu"), kernels.plan_profile(kernels.CPU_FLASH))
    for case in (warm if track_memory else workload, workload):  # the last one counts
        local, params = _mode_inputs(case, heads, cp, 1)
        leaves = [x.clone().requires_grad_() for x in local]
        del local
        dist.barrier()
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        resident = _memory_kib("VmRSS")
        start, thread = time.process_time(), time.thread_time()
        out = attention.zigzag_attention(*leaves, dist.group.WORLD, packed_seq_params=params, mode=mode)
        out.backward(torch.ones_like(out))
        seconds, thread = time.process_time() - start, time.thread_time() - thread
        peak = (_memory_kib("VmHWM") - resident) / 1024
        del out, leaves
    return {"peak": peak} if track_memory else {"seconds": seconds, "thread": thread}


def _emulated_trial(workload: Workload, cp: int, rounds: int = 3) -> dict[str, float]:
    """Process body: the compute-side efficiency of one forward + backward, every rank's work run one after another
    in this process through the same tiles, key pieces and kernels as ``allgather`` (the exchange replaced by local
    copies; no gloo, no ranks sharing cores): the slowest rank's CPU seconds x cp / SDPA's for the same work, each
    the best of ``rounds`` rounds that interleave SDPA and every rank, so a slow moment of the machine hits both; and
    the same ratio for the seconds spent inside the kernels' calls alone (the floor the kernels set)."""
    tokens = _layout_tokens(workload, cp, "zigzag")
    tensors = tuple(torch.randn(sum(workload.lengths), EFFICIENCY_HEADS, HEAD_DIM) for _ in range(3))
    _rank_time(workload, tokens, 0, tensors)  # warm-up
    sdpa, ranks, in_kernels = math.inf, [math.inf] * cp, [math.inf] * cp
    for _ in range(rounds):
        sdpa = min(sdpa, _sdpa_reference(workload, track_memory=False)["seconds"])
        for rank in range(cp):
            seconds, kernel_seconds = _rank_time(workload, tokens, rank, tensors)
            ranks[rank], in_kernels[rank] = min(ranks[rank], seconds), min(in_kernels[rank], kernel_seconds)
    return {"efficiency": max(ranks) * cp / sdpa, "kernels": max(in_kernels) * cp / sdpa}


def _trial(workload: Workload, cp: int, mode: str, checkout: Path | None, timed: bool = True) -> dict[str, float]:
    """Peak MiB of the highest rank (a run with memory tracking) and, if ``timed``, CPU seconds of the slowest rank,
    all threads and the calling one (a run without), of one trial, with this code or, in a child interpreter, the code
    at ``checkout`` run by that checkout's own copy of this script (its harness matches its code); for ``mode``
    "emulated" the compute-side efficiency of ``_emulated_trial`` instead."""
    if checkout is not None:
        spec = {"name": workload.name, "lengths": workload.lengths, "packed": workload.packed, "cp": cp, "mode": mode}
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        script = checkout / "benchmarks" / Path(__file__).name
        command = [sys.executable, str(script), "--trial", json.dumps({**spec, "timed": timed})]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"trial {spec} with {checkout} failed:\n{result.stderr[-3000:]}")
        return json.loads(result.stdout.splitlines()[-1])
    if mode == "emulated":
        return launch(_emulated_trial, 1, workload, cp, track_memory=False)[0]
    peak = max(rank["peak"] for rank in launch(_shard_trial, cp, workload, mode, True))
    if not timed:
        return {"peak": peak}
    timing = launch(_shard_trial, cp, workload, mode, False, track_memory=False)
    return {
        "peak": peak,
        "seconds": max(rank["seconds"] for rank in timing),
        "thread": max(rank["thread"] for rank in timing),
    }


def efficiency_table(
    totals: Sequence[int], memory_totals: Sequence[int], cps: Sequence[int], baseline: Path | None
) -> str:
    """Peak memory per rank against the ideal (single-process SDPA's peak / cp) and parallel efficiency (the slowest
    rank's CPU seconds x cp / SDPA's CPU seconds for the same work), both modes, dense and packed; at
    ``memory_totals`` tokens only the memory (efficiency '-')."""
    columns = "before -> after" if baseline else "value"
    compared = (
        f"; {columns}: the checkout {baseline} (the code before) and this one, config by config" if baseline else ""
    )
    lines = [
        f"### memory and parallel efficiency against single-process SDPA (causal, Hq=Hkv={EFFICIENCY_HEADS}, "
        f"D={HEAD_DIM}, float32, cpu_flash, gloo, 1 thread per rank, {os.cpu_count()} CPU cores shared by all ranks "
        "and other work; one forward + backward after a warm-up call at a quarter of the size (memory) or an identical "
        "untimed call (time), the batch's block plan "
        "built before. peak = resident growth during the call (highest rank); memory = peak / (SDPA's peak over all "
        "the tokens / cp), target <= 1.2; efficiency = the slowest rank's CPU seconds x cp / SDPA's CPU seconds for "
        "the same work at one thread (packed: SDPA per document), target <= 1.1, counting all the rank's threads "
        "(compute and gloo's copying through loopback sockets) or the compute thread alone; CPU time, not wall time, "
        "since the ranks share the cores; 'emulated in one process' (packed): every rank's work "
        "run one after another in one process through the same tiles and kernels, the exchange replaced by local "
        "copies (the compute side alone; each rank's call timed after an identical untimed one), against SDPA "
        "measured in the same process, best of 3 interleaved rounds each, and in brackets the same ratio for the "
        "time inside the kernels' calls alone (the rest is bookkeeping); "
        f"'-': not timed){compared}",
        "",
        f"| workload | cp | mode | peak MiB per rank ({columns}) | memory ({columns}) | efficiency, all threads "
        f"({columns}) | efficiency, compute thread ({columns}) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for total in sorted({*totals, *memory_totals}):
        timed = total in totals
        for workload in workloads(total):
            (memory,) = launch(_sdpa_reference, 1, workload, True)
            sdpa_peak = memory["peak"]
            if timed:
                (timing,) = launch(_sdpa_reference, 1, workload, False, track_memory=False)
                sdpa_seconds = timing["seconds"]
            reference = f"1.00 ({sdpa_seconds:.1f} s) | 1.00" if timed else "- | -"
            lines.append(f"| {workload.name} | SDPA | 1 process | {sdpa_peak:.0f} | 1.00 | {reference} |")
            for cp in cps:
                checkouts = [baseline] if baseline else []
                if timed and cp > 1 and workload.packed:
                    runs = [_trial(workload, cp, "emulated", checkout) for checkout in [*checkouts, None]]
                    compute = " -> ".join(_emulated_cell(run) for run in runs)
                    lines.append(f"| {workload.name} | {cp} | emulated in one process | - | - | - | {compute} |")
                for mode in ("allgather", "ring"):
                    runs = [_trial(workload, cp, mode, checkout, timed) for checkout in [*checkouts, None]]
                    cells = [
                        [f"{run['peak']:.0f}" for run in runs],
                        [f"{run['peak'] / (sdpa_peak / cp):.2f}" for run in runs],
                        [f"{run['seconds'] * cp / sdpa_seconds:.2f}" if timed else "-" for run in runs],
                        [f"{run['thread'] * cp / sdpa_seconds:.2f}" if timed else "-" for run in runs],
                    ]
                    lines.append(f"| {workload.name} | {cp} | {mode} | {' | '.join(' -> '.join(c) for c in cells)} |")
    return "\n".join(lines)


def emulated_table(totals: Sequence[int], cps: Sequence[int]) -> str:
    """The efficiency table's emulated rows alone (packed batches, the compute side of every rank in one process)."""
    lines = [
        "### compute-side efficiency, emulated in one process (causal, packed, Hq=Hkv="
        f"{EFFICIENCY_HEADS}, D={HEAD_DIM}, float32, cpu_flash, one thread: every rank's forward + backward run one "
        "after another through the same tiles and kernels as allgather, each timed after an identical untimed call; "
        "the slowest rank's CPU seconds x cp / per-document SDPA's, best of 3 interleaved rounds, target <= 1.1; in "
        "brackets the same ratio for the time inside the kernels' calls alone)",
        "",
        "| workload | cp | efficiency |",
        "| --- | --- | --- |",
    ]
    for total in totals:
        for workload in workloads(total):
            if workload.packed:
                lines += [f"| {workload.name} | {cp} | {_emulated_cell(_trial(workload, cp, 'emulated', None))} |"
                          for cp in cps]  # fmt: skip
    return "\n".join(lines)


def _emulated_cell(run: dict[str, float]) -> str:
    """An emulated trial's efficiency, with the kernels' own share where the measured code reports it."""
    return f"{run['efficiency']:.2f}" + (f" (kernels {run['kernels']:.2f})" if "kernels" in run else "")


def _plan_tiles(plan: kernels.BlockPlan) -> list[kernels.Block]:
    """Every tile of a block plan: the forward's and the backward's."""
    forward = [tile for source in plan.tiles for tile in source]
    return forward + [tile for source in plan.piece_tiles for piece in source for tile in piece]


def gpu_plan_table(totals: Sequence[int], cps: Sequence[int]) -> str:
    """Rank 0's block plan under the GPU profile (large tiles, small documents sharing masked calls), built on the
    host: masked tiles, the bytes their masks hold (documents and positions), the bytes boolean masks would take,
    and the build time (median of 3)."""
    lines = [
        "### a GPU's block plans for packed batches (rank 0, built on the host; masks kept as documents and positions)",
        "",
        "| tokens | workload | cp | masked tiles | mask bytes held | as boolean masks | ratio | build ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for total in totals:
        for workload in workloads(total)[1:]:
            for cp in cps:
                tokens = zigzag.ZigzagGeometry.packed(cp, list(workload.lengths)).rank_tokens
                seconds = []
                for _ in range(3):
                    started = time.perf_counter()
                    plan = kernels.build_block_plan(tokens, 0, True, torch.device("cpu"), profile=kernels._GPU_PROFILE)
                    seconds.append(time.perf_counter() - started)
                masks = [tile.mask for tile in _plan_tiles(plan) if tile.mask is not None]
                held = sum(x.numel() * x.element_size() for m in masks for x in (m.q_doc, m.q_pos, m.k_doc, m.k_pos))
                boolean = sum(m.q_doc.numel() * m.k_doc.numel() for m in masks)
                lines.append(
                    f"| {total} | {workload.name} | {cp} | {len(masks)} | {held / 2**20:.2f} MiB | "
                    f"{boolean / 2**20:.1f} MiB | {boolean / max(held, 1):.0f} | "
                    f"{statistics.median(seconds) * 1e3:.0f} |"
                )
    return "\n".join(lines)


def rule_table() -> str:
    """Bytes per layer of each mode relative to all-gather for common GPU models, and what ``auto`` picks."""
    models = [
        ("Qwen2.5-0.5B", 14, 2),
        ("Llama-3-8B / Mistral-7B", 32, 8),
        ("Llama-3-70B", 64, 8),
        ("MHA 16 heads", 16, 16),
    ]
    lines = [
        "### which mode for a GPU cluster: bytes per layer relative to all-gather (`bytes_sent_per_layer`; '-' = the "
        "heads do not split), and `attention_mode='auto'`",
        "",
        "| model (query / kv heads) | cp | ring | ulysses | best hybrid | auto |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, heads, kv_heads in models:
        for cp in (2, 4, 8, 16):
            base = cost.bytes_sent_per_layer("allgather", cp, 1, heads, kv_heads, 1, 1)
            ring = cost.bytes_sent_per_layer("ring", cp, 1, heads, kv_heads, 1, 1) / base
            ulysses = (
                f"{cost.bytes_sent_per_layer('ulysses', cp, 1, heads, kv_heads, 1, 1) / base:.2f}"
                if heads % cp == 0
                else "-"
            )
            hybrids = [
                (cost.bytes_sent_per_layer("hybrid", cp, 1, heads, kv_heads, 1, 1, ulysses_size=u) / base, u)
                for u in range(2, cp)
                if cp % u == 0 and heads % u == 0
            ]
            hybrid = f"{min(hybrids)[0]:.2f} (u={min(hybrids)[1]})" if hybrids else "-"
            mode, u = cost.choose_attention_mode(cp, heads, kv_heads)
            chosen = mode if u is None else f"{mode} u={u}"
            lines.append(f"| {name} ({heads} / {kv_heads}) | {cp} | {ring:.2f} | {ulysses} | {hybrid} | {chosen} |")
    return "\n".join(lines)


def _track_live_memory() -> None:
    """Make resident memory follow live tensors: unmap big buffers on free, return free heap inherited on fork."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)


def _reuse_freed_memory() -> None:
    """Undo ``_track_live_memory`` for timing: buffers up to 32 MiB come from the heap and are reused once freed, as
    glibc's adaptive threshold settles in a long-running process, so short-lived buffers cost no page faults."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(_M_TRIM_THRESHOLD, 128 * 2**20)


def _rank_entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, track_memory: bool
) -> None:
    """Child process: join the gloo group, run ``fn`` and report its result (or the traceback)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if track_memory:
        _track_live_memory()
    else:
        _reuse_freed_memory()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent must see every failure
        queue.put((rank, RuntimeError(traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args: Any, track_memory: bool = True) -> list[Any]:
    """Fork ``world_size`` ranks in a gloo group, run ``fn(*args)`` on each and return their results in rank order.

    ``track_memory``: resident memory follows live tensors (``_track_live_memory``); without it freed memory is kept
    for reuse, as in training, so many short-lived buffers cost no page faults (time runs).
    """
    context = mp.get_context("fork")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        context.Process(target=_rank_entry, args=(rank, world_size, port, fn, args, queue, track_memory))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=900) for _ in range(world_size))
    for process in processes:
        process.join(timeout=60)
    failures = [value for value in results.values() if isinstance(value, RuntimeError)]
    if failures:
        raise failures[0]
    return [results[rank] for rank in range(world_size)]


def _run_trial(spec: str) -> None:
    """``--trial``: measure one trial with whatever ``lightning_cp`` this interpreter imports; print JSON."""
    fields = json.loads(spec)
    workload = Workload(fields["name"], tuple(fields["lengths"]), fields["packed"])
    print(json.dumps(_trial(workload, fields["cp"], fields["mode"], None, fields["timed"])))


def main() -> None:
    """Run the benchmarks, print the tables and save them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes and one repeat (a few minutes)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--baseline", type=Path, help="another checkout: before/after memory and efficiency")
    parser.add_argument("--efficiency-tokens", default="16384,32768", help="token counts of the efficiency table")
    parser.add_argument("--memory-tokens", default="65536", help="token counts of memory-only rows in that table")
    parser.add_argument("--only-efficiency", action="store_true", help="only the memory and efficiency table")
    parser.add_argument("--only-emulated", action="store_true", help="only the emulated compute-side rows")
    parser.add_argument("--only-gpu-plans", action="store_true", help="only the GPU block plan table (a minute)")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trial:
        _run_trial(args.trial)
        return
    _track_live_memory()
    balance_tokens, modes_tokens, repeats = (8192, 2048, 2) if args.quick else (32768, 8192, 3)
    efficiency_tokens = [4096] if args.quick else [int(x) for x in args.efficiency_tokens.split(",") if x]
    memory_tokens = [8192] if args.quick else [int(x) for x in args.memory_tokens.split(",") if x]
    plan_tokens = [8192] if args.quick else [32768, 65536]
    started = time.perf_counter()
    if args.only_gpu_plans:
        sections = [gpu_plan_table(plan_tokens, (2, 4))]
    elif args.only_emulated:
        sections = [emulated_table(efficiency_tokens, (2, 4))]
    elif args.only_efficiency:
        sections = [efficiency_table(efficiency_tokens, memory_tokens, (1, 2, 4), args.baseline)]
    else:
        sections = [
            balance_table(balance_tokens, 4, repeats),
            modes_table(modes_tokens, (2, 4), repeats),
            efficiency_table(efficiency_tokens, memory_tokens, (1, 2, 4), args.baseline),
            gpu_plan_table(plan_tokens, (2, 4)),
            rule_table(),
        ]
    command = " ".join(["python", "benchmarks/attention_bench.py", *sys.argv[1:]])
    header = (
        f"## attention_bench{' --quick' if args.quick else ''}\n\n"
        f"`{command}`: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {time.perf_counter() - started:.0f} s"
    )
    report = "\n\n".join([header, *sections]) + "\n"
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)


if __name__ == "__main__":
    main()
