"""Row maps of the packed movers: every form they pick copies exactly the mapped rows (no process group)."""

from __future__ import annotations

import pytest
import torch

from lightning_cp.core.layout.movers import _CopyCosts, _RowMap

FORMS = {
    "slices": _CopyCosts(call=0, gather=2, scatter=9),
    "pieces": _CopyCosts(call=100, gather=1, scatter=1000),
    "scattered": _CopyCosts(call=1e9, gather=9, scatter=1),
}


def _mapping(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of source rows (one reversed) onto shuffled runs of destination rows, with gaps on both sides."""
    sources = torch.cat([torch.arange(2, 9), torch.arange(20, 14, -1), torch.arange(30, 41)])
    blocks = list(torch.arange(40).split([7, 3, 6, 4, 11, 9]))
    order = torch.randperm(len(blocks), generator=generator).tolist()
    targets = torch.cat([blocks[i] for i in order if blocks[i].numel() != 3 and blocks[i].numel() != 9])
    return sources, targets[: sources.numel()]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("implicit", [None, "sources", "targets"])
@pytest.mark.parametrize("transposed", [False, True])
def test_every_form_copies_the_mapped_rows(form: str, implicit: str | None, transposed: bool):
    generator = torch.Generator().manual_seed(3)
    sources, targets = _mapping(generator)
    if implicit == "sources":
        sources = torch.arange(targets.numel())
    if implicit == "targets":
        targets = torch.arange(sources.numel())
    row_map = _RowMap.build(
        None if implicit == "sources" else sources, None if implicit == "targets" else targets, FORMS[form]
    )
    if implicit != "targets" or form != "scattered":  # a gather into consecutive rows never needs an index copy
        assert (row_map.scattered is not None) == (form == "scattered")
    source = torch.randn(50, 2, 3, generator=generator)
    destination = torch.zeros(50, 3, 2).transpose(1, 2) if transposed else torch.zeros(50, 2, 3)
    row_map.apply(destination, source)
    expected = torch.zeros(50, 2, 3)
    expected[targets] = source[sources]
    assert torch.equal(destination, expected)
