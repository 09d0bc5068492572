"""Benchmark CP attention: zigzag versus contiguous load balance, and allgather versus ring at cp 2 and 4.

Run from the repository root: ``python benchmarks/attention_bench.py [--quick]``. Everything runs on CPU with one
thread per rank (gloo for the process groups); tables are printed and saved to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention import kernels
from lightning_cp.core.packed import PackedSeqParams

RESULTS = Path(__file__).resolve().parent / "results" / "attention_bench.md"
HEAD_DIM = 64
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


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
    """Gather one rank's half-major slots of a flat ``[N, H, D]`` tensor as ``[1, H, T, D]`` (zeros in padding)."""
    valid = tokens.doc >= 0
    index = torch.where(valid, offsets[tokens.doc.clamp(min=0)] + tokens.pos, 0)
    local = x.index_select(0, index) * valid.view(-1, 1, 1)
    return local.permute(1, 0, 2).unsqueeze(0).contiguous()


def _rank_time(workload: Workload, tokens: list[zigzag.RankTokens], rank: int, tensors: tuple) -> float:
    """Seconds of one rank's forward + backward against every rank's K/V (the all-gather computation)."""
    q, k, v = tensors
    offsets = torch.tensor([0, *workload.lengths]).cumsum(0)
    plan = kernels.build_block_plan(tokens, rank, True, torch.device("cpu"))
    q_local = _shard(q, tokens[rank], offsets).requires_grad_()
    kv_all = torch.stack([torch.stack([_shard(k, t, offsets), _shard(v, t, offsets)]) for t in tokens])
    kv_all.requires_grad_()
    start = time.perf_counter()
    out = attention._GatheredAttention.apply(q_local, kv_all, plan, kernels.CPU_FLASH, HEAD_DIM**-0.5)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def balance_table(total: int, cp: int, repeats: int) -> str:
    """Unmasked pairs and measured forward+backward time per rank, zigzag versus contiguous, causal."""
    lines = [
        f"### Work balance, causal, cp={cp} (time: forward+backward per rank, 1 head x {HEAD_DIM}, float32, "
        f"cpu_flash, min of {repeats}, ranks run one after another on one thread)",
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
                    times[name][rank].append(_rank_time(workload, tokens, rank, tensors))
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


def _measure_modes(workload: Workload, heads: tuple[int, int], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Rank body: interleave allgather and ring, timing forward and backward and the peak extra resident memory."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    padded = list(zigzag.ZigzagGeometry.packed(cp, workload.lengths).padded_lengths)
    tokens = zigzag.zigzag_rank_tokens(workload.lengths, padded, cp, rank)
    offsets = torch.tensor([0, *workload.lengths]).cumsum(0)
    torch.manual_seed(0)
    n = sum(workload.lengths)
    full = [torch.randn(n, h, HEAD_DIM) for h in (heads[0], heads[1], heads[1])]
    local = [_shard(x, tokens, offsets)[0].permute(1, 0, 2).contiguous() for x in full]  # half-major [T, H, D]
    if tokens.perm is not None:
        local = [x[torch.argsort(tokens.perm)] for x in local]  # back to the rank's zigzag order
    params = _packed_params(workload.lengths, padded) if workload.packed else None
    if not workload.packed:
        local = [x.unsqueeze(1) for x in local]
    results: dict[str, dict[str, list[float]]] = {m: {"fwd": [], "bwd": [], "peak": []} for m in attention.MODES}
    for repeat in range(repeats + 1):  # the first round warms up kernels and gloo connections and is not kept
        for mode in attention.MODES:
            leaves = [x.clone().requires_grad_() for x in local]
            dist.barrier()
            Path("/proc/self/clear_refs").write_text("5")
            resident = _memory_kib("VmRSS")
            start = time.perf_counter()
            out = attention.zigzag_attention(*leaves, dist.group.WORLD, packed_seq_params=params, mode=mode)
            middle = time.perf_counter()
            out.backward(torch.ones_like(out))
            end = time.perf_counter()
            if repeat:
                results[mode]["fwd"].append(middle - start)
                results[mode]["bwd"].append(end - middle)
                results[mode]["peak"].append((_memory_kib("VmHWM") - resident) / 1024)
    return results


def _packed_params(lengths: Sequence[int], padded: Sequence[int]) -> PackedSeqParams:
    """Zigzag-side metadata for a packed workload."""
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_padded = torch.tensor([0, *padded], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=max(padded))


def modes_table(total: int, cps: Sequence[int], repeats: int) -> str:
    """Allgather versus ring, forward and backward time and peak extra memory per rank, interleaved in one run."""
    heads = (4, 2)
    lines = [
        f"### allgather vs ring (causal, Hq={heads[0]}, Hkv={heads[1]}, D={HEAD_DIM}, float32, cpu_flash, gloo, "
        f"1 thread per rank, {os.cpu_count()} CPU cores shared by all ranks; time = slowest rank's min of {repeats}; "
        "memory = peak resident growth during the call)",
        "",
        "| workload | cp | mode | forward (ms) | backward (ms) | peak memory per rank (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for workload in workloads(total)[:2]:
        for cp in cps:
            outcomes = launch(_measure_modes, cp, workload, heads, repeats)
            for mode in attention.MODES:
                fwd = max(1000 * min(rank[mode]["fwd"]) for rank in outcomes)
                bwd = max(1000 * min(rank[mode]["bwd"]) for rank in outcomes)
                peaks = " / ".join(f"{max(rank[mode]['peak']):.1f}" for rank in outcomes)
                lines.append(f"| {workload.name} | {cp} | {mode} | {fwd:.0f} | {bwd:.0f} | {peaks} |")
    return "\n".join(lines)


def _track_live_memory() -> None:
    """Make resident memory follow live tensors: unmap big buffers on free, return free heap inherited on fork."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    """Child process: join the gloo group, run ``fn`` and report its result (or the traceback)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _track_live_memory()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent must see every failure
        queue.put((rank, RuntimeError(traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Fork ``world_size`` ranks in a gloo group, run ``fn(*args)`` on each and return their results in rank order."""
    context = mp.get_context("fork")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        context.Process(target=_rank_entry, args=(rank, world_size, port, fn, args, queue))
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


def main() -> None:
    """Run both benchmarks, print the tables and save them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes and one repeat (about a minute)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    balance_tokens, modes_tokens, repeats = (8192, 2048, 2) if args.quick else (32768, 8192, 3)
    torch.set_num_threads(1)
    _track_live_memory()
    started = time.perf_counter()
    sections = [balance_table(balance_tokens, 4, repeats), modes_table(modes_tokens, (2, 4), repeats)]
    header = (
        f"## attention_bench{' --quick' if args.quick else ''}\n\n"
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, {time.perf_counter() - started:.0f} s"
    )
    report = "\n\n".join([header, *sections]) + "\n"
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)


if __name__ == "__main__":
    main()
