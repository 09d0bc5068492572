"""What a short causal convolution between attention layers costs under CP, side by side in one run per CP size.

Forward + backward of ``cp_causal_conv1d`` (kernel 3, as LFM2's) on a packed batch of documents averaging 2k tokens,
float32, on local gloo ranks, each candidate timed in turn within every repetition:
- ``local``: ``F.conv1d`` of the rank's shard alone (wrong under CP: the floor, no exchange);
- ``zigzag``: ``cp_causal_conv1d`` where attention layers run (zigzag shards: two pieces of every document per rank,
  the tokens before each piece from the ranks holding them);
- ``contiguous``: ``cp_causal_conv1d`` on contiguous shards;
- ``round trip``: the two layout conversions a convolution layer run on contiguous shards between zigzag attention
  layers adds (zigzag -> contiguous -> zigzag, forward and backward).
A repetition's time is the slowest rank's; the table shows medians.

Run: ``python benchmarks/convolution_bench.py`` (``--quick`` for one size); the table is printed and saved to
``benchmarks/results/convolution_bench.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.nn.functional as F
from torch.distributed.elastic.utils.distributed import get_free_port

from lightning_cp import ContextParallelRuntime, ContextParallelSetting, cp_causal_conv1d
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.core.step import ContextParallelStep, activated, set_active_step
from lightning_cp.core.zigzag import CPLayout

RESULTS = Path(__file__).resolve().parent / "results" / "convolution_bench.md"
KERNEL = 3
HIDDEN = 1024
CANDIDATES = ("local", "zigzag", "contiguous", "round trip")


def packed_batch(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """A packed batch of ``tokens`` tokens in documents of 1 to 4k tokens (2k on average)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(1, 4096, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - tokens
    offsets = torch.tensor([0, *torch.tensor([n for n in lengths if n > 0]).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "cu_seqlens": offsets}


def _forward_backward(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, step: ContextParallelStep
) -> Callable[[], None]:
    """One forward and backward of ``fn`` on a fresh leaf copy of ``x``, with ``step`` active."""

    def run() -> None:
        with activated(step):
            fn(x.detach().requires_grad_()).sum().backward()

    return run


def _candidates(setting: ContextParallelSetting, tokens: int) -> dict[str, Callable[[], None]]:
    """The candidates that run in a step of ``setting``'s boundary layout."""
    batch = packed_batch(tokens, seed=0)
    step, _ = ContextParallelRuntime(setting, check_consensus=False).begin_step(batch)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(1, batch["input_ids"].shape[1], HIDDEN, generator=generator)
    weight = torch.randn(HIDDEN, KERNEL, generator=generator)
    if setting.boundary_layout is CPLayout.CONTIGUOUS:
        return {"contiguous": _forward_backward(lambda h: cp_causal_conv1d(h, weight), x, step)}

    def local(h: torch.Tensor) -> torch.Tensor:
        return F.conv1d(h.transpose(1, 2), weight.unsqueeze(1), padding=KERNEL - 1, groups=HIDDEN)[..., : h.shape[1]]

    def round_trip(h: torch.Tensor) -> torch.Tensor:
        contiguous = step.convert(h, CPLayout.ZIGZAG, CPLayout.CONTIGUOUS)
        return step.convert(contiguous, CPLayout.CONTIGUOUS, CPLayout.ZIGZAG)

    return {
        "local": _forward_backward(local, x, step),
        "zigzag": _forward_backward(lambda h: cp_causal_conv1d(h, weight), x, step),
        "round trip": _forward_backward(round_trip, x, step),
    }


def _rank_main(rank: int, cp: int, port: int, token_counts: list[int], repetitions: int, out: str) -> None:
    """One gloo rank: time every candidate per token count; rank 0 writes the medians to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, cp, 1))
    settings = [ContextParallelSetting(mesh, boundary_layout=layout) for layout in ("zigzag", "contiguous")]
    rows = []
    for tokens in token_counts:
        candidates = {name: run for setting in settings for name, run in _candidates(setting, tokens).items()}
        set_active_step(None)
        times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
        for repetition in range(repetitions + 2):
            for name in CANDIDATES:
                dist.barrier()
                start = time.perf_counter()
                candidates[name]()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if repetition >= 2:  # two warm-up rounds
                    times[name].append(1000 * float(elapsed))
        rows.append((tokens, {name: statistics.median(values) for name, values in times.items()}))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _table(rows_by_cp: dict[int, list], wall: float) -> str:
    """The markdown report: medians in ms and the ratios that matter."""
    lines = [
        "# Short causal convolution under CP",
        "",
        f"`python benchmarks/convolution_bench.py` on {platform.node()} ({os.cpu_count()} cores, torch "
        f"{torch.__version__}, gloo, 1 thread per rank), {wall:.0f} s. Forward + backward, kernel {KERNEL}, hidden "
        f"{HIDDEN}, float32, packed documents of 2k tokens on average; medians of the slowest rank, ms.",
        "",
        "| cp | tokens | local conv1d | zigzag | contiguous | round trip | zigzag / local | "
        "(contiguous + round trip) / zigzag |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cp, rows in rows_by_cp.items():
        for tokens, ms in rows:
            converted = (ms["contiguous"] + ms["round trip"]) / ms["zigzag"]
            lines.append(
                f"| {cp} | {tokens} | {ms['local']:.2f} | {ms['zigzag']:.2f} | {ms['contiguous']:.2f} | "
                f"{ms['round trip']:.2f} | {ms['zigzag'] / ms['local']:.2f} | {converted:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run every CP size in its own gloo group; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one token count, fewer repetitions")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to save the markdown table")
    args = parser.parse_args()
    token_counts, repetitions = ([16384], 5) if args.quick else ([16384, 65536], 9)
    started = time.perf_counter()
    rows_by_cp = {}
    with tempfile.TemporaryDirectory() as folder:
        for cp in (2, 4):
            out = str(Path(folder) / f"cp{cp}.json")
            torch_mp.start_processes(
                _rank_main, args=(cp, get_free_port(), token_counts, repetitions, out), nprocs=cp, start_method="fork"
            )
            rows_by_cp[cp] = json.loads(Path(out).read_text())
    table = _table(rows_by_cp, time.perf_counter() - started)
    print(table)
    args.output.write_text(table)


if __name__ == "__main__":
    main()
