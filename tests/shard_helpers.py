"""Per-token tensors of a whole batch given to each rank as its shard under a real step, and compared back slot by
slot: the harness of the sequence mixers' tests (causal convolution, Mamba2's and Mamba's scans, gated delta rule)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from lightning_cp import ContextParallelRuntime, ContextParallelSetting
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh

DENSE_LENGTH = 22
MIXED_DOCUMENTS = (1, 13, 2, 7, 30, 3, 1, 5)
"""Documents of 1 to 30 tokens (62 in all): most lengths not multiples of 2 x cp, documents starting inside shards."""
SCAN_CASES = pytest.mark.parametrize(
    ("ranks", "boundary", "lengths", "chunk_size", "rows"),
    [
        (3, "contiguous", MIXED_DOCUMENTS, 4, 1),
        (3, "zigzag", MIXED_DOCUMENTS, 4, 1),
        (2, "zigzag", MIXED_DOCUMENTS, 64, 1),
        (4, "contiguous", (60,), 3, 1),
        (2, "zigzag", None, 5, 2),
        (1, "zigzag", MIXED_DOCUMENTS, 4, 1),
        (2, "contiguous", (5, 26, 31), 4, 1),
    ],
    ids=["cp3-contiguous", "cp3-zigzag", "cp2-zigzag-one-chunk", "cp4-one-document-over-all-shards", "cp2-dense",
         "cp1-packed", "cp2-a-document-starting-a-shard"],
)  # fmt: skip
"""The batches a chunked scan is checked on: documents in contiguous shards (a scan's own layout) or zigzag ones
(converted and back), one document over four shards, chunks shorter and longer than the shards, two dense rows,
packed documents on one rank, a document starting exactly at a shard."""


@dataclass(frozen=True)
class RankSlots:
    """Where this rank's slots come from in the whole batch: ``taken`` (a token's place in its row) where ``real``
    (padding slots are not), and the step's setting; ``drop_last``: shards are given one slot short."""

    setting: ContextParallelSetting
    real: torch.Tensor
    taken: torch.Tensor
    drop_last: bool

    def shard(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``whole`` ``[rows, total, ...]`` as a fresh leaf (zeros in padding slots)."""
        shard = torch.where(self.mask(whole), whole[:, self.taken], 0)
        return shard[:, : -1 if self.drop_last else None].detach().requires_grad_()

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real slots, broadcastable to ``tensor`` ``[rows, slots, ...]``."""
        return self.real.view(1, -1, *[1] * (tensor.dim() - 2))

    def error(self, actual: torch.Tensor, whole: torch.Tensor) -> float:
        """The largest difference between this rank's ``actual`` and its slots of ``whole``, over real slots."""
        return ((actual - whole[:, self.taken]) * self.mask(actual)).abs().max().item()


def document_runs(starts: torch.Tensor) -> list[tuple[int, int]]:
    """The token ranges between document starts ``[s]`` (the first from token 0, starting there or not)."""
    cuts = [0, *[int(i) for i in torch.nonzero(starts).flatten() if i > 0], starts.numel()]
    return list(zip(cuts, cuts[1:], strict=False))


def saved_for_backward(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``forward()``'s output and the sizes of the tensors autograd saved for the backward while it ran (those a
    checkpoint recomputes are not among them)."""
    saved: list[int] = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        return forward(), saved


def batch_length(lengths: tuple[int, ...] | None) -> int:
    """Tokens per row: the documents' total, or a dense row's."""
    return DENSE_LENGTH if lengths is None else sum(lengths)


@contextmanager
def step_over_the_world(
    boundary: str,
    lengths: tuple[int, ...] | None,
    rows: int = 1,
    tensor_parallel: int = 1,
    ulysses: int = 1,
    drop_last: bool = False,
) -> Iterator[RankSlots]:
    """Run a step over every rank of the world (cp = world / ``tensor_parallel``) on packed documents of ``lengths``
    (None: ``rows`` dense rows) given in the ``boundary`` layout: under sequence parallelism when ``tensor_parallel``
    > 1, with ``attention_mode="hybrid"`` when ``ulysses`` > 1; yields where this rank's slots come from."""
    world = dist.get_world_size()
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, world // tensor_parallel, tensor_parallel, ulysses))
    setting = ContextParallelSetting(
        mesh, boundary_layout=boundary, sequence_parallel=tensor_parallel > 1,
        attention_mode="hybrid" if ulysses > 1 else "allgather",
    )  # fmt: skip
    total = batch_length(lengths)
    batch: dict[str, torch.Tensor] = {"input_ids": torch.arange(1, total + 1).repeat(rows, 1)}
    if lengths is not None:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with ContextParallelRuntime(setting).step(batch):
        positions = batch["input_ids"][0] - 1  # -1: a padding slot
        yield RankSlots(setting, positions >= 0, positions.clamp(min=0), drop_last)


def selective_scan_errors(
    scan: Callable[..., torch.Tensor],
    per_document: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], torch.Tensor],
    random_inputs: Callable[[int, int, torch.Generator], tuple[torch.Tensor, ...]],
    boundary: str,
    lengths: tuple[int, ...] | None,
    chunk_size: int,
    rows: int = 1,
    tensor_parallel: int = 1,
    ulysses: int = 1,
    drop_last: bool = False,
    mixed: bool = False,
) -> list[float]:
    """For a selective scan ``scan(x, dt, A, B, C, chunk_size=...)`` (Mamba2's or Mamba's), this rank's largest
    differences to ``per_document`` on one process: outputs and the gradients of x, dt, B, C, and (summed over the
    ranks) A, for the batch ``step_over_the_world`` makes of the arguments, the inputs from ``random_inputs(rows,
    tokens, generator)``; ``mixed``: x, B, C in bf16 and dt and A in float32, as under autocast (the reference: the same
    rounded values in float64), and only the output's relative error."""
    total = batch_length(lengths)
    generator = torch.Generator().manual_seed(5)
    inputs = random_inputs(rows, total, generator)
    if mixed:
        inputs = tuple(tensor.to(torch.float32 if i in (1, 2) else torch.bfloat16) for i, tensor in enumerate(inputs))
    whole = [tensor.double().clone().requires_grad_() for tensor in inputs]
    expected = per_document(tuple(whole), lengths or (total,))
    loss_weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    (expected * loss_weights).sum().backward()
    with step_over_the_world(boundary, lengths, rows, tensor_parallel, ulysses, drop_last) as slots:
        x, dt, B, C = (slots.shard(tensor) for tensor in (inputs[0], inputs[1], inputs[3], inputs[4]))
        A = inputs[2].clone().requires_grad_()
        output = scan(x, dt, A, B, C, chunk_size=chunk_size)
        if mixed:
            return [slots.error(output, expected) / expected.abs().max().item()]
        (output * loss_weights[:, slots.taken] * slots.mask(output)).sum().backward()
    dist.all_reduce(A.grad, group=slots.setting.loss_group)
    pairs = [(output, expected), (x.grad, whole[0].grad), (dt.grad, whole[1].grad), (B.grad, whole[3].grad),
             (C.grad, whole[4].grad)]  # fmt: skip
    return [
        *(slots.error(actual, reference) for actual, reference in pairs),
        (A.grad - whole[2].grad).abs().max().item(),
    ]
