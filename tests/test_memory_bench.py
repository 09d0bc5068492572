"""The memory benchmark's search guesses, fitted line and report merging (a run of some parts keeps the others')."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import ``benchmarks/memory_bench.py`` (and its ``train_bench`` import), registered only for this test."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "train_bench", raising=False)
    spec = importlib.util.spec_from_file_location("memory_bench", BENCHMARKS / "memory_bench.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "memory_bench", module)
    spec.loader.exec_module(module)
    return module


def point(peak: float, fits: bool, complete: bool = True) -> dict:
    """Return a search trial's result as ``run_trial`` gives it (the fields the search reads)."""
    return {"peak_mib": peak, "fits": fits, "complete": complete}


@pytest.mark.timeout(60)
def test_guesses_halve_after_a_lone_failure_and_follow_a_given_slope(bench):
    assert bench.next_guess({4096: point(900.0, False, complete=False)}, 800.0, 4096, 256, 256) == 2048
    one_fit = {1024: point(600.0, True)}
    # through the origin: 1024 * 800 / 600 = 1365 -> 1280; with 0.1 MiB per token: 1024 + 200 / 0.1 = 3024 -> 2816
    assert bench.next_guess(one_fit, 800.0, 1024, 256, 256) == 1280
    assert bench.next_guess(one_fit, 800.0, 1024, 256, 256, slope=0.1) == 2816
    assert bench.next_guess(one_fit, 800.0, 1024, 256, 256, slope=0.001) == 4096  # at most four times the fit


@pytest.mark.timeout(60)
def test_fitted_line_meets_the_cap_inside_the_bracket(bench):
    line = {x: point(100.0 + 0.5 * x, 100.0 + 0.5 * x <= 700.0) for x in (256, 768, 1024, 1536)}
    found = {"points": {str(x): p for x, p in line.items()}, "largest_fit": 1024, "smallest_failure": 1536}
    slope, intercept, at_cap = bench.fitted_line(found, 700.0)
    assert slope == pytest.approx(0.5) and intercept == pytest.approx(100.0) and at_cap == pytest.approx(1200.0)
    assert bench.fitted_line(found, 2000.0)[2] == 1536  # never past the smallest failure
    only_one = {"points": {"256": point(228.0, True)}, "largest_fit": 256, "smallest_failure": None}
    assert bench.fitted_line(only_one, 700.0) is None


@pytest.mark.timeout(60)
def test_a_run_of_some_parts_keeps_the_other_parts_text_and_data(bench, tmp_path):
    out = tmp_path / "train_bench.md"
    sweep = "# sweep\n\nrows\n"
    out.write_text(f"{sweep}\n{bench.SECTION}\n\n## old main\n\n{bench.VOCAB_MARK}\n\n### old vocab\n")
    out.with_suffix(".json").write_text(json.dumps({"sequence_sweep": [1], "memory": {"part1": 1, "vocab": 2}}))

    vocab_only = bench.merged_section(out, None, "### new vocab\n")
    assert vocab_only == f"## old main\n\n{bench.VOCAB_MARK}\n\n### new vocab\n"
    assert bench.merged_data(out, None, {"seq": 3}) == {"part1": 1, "vocab": {"seq": 3}}

    main_only = bench.merged_section(out, "## new main\n", None)
    assert main_only == f"## new main\n\n{bench.VOCAB_MARK}\n\n### old vocab\n"
    assert bench.merged_data(out, {"part1": 4}, None) == {"part1": 4, "vocab": 2}

    bench.save_results(out, "memory", bench.merged_data(out, None, {"seq": 3}), vocab_only)
    assert out.read_text().startswith(sweep) and out.read_text().endswith("### new vocab\n")
    assert json.loads(out.with_suffix(".json").read_text())["sequence_sweep"] == [1]


@pytest.mark.timeout(60)
def test_no_old_report_gives_just_the_new_parts(bench, tmp_path):
    out = tmp_path / "train_bench.md"
    assert bench.merged_section(out, None, "### vocab\n") == f"{bench.VOCAB_MARK}\n\n### vocab\n"
    assert bench.merged_section(out, "## main\n", None) == "## main\n"
    assert bench.merged_data(out, {"part1": 1}, None) == {"part1": 1}
