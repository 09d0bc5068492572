"""Benchmark CP layout conversion on local gloo ranks against the raw all-to-all floor and a naive all-gather.

Each timed repetition runs contiguous -> zigzag -> contiguous once per candidate, candidates interleaved:
- ``ours``: ``contiguous_to_zigzag`` then ``zigzag_to_contiguous`` (dense, or packed with a THD plan: ``packed``
  documents average 2k tokens, ``packed-short`` ones 256, as fine-tuning samples do; ``packed-short-aligned`` rounds
  those lengths to multiples of ``2 * cp``, so no zigzag slot is padding: the padding's share of the cost);
- ``floor``: one raw ``all_to_all_single`` pair moving the same rows with the plan's split sizes, no index work,
  into freshly allocated outputs (what any out-of-place conversion must at least pay);
- ``floor-prealloc``: the same pair into outputs allocated once before timing (a lower bound no API returning new
  tensors can reach on a host without a caching allocator);
- ``floor-staged``: the fresh-output pair with one copy of the sent rows into a reused send buffer before each
  all-to-all: the least a conversion through one ``all_to_all_single`` per direction pays, since a rank's rows for
  one destination lie between those for the others on one side of every zigzag conversion (a gather on send or a
  scatter on receive);
- ``naive``: all-gather the whole sequence and slice this rank's part, both ways.
A repetition's time is the slowest rank's; the table shows the best repetition (interference from other jobs on
a shared host only ever adds time) and, for the ratio to the floor, also the ratio of medians. THD plan building
is timed on its own (one rank's ``build_thd_cp_layout_plan`` with a stand-in group, single thread) for a grid of token
and sequence counts, side by side with the reference builder when ``--reference-layout`` names its file.

Run: ``python benchmarks/layout_bench.py`` (``--quick`` for a short run, ``--reference-layout PATH``); the table is
printed and saved to
``benchmarks/results/layout_bench.md``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_cp.layout import (
    _build_layout_redistribution_plan,
    _build_thd_rank_order_indices,
    build_thd_cp_layout_plan,
    contiguous_to_zigzag,
    zigzag_to_contiguous,
)

CANDIDATES = ("ours", "floor", "floor-prealloc", "floor-staged", "naive")
SHORT_DOCUMENT_TOKENS = 256
"""Mean document length of the ``packed-short`` case (fine-tuning samples): many small runs to gather and scatter."""
_REFERENCE: dict[str, Any] = {}  # the reference layout module, loaded before the ranks fork
RESULTS = Path(__file__).resolve().parent / "results" / "layout_bench.md"


@dataclass(frozen=True)
class Settings:
    """What one run measures."""

    cp_sizes: tuple[int, ...]
    token_counts: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    quick: bool
    plan_token_counts: tuple[int, ...]
    plan_sequence_counts: tuple[int, ...]
    plan_cp_sizes: tuple[int, ...]
    dtype: torch.dtype

    def repetitions(self, tokens: int) -> int:
        """More repetitions for small, noisy shapes (a few ms each, so host jitter moves their ratios most); few for
        the big ones whose naive all-gather takes seconds."""
        if tokens <= 8192:
            return 101 if self.quick else 151
        if tokens <= 32768:
            return 15 if self.quick else 21
        return 3


def _settings(quick: bool) -> Settings:
    """The full grid, or a trimmed one for ``--quick``."""
    if quick:
        return Settings(
            (2, 4), (8192, 32768, 131072), (1024,), True, (65536, 262144), (100, 2048), (2, 8), torch.bfloat16
        )
    return Settings(
        (2, 4),
        (8192, 32768, 131072, 262144),
        (512, 1024),
        False,
        (65536, 262144, 1048576),
        (100, 2048, 20480),
        (2, 4, 8),
        torch.bfloat16,
    )


def _random_cu_seqlens(token_count: int, sequence_count: int, seed: int) -> torch.Tensor:
    """Offsets of ``sequence_count`` random-length sequences filling ``token_count`` tokens (int32)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(token_count - 1, generator=generator)[: sequence_count - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([token_count])]).to(torch.int32)


def _slowest_rank_statistics(times: dict[str, list[float]]) -> dict[str, float]:
    """Per candidate, the best and the median over repetitions of the slowest rank's time (ms)."""
    names = sorted(times)
    local = torch.tensor([times[name] for name in names], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    statistics_ms = {}
    for name, row in zip(names, local.tolist(), strict=True):
        statistics_ms[name] = 1e3 * min(row)
        statistics_ms[f"{name} median"] = 1e3 * statistics.median(row)
    return statistics_ms


def _interleaved(candidates: dict[str, Callable[[], object]], repetitions: int) -> dict[str, float]:
    """Warm every candidate once, then time them round-robin (rotating the start) with a barrier before each."""
    for run in candidates.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for repetition in range(repetitions):
        for name in names[repetition % len(names) :] + names[: repetition % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    return _slowest_rank_statistics(times)


def _raw_pair(
    rows: torch.Tensor,
    forward: tuple[list[int], list[int]],
    reverse: tuple[list[int], list[int]],
    outputs: tuple[torch.Tensor, torch.Tensor] | None,
    staging: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Two raw all_to_all_single calls with precomputed ``(output, input)`` splits, into fresh or given outputs; with
    ``staging``, each call sends from that buffer after copying its input into it."""
    middle = rows.new_empty((sum(forward[0]), *rows.shape[1:])) if outputs is None else outputs[0]
    dist.all_to_all_single(middle, rows if staging is None else staging[0].copy_(rows), forward[0], forward[1])
    back = rows.new_empty((sum(reverse[0]), *rows.shape[1:])) if outputs is None else outputs[1]
    dist.all_to_all_single(back, middle if staging is None else staging[1].copy_(middle), reverse[0], reverse[1])
    return back


def _floor_candidates(rows: torch.Tensor, forward, reverse) -> dict[str, Callable[[], object]]:
    """The fresh-output, preallocated and staged raw all-to-all pairs (sending as many rows as the plan sends)."""
    sent = sum(forward[1])
    rows = rows if rows.shape[0] == sent else torch.randn(sent, *rows.shape[1:]).to(rows.dtype)
    outputs = (rows.new_empty((sum(forward[0]), *rows.shape[1:])), rows.new_empty((sum(reverse[0]), *rows.shape[1:])))
    staging = (torch.empty_like(rows), torch.empty_like(outputs[0]))
    return {
        "floor": lambda: _raw_pair(rows, forward, reverse, None),
        "floor-prealloc": lambda: _raw_pair(rows, forward, reverse, outputs),
        "floor-staged": lambda: _raw_pair(rows, forward, reverse, None, staging),
    }


def _naive_round_trip(rows: torch.Tensor, to_zigzag: torch.Tensor, to_contiguous: torch.Tensor, group_size: int):
    """All-gather the contiguous shards and pick this rank's zigzag rows, then all-gather those and pick back."""
    gathered = rows.new_empty((rows.shape[0] * group_size, *rows.shape[1:]))
    dist.all_gather_into_tensor(gathered, rows)
    zigzag = gathered.index_select(0, to_zigzag)
    gathered_zigzag = zigzag.new_empty((zigzag.shape[0] * group_size, *zigzag.shape[1:]))
    dist.all_gather_into_tensor(gathered_zigzag, zigzag)
    return gathered_zigzag.index_select(0, to_contiguous)


def _dense_case(cp: int, rank: int, tokens: int, hidden: int, settings: Settings) -> dict[str, float]:
    """Time the dense candidates for one shape."""
    local = tokens // cp
    rows = torch.randn(local, hidden).to(settings.dtype)
    segment = local // 2
    forward_plan = _build_layout_redistribution_plan("contiguous", "zigzag", cp, rank)
    reverse_plan = _build_layout_redistribution_plan("zigzag", "contiguous", cp, rank)
    forward = (
        [c * segment for c in forward_plan.output_segment_counts],
        [c * segment for c in forward_plan.input_segment_counts],
    )
    reverse = (
        [c * segment for c in reverse_plan.output_segment_counts],
        [c * segment for c in reverse_plan.input_segment_counts],
    )
    chunk = tokens // (2 * cp)
    zigzag_positions = torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )
    zigzag_order = torch.cat(
        [
            torch.cat(
                [torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
            )
            for r in range(cp)
        ]
    )
    contiguous_positions = torch.argsort(zigzag_order)[rank * local : (rank + 1) * local]
    group = dist.group.WORLD

    def ours() -> torch.Tensor:
        return zigzag_to_contiguous(contiguous_to_zigzag(rows, group), group)

    result = ours()
    assert torch.equal(result, rows), "dense round trip changed the data"
    candidates = {"ours": ours, **_floor_candidates(rows, forward, reverse)}
    candidates["naive"] = lambda: _naive_round_trip(rows, zigzag_positions, contiguous_positions, cp)
    with torch.no_grad():
        return _interleaved(candidates, settings.repetitions(tokens))


def _packed_case(
    cp: int,
    rank: int,
    tokens: int,
    hidden: int,
    settings: Settings,
    document_tokens: int = 2048,
    aligned: bool = False,
) -> dict[str, float]:
    """Time the packed candidates for one shape (about one sequence per ``document_tokens``, random lengths;
    ``aligned``: every length a multiple of ``2 * cp``, so no zigzag slot is padding)."""
    cu_seqlens = _random_cu_seqlens(tokens, max(2, tokens // document_tokens), seed=tokens + hidden)
    if aligned:
        cu_seqlens = torch.unique(torch.div(cu_seqlens, 2 * cp, rounding_mode="floor") * 2 * cp)
    group = dist.group.WORLD
    dist.barrier()
    start = time.perf_counter()
    plan = build_thd_cp_layout_plan(cu_seqlens, tokens, group)
    plan_ms = 1e3 * (time.perf_counter() - start)
    rows = torch.randn(plan.contiguous_local_token_count, hidden).to(settings.dtype)
    forward = (list(plan.forward_output_split_sizes), list(plan.forward_input_split_sizes))
    reverse = (list(plan.forward_input_split_sizes), list(plan.forward_output_split_sizes))
    rank_order, _ = _build_thd_rank_order_indices(cu_seqlens, None, cp, 1)
    zigzag_count = plan.zigzag_local_token_count
    mine = rank_order[rank * zigzag_count : (rank + 1) * zigzag_count]
    padding_row = tokens
    to_zigzag = torch.where(mine >= 0, mine, padding_row)
    position_of_token = torch.empty(tokens, dtype=torch.int64)
    valid = rank_order >= 0
    position_of_token[rank_order[valid]] = torch.nonzero(valid).flatten()
    to_contiguous = position_of_token[rank * plan.contiguous_local_token_count :][: plan.contiguous_local_token_count]

    def naive() -> torch.Tensor:
        gathered = rows.new_empty((tokens + 1, hidden))
        dist.all_gather_into_tensor(gathered[:tokens], rows)
        gathered[tokens].zero_()
        zigzag = gathered.index_select(0, to_zigzag)
        gathered_zigzag = zigzag.new_empty((zigzag_count * cp, hidden))
        dist.all_gather_into_tensor(gathered_zigzag, zigzag)
        return gathered_zigzag.index_select(0, to_contiguous)

    def ours() -> torch.Tensor:
        return zigzag_to_contiguous(contiguous_to_zigzag(rows, group, thd_plan=plan), group, thd_plan=plan)

    assert torch.equal(ours(), rows) and torch.equal(naive(), rows), "packed round trip changed the data"
    candidates = {"ours": ours, **_floor_candidates(rows, forward, reverse), "naive": naive}
    with torch.no_grad():
        medians = _interleaved(candidates, settings.repetitions(tokens))
        if "module" in _REFERENCE:
            medians.update(_plan_and_first_conversion(cu_seqlens, tokens, rows, group, settings.repetitions(tokens)))
    plan_time = torch.tensor([plan_ms], dtype=torch.float64)
    dist.all_reduce(plan_time, op=dist.ReduceOp.MAX)
    return {**medians, "plan": float(plan_time)}


def _plan_and_first_conversion(
    cu_seqlens: torch.Tensor, tokens: int, rows: torch.Tensor, group: Any, repetitions: int
) -> dict[str, float]:
    """Plan building plus the first contiguous -> zigzag conversion with a real group, ours and the reference's, on a
    fresh copy of the offsets each time (nothing cached from an earlier batch)."""
    reference = _REFERENCE["module"]

    def first(build: Callable[..., Any], convert: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            plan = build(cu_seqlens.clone(), tokens, group)
            return convert(rows, group, thd_plan=plan)

        return run

    ours = first(build_thd_cp_layout_plan, contiguous_to_zigzag)
    theirs = first(reference.build_thd_cp_layout_plan, reference.contiguous_to_zigzag)
    assert torch.equal(ours(), theirs()), "the reference converts differently"
    return _interleaved({"first ours": ours, "first reference": theirs}, repetitions)


CASES: dict[str, Callable[..., dict[str, float]]] = {
    "dense": _dense_case,
    "packed": _packed_case,
    "packed-short": functools.partial(_packed_case, document_tokens=SHORT_DOCUMENT_TOKENS),
    "packed-short-aligned": functools.partial(_packed_case, document_tokens=SHORT_DOCUMENT_TOKENS, aligned=True),
}


def _rank_main(rank: int, cp: int, port: int, settings: Settings, results: mp.Queue) -> None:
    """One gloo rank: run every conversion case for this CP size; rank 0 reports the rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    rows = []
    try:
        for tokens in settings.token_counts:
            for hidden in settings.hidden_sizes:
                for kind, case in CASES.items():
                    rows.append((kind, cp, tokens, hidden, case(cp, rank, tokens, hidden, settings)))
                    if rank == 0:
                        print(f"  cp={cp} {kind:12} tokens={tokens:>7} hidden={hidden}: {rows[-1][-1]}", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _conversion_rows(settings: Settings) -> list[tuple]:
    """Launch one gloo group per CP size and collect rank 0's rows."""
    context = mp.get_context("fork")
    rows = []
    for cp in settings.cp_sizes:
        results = context.Queue()
        port = _free_port()
        processes = [context.Process(target=_rank_main, args=(r, cp, port, settings, results)) for r in range(cp)]
        for process in processes:
            process.start()
        while results.empty():
            if any(process.exitcode not in (None, 0) for process in processes):
                for process in processes:
                    process.kill()
                raise RuntimeError(f"a cp={cp} rank failed; see its traceback above")
            time.sleep(0.5)
        rows += results.get()
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"a cp={cp} rank exited with code {process.exitcode}")
    return rows


class _StandInGroup:
    """A group that only answers ``size()`` and ``rank()``: plan building needs no process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _reference_all_to_all(
    group: Any, input_: torch.Tensor, output_split_sizes_: list[int], input_split_sizes: list[int], **_: Any
) -> torch.Tensor:
    """Megatron's ``all_to_all`` without autograd: one ``all_to_all_single`` into a fresh buffer."""
    output = input_.new_empty((sum(output_split_sizes_), *input_.shape[1:]))
    dist.all_to_all_single(output, input_.contiguous(), output_split_sizes_, input_split_sizes, group=group)
    return output


def _load_reference_layout(path: Path | None) -> Any:
    """Load the reference layout module (Megatron-LM's ``megatron/core/context_parallel/layout.py``) from ``path``.

    Its two Megatron imports are stubbed: ``all_to_all`` by one ``all_to_all_single`` (what Megatron's wrapper runs),
    ``PackedSeqParams`` by an empty class. Get the file with
    ``git show 3aa19548c6:megatron/core/context_parallel/layout.py`` in a Megatron-LM clone.
    """
    if path is None:
        return None
    stubs = {
        name: types.ModuleType(name)
        for name in (
            "megatron",
            "megatron.core",
            "megatron.core.tensor_parallel",
            "megatron.core.tensor_parallel.mappings",
            "megatron.core.packed_seq_params",
        )
    }
    stubs["megatron.core.tensor_parallel.mappings"].all_to_all = _reference_all_to_all
    stubs["megatron.core.packed_seq_params"].PackedSeqParams = type("PackedSeqParams", (), {})
    for name, module in stubs.items():
        sys.modules.setdefault(name, module)
    spec = importlib.util.spec_from_file_location("reference_layout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_building_rows(settings: Settings, reference: Any) -> list[tuple[int, int, int, float, float | None]]:
    """Median time of one rank's ``build_thd_cp_layout_plan`` (stand-in group, single thread), ours and the reference's
    interleaved when given, over a grid."""
    torch.set_num_threads(1)
    rows = []
    for tokens in settings.plan_token_counts:
        for sequences in settings.plan_sequence_counts:
            cu_seqlens = _random_cu_seqlens(tokens, sequences, seed=sequences)
            for cp in settings.plan_cp_sizes:
                group = _StandInGroup(cp, cp - 1)
                builders = {"ours": build_thd_cp_layout_plan}
                if reference is not None:
                    builders["reference"] = reference.build_thd_cp_layout_plan
                times: dict[str, list[float]] = {name: [] for name in builders}
                for _ in range(7):
                    for name, build in builders.items():
                        start = time.perf_counter()
                        build(cu_seqlens, tokens, group)
                        times[name].append(time.perf_counter() - start)
                medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
                rows.append((tokens, sequences, cp, medians["ours"], medians.get("reference")))
    return rows


def _first_conversion_lines(conversions: list[tuple], settings: Settings) -> list[str]:
    """The plan + first conversion table (real gloo group), when the reference was given."""
    rows = [row for row in conversions if row[0] == "packed" and "first ours" in row[4]]
    if not rows:
        return []
    lines = [
        "Plan + first conversion with the real gloo group (packed, a fresh copy of the offsets each time, so nothing "
        "is cached; slowest rank, best of the repetitions, ms), ours against the reference's plan builder and "
        "conversion (`--reference-layout`; its `all_to_all` is one `all_to_all_single`); in brackets the ratio of the "
        "medians:",
        "",
        "| cp | tokens | hidden | ours | reference | ours / reference |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    worst = worst_median = 0.0
    for _, cp, tokens, hidden, ms in rows:
        ratio = ms["first ours"] / ms["first reference"]
        median_ratio = ms["first ours median"] / ms["first reference median"]
        worst, worst_median = max(worst, ratio), max(worst_median, median_ratio)
        lines.append(
            f"| {cp} | {tokens} | {hidden} | {ms['first ours']:.1f} | {ms['first reference']:.1f} | {ratio:.2f} "
            f"({median_ratio:.2f}) |"
        )
    return [
        *lines,
        "",
        f"Worst plan + first conversion, ours / reference: {worst:.2f} (medians {worst_median:.2f}; target <= 1.0).",
        "",
    ]


def _table(conversions: list[tuple], plans: list[tuple], settings: Settings, wall: float) -> str:
    """Render both tables, the target check and the run's conditions as markdown."""
    repetitions = ", ".join(f"{tokens}: {settings.repetitions(tokens)}" for tokens in settings.token_counts)
    lines = [
        "# Layout conversion benchmark",
        "",
        f"`python benchmarks/layout_bench.py{' --quick' if settings.quick else ''}` on "
        f"{os.cpu_count()} CPU cores ({platform.machine()}, shared with other jobs), torch {torch.__version__}, "
        f"gloo over loopback, dtype {str(settings.dtype).removeprefix('torch.')}, one thread per rank, "
        f"interleaved repetitions after one warm-up ({repetitions} by token count; best of the slowest rank), "
        f"wall {wall:.0f} s, load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "Round trip contiguous -> zigzag -> contiguous, ms. Ratios: ours / floor (fresh outputs; in brackets the ratio "
        "of the medians), ours / floor with preallocated outputs, ours / floor with one staging copy per all-to-all "
        "(in brackets the ratio of the medians), ours / naive all-gather.",
        "",
        "| kind | cp | tokens | hidden | ours | floor | floor-prealloc | floor-staged | naive | /floor | /prealloc "
        "| /staged | /naive |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worst_floor = worst_floor_median = worst_naive = worst_staged = 0.0
    worst_short = {kind: {"floor": 0.0, "floor-staged": 0.0} for kind in ("packed-short", "packed-short-aligned")}
    for kind, cp, tokens, hidden, ms in conversions:
        floor_ratio, naive_ratio = ms["ours"] / ms["floor"], ms["ours"] / ms["naive"]
        floor_median_ratio = ms["ours median"] / ms["floor median"]
        staged_ratio = ms["ours"] / ms["floor-staged"]
        if kind in worst_short:
            worst_short[kind] = {
                "floor": max(worst_short[kind]["floor"], floor_ratio),
                "floor-staged": max(worst_short[kind]["floor-staged"], staged_ratio),
            }
        else:
            worst_floor = max(worst_floor, floor_ratio)
            worst_floor_median = max(worst_floor_median, floor_median_ratio)
            worst_staged = max(worst_staged, staged_ratio)
        if tokens >= 32768:
            worst_naive = max(worst_naive, naive_ratio)
        lines.append(
            f"| {kind} | {cp} | {tokens} | {hidden} | {ms['ours']:.1f} | {ms['floor']:.1f} | "
            f"{ms['floor-prealloc']:.1f} | {ms['floor-staged']:.1f} | {ms['naive']:.1f} | "
            f"{floor_ratio:.2f} ({floor_median_ratio:.2f}) | {ms['ours'] / ms['floor-prealloc']:.2f} | "
            f"{staged_ratio:.2f} ({ms['ours median'] / ms['floor-staged median']:.2f}) | {naive_ratio:.2f} |"
        )
    lines += [
        "",
        f"Dense and packed (2k-token documents), at every size: worst ours / floor = {worst_floor:.2f} (ratio of "
        f"medians {worst_floor_median:.2f}; target <= 1.3); worst ours / floor-staged = {worst_staged:.2f}. "
        f"Packed-short ({SHORT_DOCUMENT_TOKENS}-token documents): worst ours / floor = "
        f"{worst_short['packed-short']['floor']:.2f}, ours / floor-staged = "
        f"{worst_short['packed-short']['floor-staged']:.2f}; the same documents with lengths rounded to multiples of "
        f"2 x cp (no padding slot, so every rank's arrivals land in place): "
        f"{worst_short['packed-short-aligned']['floor']:.2f} and "
        f"{worst_short['packed-short-aligned']['floor-staged']:.2f}. From 32k tokens up: worst ours / naive = "
        f"{worst_naive:.2f} (target <= 0.5).",
        "",
        "Packed plan building inside the gloo runs (`build_thd_cp_layout_plan`, slowest rank, ms): "
        + ", ".join(
            f"cp={cp} {tokens} tokens: {ms['plan']:.1f}"
            for kind, cp, tokens, hidden, ms in conversions
            if kind == "packed" and hidden == settings.hidden_sizes[-1]
        ),
        "",
        *_first_conversion_lines(conversions, settings),
        "THD plan building: one rank's `build_thd_cp_layout_plan` with a stand-in group (no process group), single "
        "thread, median of 7 interleaved runs, ms; the reference is Megatron-LM's builder (`--reference-layout`):",
        "",
        "| tokens | sequences | cp | ours | reference | ours / reference |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for tokens, sequences, cp, ours, reference in plans:
        versus = "" if reference is None else f"{reference:.1f} | {ours / reference:.2f}"
        lines.append(f"| {tokens} | {sequences} | {cp} | {ours:.1f} | {versus or 'not run |'} |")
    target = [row for row in plans if row[:3] == (262144, 2048, 8)]
    if target and target[0][4] is not None:
        ratio = target[0][3] / target[0][4]
        lines += ["", f"256k tokens / 2k sequences / cp=8: {ratio:.2f} x the reference's time (target <= 0.5)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark, print the table and save it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to save the markdown table")
    parser.add_argument(
        "--reference-layout", type=Path, help="Megatron-LM's context_parallel/layout.py, to time its plan builder too"
    )
    arguments = parser.parse_args()
    settings = _settings(arguments.quick)
    start = time.perf_counter()
    reference = _load_reference_layout(arguments.reference_layout)
    if reference is not None:
        _REFERENCE["module"] = reference
    plans = _plan_building_rows(settings, reference)
    conversions = _conversion_rows(settings)
    table = _table(conversions, plans, settings, time.perf_counter() - start)
    print(table)
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(table)


if __name__ == "__main__":
    main()
