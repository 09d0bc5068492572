"""Benchmark the main job's data preparation: read + tokenise + pack a generated JSONL corpus, and first-fit packing
against the plain scan it replaced.

1. A JSONL file of ``--size-mb`` megabytes (default 1024) is written to a temporary folder: text documents of
   lognormal length (median about 1.5 KB, 1 in 200 from 50 to 500 KB), one in ten a prompt/completion pair (so a
   target mask is written too), words with some non-ASCII ones. It is not timed.
2. A fresh process runs ``PackedTextDataModule.prepare_data`` with the byte tokeniser into a temporary cache (what
   local rank 0 does): wall time of each phase (read + tokenise, split + pack) and its peak RSS.
3. Another fresh process runs ``setup`` on that cache (what every other rank does): wall time, peak RSS, and the
   time per sample of reading 10,000 random packs.
4. ``first_fit`` against the plain first-fit scan (a copy of the previous implementation), on inputs where the scan
   takes a few seconds: one long document, and many documents of the corpus's lengths; the bins are compared.

Run: ``python benchmarks/packing_bench.py`` (``--size-mb 64`` for a short run); the table is printed and, unless
``--no-save``, written to ``benchmarks/results/packing_bench.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "packing_bench.md"
WORDS_ASCII = 4000
BATCH = 256
UNICODE_WORDS = ["naïve", "café", "Straße", "München", "東京", "данные", "λόγος", "✓", "🙂", "façade"]


def corpus_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    """Document lengths in characters: lognormal (median about 1.5 K), 1 in 200 from 50 K to 500 K."""
    long = rng.random(count) < 0.005
    return np.where(long, rng.integers(50_000, 500_000, count), rng.lognormal(7.3, 1.0, count)).astype(np.int64)


def generate(path: Path, size_bytes: int, seed: int = 0) -> dict[str, int]:
    """Write a JSONL corpus of about ``size_bytes`` bytes; return how many records and bytes it has."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(1, 10))) for _ in range(WORDS_ASCII)] + UNICODE_WORDS
    pool = " ".join(rng.choice(words, 4_000_000).tolist())
    records = written = 0
    with path.open("w", encoding="utf-8") as handle:
        while written < size_bytes:
            lengths = corpus_lengths(rng, BATCH)
            starts = rng.integers(0, len(pool) - 500_000, BATCH)
            lines = []
            for length, start in zip(lengths.tolist(), starts.tolist(), strict=True):
                text = pool[start : start + max(1, length)]
                if rng.random() < 0.1:
                    cut = len(text) // 3
                    record = {"prompt": text[:cut], "completion": text[cut:]}
                else:
                    record = {"text": text}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
            chunk = "".join(lines)
            handle.write(chunk)
            written += len(chunk.encode("utf-8"))
            records += len(lines)
    return {"records": records, "bytes": path.stat().st_size}


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_parts_mb() -> dict[str, float]:
    """Resident memory now: anonymous (this process's own) and file-backed (mapped cache pages, shared by every
    process mapping the same file and dropped by the kernel under pressure)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}


def worker_prepare(corpus: str, cache: str, tokens_per_sample: int) -> dict[str, float]:
    """Prepare the corpus into the cache as local rank 0 does; time each phase."""
    from lightning_cp.train.data import datamodule as dm_module

    baseline = peak_rss_mb()
    phases: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    dm_module.tokenize_sources = timed("tokenise", dm_module.tokenize_sources)
    dm_module.split_arrays = timed("pack", dm_module.split_arrays)
    dm = dm_module.PackedTextDataModule(sources=[corpus], tokens_per_sample=tokens_per_sample, cache_dir=cache)
    start = time.perf_counter()
    dm.prepare_data()
    total = time.perf_counter() - start
    return {"total_s": total, **{f"{k}_s": v for k, v in phases.items()}, "rss_mb": peak_rss_mb(),
            "baseline_rss_mb": baseline, **rss_parts_mb()}  # fmt: skip


def worker_setup(corpus: str, cache: str, tokens_per_sample: int) -> dict[str, float]:
    """Load the prepared cache as every other rank does; time random sample reads."""
    from lightning_cp.train.data import PackedTextDataModule

    baseline = peak_rss_mb()
    dm = PackedTextDataModule(sources=[corpus], tokens_per_sample=tokens_per_sample, cache_dir=cache)
    start = time.perf_counter()
    dm.setup("fit")
    load = time.perf_counter() - start
    samples = dm.train_samples
    after_setup = rss_parts_mb()["RssAnon"]
    picks = np.random.default_rng(0).integers(0, len(samples), 10_000).tolist()
    start = time.perf_counter()
    tokens = sum(samples[i].num_tokens for i in picks)
    read = time.perf_counter() - start
    return {"setup_s": load, "read_us": read / len(picks) * 1e6, "rss_mb": peak_rss_mb(),
            "baseline_rss_mb": baseline, "train_packs": len(samples), "val_packs": len(dm.val_samples),
            "mean_fill": tokens / len(picks), "anon_after_setup_mb": after_setup, **rss_parts_mb()}  # fmt: skip


def run_worker(kind: str, corpus: Path, cache: Path, tokens_per_sample: int) -> dict[str, float]:
    """Run one worker in a fresh process; return what it measured."""
    command = [sys.executable, __file__, "--worker", kind, str(corpus), str(cache), str(tokens_per_sample)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def scan_first_fit(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """The previous first-fit: each piece scans every bin from the first (O(bins) per piece)."""
    bins: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    for doc, length in enumerate(lengths):
        for start in range(0, length, budget):
            piece = (doc, start, min(start + budget, length))
            size = piece[2] - piece[1]
            target = next((i for i, free in enumerate(room) if free >= size), None)
            if target is None:
                bins.append([])
                room.append(budget)
                target = len(bins) - 1
            bins[target].append(piece)
            room[target] -= size
    return bins


def compare_first_fit(budget: int) -> list[dict[str, object]]:
    """Time the scan and ``first_fit`` on the same inputs; check they give the same bins."""
    from lightning_cp.train.data import first_fit

    rng = np.random.default_rng(1)
    cases = {
        "one document of 32M tokens": [32_000_000],
        "5,000 documents, corpus lengths": corpus_lengths(rng, 5_000).tolist(),
    }
    rows = []
    for name, lengths in cases.items():
        start = time.perf_counter()
        old = scan_first_fit(lengths, budget)
        old_s = time.perf_counter() - start
        start = time.perf_counter()
        new = first_fit(lengths, budget)
        new_s = time.perf_counter() - start
        same = old == [[(p.doc, p.start, p.end) for p in b] for b in new]
        rows.append({"case": name, "pieces": sum(map(len, new)), "bins": len(new), "old_s": old_s, "new_s": new_s,
                     "same": same})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024.0, help="corpus size in MB (2**20 bytes)")
    ap.add_argument("--tokens-per-sample", type=int, default=1024)
    ap.add_argument("--no-save", action="store_true", help="print the table only")
    ap.add_argument("--worker", nargs=4, metavar=("KIND", "CORPUS", "CACHE", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, corpus, cache, tokens = args.worker
        fn = worker_prepare if kind == "prepare" else worker_setup
        print(json.dumps(fn(corpus, cache, int(tokens))))
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="packing_bench.") as folder:
        corpus, cache = Path(folder) / "corpus.jsonl", Path(folder) / "cache"
        start = time.perf_counter()
        made = generate(corpus, int(args.size_mb * 2**20))
        generate_s = time.perf_counter() - start
        prepared = run_worker("prepare", corpus, cache, args.tokens_per_sample)
        cache_mb = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 2**20
        loaded = run_worker("setup", corpus, cache, args.tokens_per_sample)
    scan = compare_first_fit(args.tokens_per_sample)
    mb = made["bytes"] / 2**20
    lines = [
        "# Data preparation benchmark",
        "",
        f"`python benchmarks/packing_bench.py --size-mb {args.size_mb:g}` on {os.cpu_count()} CPU cores "
        f"({platform.machine()}, shared with other jobs), Python {platform.python_version()}, numpy {np.__version__}; "
        f"wall {time.perf_counter() - started:.0f} s (generating the corpus: {generate_s:.0f} s, not counted below).",
        "",
        f"Corpus: {mb:,.0f} MB of JSONL, {made['records']:,} records (1 in 10 prompt/completion), byte tokeniser, "
        f"data.tokens_per_sample={args.tokens_per_sample}, data.val_fraction=0.1. Peak RSS is the process's high-water "
        "mark; `after imports` is that mark before the work started.",
        "",
        "| step | wall s | MB/s | peak RSS MB | RSS after imports MB | at the end: anonymous / file-backed MB |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| read + tokenise (into the cache) | {prepared['tokenise_s']:.1f} | {mb / prepared['tokenise_s']:.0f} "
        "| | | |",
        f"| split + pack (train and val) | {prepared['pack_s']:.1f} | {mb / prepared['pack_s']:.0f} | | | |",
        f"| `prepare_data` total (local rank 0) | {prepared['total_s']:.1f} | {mb / prepared['total_s']:.0f} | "
        f"{prepared['rss_mb']:.0f} | {prepared['baseline_rss_mb']:.0f} | "
        f"{prepared['RssAnon']:.0f} / {prepared['RssFile']:.0f} |",
        f"| `setup` from the cache (every rank), then 10,000 random packs read | {loaded['setup_s']:.2f} | | "
        f"{loaded['rss_mb']:.0f} | {loaded['baseline_rss_mb']:.0f} | "
        f"{loaded['RssAnon']:.0f} / {loaded['RssFile']:.0f} |",
        "",
        f"Anonymous memory right after `setup`: {loaded['anon_after_setup_mb']:.0f} MB. The file-backed part is cache "
        "pages mapped while reading (the kernel maps 64 KB around each touched page); the ranks of a node share them.",
        "",
        f"Cache on disk: {cache_mb:,.0f} MB; {loaded['train_packs']:,} training and {loaded['val_packs']:,} validation "
        f"packs, mean fill {loaded['mean_fill']:.1f} of {args.tokens_per_sample} tokens; reading one random pack from "
        f"the memory-mapped cache: {loaded['read_us']:.0f} us.",
        "",
        f"First-fit: the previous scan over every bin against `first_fit` (max-tree), budget {args.tokens_per_sample}, "
        "same input, same process:",
        "",
        "| input | pieces | bins | scan s | first_fit s | scan / first_fit | same bins |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['case']} | {r['pieces']:,} | {r['bins']:,} | {r['old_s']:.2f} | {r['new_s']:.3f} | "
            f"{r['old_s'] / r['new_s']:.0f} | {'yes' if r['same'] else 'NO'} |"
            for r in scan
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
