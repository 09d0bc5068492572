"""What CP attention keeps and moves: the forward saves only the local tensors a flash-style backward needs, the
backward moves K/V and dK/dV one piece at a time, and results stay exact when tiles cut documents, causal
diagonals and document groups."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import comm, zigzag
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention import kernels
from lightning_cp.core.attention.api import zigzag_attention
from tests.attention_helpers import all_cases, check_all_cases, packed_params
from tests.distributed_harness import run_on_ranks

TILES_PER_RANK = 8


@pytest.fixture
def small_tiles(monkeypatch):
    """Backward tiles of an eighth of a rank's rows however few there are, forward tiles of a quarter (plans built
    afresh, also in forked ranks)."""
    small = dataclasses.replace(kernels._CPU_PROFILE, min_tile_rows=1, forward_tiles=2)
    monkeypatch.setattr(kernels, "_CPU_PROFILE", small)
    monkeypatch.setattr(kernels, "_TILES_PER_RANK", TILES_PER_RANK)
    attention._block_plan.cache_clear()
    yield
    attention._block_plan.cache_clear()


def test_small_tiles_cut_blocks_every_way(small_tiles):
    lengths = [1, 5, 3, 200, 2, 2, 17]
    tokens = zigzag.ZigzagGeometry.packed(2, lengths).rank_tokens
    plan = kernels.build_block_plan(tokens, 0, True, torch.device("cpu"))
    tiles = [tile for source in plan.tiles for tile in source]
    pieces = [tile for source in plan.piece_tiles for piece in source for tile in piece]
    rows = tokens[0].doc.shape[0]
    tile = -(-rows // TILES_PER_RANK)
    piece_rows = [kernels._positions(piece) for piece in plan.pieces]
    assert sorted(torch.cat(piece_rows).tolist()) == list(range(rows)), "the pieces cut the local rows"
    assert len(plan.pieces) > 1 and all(piece.numel() <= tile for piece in piece_rows)
    counts = [(kernels.index_count(t.rows), kernels.index_count(t.cols)) for t in pieces]
    assert max(max(pair) for pair in counts) <= tile, "a backward tile spans at most a tile's rows and columns"
    assert max(kernels.index_count(t.rows) for t in tiles) <= 2 * tile, "a forward tile spans at most 2 tiles' rows"
    assert len(tiles) > sum(map(len, plan.blocks)) and len(pieces) > len(tiles)
    assert any(isinstance(tile.rows, torch.Tensor) for tile in tiles), "document groups address scattered rows"
    assert any(tile.causal for tile in pieces) and any(tile.mask is not None for tile in pieces)
    dense = kernels.build_block_plan(zigzag.ZigzagGeometry.dense(1, 64).rank_tokens, 0, True, torch.device("cpu"))
    assert [(tile.rows, tile.cols, tile.causal) for tile in dense.tiles[0][:3]] == [
        (slice(0, 16), slice(0, 16), True),
        (slice(16, 32), slice(0, 16), False),
        (slice(16, 32), slice(16, 32), True),
    ], "a causal block's forward tiles: the diagonal, then the columns before it"
    assert [(piece.start, piece.stop) for piece in dense.pieces] == [(s, s + 8) for s in range(0, 64, 8)]


def test_key_pieces_hold_early_and_late_keys_alike():
    """Every piece of a dense zigzag shard pairs front rows with their mirror images, so each piece costs every rank
    the same work: ranks working through the pieces in lockstep do not wait for each other."""
    tokens = zigzag.ZigzagGeometry.dense(4, 256).rank_tokens
    plans = [kernels.build_block_plan(tokens, rank, True, torch.device("cpu"), tile=8) for rank in range(4)]
    first = plans[0].pieces[0].tolist()
    assert first == [0, 1, 2, 3, 60, 61, 62, 63] and all(torch.equal(p.pieces[1], plans[0].pieces[1]) for p in plans)
    for src in range(4):
        for piece in range(len(plans[0].pieces)):
            work = [sum(_pairs(tile) for tile in plan.piece_tiles[src][piece]) for plan in plans]
            assert max(work) - min(work) <= 8, f"source {src} piece {piece}: pairs per rank {work}"


def test_key_pieces_keep_small_documents_whole_and_cut_only_larger_ones():
    """Pieces of 16 rows (8 front rows and their mirrors) at cp 2. Documents of 24 and 12 tokens (front chunks of 6
    and 3 rows): the second does not fit beside the first, so the first piece ends early and each piece is one
    document's adjacent rows, on both ranks. Documents of 8, 12 and 40 tokens (front chunks of 2, 3 and 10): the
    large one is cut where the rows run out, its first run sharing the first piece with the two small ones."""
    tokens = zigzag.ZigzagGeometry.packed(2, [24, 12]).rank_tokens
    plans = [kernels.build_block_plan(tokens, rank, True, torch.device("cpu"), tile=16) for rank in range(2)]
    assert [plan.pieces for plan in plans] == [(slice(0, 12), slice(12, 18))] * 2
    tokens = zigzag.ZigzagGeometry.packed(2, [8, 12, 40]).rank_tokens
    plan = kernels.build_block_plan(tokens, 0, True, torch.device("cpu"), tile=16)
    assert plan.pieces[0].tolist() == [*range(13), 27, 28, 29] and plan.pieces[1] == slice(13, 27)


def test_a_small_documents_chunks_share_a_key_piece_and_its_backward_diagonal_joins():
    """Two documents of 40 tokens at cp 2 with pieces of 20 rows: each piece mirrors its front rows within their own
    document, so it holds one whole document (rank 0: chunks 0 and 3, adjacent in local order), and the backward
    attends that document's own keys in one causal tile, as the forward does, instead of three."""
    tokens = zigzag.ZigzagGeometry.packed(2, [40, 40]).rank_tokens
    plan = kernels.build_block_plan(tokens, 0, True, torch.device("cpu"), tile=20)
    assert plan.pieces == (slice(0, 20), slice(20, 40))
    own = [[(tile.rows, tile.cols, tile.causal) for tile in piece] for piece in plan.piece_tiles[0]]
    assert own == [[(slice(0, 20), slice(0, 20), True)], [(slice(20, 40), slice(0, 20), True)]]


def test_a_block_smaller_than_a_tile_keeps_its_rows_whole_across_a_tile_boundary():
    """Documents of 50 and 60 tokens, one rank, no causal mask, tiles of 80 rows: the second document's rows 50..109
    cross row 80, but only the key pieces cut it (its columns), so each piece meets it in one tile of all its rows."""
    tokens = zigzag.ZigzagGeometry.packed(1, [50, 60]).rank_tokens
    plan = kernels.build_block_plan(tokens, 0, False, torch.device("cpu"), tile=80)
    assert plan.pieces == (slice(0, 80), slice(80, 110))
    backward = [[(tile.rows, tile.cols) for tile in piece] for piece in plan.piece_tiles[0]]
    first, second = [(slice(0, 50), slice(0, 50)), (slice(50, 110), slice(50, 80))], [(slice(50, 110), slice(0, 30))]
    assert backward == [first, second]
    chunks = [chunk.tolist() for chunk in kernels._row_chunks(17, 8)]
    assert chunks == [list(range(0, 6)), list(range(6, 12)), list(range(12, 17))], "as few near-equal runs as fit"


def test_a_documents_blocks_from_both_halves_join_into_one_forward_tile():
    """One document of 40 tokens at cp 2: chunks of 10, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2, each
    pair adjacent in local order. Every forward tile joins what the half-by-half blocks split: the own chunks as one
    causal square, and the fully visible quadrants beside each other as one rectangle."""
    tokens = zigzag.ZigzagGeometry.packed(2, [40]).rank_tokens
    plans = [kernels.build_block_plan(tokens, rank, True, torch.device("cpu")) for rank in range(2)]
    forward = [[[(tile.rows, tile.cols, tile.causal) for tile in source] for source in plan.tiles] for plan in plans]
    assert forward[0] == [[(slice(0, 20), slice(0, 20), True)], [(slice(10, 20), slice(0, 20), False)]]
    assert forward[1] == [[(slice(0, 20), slice(0, 10), False)], [(slice(0, 20), slice(0, 20), True)]]
    assert [len(source) for source in plans[0].blocks] == [3, 2], "the plan's blocks stay per half"


def test_causal_tiles_cover_the_triangle_once_in_small_diagonal_squares():
    """A causal square of local rows 100..399 against columns 0..299, leaves of at most 64 rows: every visible pair in
    exactly one tile, causal tiles only along the diagonal, halved until they fit (300 -> 150 -> 75 -> 37-38: 8)."""
    size, shift, leaf = 300, 100, 64
    tiles = kernels._causal_tiles(torch.arange(shift, shift + size), torch.arange(size), leaf)
    covered = torch.zeros(size, size, dtype=torch.int64)
    for tile in tiles:
        row, col = (torch.arange(index.start, index.stop) for index in (tile.rows, tile.cols))
        row = row - shift
        assert tile.mask is None
        if tile.causal:
            assert row.numel() <= leaf and torch.equal(row, col)
        else:
            assert int(col.max()) < int(row.min()), "a full tile lies below the diagonal"
        seen = torch.ones(row.numel(), col.numel(), dtype=torch.int64)
        covered[row.unsqueeze(1), col.unsqueeze(0)] += seen.tril() if tile.causal else seen
    assert torch.equal(covered, torch.ones(size, size, dtype=torch.int64).tril())
    assert sum(tile.causal for tile in tiles) == 8


def _pairs(tile: kernels.Block) -> int:
    """Visible pairs of one tile."""
    rows, cols = kernels.index_count(tile.rows), kernels.index_count(tile.cols)
    if tile.causal:
        return rows * (rows + 1) // 2
    return rows * cols if tile.mask is None else int(tile.mask.dense().sum())


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_small_tiles_match_the_single_device_reference(cp, small_tiles):
    outcomes = run_on_ranks(check_all_cases, cp, all_cases(), timeout=240)
    failures = [failure for rank_failures in outcomes for failure in rank_failures]
    assert not failures, "\n".join(failures)


def _kept_and_moved(mode: str, packed: bool) -> tuple[int, int, list[int], list[int], int, int]:
    """Rank body: bytes the forward saves besides the caller's q, k, v; bytes of the output and its log-sum-exp;
    rows of every K/V (or dK/dV) transfer in the forward and in the backward; this rank's rows; the tile rows."""
    cp, heads, dim = dist.get_world_size(), 4, 8
    lengths = [64 * cp, 3, 29 * cp]
    params = packed_params(lengths, cp) if packed else None
    rows = sum(-(-length // (2 * cp)) * 2 * cp for length in lengths) // cp if packed else 64
    shape = (rows, heads, dim) if packed else (rows, 2, heads, dim)
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    saved: list[torch.Tensor] = []
    moved: dict[str, list[int]] = {"forward": [], "backward": []}
    phase = ["forward"]

    def recording(fn):
        @functools.wraps(fn)
        def wrapped(tensor, *args, **kwargs):
            moved[phase[0]].append(tensor.numel())  # K/V or dK/dV of some rows (forward K/V: + 1 flag)
            return fn(tensor, *args, **kwargs)

        return wrapped

    originals = {name: getattr(comm, name) for name in ("broadcast_from", "reduce_sum_to", "ring_shift")}
    for name, fn in originals.items():
        setattr(comm, name, recording(fn))
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = zigzag_attention(q, k, v, dist.group.WORLD, packed_seq_params=params, mode=mode)
        phase[0] = "backward"
        out.backward(torch.randn_like(out))
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    inputs = {x.data_ptr() for x in (q, k, v)}
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in inputs)
    own = out.numel() * out.element_size() + out.numel() // dim * 4
    pair = 2 * math.prod(shape[1:])  # elements of one row of K and V
    transfers = {phase: [elements // pair for elements in counts] for phase, counts in moved.items()}
    return extra, own, transfers["forward"], transfers["backward"], rows, -(-rows // TILES_PER_RANK)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["allgather", "ring"])
@pytest.mark.parametrize("packed", [False, True])
def test_backward_keeps_local_tensors_and_moves_pieces(cp, mode, packed, small_tiles):
    for extra, own, forward, backward, rows, tile in run_on_ranks(_kept_and_moved, cp, mode, packed, timeout=120):
        assert extra <= own, f"the forward saved {extra} bytes besides q, k, v; out + lse are {own}"
        assert forward and set(forward) == {rows}, f"forward transfers carry whole shards: {forward}"
        assert backward and max(backward) <= tile < rows, f"backward transfers of {backward} rows; tile {tile}"


def test_exchange_buffers_alternate_between_two_allocations():
    """The exchanges' buffer pairs hand out contiguous ``[2, rows, ...]`` views of two allocations in turn, so a
    piece's buffer serves again only two pieces later."""
    pair = attention._BufferPair(torch.zeros(10, 2, 3), 6, torch.float64)
    taken = [pair.take(rows) for rows in (6, 4, 2, 5)]
    assert [tuple(x.shape) for x in taken] == [(2, rows, 2, 3) for rows in (6, 4, 2, 5)]
    assert all(x.is_contiguous() and x.dtype == torch.float64 for x in taken)
    pointers = [x.data_ptr() for x in taken]
    assert pointers[0] != pointers[1] and pointers[2] == pointers[0] and pointers[3] == pointers[1]


def test_a_plan_reaches_another_device_whole_in_one_copy_per_dtype(monkeypatch):
    """A GPU plan (masked groups of small documents, index tensors) built for another device: the same tiles,
    pieces and masks there, moved by one copy per dtype instead of one per tensor."""
    lengths = [3, 1, 7, 2, 40, 5, 1, 9, 30, 2]
    geometry = zigzag.ZigzagGeometry.packed(2, lengths)
    host = kernels.build_block_plan(geometry.rank_tokens, 1, True, torch.device("cpu"), profile=kernels._GPU_PROFILE)
    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: copies.append(self.dtype) or real_to(self, *a, **kw))
    moved = kernels.build_block_plan(geometry.rank_tokens, 1, True, torch.device("meta"), profile=kernels._GPU_PROFILE)
    monkeypatch.setattr(torch.Tensor, "to", real_to)

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return b.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype
        if isinstance(a, kernels.Block):
            fields = ("rows", "cols", "mask")
            return a.causal == b.causal and all(same(getattr(a, f), getattr(b, f)) for f in fields)
        if isinstance(a, kernels.TileMask):
            fields = ("q_doc", "q_pos", "k_doc", "k_pos")
            return a.causal == b.causal and all(same(getattr(a, f), getattr(b, f)) for f in fields)
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    assert any(block.mask is not None for source in host.tiles for block in source), "masked groups were planned"
    assert (
        same(host.tiles, moved.tiles) and same(host.piece_tiles, moved.piece_tiles) and same(host.pieces, moved.pieces)
    )
    assert copies and len(set(copies)) == len(copies), copies  # one copy per dtype (indices, masks' vectors)


def test_one_copy_per_dtype_keeps_every_tensor_its_values_and_shape():
    """``_copied`` (the copy behind a plan's move to a GPU) run to the host: each tensor back whole, in order."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 100, (5,), generator=generator),
        torch.rand(3, 4, generator=generator) > 0.5,
        torch.randint(0, 100, (0,), generator=generator),
        torch.randint(0, 100, (2, 3), generator=generator),
        torch.rand(1, 1, generator=generator) > 0.5,
    ]
    copies = kernels._copied(tensors, torch.device("cpu"))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, copies, strict=True))
