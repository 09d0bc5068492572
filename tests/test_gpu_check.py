"""The GPU check script's CPU dry run: it writes its report and its exactness checks pass; a wrong kernel fails them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_cp.core.attention import api, kernels
from lightning_cp.train.runfolder import RUN_DIR_ENV
from tests.attention_helpers import fake_varlen

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
EXACTNESS_SECTIONS = ("attention", "group", "mixers")


def _load_script(monkeypatch):
    """Import ``benchmarks/gpu_check.py`` as the module ``gpu_check`` (registered only for this test)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(420)
def test_dry_run_writes_the_report_and_every_exactness_check_passes(tmp_path: Path) -> None:
    out, checks_file = tmp_path / "gpu.md", tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop(RUN_DIR_ENV, None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--json", str(checks_file)],
        capture_output=True, text=True, timeout=360, env=env, check=False,
    )  # fmt: skip
    assert out.exists(), result.stderr[-3000:]
    report = out.read_text()
    assert report.startswith("# GPU check: CPU DRY RUN")
    checks = json.loads(checks_file.read_text())
    exactness = [check for check in checks if check["section"] in EXACTNESS_SECTIONS]
    names = {check["name"] for check in exactness}
    assert {"dense cp=4 math", "packed cp=4 cpu_flash", "layout packed (15 docs) float cp=4"} <= names
    assert any(name.startswith("attention packed cp=2 ulysses") for name in names)
    assert all(check["status"] == "PASS" for check in exactness), [c for c in exactness if c["status"] != "PASS"]
    train = [check for check in checks if check["section"] == "train"]
    assert [check["status"] for check in train] == ["PASS"], train
    assert {check["section"] for check in checks} == {"attention", "group", "mixers", "perf", "train"}
    assert {
        "cp_ssd_scan packed float32",
        "cp_selective_scan one row float32",
        "cp_gated_delta_rule packed bf16 autocast",
        "cp_gated_delta_rule per key channel packed float32",
    } <= names
    assert any(check["name"] == "tile call costs (cpu_flash)" for check in checks), "the fitted tile costs"
    assert result.returncode == 0, report


@pytest.mark.timeout(120)
def test_an_attention_kernel_that_is_slightly_wrong_fails_the_exactness_check(monkeypatch) -> None:
    """Scaling the math kernel's block output by 1% (about two bf16 ulps) must fail; the true kernel passes."""
    gpu_check = _load_script(monkeypatch)
    settings = gpu_check.dry_run_settings(60.0)
    case = gpu_check.make_case(settings, packed=True)
    assert gpu_check.exactness_row(case, 2, "math")[1] == "PASS"

    def scaled_forward(q, k, v, mask, causal, scale):
        out, lse = kernels.math_forward(q, k, v, mask, causal, scale)
        return out * 1.01, lse

    monkeypatch.setitem(api._KERNELS, "math", kernels.BlockKernel("math", scaled_forward, kernels.math_backward))
    row, status, _ = gpu_check.exactness_row(case, 2, "math")
    assert status == "FAIL", row


@pytest.mark.timeout(120)
def test_a_mixer_that_is_slightly_wrong_on_the_device_fails_its_rows(monkeypatch) -> None:
    """A gated delta rule off by 0.1% in float32 (as a device kernel might be) fails its float32 rows; the others
    pass."""
    gpu_check = _load_script(monkeypatch)
    exact = gpu_check.MIXERS["cp_gated_delta_rule"]

    def slightly_wrong(*inputs):
        output = exact(*inputs)
        return output * 1.001 if inputs[0].dtype == torch.float32 else output

    monkeypatch.setitem(gpu_check.MIXERS, "cp_gated_delta_rule", slightly_wrong)
    settings = gpu_check.dry_run_settings(60.0)
    report = gpu_check.Report(settings)
    gpu_check.check_mixers(settings, report, gpu_check.Budget(60.0))
    failed = {check.name for check in report.checks if check.status == "FAIL"}
    assert all(check.detail.startswith("out ") for check in report.checks), "a tolerance failure, not a crash"
    assert failed == {f"cp_gated_delta_rule {kind} {precision}" for kind in ("one row", "packed")
                      for precision in ("float32", "bf16 autocast")}, failed  # fmt: skip
    assert all(check.status == "PASS" for check in report.checks if check.name not in failed)


@pytest.mark.timeout(120)
def test_the_flash_attn_path_is_emulated_exactly_with_every_rank_s_gradients(monkeypatch) -> None:
    """The flash path (a plain-torch stand-in for flash-attn's varlen kernel here) passes, packed at cp=2 and cp=4
    and dense at cp=2, dK/dV summed over the emulated ranks; a 1% error in the kernel fails."""
    gpu_check = _load_script(monkeypatch)
    settings = gpu_check.dry_run_settings(60.0)
    case, dense = gpu_check.make_case(settings, packed=True), gpu_check.make_case(settings, packed=False)
    monkeypatch.setattr(api, "flash_attn_varlen_func", lambda: fake_varlen)
    rows = [gpu_check.exactness_row(case, cp, "flash_attn") for cp in (2, 4)] + [
        gpu_check.exactness_row(dense, 2, "flash_attn")
    ]
    assert [status for _, status, _ in rows] == ["PASS"] * 3, rows
    monkeypatch.setattr(api, "flash_attn_varlen_func", lambda: lambda *a, **kw: fake_varlen(*a, **kw) * 1.01)
    row, status, _ = gpu_check.exactness_row(case, 2, "flash_attn")
    assert status == "FAIL", row


@pytest.mark.timeout(180)
def test_a_backend_that_raises_fails_its_rows_and_the_other_backends_still_report(monkeypatch) -> None:
    """A kernel that raises (as an untried GPU kernel may) fails its own rows, with its traceback in the report; the
    other backend's rows are still measured and pass."""
    gpu_check = _load_script(monkeypatch)
    settings = gpu_check.dry_run_settings(60.0)

    def broken_forward(q, k, v, mask, causal, scale):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setitem(api._KERNELS, "math", kernels.BlockKernel("math", broken_forward, kernels.math_backward))
    report = gpu_check.Report(settings)
    gpu_check.check_attention(settings, report, gpu_check.Budget(60.0))
    statuses = {check.name: (check.status, check.detail) for check in report.checks}
    math_rows = {name: result for name, result in statuses.items() if name.endswith(" math")}
    flash_rows = {name: result for name, result in statuses.items() if name.endswith(" cpu_flash")}
    assert len(math_rows) == len(flash_rows) == 2 * len(settings.exact_cps)
    assert all(status == "FAIL" and "no kernel image" in detail for status, detail in math_rows.values()), math_rows
    assert all(status == "PASS" for status, _ in flash_rows.values()), flash_rows
    assert "no kernel image for this device" in report.markdown() and report.failures


class _Finished:
    """A stand-in for a group process that has exited with ``exitcode``."""

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode


def test_a_group_rank_that_dies_without_reporting_ends_the_wait(monkeypatch) -> None:
    """The group waits for every rank's report; a rank that died (a crash, a kill) ends the wait within seconds
    instead of at the group's timeout, and a report still on its way is taken."""
    import queue

    gpu_check = _load_script(monkeypatch)
    reports = queue.Queue()
    reports.put((0, ["rank 0's records"]))
    with pytest.raises(RuntimeError, match=r"group rank 1 died without reporting \(exit code -9\)"):
        gpu_check.wait_for_group([_Finished(0), _Finished(-9)], reports, timeout=600)
    reports.put((1, ["rank 1's records"]))
    reports.put((0, ["rank 0's records"]))
    outcomes = gpu_check.wait_for_group([_Finished(0), _Finished(1)], reports, timeout=600)
    assert outcomes == {0: ["rank 0's records"], 1: ["rank 1's records"]}
