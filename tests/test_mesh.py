"""The device mesh (data x context x tensor parallel, tensor fastest) and its CP, TP, TP x CP, DP, DP x CP groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_cp.core import comm
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh, resolve_parallel_dims
from tests.distributed_harness import run_on_ranks

torch.set_num_threads(1)

GROUP_NAMES = ("cp_group", "tp_group", "tp_cp_group", "dp_group", "dp_cp_group")


def groups_of_each_mesh(all_dims: list[ParallelDims]) -> list[dict[str, Any]]:
    """Build each mesh in turn and report this rank's groups (as global ranks) and coordinates."""
    reports = []
    for dims in all_dims:
        mesh = build_context_parallel_mesh("cpu", dims)
        report: dict[str, Any] = {name: comm.group_global_ranks(getattr(mesh, name)) for name in GROUP_NAMES}
        report["coordinates"] = (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank)
        report["dim_names"] = mesh.device_mesh.mesh_dim_names
        reports.append(report)
    dist.barrier()  # no rank may leave (and stop rank 0's store) while another still builds its groups
    return reports


WORLD_4 = {
    "cp4": (
        ParallelDims(1, 4, 1),
        lambda r: {
            "cp_group": (0, 1, 2, 3),
            "tp_group": (r,),
            "tp_cp_group": (0, 1, 2, 3),
            "dp_group": (r,),
            "dp_cp_group": (0, 1, 2, 3),
            "coordinates": (0, r, 0),
        },
    ),
    "dp2xcp2": (
        ParallelDims(2, 2, 1),
        lambda r: {
            "cp_group": (2 * (r // 2), 2 * (r // 2) + 1),
            "tp_group": (r,),
            "tp_cp_group": (2 * (r // 2), 2 * (r // 2) + 1),
            "dp_group": (r % 2, r % 2 + 2),
            "dp_cp_group": (0, 1, 2, 3),
            "coordinates": (r // 2, r % 2, 0),
        },
    ),
    "cp2xtp2": (
        ParallelDims(1, 2, 2),
        lambda r: {
            "cp_group": (r % 2, r % 2 + 2),
            "tp_group": (2 * (r // 2), 2 * (r // 2) + 1),
            "tp_cp_group": (0, 1, 2, 3),
            "dp_group": (r,),
            "dp_cp_group": (r % 2, r % 2 + 2),
            "coordinates": (0, r // 2, r % 2),
        },
    ),
}
WORLD_6_CP3_DP2 = lambda r: {  # noqa: E731 - one expectation table per rank
    "cp_group": tuple(range(3 * (r // 3), 3 * (r // 3) + 3)),
    "tp_group": (r,),
    "tp_cp_group": tuple(range(3 * (r // 3), 3 * (r // 3) + 3)),
    "dp_group": (r % 3, r % 3 + 3),
    "dp_cp_group": (0, 1, 2, 3, 4, 5),
    "coordinates": (r // 3, r % 3, 0),
}


def check(report: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Compare one rank's groups and coordinates with the expectation."""
    assert report["dim_names"] == ("data_parallel", "context_parallel", "tensor_parallel")
    for key, value in expected.items():
        assert report[key] == value, f"{where}: {key} is {report[key]}, expected {value}"


def test_world_4_as_cp4_dp2xcp2_and_cp2xtp2() -> None:
    """Groups of every rank for the three world-4 meshes, built one after another in the same processes."""
    reports = run_on_ranks(groups_of_each_mesh, 4, [dims for dims, _ in WORLD_4.values()])
    for rank, rank_reports in enumerate(reports):
        for (name, (_, expected)), report in zip(WORLD_4.items(), rank_reports, strict=True):
            check(report, expected(rank), f"{name} rank {rank}")


def test_world_6_as_cp3xdp2() -> None:
    """Groups of every rank for dp2 x cp3."""
    reports = run_on_ranks(groups_of_each_mesh, 6, [ParallelDims(2, 3, 1)])
    for rank, (report,) in enumerate(reports):
        check(report, WORLD_6_CP3_DP2(rank), f"cp3xdp2 rank {rank}")


@pytest.mark.parametrize(
    ("world_size", "cp", "tp", "dp", "expected"),
    [
        (4, 4, 1, "auto", ParallelDims(1, 4, 1)),
        (4, 2, 1, "auto", ParallelDims(2, 2, 1)),
        (4, 2, 2, 1, ParallelDims(1, 2, 2)),
        (6, 3, 1, 2, ParallelDims(2, 3, 1)),
        (1, 1, 1, "auto", ParallelDims(1, 1, 1)),
    ],
)
def test_sizes_resolve(world_size: int, cp: int, tp: int, dp: int | str, expected: ParallelDims) -> None:
    """``"auto"`` data parallelism is world / (cp x tp); explicit sizes that fit are kept."""
    assert resolve_parallel_dims(world_size, cp, tp, dp) == expected
    assert expected.world_size == world_size


def test_sequence_parallel_with_tensor_parallelism_is_accepted() -> None:
    """Sequence parallelism needs tp > 1 and nothing else."""
    assert resolve_parallel_dims(4, 2, 2, "auto", sequence_parallel=True) == ParallelDims(1, 2, 2)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((6, 4), "world size 6 is not divisible by context_parallel_size x tensor_parallel_size = 4 x 1 = 4"),
        ((8, 2, 2, 3), "data_parallel_size=3 does not fit world size 8"),
        ((4, 4, 1, "auto", True), "sequence_parallel=True needs tensor_parallel_size > 1"),
        ((4, True), "context_parallel_size=True is invalid"),
        ((4, 2, 1, "half"), "data_parallel_size='half' is invalid"),
    ],
)
def test_bad_sizes_name_the_numbers(arguments: tuple[Any, ...], message: str) -> None:
    """Sizes that do not fit raise ``ValueError`` with the numbers."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_parallel_dims(*arguments)
