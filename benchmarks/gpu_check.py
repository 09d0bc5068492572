"""GPU check: exactness of the attention backends and of the layout on the device, compute-side efficiency of each
rank's attention work, and a short run of the main job, in one markdown report.

Sections (``--sections``, comma-separated; default all):

- ``attention``: every library backend in bf16 against a float32 reference, dense and packed, through the public
  ``zigzag_attention`` at cp=1 and, for cp > 1, through each rank's local work run in this process
  (``emulated_rank_attention``: the training tiles with every rank's K/V given); judged against SDPA-bf16's own error.
- ``group``: a real gloo group of 4 processes on the device: layout round trips (``lightning_cp.layout``) compared
  bit for bit, and the public ``zigzag_attention`` over the group (cp=4 and cp=2).
- ``mixers``: ``cp_causal_conv1d``, ``cp_ssd_scan``, ``cp_selective_scan`` and ``cp_gated_delta_rule`` (decays per
  head and per key channel; forward and backward) on the device in float32 and under a bf16 autocast, each row one
  document and packed documents under a one-process step, against float64 on the CPU.
- ``perf``: each rank's forward+backward attention time at cp=2/4/8 versus flash-attn (or SDPA) on the whole sequence
  divided by cp, dense and packed.
- ``train``: the main job ``lightning-cp fit --config gpu`` at cp=1 for a few steps; whether it ran and its losses.

    python benchmarks/gpu_check.py                                  # one GPU, 7 minutes at most, results/gpu.md
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_dry.md  # CPU, tiny sizes, the same code paths

Each section records its failure in the report and the next one runs; the report is rewritten after each section.
The exit code is 1 when a judged check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning_cp.attention as attention
import lightning_cp.layout as layout
from lightning_cp import (
    ContextParallelRuntime,
    ContextParallelSetting,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_selective_scan,
    cp_ssd_scan,
)
from lightning_cp.core import comm
from lightning_cp.core.attention import kernels
from lightning_cp.core.zigzag import ZigzagGeometry
from lightning_cp.packed import PackedSeqParams
from lightning_cp.train.data.datamodule import CACHE_ENV
from lightning_cp.train.runfolder import METRICS_FILE, RUN_DIR_ENV, loss_series, read_metrics

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.md"
SECTIONS = ("attention", "group", "mixers", "perf", "train")
RMS_RATIO_LIMIT = 2.0
MAX_RATIO_LIMIT = 4.0
EFFICIENCY_TARGET = 0.9
GRADIENTS = ("out", "dq", "dk", "dv")
Error = tuple[float, float, int]  # largest absolute error, sum of squared errors, number of values
NO_ERROR: Error = (math.inf, math.inf, 1)


@dataclass(frozen=True)
class Settings:
    """Sizes and limits of one run (GPU or CPU dry run); plain values so spawned workers receive them pickled."""

    dry_run: bool
    device: str
    dtype: str
    exact_dense_tokens: int
    exact_batch: int
    exact_packed_tokens: int
    exact_heads: tuple[int, int]
    exact_head_dim: int
    exact_cps: tuple[int, ...]
    group_size: int
    perf_tokens: tuple[int, ...]
    perf_heads: int
    perf_head_dim: int
    perf_cps: tuple[int, ...]
    cost_rows: tuple[int, ...]
    warmup: int
    iters: int
    budget_s: float
    group_timeout_s: float
    train_timeout_s: float
    train_overrides: tuple[str, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The attention dtype as a torch dtype."""
        return getattr(torch, self.dtype)


TRAIN_COMMON = (
    "--config", "gpu", "strategy.context_parallel_size=1", "trainer.devices=1",
    "trainer.enable_progress_bar=false", "run.name=gpu-check",
)  # fmt: skip


def gpu_settings(budget_s: float) -> Settings:
    """One H200: 32 heads x 128 in bf16 for the timings, 32k and 128k tokens; the main job at its real size."""
    return Settings(
        dry_run=False, device="cuda", dtype="bfloat16",
        exact_dense_tokens=2048, exact_batch=2, exact_packed_tokens=3000, exact_heads=(4, 2), exact_head_dim=128,
        exact_cps=(1, 2, 4, 8), group_size=4,
        perf_tokens=(32768, 131072), perf_heads=32, perf_head_dim=128, perf_cps=(2, 4, 8),
        cost_rows=(64, 256, 1024, 2048, 4096), warmup=2, iters=3,
        budget_s=budget_s, group_timeout_s=240.0, train_timeout_s=240.0,
        train_overrides=(
            *TRAIN_COMMON, "trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.limit_val_batches=2",
        ),
    )  # fmt: skip


def dry_run_settings(budget_s: float) -> Settings:
    """CPU: the same code paths with tiny sizes (bf16 still, the CPU kernels support it) and a tiny model."""
    return Settings(
        dry_run=True, device="cpu", dtype="bfloat16",
        exact_dense_tokens=96, exact_batch=2, exact_packed_tokens=160, exact_heads=(4, 2), exact_head_dim=16,
        exact_cps=(1, 2, 4), group_size=4,
        perf_tokens=(512, 1024), perf_heads=2, perf_head_dim=16, perf_cps=(2, 4), cost_rows=(8, 16, 32, 64),
        warmup=1, iters=2,
        budget_s=budget_s, group_timeout_s=120.0, train_timeout_s=120.0,
        train_overrides=(
            *TRAIN_COMMON, "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.accelerator=cpu", "strategy.process_group_backend=gloo", "data.tokens_per_sample=256",
            "data.num_workers=0", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
            "model.num_kv_heads=2", "model.intermediate_size=128",
        ),
    )  # fmt: skip


# The report.


@dataclass
class Check:
    """One judged (or informational) result: ``status`` is PASS, FAIL, SKIP or INFO."""

    section: str
    name: str
    status: str
    detail: str = ""


@dataclass
class Report:
    """Checks, per-section markdown and failures, written as one markdown file (and optionally JSON)."""

    settings: Settings
    started: float = field(default_factory=time.perf_counter)
    checks: list[Check] = field(default_factory=list)
    parts: dict[str, list[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, section: str, name: str, status: str, detail: str = "") -> None:
        """Record one check."""
        self.checks.append(Check(section, name, status, detail))

    def text(self, section: str, *lines: str) -> None:
        """Append markdown lines to a section."""
        self.parts.setdefault(section, []).extend(lines)

    def failed(self) -> bool:
        """Whether any check failed."""
        return any(check.status == "FAIL" for check in self.checks)

    def raised(self, section: str, name: str, error: Exception) -> str:
        """Record an exception as a failed check, its traceback under Failures; return its one-line summary."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        summary = f"{type(error).__name__}: {first}"[:300]
        self.add(section, name, "FAIL", summary)
        self.failures.append(f"{section} {name}:\n{traceback.format_exc()[-4000:]}")
        return summary

    def markdown(self) -> str:
        """The whole report."""
        title = "# GPU check" if not self.settings.dry_run else "# GPU check: CPU DRY RUN (not GPU results)"
        lines = [title, "", *environment_lines(self.settings), f"- wall time: {self.elapsed():.0f} s", ""]
        lines += ["## Summary", "", "| section | check | result | detail |", "| --- | --- | --- | --- |"]
        lines += [f"| {c.section} | {c.name} | {c.status} | {c.detail} |" for c in self.checks]
        for section in SECTIONS:
            if section in self.parts:
                lines += ["", *self.parts[section]]
        if self.failures:
            lines += ["", "## Failures", ""]
            lines += [f"```\n{failure}\n```" for failure in self.failures]
        return "\n".join(lines) + "\n"

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def write(self, path: Path, json_path: Path | None) -> None:
        """Write the markdown report (and the checks as JSON)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.markdown())
        if json_path is not None:
            json_path.write_text(json.dumps([asdict(check) for check in self.checks], indent=1))


def environment_lines(settings: Settings) -> list[str]:
    """Device, versions and date."""
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"- date: {now:%Y-%m-%d %H:%M} UTC", f"- command: `{' '.join(sys.argv)}`"]
    if settings.device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        lines.append(f"- device: CPU ({platform.machine()}, {os.cpu_count()} cores)")
    lines.append(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, flash-attn {flash_attn_version()}")
    return lines


def flash_attn_version() -> str:
    """flash-attn's version, or 'not installed'."""
    try:
        import flash_attn
    except ImportError:
        return "not installed"
    return getattr(flash_attn, "__version__", "installed")


class Budget:
    """The wall-clock budget of the whole run: sections and measurements ask what is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.perf_counter()


# Inputs and references shared by the exactness checks.


def exactness_lengths(total: int, seed: int) -> list[int]:
    """Packed document lengths summing to about ``total`` (a multiple of 4, so the contiguous stream splits over cp=2
    and cp=4): 1-token and short documents, lengths not divisible by 2*cp, and one long document."""
    rng = random.Random(seed)
    lengths = [1, 15, 2, 17, total // 3]
    while sum(lengths) < total:
        lengths.append(rng.randint(1, max(2, total // 10)))
    lengths[-1] += (-sum(lengths)) % 4
    rng.shuffle(lengths)
    return lengths


def zigzag_index(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Global token index of every zigzag slot of ``rank`` (``-1`` for padding), written from the layout rule: each
    sequence padded to a multiple of 2*cp, the rank holding chunks ``rank`` and ``2cp-1-rank`` of every sequence."""
    index, offset = [], 0
    for length in lengths:
        chunk = -(-length // (2 * cp))
        for chunk_id in (rank, 2 * cp - 1 - rank):
            index += [offset + p if p < length else -1 for p in range(chunk_id * chunk, (chunk_id + 1) * chunk)]
        offset += length
    return torch.tensor(index, dtype=torch.int64)


def document_ids(lengths: Sequence[int]) -> torch.Tensor:
    """Document id of every token of the concatenated documents."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention within documents on ``[S, B, H, D]`` in float32, written out with a mask."""
    q, k, v = (x.float() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[2] // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    mask = (doc.unsqueeze(1) == doc.unsqueeze(0)) & torch.ones(doc.shape[0], doc.shape[0], dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask.to(q.device), -math.inf), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """PyTorch's SDPA on the whole ``[S, B, H, D]`` sequence, one causal call per document (the baseline)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    pieces = zip(*(x.permute(1, 2, 0, 3).split(list(lengths), dim=2) for x in (q, k, v)), strict=True)
    out = torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in pieces], dim=2)
    return out.permute(2, 0, 1, 3)


def forward_backward(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], dout: torch.Tensor) -> dict:
    """Run ``fn`` on fresh leaves of ``inputs``, backward ``dout``; return the output and the input gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


@dataclass
class Case:
    """One layout's global inputs ``[S, B, H, D]``, its float32 reference results and SDPA's error against them."""

    packed: bool
    lengths: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    reference: dict[str, torch.Tensor]
    baseline_error: dict[str, Error]


def make_case(settings: Settings, packed: bool) -> Case:
    """Seeded inputs (the same in every process), the float32 reference and the SDPA baseline error."""
    lengths = exactness_lengths(settings.exact_packed_tokens, 7) if packed else [settings.exact_dense_tokens]
    batch, (hq, hkv), dim = (1 if packed else settings.exact_batch), settings.exact_heads, settings.exact_head_dim
    generator = torch.Generator().manual_seed(11 + packed)
    total = sum(lengths)
    shapes = [(total, batch, h, dim) for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = (torch.randn(s, generator=generator).to(settings.torch_dtype).to(settings.device) for s in shapes)
    doc = document_ids(lengths)
    reference = forward_backward(
        lambda a, b, c: reference_attention(a, b, c, doc), [x.float() for x in (q, k, v)], dout.float()
    )
    baseline = forward_backward(lambda a, b, c: sdpa_attention(a, b, c, lengths), [q, k, v], dout)
    errors = {name: error_of(baseline[name], reference[name]) for name in GRADIENTS}
    return Case(packed, lengths, q, k, v, dout, reference, errors)


def error_of(got: torch.Tensor, expected: torch.Tensor) -> Error:
    """Absolute error of ``got`` against ``expected`` (in float32): largest, sum of squares and count."""
    difference = (got.float() - expected.float()).abs()
    largest = difference.max().item() if difference.numel() else 0.0
    return largest, difference.square().sum().item(), difference.numel()


def combined(a: Error, b: Error) -> Error:
    """The error of two sets of values together."""
    return max(a[0], b[0]), a[1] + b[1], a[2] + b[2]


def rms(error: Error) -> float:
    """Root-mean-square error."""
    return math.sqrt(error[1] / max(error[2], 1))


def shard(x: torch.Tensor, index: torch.Tensor, packed: bool) -> torch.Tensor:
    """A rank's slots of a global ``[S, B, H, D]`` tensor, zeros in padding; ``[T, H, D]`` when packed."""
    index = index.to(x.device)
    local = torch.where((index >= 0).view(-1, 1, 1, 1), x[index.clamp(min=0)], 0)
    return local.squeeze(1) if packed else local


def packed_params(lengths: Sequence[int], cp: int, device: str) -> PackedSeqParams:
    """Zigzag-side packed metadata: actual offsets and offsets of every document padded to a multiple of 2*cp."""
    padded = [-(-n // (2 * cp)) * (2 * cp) for n in lengths]
    cu, cu_padded = (offsets(x, device) for x in (lengths, padded))
    return PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=max(padded))


def offsets(lengths: Sequence[int], device: str | torch.device) -> torch.Tensor:
    """int32 cumulative offsets ``[0, l0, l0 + l1, ...]`` on ``device``."""
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32, device=device)


def slot_errors(name: str, got: torch.Tensor, case: Case, index: torch.Tensor) -> tuple[Error, str]:
    """Error of one rank's slots of ``name`` against the reference, and a problem found in them ('' if none)."""
    got = got.unsqueeze(1) if case.packed else got
    valid = (index >= 0).to(got.device)
    if not torch.isfinite(got).all():
        return NO_ERROR, f"{name} has non-finite values"
    if name == "out" and bool((got[~valid] != 0).any()):
        return NO_ERROR, "the output is nonzero in padding slots"
    return error_of(got[valid], case.reference[name][index[index >= 0].to(got.device)]), ""


def judge(errors: dict[str, Error], baseline: dict[str, Error], problems: Sequence[str]) -> tuple[str, str, str]:
    """Status, per-quantity cells ``max/rms (max ratio/rms ratio)`` and a one-line detail of one exactness check."""
    max_ratio = {n: errors[n][0] / max(baseline[n][0], 1e-30) for n in GRADIENTS}
    rms_ratio = {n: rms(errors[n]) / max(rms(baseline[n]), 1e-30) for n in GRADIENTS}
    passed = not problems and all(
        max_ratio[n] <= MAX_RATIO_LIMIT and rms_ratio[n] <= RMS_RATIO_LIMIT for n in GRADIENTS
    )
    cells = " | ".join(
        f"{errors[n][0]:.1e}/{rms(errors[n]):.1e} ({max_ratio[n]:.2f}/{rms_ratio[n]:.2f})" for n in GRADIENTS
    )
    detail = "; ".join(sorted(set(problems))) or (
        f"worst ratio to SDPA: max {max(max_ratio.values()):.2f}, rms {max(rms_ratio.values()):.2f}"
    )
    return "PASS" if passed else "FAIL", cells, detail


def library_backends(device: str) -> list[str]:
    """The library's attention kernels usable on ``device``: torch's CUDA kernels, flash-attn (when installed) and
    math on CUDA, the CPU flash kernel and math on CPU."""
    if device == "cpu":
        return ["math", "cpu_flash"]
    return ["math", "cuda_sdpa", *(["flash_attn"] if attention.flash_attn_varlen_func() is not None else [])]


# One rank's local attention work, run in this process.


def rank_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_all: torch.Tensor,
    sent: torch.Tensor,
    geometry: ZigzagGeometry,
    rank: int,
    *,
    packed: bool,
    kernel: str,
    gathered: torch.Tensor | None = None,
) -> torch.Tensor:
    """CP rank ``rank``'s attention as the library runs it with mode='allgather', in this process without a group:
    ``kv_all`` (``[cp, 2, *k.shape]``) holds every rank's K/V in their local layout. Autograd gives dQ and this
    rank's share of its own dK/dV; its shares of the other ranks' dK/dV are added into ``sent`` (what a group would
    send to their owners). The library kernels run the same tiles and key pieces as training; the flash-attn path,
    which all-gathers K/V whole, gets this rank's K/V and the others' (``gathered_kv``) from its all-gather, and
    with ``gathered`` prepared once (timing) their gradient is computed but not collected."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel != "flash_attn":
        library_kernel = attention._KERNELS[kernel]
        plan = attention._block_plan(geometry, rank, True, q.device, kernels.plan_profile(library_kernel))
        return attention.emulated_rank_attention(q, k, v, kv_all, sent, plan, scale=scale, kernel=library_kernel)
    perms = [attention._device_perm(tokens, q.device) for tokens in geometry.rank_tokens]  # (perm, inverse) each
    others = gathered if gathered is not None else gathered_kv(kv_all, geometry, packed)

    def send_back(grad: torch.Tensor) -> None:
        for src in range(geometry.cp_size):
            if src == rank:  # this rank's own share reaches k and v through autograd
                continue
            for part in (0, 1):
                sent[src, part] += attention._from_internal(grad[src, part], packed, perms[src][1]).to(sent.dtype)

    def gather(kv: torch.Tensor, group: object) -> torch.Tensor:
        return torch.cat([others[:rank], kv.unsqueeze(0), others[rank + 1 :]])

    if gathered is None:
        others.register_hook(send_back)
    with mock.patch.object(comm, "all_gather_stack", gather):
        return attention._flash_attention(q, k, v, None, geometry.rank_tokens, rank, packed, True, scale)


def gathered_kv(kv_all: torch.Tensor, geometry: ZigzagGeometry, packed: bool) -> torch.Tensor:
    """What the flash path's all-gather returns: every rank's K/V in the kernels' half-major layout, stacked (a leaf
    that collects their gradient)."""
    perms = [attention._device_perm(tokens, kv_all.device)[0] for tokens in geometry.rank_tokens]
    pairs = zip(kv_all, perms, strict=True)
    internal = [torch.stack([attention._to_internal(x, packed, perm) for x in kv]) for kv, perm in pairs]
    return torch.stack(internal).requires_grad_()


def stacked_kv(shards: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V stacked ``[cp, 2, ...]`` (what the ranks exchange), and zeroed ``sent`` gradients."""
    kv_all = torch.stack([torch.stack([k, v]) for k, v in shards])
    return kv_all, torch.zeros_like(kv_all)


def geometry_of(case_lengths: Sequence[int], cp: int, packed: bool) -> ZigzagGeometry:
    """The library's geometry of one batch at ``cp``."""
    if packed:
        return ZigzagGeometry.packed(cp, list(case_lengths))
    return ZigzagGeometry.dense(cp, case_lengths[0])


# (a) Exactness in one process.


def emulated_ranks(case: Case, cp: int, kernel: str) -> tuple[dict[str, Error], list[str]]:
    """Every rank's local work at ``cp``; dK/dV summed over ranks as the group's exchange does."""
    geometry = geometry_of(case.lengths, cp, case.packed)
    indexes = [zigzag_index(case.lengths, cp, rank) for rank in range(cp)]
    shards = [[shard(x, index, case.packed) for x in (case.q, case.k, case.v, case.dout)] for index in indexes]
    kv_all, sent = stacked_kv([(s[1], s[2]) for s in shards])
    errors: dict[str, Error] = dict.fromkeys(GRADIENTS, (0.0, 0.0, 0))
    problems: list[str] = []
    own_grads = []
    for rank, (q, k, v, dout) in enumerate(shards):
        q_leaf, k_leaf, v_leaf = (x.clone().requires_grad_() for x in (q, k, v))
        out = rank_attention(q_leaf, k_leaf, v_leaf, kv_all, sent, geometry, rank, packed=case.packed, kernel=kernel)
        out.backward(dout)
        own_grads.append((k_leaf.grad, v_leaf.grad))
        for name, got in (("out", out.detach()), ("dq", q_leaf.grad)):
            error, problem = slot_errors(name, got, case, indexes[rank])
            errors[name], problems = combined(errors[name], error), problems + [problem] * bool(problem)
    for rank in range(cp):
        for name, part in (("dk", 0), ("dv", 1)):
            got = own_grads[rank][part] + sent[rank, part]
            error, problem = slot_errors(name, got, case, indexes[rank])
            errors[name], problems = combined(errors[name], error), problems + [problem] * bool(problem)
    return errors, problems


def public_entry_cp1(case: Case, kernel: str) -> tuple[dict[str, Error], list[str]]:
    """The public ``zigzag_attention`` with no CP group (one rank), on the zigzag-padded sequence."""
    index = zigzag_index(case.lengths, 1, 0)
    q, k, v, dout = (shard(x, index, case.packed) for x in (case.q, case.k, case.v, case.dout))
    params = packed_params(case.lengths, 1, case.q.device.type) if case.packed else None
    results = forward_backward(
        lambda a, b, c: attention.zigzag_attention(a, b, c, None, packed_seq_params=params, backend=kernel),
        [q, k, v],
        dout,
    )
    errors, problems = {}, []
    for name in GRADIENTS:
        errors[name], problem = slot_errors(name, results[name], case, index)
        problems += [problem] * bool(problem)
    return errors, problems


def exactness_row(case: Case, cp: int, kernel: str) -> tuple[str, str, str]:
    """One (layout, cp, kernel) check: its table row, status and detail."""
    errors, problems = public_entry_cp1(case, kernel) if cp == 1 else emulated_ranks(case, cp, kernel)
    status, cells, detail = judge(errors, case.baseline_error, problems)
    entry = "zigzag_attention (no group)" if cp == 1 else "each rank's local work"
    layout_name = "packed" if case.packed else "dense"
    return f"| {layout_name} | {cp} | {entry} | {kernel} | {cells} | {status} |", status, detail


def check_attention(settings: Settings, report: Report, budget: Budget) -> None:
    """(a) Every backend versus the float32 reference, dense and packed, cp=1 (public entry) and emulated cp > 1."""
    report.text(
        "attention",
        f"## (a) Attention exactness ({settings.dtype}, {settings.device}, causal, Hq/Hkv={settings.exact_heads}, "
        f"D={settings.exact_head_dim})",
        "",
        "Each cell: `max/rms (max ratio/rms ratio)`: the largest and the root-mean-square absolute error against a "
        f"float32 reference computed from the same {settings.dtype} inputs, and each divided by "
        f"SDPA-{settings.dtype}'s own error against the same reference (whole sequence, one call per document). "
        f"Pass: every rms ratio <= {RMS_RATIO_LIMIT:g} and every max ratio <= {MAX_RATIO_LIMIT:g} (largest errors in "
        "bf16 come in whole ulps, so they are the coarser measure), finite values, zero output in padding slots. "
        "cp=1 goes through the public `zigzag_attention` without a group; cp > 1 runs every rank's local work (mode "
        "allgather, the same tiles and key pieces as training) in this process with every rank's K/V given, each "
        "rank's shares of the others' dK/dV summed in the K/V dtype as the group's reduce sums them.",
        "",
    )
    for packed in (False, True):
        case = make_case(settings, packed)
        baseline = " | ".join(f"{case.baseline_error[n][0]:.1e}/{rms(case.baseline_error[n]):.1e}" for n in GRADIENTS)
        report.text(
            "attention",
            f"{'Packed' if packed else 'Dense'}: {len(case.lengths)} document(s), {sum(case.lengths)} tokens; "
            f"SDPA-{settings.dtype} errors max/rms (out; dq; dk; dv): {baseline.replace(' | ', '; ')}",
            "",
            "| layout | cp | entry | backend | out | dq | dk | dv | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        )
        for cp in settings.exact_cps:
            for kernel in library_backends(settings.device):
                name = f"{'packed' if packed else 'dense'} cp={cp} {kernel}"
                try:
                    row, status, detail = exactness_row(case, cp, kernel)
                except Exception as error:  # noqa: BLE001 - one backend's failure must not hide the others' rows
                    cells = f"{'packed' if packed else 'dense'} | {cp} | - | {kernel} | - | - | - | -"
                    report.text("attention", f"| {cells} | FAIL: {report.raised('attention', name, error)} |")
                    continue
                report.text("attention", row)
                report.add("attention", name, status, detail)
        report.text("attention", "")


# (a) Layout and attention over a real process group.


def check_group(settings: Settings, report: Report, budget: Budget) -> None:
    """(a) Spawn a gloo group on the device; layout round trips and the public attention entry over it."""
    if budget.left() < 30:
        report.add("group", "section", "SKIP", "time budget spent")
        return
    timeout = min(settings.group_timeout_s, budget.left())
    outcomes = launch_group(settings, timeout)
    modes = group_modes(settings.device)
    report.text(
        "group",
        f"## (a) Layout and attention over a real process group (gloo, {settings.group_size} processes on one "
        f"{settings.device} device)",
        "",
        "Layout: `contiguous_to_zigzag` / `zigzag_to_contiguous` of dense (seq_dim 0 and 1) and packed (THD plan) "
        f"{settings.dtype} and int64 tensors; the zigzag shard must equal the slots the layout rule names, the round "
        "trip the input, and each conversion's backward the inverse conversion, all bit for bit (`torch.equal`). "
        f"Attention: the public `zigzag_attention` over the group, modes {', '.join(modes)} "
        "(ring needs point-to-point sends, which gloo does not do with CUDA tensors, so it runs on CPU only), judged "
        "like the exactness table above, over the slots of every rank together; detail `max/rms (ratios)` "
        "for out; dq; dk; dv.",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    )
    for name, status, detail, cell in merge_group_outcomes(outcomes):
        report.text("group", f"| {name} | {status} | {cell} |")
        report.add("group", name, status, detail)
    report.text("group", "")


def group_modes(device: str) -> list[str]:
    """Attention modes checked over the group."""
    return ["allgather", "ulysses", *(["ring"] if device == "cpu" else [])]


def wait_for_group(processes: list[Any], results: Any, timeout: float) -> dict[int, Any]:
    """Every rank's outcome by rank; a rank that died without reporting, or the deadline, ends the wait at once."""
    outcomes: dict[int, Any] = {}
    deadline = time.perf_counter() + timeout
    while len(outcomes) < len(processes):
        try:
            rank, outcome = results.get(timeout=5.0)
        except queue.Empty:
            dead = [rank for rank, process in enumerate(processes) if process.exitcode and rank not in outcomes]
            if dead:
                code = processes[dead[0]].exitcode
                raise RuntimeError(f"group rank {dead[0]} died without reporting (exit code {code})") from None
            if time.perf_counter() > deadline:
                done = sorted(outcomes)
                raise TimeoutError(f"the group did not finish within {timeout:.0f} s (ranks done: {done})") from None
            continue
        outcomes[rank] = outcome
    return outcomes


def launch_group(settings: Settings, timeout: float) -> list[list[dict]]:
    """Start the group's processes (spawned: this process may hold a CUDA context) and collect every rank's records."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        context.Process(target=group_worker, args=(rank, settings.group_size, port, settings, results), daemon=True)
        for rank in range(settings.group_size)
    ]
    for process in processes:
        process.start()
    try:
        outcomes = wait_for_group(processes, results, timeout)
    except BaseException:
        for process in processes:  # the others wait in a collective for the one that failed
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failed = [outcome for outcome in outcomes.values() if isinstance(outcome, str)]
    if failed:
        raise RuntimeError(f"a group rank failed:\n{failed[0]}")
    return [outcomes[rank] for rank in range(settings.group_size)]


def group_worker(rank: int, world: int, port: int, settings: Settings, results: Any) -> None:
    """One rank of the group: run every group check and put its records (or the traceback) on ``results``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if settings.device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        records = []
        cases = {packed: make_case(settings, packed) for packed in (False, True)}
        for cp, group in ((world, dist.group.WORLD), (2, pairs[rank // 2])):
            cp_rank = dist.get_rank(group)
            records += layout_records(settings, cp, cp_rank, group)
            for case in cases.values():
                records += group_attention_records(settings, case, cp, cp_rank, group)
        results.put((rank, records))
    except BaseException:  # noqa: BLE001 - the parent must see every failure
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def layout_records(settings: Settings, cp: int, rank: int, group: Any) -> list[dict]:
    """Dense (seq_dim 0 and 1) and packed conversions of a float and an int64 tensor: which comparisons held."""
    records = []
    generator = torch.Generator().manual_seed(3)
    lengths = exactness_lengths(settings.exact_packed_tokens, 5)
    dense_length = 2 * 2 * settings.group_size * 12
    for kind, dtype in (("float", settings.torch_dtype), ("int64", torch.int64)):
        for seq_dim in (0, 1):
            shape = (dense_length, 3, 8) if seq_dim == 0 else (2, dense_length, 8)
            stream = random_tensor(shape, dtype, generator).to(settings.device)
            name = f"layout dense seq_dim={seq_dim} {kind} cp={cp}"
            failed = guarded(lambda s=stream, d=seq_dim: dense_round_trip(s, cp, rank, group, d))
            records.append({"kind": "layout", "name": name, "failed": failed})
        stream = random_tensor((sum(lengths), 6), dtype, generator).to(settings.device)
        name = f"layout packed ({len(lengths)} docs) {kind} cp={cp}"
        failed = guarded(lambda s=stream: packed_round_trip(s, lengths, cp, rank, group))
        records.append({"kind": "layout", "name": name, "failed": failed})
    return records


def guarded(check: Callable[[], list[str]]) -> list[str]:
    """Run a layout check; an exception becomes its failure (gloo fails the same way on every rank, so the group
    goes on to the next check)."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - recorded in the report
        return [f"raised {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Seeded random values of ``dtype`` (integers for int64), the same in every process."""
    if dtype == torch.int64:
        return torch.randint(0, 2**40, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def conversion_failures(
    local: torch.Tensor,
    expected_zigzag: torch.Tensor,
    to_zigzag: Callable[[torch.Tensor], torch.Tensor],
    to_contiguous: Callable[[torch.Tensor], torch.Tensor],
) -> list[str]:
    """Compare a conversion, its round trip and both backwards with what they must be, bit for bit."""
    failures = []
    source = local.clone().requires_grad_() if local.is_floating_point() else local
    zigzag = to_zigzag(source)
    if not torch.equal(zigzag.detach(), expected_zigzag):
        failures.append("zigzag shard differs from the layout rule")
    if not torch.equal(to_contiguous(zigzag.detach()), local):
        failures.append("round trip differs from the input")
    if local.is_floating_point():
        upstream = torch.randn_like(expected_zigzag, dtype=torch.float32).to(local.dtype)
        zigzag.backward(upstream)
        if not torch.equal(source.grad, to_contiguous(upstream)):
            failures.append("backward of contiguous_to_zigzag is not zigzag_to_contiguous")
    return failures


def dense_round_trip(stream: torch.Tensor, cp: int, rank: int, group: Any, seq_dim: int) -> list[str]:
    """A dense sequence: this rank's contiguous slice to zigzag and back."""
    length = stream.shape[seq_dim]
    per_rank = length // cp
    local = stream.narrow(seq_dim, rank * per_rank, per_rank).contiguous()
    expected = stream.index_select(seq_dim, zigzag_index([length], cp, rank).to(stream.device))
    return conversion_failures(
        local,
        expected,
        lambda x: layout.contiguous_to_zigzag(x, group, seq_dim=seq_dim),
        lambda x: layout.zigzag_to_contiguous(x, group, seq_dim=seq_dim),
    )


def packed_round_trip(stream: torch.Tensor, lengths: Sequence[int], cp: int, rank: int, group: Any) -> list[str]:
    """A packed stream: this rank's contiguous slice to the zigzag side of a THD plan and back."""
    total = stream.shape[0]
    cu = offsets(lengths, stream.device)
    plan = layout.build_thd_cp_layout_plan(cu, total, group)
    per_rank = total // cp
    local = stream[rank * per_rank : (rank + 1) * per_rank]
    index = zigzag_index(lengths, cp, rank).to(stream.device)
    expected = torch.where((index >= 0).unsqueeze(1), stream[index.clamp(min=0)], 0)
    return conversion_failures(
        local,
        expected,
        lambda x: layout.contiguous_to_zigzag(x, group, thd_plan=plan),
        lambda x: layout.zigzag_to_contiguous(x, group, thd_plan=plan),
    )


def group_attention_records(settings: Settings, case: Case, cp: int, rank: int, group: Any) -> list[dict]:
    """The public ``zigzag_attention`` over ``group`` for every mode and backend: this rank's slot errors."""
    records = []
    for mode in group_modes(settings.device):
        for backend in library_backends(settings.device):
            if backend == "flash_attn" and mode not in ("allgather", "ulysses"):
                continue
            name = f"attention {'packed' if case.packed else 'dense'} cp={cp} {mode} {backend}"
            errors: dict[str, Error] = dict.fromkeys(GRADIENTS, NO_ERROR)
            problems = guarded(
                lambda m=mode, b=backend, e=errors: group_attention_errors(case, cp, rank, group, m, b, e)
            )
            records.append({"kind": "attention", "name": name, "errors": errors, "problems": problems,
                            "baseline": case.baseline_error})  # fmt: skip
    return records


def group_attention_errors(
    case: Case, cp: int, rank: int, group: Any, mode: str, backend: str, errors: dict[str, Error]
) -> list[str]:
    """Fill ``errors`` with this rank's slot errors of one public ``zigzag_attention`` call; return the problems."""
    index = zigzag_index(case.lengths, cp, rank)
    q, k, v, dout = (shard(x, index, case.packed) for x in (case.q, case.k, case.v, case.dout))
    params = packed_params(case.lengths, cp, case.q.device.type) if case.packed else None
    results = forward_backward(
        lambda a, b, c: attention.zigzag_attention(
            a, b, c, group, packed_seq_params=params, mode=mode, backend=backend
        ),
        [q, k, v],
        dout,
    )
    problems = []
    for name in GRADIENTS:
        errors[name], problem = slot_errors(name, results[name], case, index)
        problems += [problem] * bool(problem)
    return problems


def merge_group_outcomes(outcomes: list[list[dict]]) -> list[tuple[str, str, str, str]]:
    """One (name, status, detail, table cell) per check: layout passes when every rank matched; attention is judged
    on the slots of every rank together."""
    merged = []
    for position, first in enumerate(outcomes[0]):
        records = [rank_records[position] for rank_records in outcomes]
        if first["kind"] == "layout":
            failures = sorted({failure for record in records for failure in record["failed"]})
            detail = "; ".join(failures) or "bit-exact"
            merged.append((first["name"], "FAIL" if failures else "PASS", detail, detail))
            continue
        errors = {n: functools.reduce(combined, (record["errors"][n] for record in records)) for n in GRADIENTS}
        problems = [problem for record in records for problem in record["problems"]]
        status, cells, detail = judge(errors, first["baseline"], problems)
        merged.append((first["name"], status, detail, cells.replace(" | ", "; ")))
    return merged


# (b) Compute-side efficiency.


def timed(fn: Callable[[], None], device: str) -> float:
    """Seconds ``fn`` takes on ``device`` (CUDA events on a GPU)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


def median_time(fn: Callable[[], None], settings: Settings) -> float:
    """Median seconds of ``settings.iters`` runs after ``settings.warmup`` warm-up runs."""
    for _ in range(settings.warmup):
        fn()
    return statistics.median(timed(fn, settings.device) for _ in range(settings.iters))


def perf_lengths(total: int, seed: int) -> list[int]:
    """A packed batch of about ``total`` tokens: a few long documents (total/8..total/4) among short ones (1..512)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(rng.randint(total // 8, total // 4) if rng.random() < 0.25 else rng.randint(1, 512))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def whole_sequence_step(settings: Settings, lengths: Sequence[int], packed: bool) -> tuple[Callable[[], None], str]:
    """Forward+backward of flash-attn (when installed, on CUDA) or SDPA over the whole sequence, and its name."""
    heads, dim, device, dtype = settings.perf_heads, settings.perf_head_dim, settings.device, settings.torch_dtype
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, heads, dim, device=device, dtype=dtype)
    flash = device == "cuda" and attention.flash_attn_varlen_func() is not None
    if flash:
        cu = offsets(lengths, device)
        varlen, longest = attention.flash_attn_varlen_func(), max(lengths)

        def attend() -> torch.Tensor:
            return varlen(q, k, v, cu, cu, longest, longest, causal=True)

    else:

        def attend() -> torch.Tensor:
            return sdpa_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), lengths).squeeze(1)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        attend().backward(dout)

    return step, ("flash-attn varlen" if flash else "SDPA per document") if packed else (
        "flash-attn" if flash else "SDPA"
    )


def rank_step(settings: Settings, geometry: ZigzagGeometry, rank: int, packed: bool, kernel: str) -> Callable:
    """Forward+backward of one rank's local attention work (random shards, every rank's K/V given)."""
    heads, dim, device, dtype = settings.perf_heads, settings.perf_head_dim, settings.device, settings.torch_dtype
    local, cp = geometry.zigzag_local_token_count, geometry.cp_size
    shape = (local, heads, dim) if packed else (local, 1, heads, dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=dtype)
    kv_all, sent = stacked_kv([(torch.randn_like(k), torch.randn_like(v)) for _ in range(cp)])
    gathered = gathered_kv(kv_all, geometry, packed) if kernel == "flash_attn" else None

    def step() -> None:
        q.grad = k.grad = v.grad = None
        if gathered is not None:
            gathered.grad = None
        out = rank_attention(q, k, v, kv_all, sent, geometry, rank, packed=packed, kernel=kernel, gathered=gathered)
        out.backward(dout)

    return step


def math_memory_problem(settings: Settings, geometry: ZigzagGeometry) -> str:
    """Why the math kernel cannot run this geometry on the GPU (it materialises float32 scores per tile), or ''."""
    if settings.device != "cuda":
        return ""
    largest = 0
    for rank in range(geometry.cp_size):
        plan = attention._block_plan(geometry, rank, True, torch.device("cpu"), kernels.plan_profile(kernels.MATH))
        tiles = [t for source in plan.tiles for t in source]
        tiles += [t for source in plan.piece_tiles for piece in source for t in piece]
        largest = max([largest, *(kernels.index_count(t.rows) * kernels.index_count(t.cols) for t in tiles)])
    needed = 6 * largest * settings.perf_heads * 4
    free = torch.cuda.mem_get_info()[0]
    if needed > 0.7 * free:
        return f"math kernel would need ~{needed / 2**30:.0f} GiB of score buffers ({free / 2**30:.0f} GiB free)"
    return ""


def measure_performance(settings: Settings, report: Report, budget: Budget) -> None:
    """(b) Per-rank attention time (max over ranks) versus the whole sequence's time divided by cp."""
    probe = torch.zeros(2, 1, 1, 8, device=settings.device, dtype=settings.torch_dtype)
    kernel = attention._choose_kernel("auto", "allgather", probe)
    try:  # cheap, so first; a failure here must not cost the efficiency table
        measure_call_costs(settings, report, kernel if kernel in attention._KERNELS else "cuda_sdpa")
    except Exception as error:  # noqa: BLE001 - recorded in the report
        report.raised("perf", "tile call costs", error)
    judged = not settings.dry_run
    report.text(
        "perf",
        f"## (b) Compute-side efficiency ({settings.dtype}, {settings.perf_heads} heads x {settings.perf_head_dim}, "
        f"causal, forward+backward, library kernel `{kernel}`, mode allgather)",
        "",
        "Every rank's local attention work runs in this process, one rank after another (the library's own code and "
        "tiles, every rank's K/V given; communication excluded). Time: median of "
        f"{settings.iters} after {settings.warmup} warm-up runs"
        f"{', CUDA events' if settings.device == 'cuda' else ''}. Efficiency = (whole-sequence time / cp) / (slowest "
        f"rank's time); target >= {EFFICIENCY_TARGET}"
        f"{'' if judged else ' (not judged in a CPU dry run: CPU timings of tiny sizes say nothing about a GPU)'}.",
        "",
        "| workload | cp | whole sequence | whole (ms) | whole / cp (ms) | per rank (ms) | efficiency | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    )
    for total in settings.perf_tokens:
        for packed in (False, True):
            lengths = perf_lengths(total, 1) if packed else [total]
            size = f"{total // 1024}k" if total % 1024 == 0 else str(total)
            workload = f"{'packed' if packed else 'dense'} {size}" + (f" ({len(lengths)} docs)" * packed)
            perf_workload(settings, report, budget, kernel, workload, lengths, packed)
    report.text("perf", "")


def tile_seconds(settings: Settings, kernel_name: str, rows: int, masked: bool) -> float:
    """Seconds per ``rows`` x ``rows`` tile, forward + backward, through the library's per-tile path (the kernel, the
    log-sum-exp merge, the gradient adds); ``masked``: a mask of two documents, as grouped small documents get (built
    for each call, as there)."""
    heads, dim, device, dtype = settings.perf_heads, settings.perf_head_dim, settings.device, settings.torch_dtype
    q, k, v, dout = (torch.randn(1, heads, rows, dim, device=device, dtype=dtype) for _ in range(4))
    acc = kernels.accumulation_dtype(dtype)
    out, lse = torch.zeros(q.shape, dtype=acc, device=device), torch.zeros(q.shape[:3], dtype=acc, device=device)
    grads = tuple(torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
    documents, positions = (torch.arange(rows, device=device) >= rows // 2).long(), torch.arange(rows, device=device)
    mask = kernels.TileMask(documents, positions, documents, positions, causal=False) if masked else None
    calls = max(2, min(50, (4096 // rows) ** 2 * 2))
    blocks = [kernels.Block(slice(0, rows), slice(0, rows), mask)] * calls
    kernel, scale = attention._KERNELS[kernel_name], 1.0 / math.sqrt(dim)

    def step() -> None:  # the backward gets the output in q's dtype, as training saves it
        out.zero_()
        lse.fill_(-math.inf)
        kernels.forward_source(out, lse, q, k, v, blocks, kernel, scale)
        merged = (dout, q, kernels.as_dtype(out, dtype), kernels.finite_lse(lse))
        kernels.backward_source(grads, merged, k, v, blocks, kernel, scale)

    return median_time(step, settings) / calls


def measure_call_costs(settings: Settings, report: Report, kernel_name: str) -> None:
    """What one tile call costs on this device, fitted as ``a + b * rows**2`` for full and masked tiles, in score
    pairs of a full tile (``a / b``: what a plan's ``_document_groups`` and tile sizes assume), beside the costs a
    plan for this device assumes."""
    rows = settings.cost_rows
    times = {masked: [tile_seconds(settings, kernel_name, n, masked) for n in rows] for masked in (False, True)}
    fits = {masked: statistics.linear_regression([n * n for n in rows], times[masked]) for masked in (False, True)}
    slope = fits[False].slope
    fitted = (fits[False].intercept / slope, fits[True].intercept / slope, fits[True].slope / slope)
    assumed = kernels.plan_profile(attention._KERNELS[kernel_name])
    report.text(
        "perf",
        f"## What a tile call costs (`{kernel_name}`, forward + backward with the merge and gradient adds)",
        "",
        "| tile rows | full (ms per call) | masked (ms per call) |",
        "| --- | --- | --- |",
        *(f"| {n} | {1000 * t:.3f} | {1000 * m:.3f} |" for n, t, m in zip(rows, *times.values(), strict=True)),
        "",
        "| in score pairs of a full tile | fitted here | a plan assumes |",
        "| --- | --- | --- |",
        f"| a call (`call_pairs`) | {fitted[0]:.3g} | {assumed.call_pairs:.3g} |",
        f"| a masked call (`masked_call_pairs`) | {fitted[1]:.3g} | {assumed.masked_call_pairs:.3g} |",
        f"| a masked pair (`masked_pair_cost`) | {fitted[2]:.3g} | {assumed.masked_pair_cost:.3g} |",
        "",
    )  # fmt: skip
    names = ("call", "masked call", "masked pair")
    detail = ", ".join(f"{name} {value:.3g}" for name, value in zip(names, fitted, strict=True))
    report.add("perf", f"tile call costs ({kernel_name})", "INFO", f"fitted in score pairs: {detail}")


def perf_workload(
    settings: Settings, report: Report, budget: Budget, kernel: str, workload: str, lengths: list[int], packed: bool
) -> None:
    """Measure one workload at every cp: the whole-sequence reference once, then every rank."""
    if budget.left() < 10:
        report.add("perf", workload, "SKIP", "time budget spent")
        return
    try:
        step, reference = whole_sequence_step(settings, lengths, packed)
        whole = median_time(step, settings)
        del step
    except Exception as error:  # noqa: BLE001 - the reference's failure (out of memory, say) ends only its workload
        summary = report.raised("perf", f"{workload} whole sequence", error)
        report.text("perf", f"| {workload} | - | - | - | - | - | - | FAIL: {summary} |")
        if settings.device == "cuda":
            torch.cuda.empty_cache()
        return
    for cp in settings.perf_cps:
        geometry = geometry_of(lengths, cp, packed)
        problem = math_memory_problem(settings, geometry) if kernel == "math" else ""
        name = f"{workload} cp={cp}"
        try:
            times, problem = rank_times(settings, budget, geometry, packed, kernel) if not problem else ([], problem)
        except Exception as error:  # noqa: BLE001 - one configuration's failure (out of memory, say) ends only it
            summary = report.raised("perf", name, error)
            row = f"| {workload} | {cp} | {reference} | {1000 * whole:.1f} | - | - | - | FAIL: {summary} |"
            report.text("perf", row)
            if settings.device == "cuda":
                torch.cuda.empty_cache()
            continue
        if problem:
            row = f"| {workload} | {cp} | {reference} | {1000 * whole:.1f} | - | - | - | SKIP: {problem} |"
            report.text("perf", row)
            report.add("perf", name, "SKIP", problem)
            continue
        efficiency = whole / cp / max(times)
        status = ("PASS" if efficiency >= EFFICIENCY_TARGET else "FAIL") if not settings.dry_run else "INFO"
        spread = f"{1000 * min(times):.1f}..{1000 * max(times):.1f}"
        report.text(
            "perf",
            f"| {workload} | {cp} | {reference} | {1000 * whole:.1f} | {1000 * whole / cp:.1f} | {spread} | "
            f"{efficiency:.2f} | {status} |",
        )
        report.add("perf", name, status, f"efficiency {efficiency:.2f} (kernel {kernel} vs {reference})")
        if settings.device == "cuda":
            torch.cuda.empty_cache()


def rank_times(
    settings: Settings, budget: Budget, geometry: ZigzagGeometry, packed: bool, kernel: str
) -> tuple[list[float], str]:
    """Every rank's median time, or a reason to stop (the budget would run out)."""
    times: list[float] = []
    for rank in range(geometry.cp_size):
        step = rank_step(settings, geometry, rank, packed, kernel)
        first = timed(step, settings.device)
        estimate = first * (settings.warmup + settings.iters) * (geometry.cp_size - rank)
        if estimate > budget.left():
            return [], f"time budget: about {estimate:.0f} s more needed, {budget.left():.0f} s left"
        times.append(median_time(step, settings))
    return times, ""


# (a) The sequence mixers.

MIXER_TOLERANCE = {"float32": 1e-4, "bf16 autocast": 2e-2}
"""Largest error relative to the output's largest value: float32 rounding over a few thousand tokens, and bf16 inputs
for the convolution under autocast (the scans compute in float32 there too, and are held to float32's limit)."""


def mixer_inputs(name: str, tokens: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Seeded float64 CPU inputs of one row of ``tokens`` tokens for the mixer ``name``."""
    generator = torch.Generator().manual_seed(7)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    if name == "cp_causal_conv1d":
        return normal(1, tokens, heads * dim), normal(heads * dim, 4) / 2, normal(heads * dim)
    if name == "cp_ssd_scan":
        return normal(1, tokens, heads, dim), uniform(1, tokens, heads) * 0.1, -uniform(heads) - 0.5, \
            normal(1, tokens, 1, dim), normal(1, tokens, 1, dim)  # fmt: skip
    if name == "cp_selective_scan":  # heads x dim channels, a state of 16
        return normal(1, tokens, heads * dim), uniform(1, tokens, heads * dim) * 0.1, -uniform(heads * dim, 16) - 0.5, \
            normal(1, tokens, 16), normal(1, tokens, 16)  # fmt: skip
    q, k = (F.normalize(normal(1, tokens, heads, dim), dim=-1) for _ in range(2))
    gates = (heads, dim) if name.endswith("per key channel") else (heads,)
    return q, k, normal(1, tokens, heads, dim), -uniform(1, tokens, *gates) * 0.1, uniform(1, tokens, heads)


MIXERS: dict[str, Callable[..., torch.Tensor]] = {
    "cp_causal_conv1d": cp_causal_conv1d,
    "cp_ssd_scan": functools.partial(cp_ssd_scan, chunk_size=64),
    "cp_selective_scan": cp_selective_scan,
    "cp_gated_delta_rule": cp_gated_delta_rule,
    "cp_gated_delta_rule per key channel": cp_gated_delta_rule,
}


def check_mixers(settings: Settings, report: Report, budget: Budget) -> None:
    """(a) The sequence mixers on the device against the same functions in float64 on the CPU (whose float64 results
    the tests check against token-by-token references), each row one document and packed documents under a step."""
    if budget.left() < 20:
        report.add("mixers", "section", "SKIP", "time budget spent")
        return
    tokens, heads, dim = settings.exact_packed_tokens, settings.exact_heads[0], settings.exact_head_dim
    lengths = exactness_lengths(tokens, seed=3)
    packed = {"input_ids": torch.zeros(1, sum(lengths), dtype=torch.long), "cu_seqlens": offsets(lengths, "cpu")}
    runtime = ContextParallelRuntime(ContextParallelSetting())
    report.text(
        "mixers",
        f"## (a) Sequence mixers on {settings.device} ({sum(lengths)} tokens, {heads} heads x {dim})",
        "",
        "Each mixer, forward and backward, in float32 and under a bf16 autocast on the device, against itself in "
        "float64 on the CPU; `packed`: documents under a one-process step (restarting at each). Detail: largest error "
        "of the output and of its first input's gradient, relative to the largest value (limit).",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    )
    for name, mixer in MIXERS.items():
        inputs = mixer_inputs(name, sum(lengths), heads, dim)
        for kind in ("one row", "packed"):
            for precision in MIXER_TOLERANCE:
                tolerance = MIXER_TOLERANCE[precision if name == "cp_causal_conv1d" else "float32"]
                check = f"{name} {kind} {precision}"
                try:
                    with runtime.step(dict(packed)) if kind == "packed" else contextlib.nullcontext():
                        reference = [tensor.clone().requires_grad_() for tensor in inputs]
                        expected = mixer(*reference)
                        weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).double()
                        (expected * weights).sum().backward()
                        device_inputs = [
                            tensor.to(settings.device, torch.float32).requires_grad_() for tensor in inputs
                        ]
                        autocast = torch.autocast(settings.device, torch.bfloat16, enabled=precision != "float32")
                        with autocast:
                            got = mixer(*device_inputs)
                        (got * weights.to(got.device)).sum().backward()
                    errors = [
                        ((actual.double().cpu() - wanted).abs().max() / wanted.abs().max()).item()
                        for actual, wanted in ((got, expected), (device_inputs[0].grad, reference[0].grad))
                    ]
                    status = "PASS" if max(errors) <= tolerance else "FAIL"
                    detail = f"out {errors[0]:.1e}, first input's gradient {errors[1]:.1e} ({tolerance:.0e})"
                    report.add("mixers", check, status, detail)
                except Exception as failure:  # noqa: BLE001 - a kernel missing on the device fails its row
                    status, detail = "FAIL", report.raised("mixers", check, failure)
                report.text("mixers", f"| {check} | {status} | {detail} |")
    report.text("mixers", "")


# (c) The main job.


def check_training(settings: Settings, report: Report, budget: Budget) -> None:
    """(c) ``lightning-cp fit --config gpu`` at cp=1 in a subprocess with a timeout: exit code and losses."""
    if budget.left() < 30:
        report.add("train", "section", "SKIP", "time budget spent")
        return
    timeout = min(settings.train_timeout_s, budget.left())
    run_root = Path(tempfile.mkdtemp(prefix="gpu_check_run_"))
    command = [sys.executable, "-m", "lightning_cp", "fit", *settings.train_overrides, f"run.root={run_root}"]
    try:
        returncode, wall, log_tail = run_main_job(command, timeout, data_cache=run_root / "data")
        steps, losses = loss_series(read_metrics(run_root / "gpu-check" / METRICS_FILE), "train_loss")
        val_steps, val = loss_series(read_metrics(run_root / "gpu-check" / METRICS_FILE), "val_loss", "trained_steps")
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    expected = int(next(o.split("=")[1] for o in settings.train_overrides if o.startswith("trainer.max_steps=")))
    finite = all(math.isfinite(loss) for loss in losses)
    ran = returncode == 0 and len(losses) == expected and finite
    detail = f"exit {returncode}, {len(losses)}/{expected} train losses, {wall:.0f} s" + ("" if finite else ", NaN/inf")
    report.add("train", "lightning-cp fit --config gpu, cp=1", "PASS" if ran else "FAIL", detail)
    shown = " ".join(a for a in command[3:] if not a.startswith("run.root="))
    report.text(
        "train",
        "## (c) The main job",
        "",
        f"`lightning-cp {shown} run.root=<temp>` (at cp=1 `cp_attention` is single-device attention: SDPA per "
        f"document). Pass: exit code 0, {expected} finite train losses.",
        "",
        f"- exit code {returncode}, wall time {wall:.0f} s (start-up, data, validation and checkpoint included)",
        "- train loss by step: " + (", ".join(f"{s}: {x:.4f}" for s, x in zip(steps, losses, strict=True)) or "none"),
        "- validation loss: " + (", ".join(f"after {s}: {x:.4f}" for s, x in zip(val_steps, val, strict=True)) or "-"),
    )
    if not ran:
        report.text("train", "", "Last lines of its output:", "", "```", log_tail, "```")
    report.text("train", "")


def run_main_job(command: list[str], timeout: float, data_cache: Path) -> tuple[int | str, float, str]:
    """Run the job in its own session (killed with its workers on timeout), its prepared data under ``data_cache``;
    exit code, seconds, last output lines."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", CACHE_ENV: str(data_cache)}
    env.pop(RUN_DIR_ENV, None)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: int | str = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = f"timeout after {timeout:.0f} s"
        log.seek(0)
        tail = "\n".join(log.read().splitlines()[-30:])
    return returncode, time.perf_counter() - start, tail


# Driver.

SECTION_FUNCTIONS: dict[str, Callable[[Settings, Report, Budget], None]] = {
    "attention": check_attention,
    "group": check_group,
    "mixers": check_mixers,
    "perf": measure_performance,
    "train": check_training,
}
RUN_ORDER = ("attention", "group", "mixers", "train", "perf")  # perf last: it adapts to whatever time is left


def run_section(name: str, settings: Settings, report: Report, budget: Budget) -> None:
    """Run one section; a failure is recorded in the report and does not stop the others."""
    started = time.perf_counter()
    try:
        SECTION_FUNCTIONS[name](settings, report, budget)
        if settings.device == "cuda":
            torch.cuda.empty_cache()  # the main job runs in another process on the same device
    except Exception as error:  # noqa: BLE001 - every failure (a sticky CUDA error included) becomes a line
        report.raised(name, "section", error)
    print(f"gpu_check: section {name} done in {time.perf_counter() - started:.0f} s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the same code paths (about a minute)")
    ap.add_argument("--out", type=Path, help="markdown report (default results/gpu.md; a temp file for --dry-run)")
    ap.add_argument("--json", type=Path, help="also write the checks as JSON here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, help="wall-clock budget (default 420 on a GPU, 150 for --dry-run)")
    args = ap.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "gpu_check_dry_run.md" if args.dry_run else RESULTS
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, writing the report after each; 1 when a judged check failed."""
    args = parse_args(argv)
    if args.dry_run:
        settings = dry_run_settings(args.budget_s or 150.0)
        torch.set_num_threads(1)  # steadier on a shared CPU
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
            return 2
        settings = gpu_settings(args.budget_s or 420.0)
    torch.manual_seed(0)
    report, budget = Report(settings), Budget(settings.budget_s)
    chosen = set(args.sections.split(","))
    for name in (section for section in RUN_ORDER if section in chosen):
        run_section(name, settings, report, budget)
        report.write(args.out, args.json)
    print(f"gpu_check: report in {args.out} ({report.elapsed():.0f} s)", flush=True)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
