"""NaN and infinite attention inputs: ``zigzag_attention`` rejects them with the same ValueError on every rank; the
unchecked path (``check_consensus=False``, what runs inside a training step) gives NaN rows, never wrong finite values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import kernels
from lightning_cp.core.attention.api import NON_FINITE_FIELD, emulated_rank_attention, zigzag_attention
from tests.attention_helpers import Case, case_lengths, packed_params, reference_case, shard_slots, zigzag_index
from tests.distributed_harness import run_on_ranks

BAD_VALUES = (math.nan, math.inf, -math.inf)
BACKENDS = ("math", "cpu_flash")
NAMES = ("q", "k", "v")
TOLERANCE = 1e-5  # float32 kernels against the float64 reference, absolute (outputs are O(1))


def _group_and_rank(cp: int) -> tuple[dist.ProcessGroup | None, int]:
    return (None, 0) if cp == 1 else (dist.group.WORLD, dist.get_rank())


def _local_inputs(case: Case, cp: int, rank: int, seed: int):
    """Global float64 q, k, v of a case, the document id of every token, this rank's slot index and lengths."""
    torch.manual_seed(seed)
    lengths = case_lengths(case, cp, seed)
    (q, k, v, _), expected, _ = reference_case(case, lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return [q, k, v], expected, doc, torch.tensor(zigzag_index(lengths, cp, rank)), lengths


def _attend(case: Case, local: list[torch.Tensor], group, lengths: list[int], cp: int, **kwargs) -> torch.Tensor:
    params = packed_params(lengths, cp) if case.packed else None
    return zigzag_attention(
        *local, group, packed_seq_params=params, causal=case.causal, mode=case.mode, backend=case.backend, **kwargs
    )


def _rejections(cp: int) -> list[tuple[str, str, str]]:
    """Rank body: bad values in q, k, v (every rank, one rank only, a padding slot, two tensors) for both backends,
    dense and packed; return (label, error type, message) per call, then prove the group still attends exactly."""
    group, rank = _group_and_rank(cp)
    outcomes = []
    for backend in BACKENDS:
        for packed in (False, True):
            case = Case(packed, True, "allgather", backend, (4, 2), torch.float32)
            (q, k, v), expected, _, index, lengths = _local_inputs(case, cp, rank, seed=1)
            clean = [shard_slots(x, index, case).float() for x in (q, k, v)]
            valid = torch.nonzero(index >= 0).squeeze(1)
            slots = {"every rank": (valid[0], True), "rank 0 only": (valid[-1], rank == 0)}
            if packed:
                slots["padding"] = (torch.nonzero(index < 0).squeeze(1)[0], True)
            for names in (*((name,) for name in NAMES), ("q", "v")):
                for value in BAD_VALUES:
                    for where, (slot, here) in slots.items():
                        local = [x.clone() for x in clean]
                        for name in names:
                            if here:
                                local[NAMES.index(name)][slot, ..., -1] = value
                        label = f"{backend} packed={packed} {'+'.join(names)}={value} {where}"
                        try:
                            _attend(case, local, group, lengths, cp)
                            outcomes.append((label, "returned", ""))
                        except ValueError as error:
                            outcomes.append((label, "ValueError", str(error)))
            out = _attend(case, clean, group, lengths, cp)
            error = (out.double().unsqueeze(1) if packed else out.double())[index >= 0] - expected[index[index >= 0]]
            outcomes.append((f"{backend} packed={packed} finite afterwards", "max error", f"{error.abs().max():.1e}"))
    if group is not None:
        dist.barrier()
    return outcomes


@pytest.mark.parametrize("cp", [1, 2])
def test_non_finite_inputs_raise_the_same_error_on_every_rank(cp: int) -> None:
    per_rank = run_on_ranks(_rejections, cp, cp, timeout=120) if cp > 1 else [_rejections(cp)]
    assert all(len(outcomes) == len(per_rank[0]) for outcomes in per_rank)
    for outcomes in zip(*per_rank, strict=True):
        label, kind, message = outcomes[0]
        if label.endswith("finite afterwards"):
            assert all(float(outcome[2]) <= TOLERANCE for outcome in outcomes), f"{label}: {outcomes}"
            continue
        assert all(outcome == outcomes[0] for outcome in outcomes), f"{label}: ranks differ: {outcomes}"
        assert kind == "ValueError", f"{label}: {kind} {message}"
        names = label.split()[2].split("=")[0].split("+")
        if "rank 0 only" in label and cp > 1:
            assert f"different {NON_FINITE_FIELD}" in message, f"{label}: {message}"
        else:
            verb = "holds" if len(names) == 1 else "hold"
            assert f"{' and '.join(names)} {verb} NaN or infinite values" in message, f"{label}: {message}"
    assert sum(label.endswith("padding") for label, _, _ in per_rank[0]) == len(BACKENDS) * 4 * len(BAD_VALUES)


def visible_reference(q, k, v, doc, causal: bool) -> torch.Tensor:
    """Float64 attention of ``[S, B, H, D]`` tensors summing over each query's visible keys only: a key a query
    cannot see contributes nothing, whatever its values."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    visible = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        visible &= torch.ones_like(visible).tril()
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    terms = probs.unsqueeze(-1) * v.permute(1, 2, 0, 3).unsqueeze(2)
    return torch.where(visible[:, :, None], terms, 0.0).sum(3).permute(2, 0, 1, 3)


def _unchecked_failures(cp: int) -> list[str]:
    """Rank body: without the check, bad values at the first, a middle and the last token, in q, k or v, for both
    backends, modes, layouts and masks; every finite output must match the reference, NaN wherever it has NaN."""
    group, rank = _group_and_rank(cp)
    failures = []
    modes = ("allgather", "ring") if cp > 1 else ("allgather",)
    for seed, (backend, packed, causal, mode) in enumerate(
        (b, p, c, m) for b in BACKENDS for p in (False, True) for c in (True, False) for m in modes
    ):
        case = Case(packed, causal, mode, backend, (4, 2), torch.float32)
        (q, k, v), _, doc, index, lengths = _local_inputs(case, cp, rank, seed)
        valid = index >= 0
        for name in NAMES:
            for value in BAD_VALUES:
                for token in (0, doc.shape[0] // 2, doc.shape[0] - 1):
                    inputs = [x.clone() for x in (q, k, v)]
                    inputs[NAMES.index(name)][token, :, :, 0] = value
                    reference = visible_reference(*inputs, doc, causal)[index[valid]]
                    local = [shard_slots(x, index, case).float() for x in inputs]
                    out = _attend(case, local, group, lengths, cp, check_consensus=False).double()
                    got = (out.unsqueeze(1) if packed else out)[valid]
                    finite = torch.isfinite(got)
                    label = f"{case.name} {name}[{token}]={value} rank {rank}"
                    if bool((finite & ~torch.isfinite(reference)).any()):
                        failures.append(f"{label}: finite output where the reference is not")
                    both = finite & torch.isfinite(reference)
                    error = (got - reference)[both].abs().max().item() if bool(both.any()) else 0.0
                    if error > TOLERANCE:
                        failures.append(f"{label}: max error {error:.3g} > {TOLERANCE}")
    return failures


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_unchecked_non_finite_inputs_never_give_wrong_finite_values(cp: int) -> None:
    """cp 3: a source's finite flag reaches ranks that get its K/V second-hand (the ring's forwarded buffers)."""
    per_rank = run_on_ranks(_unchecked_failures, cp, cp, timeout=240) if cp > 1 else [_unchecked_failures(cp)]
    failures = [failure for rank_failures in per_rank for failure in rank_failures]
    assert not failures, "\n".join(failures[:20])


VIEWS = {
    "contiguous": lambda x: x,
    "heads first": lambda x: x.permute(1, 0, 2).unsqueeze(0),
    "rows of heads first": lambda x: x.permute(1, 0, 2).unsqueeze(0)[:, :, 2:5],
    "heads of heads first": lambda x: x.permute(1, 0, 2).unsqueeze(0)[:, 1:],
    "every other row": lambda x: x[::2],
}


@pytest.mark.parametrize("view", VIEWS)
def test_all_finite_sees_exactly_the_elements_of_a_view(view: str) -> None:
    """``all_finite`` reduces permuted contiguous views in memory order; a bad value just outside a view (but inside
    the storage it spans) must not count, one inside must."""
    base = torch.randn(7, 3, 4)
    for position in range(base.numel()):
        x = base.clone()
        x.view(-1)[position] = math.inf
        seen = VIEWS[view](x)
        assert kernels.all_finite(seen).item() == torch.isfinite(seen).all().item(), position


def test_an_emulated_rank_trusts_the_finite_flags_its_sources_send() -> None:
    """``emulated_rank_attention(kv_finite=...)``: another rank's K/V flagged non-finite turn the rows that see them
    NaN, as a group's message flag does, while a rank checks its own K/V itself; flags saying finite change nothing."""
    cp, lengths = 2, [24]
    torch.manual_seed(0)
    tokens = [zigzag.contiguous_rank_tokens(lengths, cp, rank) for rank in range(cp)]
    q, k, v = (torch.randn(cp, 12, 2, 8) for _ in range(3))  # two ranks' contiguous halves of one causal sequence
    kv_all = torch.stack([k, v], dim=1)

    def attend(rank: int, kv_finite: torch.Tensor | None) -> torch.Tensor:
        plan = kernels.build_block_plan(tokens, rank, True, torch.device("cpu"))
        sent = torch.zeros_like(kv_all)
        return emulated_rank_attention(
            q[rank], k[rank], v[rank], kv_all, sent, plan, scale=8**-0.5, kernel=kernels.CPU_FLASH, kv_finite=kv_finite
        )

    for rank in range(cp):
        checked = attend(rank, None)
        assert torch.isfinite(checked).all()
        assert torch.equal(attend(rank, torch.tensor([True, True])), checked)
    assert torch.equal(attend(0, torch.tensor([False, True])), attend(0, None)), "rank 0 checks its own K/V"
    assert torch.isnan(attend(1, torch.tensor([False, True]))).all(), "rank 1 sees rank 0's keys flagged non-finite"
