"""The package's layers, read from its source: core < lightning < train, no cycles, public paths intact."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_cp"
LAYERS = {"core": 0, "lightning": 1, "train": 2}
# Top-level modules: the public surface (``__init__``, the aliases of the spec'd modules, ``python -m``).
SURFACE = 3


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: {imported for imported in _imports(path) if imported in MODULES} for name, path in MODULES.items()}


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else SURFACE


def test_the_three_layers_exist_and_hold_the_modules():
    assert {name.split(".")[1] for name in MODULES if name.count(".") >= 2} == set(LAYERS)
    top_level = sorted(name for name in MODULES if _layer(name) == SURFACE)
    assert top_level == ["lightning_cp", "lightning_cp.__main__", "lightning_cp.attention", "lightning_cp.hf",
                         "lightning_cp.layout", "lightning_cp.packed"]  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_from_a_layer_above_it(name: str):
    above = sorted(imported for imported in GRAPH[name] if _layer(imported) > _layer(name))
    assert not above, f"{name} imports from a layer above it: {above}"


@pytest.mark.parametrize("name", sorted(name for name in MODULES if _layer(name) == LAYERS["core"]))
def test_the_core_imports_no_lightning_and_no_transformers(name: str):
    outside = {"lightning", "pytorch_lightning", "transformers", "tokenizers"}
    imported = sorted(module for module in _imports(MODULES[name]) if module.split(".")[0] in outside)
    assert not imported, f"{name} imports {imported}"


DISTRIBUTED_TYPES = {"ProcessGroup", "DeviceMesh", "DTensor"}


def _distributed_uses(path: Path) -> list[str]:
    """``torch.distributed`` names a module imports or reaches, other than the group and mesh types."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            uses += [alias.name for alias in node.names if alias.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            uses += [f"{node.module}.{alias.name}" for alias in node.names if alias.name not in DISTRIBUTED_TYPES]
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed."):
            uses.append(ast.unparse(node))
    return uses


def test_one_core_module_talks_to_torch_distributed():
    talkers = sorted(name for name in MODULES if _layer(name) == LAYERS["core"] and _distributed_uses(MODULES[name]))
    assert talkers == ["lightning_cp.core.comm"], {name: _distributed_uses(MODULES[name]) for name in talkers}


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for imported in sorted(GRAPH[name]):
            if state.get(imported) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(imported) :], imported]))
            if imported not in state:
                visit(imported, [*trail, imported])
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])


def test_public_import_paths_still_work():
    import lightning_cp
    from lightning_cp import attention, layout, packed
    from lightning_cp.core.attention import api as attention_api
    from lightning_cp.core.layout import api as layout_api

    assert (
        layout is layout_api
        and attention is attention_api
        and packed is importlib.import_module("lightning_cp.core.packed")
    )
    spec_names = [
        "CPLayout", "THDCPLayoutPlan", "ContextParallelLayoutManager", "ContextParallelLayoutState",
        "_LayoutRedistributionPlan", "_LayoutParallelContext", "_segments_per_rank", "_local_segment_ids",
        "_segment_owner", "_build_group_rank_by_logical_rank", "_get_group_rank_by_logical_rank",
        "_get_layout_parallel_context", "_build_layout_redistribution_plan",
        "_build_thd_cp_layout_plan_from_rank_order_indices", "_build_thd_rank_order_indices",
        "build_thd_cp_layout_plan", "_redistribute_layout", "_redistribute_thd_layout", "contiguous_to_zigzag",
        "zigzag_to_contiguous",
    ]  # fmt: skip
    assert [name for name in spec_names if not hasattr(layout, name)] == []
    assert callable(attention.zigzag_attention) and callable(attention.attention_work_per_rank)
    assert packed.PackedSeqParams is lightning_cp.PackedSeqParams
    for name in lightning_cp.__all__:
        assert getattr(lightning_cp, name) is not None
