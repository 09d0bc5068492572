"""zigzag_attention input checks (same ValueError on every rank), work counting and block skipping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import zigzag
from lightning_cp.core.attention import kernels
from lightning_cp.core.attention.api import attention_work_per_rank, zigzag_attention
from lightning_cp.core.packed import PackedSeqParams, host_offsets
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks

CP = 2


def _packed(lengths_cu: list[int], padded_cu: list[int] | None) -> PackedSeqParams:
    """Packed metadata from plain lists; ``padded_cu`` ``None`` leaves the padded offsets out."""
    padded = None if padded_cu is None else torch.tensor(padded_cu, dtype=torch.int32)
    return PackedSeqParams(cu_seqlens_q=torch.tensor(lengths_cu, dtype=torch.int32), cu_seqlens_q_padded=padded)


def _dense(tokens: int = 4, heads: int = 2, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    """Dense q, k, v of the given local shape."""
    return (
        torch.randn(tokens, 1, heads, dim),
        torch.randn(tokens, 1, kv_heads, dim),
        torch.randn(tokens, 1, kv_heads, dim),
    )


BAD_INPUTS = {
    "token counts": (lambda: (torch.randn(4, 1, 2, 8), *_dense(6)[1:]), {}, "token counts differ: q 4, k 6, v 6"),
    "head dims": (lambda: (torch.randn(4, 1, 2, 16), *_dense()[1:]), {}, "head dims differ: q 16, k/v 8"),
    "gqa heads": (lambda: _dense(heads=3, kv_heads=2), {}, "Hq=3 query heads, Hkv=2 key heads"),
    "k v shapes": (lambda: (*_dense()[:2], torch.randn(4, 1, 1, 8)), {}, "expected equal shapes"),
    "odd dense": (lambda: _dense(tokens=5), {}, "S_local=5"),
    "packed without metadata": (
        lambda: tuple(torch.randn(8, 2, 8) for _ in range(3)),
        {},
        "packed (THD) tensors need packed_seq_params",
    ),
    "metadata without padded offsets": (
        lambda: tuple(torch.randn(6, 2, 8) for _ in range(3)),
        {"packed_seq_params": _packed([0, 3, 8], None)},
        "cu_seqlens_q_padded is None",
    ),
    "token count versus metadata": (
        lambda: tuple(torch.randn(5, 2, 8) for _ in range(3)),
        {"packed_seq_params": _packed([0, 3, 8], [0, 4, 12])},
        "local token count 5 does not match packed_seq_params: 12 padded tokens over cp=2 ranks; expected 6",
    ),
    "padding not a multiple of 2cp": (
        lambda: tuple(torch.randn(5, 2, 8) for _ in range(3)),
        {"packed_seq_params": _packed([0, 3, 8], [0, 3, 10])},
        "sequence 0 has length 3 and padded length 3",
    ),
    "mode": (_dense, {"mode": "bogus"}, "mode='bogus' is not supported"),
    "backend": (_dense, {"backend": "bogus"}, "backend='bogus' is not supported"),
    "flash_attn on cpu": (_dense, {"backend": "flash_attn"}, "backend='flash_attn' with mode='allgather'"),
}


def _call_with_bad_input(name: str) -> None:
    """Rank body: call zigzag_attention with the named bad input, then prove the group still works."""
    make, kwargs, _ = BAD_INPUTS[name]
    try:
        zigzag_attention(*make(), dist.group.WORLD, **kwargs)
    finally:
        dist.barrier()


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_the_same_error_on_every_rank(name):
    assert_same_error_on_every_rank(_call_with_bad_input, CP, name, match=BAD_INPUTS[name][2], timeout=60)


def _work_matches_actual_run() -> list[int]:
    """Rank body: sum of the visible pairs in this rank's block plan, for a packed causal batch."""
    lengths = [1, 3, 17, 6, 30]
    padded = list(zigzag.ZigzagGeometry.packed(3, lengths).padded_lengths)
    tokens = [zigzag.zigzag_rank_tokens(lengths, padded, 3, src) for src in range(3)]
    plan = kernels.build_block_plan(tokens, dist.get_rank(), True, torch.device("cpu"))
    return sum(_pairs(block) for blocks in plan.blocks for block in blocks)


def _pairs(block: kernels.Block) -> int:
    """Visible pairs of one block."""
    rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    if block.causal:
        return rows * (rows + 1) // 2
    return rows * cols if block.mask is None else int(block.mask.dense().sum())


def test_host_offsets_are_read_once_and_follow_in_place_changes():
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    first = host_offsets(offsets)
    assert first == [0, 3, 8] and host_offsets(offsets) is first
    offsets[2] = 9
    assert host_offsets(offsets) == [0, 3, 9]
    assert host_offsets(torch.tensor([0, 5], dtype=torch.int32)) == [0, 5]


def test_work_per_rank_counts_the_pairs_the_plan_computes():
    expected = attention_work_per_rank(3, cu_seqlens=[0, 1, 4, 21, 27, 57])
    assert run_on_ranks(_work_matches_actual_run, 3) == expected


def test_dense_zigzag_work_is_balanced_and_contiguous_is_not():
    seq_len, cp = 32, 4
    zigzag = attention_work_per_rank(cp, seq_len=seq_len)
    contiguous = attention_work_per_rank(cp, seq_len=seq_len, layout="contiguous")
    total = seq_len * (seq_len + 1) // 2
    assert zigzag == [total // cp] * cp
    assert contiguous == [36, 100, 164, 228]
    assert attention_work_per_rank(cp, seq_len=seq_len, causal=False) == [seq_len * seq_len // cp] * cp


def test_packed_work_excludes_padding():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    # cp=2 rank order (0,-1,3,4,-1,-1 | 1,2,5,6,7,-1): positions 0 | 0,1 vs 1,2 | 2,3,4
    assert attention_work_per_rank(2, cu_seqlens=cu) == [1 + 1 + 2, 2 + 3 + 3 + 4 + 5]
    assert attention_work_per_rank(2, cu_seqlens=cu, causal=False) == [3 + 5 + 5, 3 + 3 + 5 + 5 + 5]
    assert sum(attention_work_per_rank(2, cu_seqlens=cu, layout="contiguous")) == 3 * 4 // 2 + 5 * 6 // 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "expected exactly one of them"),
        ({"seq_len": 8, "cu_seqlens": [0, 8]}, "expected exactly one of them"),
        ({"seq_len": 8, "layout": "diagonal"}, "layout='diagonal'"),
        ({"cu_seqlens": [1, 8]}, "cu_seqlens=[1, 8]; expected non-decreasing cumulative offsets starting at 0"),
    ],
)
def test_work_per_rank_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
        attention_work_per_rank(2, **kwargs)


def test_dense_causal_plan_skips_empty_blocks():
    cp = 4
    tokens = [zigzag.zigzag_rank_tokens([8 * cp], [8 * cp], cp, src) for src in range(cp)]
    for rank in range(cp):
        plan = kernels.build_block_plan(tokens, rank, True, torch.device("cpu"))
        counts = [len(blocks) for blocks in plan.blocks]
        assert counts == [3 if src == rank else 2 for src in range(cp)]
        blocks = [(src, block) for src, source_blocks in enumerate(plan.blocks) for block in source_blocks]
        partial = [(src, block.rows, block.cols) for src, block in blocks if block.causal]
        assert all(block.mask is None for _, block in blocks)
        assert partial == [(rank, slice(0, 4), slice(0, 4)), (rank, slice(4, 8), slice(4, 8))]
