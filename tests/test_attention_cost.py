"""The byte model of the attention modes equals what the collectives send, and the mode it picks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_cp.attention import zigzag_attention
from lightning_cp.core import comm
from lightning_cp.core.attention import api as attention
from lightning_cp.core.attention.cost import bytes_sent_per_layer, choose_attention_mode, model_head_counts
from lightning_cp.packed import PackedSeqParams
from lightning_cp.train.models import LlamaConfig, LlamaDecoder
from tests.distributed_harness import run_on_ranks
from tests.layout_reference import thd_positions

HEAD_DIM = 8


def _counted(mode: str, packed: bool, heads: tuple[int, int], ulysses: int, checked: bool) -> tuple[int, float]:
    """Rank body: bytes counted for one attention forward and backward, and what the model says (``checked``: the
    consensus check read the inputs, so no finite flags travel)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    ring = cp // ulysses if mode == "hybrid" else cp
    split = ulysses if mode == "hybrid" else 1
    groups = {}
    if mode == "hybrid":
        ulysses_groups = [dist.new_group([r * ulysses + u for u in range(ulysses)]) for r in range(ring)]
        ring_groups = [dist.new_group([r * ulysses + u for r in range(ring)]) for u in range(ulysses)]
        groups = {"ulysses_group": ulysses_groups[rank // ulysses], "ring_group": ring_groups[rank % ulysses]}
    params, batch = None, 3
    if packed:
        cu = [0, 5, 6, 19, 30]
        positions, offsets = thd_positions(cu, None, ring, split)
        rows, batch = len(positions[rank]), 1
        cu_tensor, padded = torch.tensor(cu, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32)
        params = PackedSeqParams(cu_seqlens_q=cu_tensor, cu_seqlens_q_padded=padded)
        shape = (rows,)
    else:
        rows = 24 // cp
        shape = (rows, batch)
    q = torch.randn(*shape, heads[0], HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(*shape, heads[1], HEAD_DIM, requires_grad=True) for _ in range(2))
    with comm.counting_sent_bytes() as sent:
        out = zigzag_attention(
            q, k, v, dist.group.WORLD, packed_seq_params=params, mode=mode, check_consensus=checked, **groups
        )
        out.sum().backward()
    flags = not checked and attention._KERNELS[attention._choose_kernel("auto", mode, q)].needs_finite_inputs
    model = bytes_sent_per_layer(mode, cp, rows * batch, *heads, HEAD_DIM, 4, ulysses_size=ulysses, finite_flags=flags)
    return sent.total, model


@pytest.mark.parametrize(
    ("mode", "cp", "heads", "ulysses"),
    [
        ("allgather", 2, (4, 2), 1),
        ("allgather", 3, (6, 1), 1),
        ("ring", 2, (4, 2), 1),
        ("ring", 3, (6, 3), 1),
        ("ulysses", 2, (4, 2), 1),
        ("ulysses", 4, (8, 2), 1),
        ("ulysses", 4, (8, 1), 1),
        ("hybrid", 4, (4, 1), 2),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("checked", [True, False])
def test_bytes_sent_equal_the_model(
    mode: str, cp: int, heads: tuple[int, int], ulysses: int, packed: bool, checked: bool
) -> None:
    for counted, model in run_on_ranks(_counted, cp, mode, packed, heads, ulysses, checked, timeout=120):
        assert counted > 0 and counted == model, f"counted {counted} bytes, the model says {model}"


def test_the_cheapest_mode_by_hand():
    """Bytes per token x head dim x element size, from the formulas in docs (worked by hand):
    cp=8, 32 heads / 8 kv: allgather 6*7*8 = 336, ulysses 2*(7/8)*(64+16) = 140 -> ulysses;
    cp=8, 32 / 2: kv replicated to 8 for ulysses (140) vs allgather 6*7*2 = 84 -> allgather;
    cp=16, 8 / 8: ulysses impossible; hybrid u=8: 2*(7/8)*32 + 2*8*(2+2) = 120, allgather 720 -> hybrid u=8."""
    assert choose_attention_mode(8, 32, 8) == ("ulysses", None)
    assert choose_attention_mode(8, 32, 2) == ("allgather", None)
    assert bytes_sent_per_layer("allgather", 8, 1, 32, 2, 1, 1) == 84
    assert choose_attention_mode(16, 8, 8) == ("hybrid", 8)
    assert choose_attention_mode(1, 4, 2) == ("allgather", None)
    assert bytes_sent_per_layer("ulysses", 8, 1, 32, 8, 1, 1) == 140
    assert bytes_sent_per_layer("hybrid", 16, 1, 8, 8, 1, 1, ulysses_size=8) == 120


def test_head_counts_are_found_in_the_reference_model_and_hf_configs():
    assert model_head_counts(LlamaDecoder(LlamaConfig(hidden_size=32, num_heads=4, num_kv_heads=2))) == (4, 2)

    class HFLike(torch.nn.Module):
        config = type("Config", (), {"num_attention_heads": 16, "num_key_value_heads": 4})()

    assert model_head_counts(HFLike()) == (16, 4)
    assert model_head_counts(torch.nn.Linear(2, 2)) is None


def test_the_strategy_resolves_auto_from_the_module_heads():
    from lightning_cp import CPZigzagStrategy
    from lightning_cp.train.models import LlamaLM

    strategy = CPZigzagStrategy(attention_mode="auto")
    strategy._lightning_module = LlamaLM(hidden_size=64, num_layers=1, num_heads=16, num_kv_heads=16)
    strategy._choose_attention_mode(4)
    assert (strategy.attention_mode, strategy.ulysses_size) == ("ulysses", None)
    strategy._lightning_module = torch.nn.Linear(2, 2)
    strategy.attention_mode = "auto"
    strategy._choose_attention_mode(4)
    assert (strategy.attention_mode, strategy.ulysses_size) == ("allgather", None)
