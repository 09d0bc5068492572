"""Inputs that differ between a group's ranks: the same ValueError on every rank, never a crash, hang or garbage."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_cp import ContextParallelRuntime, ContextParallelSetting
from lightning_cp.attention import zigzag_attention
from lightning_cp.core import comm
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.packed import PackedSeqParams
from tests.distributed_harness import assert_same_error_on_every_rank


def _offsets(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _dense(tokens: int = 4, heads: int = 2) -> list[torch.Tensor]:
    return [torch.randn(tokens, 1, heads, 8) for _ in range(3)]


def _call(case: str) -> None:
    """Rank body: rank 1 deviates from rank 0 as ``case`` says; then prove the group still works."""
    rank = dist.get_rank()
    q, k, v = _dense()
    kwargs = {}
    if case == "shape" and rank == 1:
        q, k, v = _dense(tokens=6)
    elif case == "heads" and rank == 1:
        q = torch.randn(4, 1, 4, 8)
    elif case == "dtype" and rank == 1:
        q, k, v = (x.double() for x in (q, k, v))
    elif case == "requires_grad" and rank == 1:
        q.requires_grad_()
    elif case == "mode":
        kwargs["mode"] = "bogus" if rank == 1 else "allgather"
    elif case == "offsets":
        cu = [0, 3, 8] if rank == 0 else [0, 5, 8]
        kwargs["packed_seq_params"] = PackedSeqParams(
            cu_seqlens_q=_offsets(cu), cu_seqlens_q_padded=_offsets([0, 4, 12])
        )
        q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
    elif case == "kv offsets":
        kwargs["packed_seq_params"] = PackedSeqParams(
            cu_seqlens_q=_offsets([0, 3, 8]),
            cu_seqlens_q_padded=_offsets([0, 4, 12]),
            cu_seqlens_kv=_offsets([0, 3, 8] if rank == 0 else [0, 4, 8]),
        )
        q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
    elif case == "hybrid groups":
        ulysses, rings = dist.new_group([0, 1]), [dist.new_group([0]), dist.new_group([1])]
        kwargs["mode"] = "hybrid"
        if rank == 0:
            kwargs.update(ulysses_group=ulysses, ring_group=rings[rank])
    try:
        zigzag_attention(q, k, v, dist.group.WORLD, **kwargs)
    finally:
        dist.barrier()


@pytest.mark.parametrize(
    ("case", "named"),
    [("shape", "q, k, v"), ("heads", "different q"), ("dtype", "q, k, v"), ("requires_grad", "different q"),
     ("mode", "different mode"), ("offsets", "different cu_seqlens_q"), ("kv offsets", "different cu_seqlens_kv"),
     ("hybrid groups", "different hybrid sub-groups")],
)  # fmt: skip
def test_attention_calls_that_differ_between_ranks(case: str, named: str) -> None:
    message = assert_same_error_on_every_rank(_call, 2, case, match=named, timeout=60)
    assert message.startswith("zigzag_attention: the ranks of the group were given different")


def _batches_that_differ() -> None:
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, 2, 1))
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh))
    cu = [0, 5, 9] if dist.get_rank() == 0 else [0, 4, 9]
    try:
        runtime.begin_step({"input_ids": torch.zeros(1, 9, dtype=torch.long), "cu_seqlens": _offsets(cu)})
    finally:
        dist.barrier()


def test_replica_batches_that_differ_between_ranks() -> None:
    assert_same_error_on_every_rank(_batches_that_differ, 2, match="the replica batch: the ranks of the group were "
                                    "given different cu_seqlens", timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", "cpu"), ("nccl", "cuda"), ("xccl", "xpu")],
)
def test_the_consensus_fingerprint_goes_where_the_group_can_reduce_it(
    backend: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NCCL-only group reduces only accelerator tensors, so the fingerprint goes to the current accelerator."""
    if ":" not in backend and backend not in dist.Backend.backend_capability:
        pytest.skip(f"this torch has no {backend} backend")
    monkeypatch.setattr(comm.dist, "get_backend", lambda group: backend)
    assert comm._bookkeeping_device(dist.group.WORLD) == torch.device(expected)
