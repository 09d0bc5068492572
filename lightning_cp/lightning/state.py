"""Model and optimizer state through ``torch.distributed.checkpoint``: one portable full-state file, or a folder of
shards written by every rank (DCP) that loads at any other world size.

Full states are keyed by parameter names (FSDP, tensor parallelism and DDP agree on them), so a checkpoint written
under any (dp, cp, tp, ddp|fsdp) loads under any other, and its ``state_dict`` under a plain Lightning strategy.
The folder format is Lightning's ``ModelParallelStrategy`` one: DCP shards of ``state_dict`` and ``optimizer_<i>``
plus ``meta.pt`` with the rest of the checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint folder (DCP writes its ``.metadata`` last, we write ``meta.pt``)."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA_FILE).is_file() and (path / META_FILE).is_file()


def model_state(module: nn.Module, full: bool = True) -> dict[str, Any]:
    """Return the module's state: full tensors on global rank 0 (empty elsewhere), or this rank's shards."""
    return get_model_state_dict(module, options=_GATHERED if full else StateDictOptions())


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, full: bool = True) -> dict[str, Any]:
    """Return the optimizer's state keyed by parameter name: full on global rank 0 (empty elsewhere), or shards.

    Before the first step there is no state to gather: ``get_optimizer_state_dict`` would create it with a step of
    zero learning rate (changing the bias correction of the first real update), so only the groups are returned.
    """
    if not optimizer.state:
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        groups = [{**group, "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
        return {"state": {}, "param_groups": groups}
    return get_optimizer_state_dict(module, optimizer, options=_GATHERED if full else StateDictOptions())


def load_model_state(module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
    """Load full tensors (held by every rank) into the module, cutting this rank's shard of every DTensor; with
    ``strict``, weights the module has and the file lacks are refused as extra ones are (torch checks only these)."""
    missing = sorted(module.state_dict().keys() - state.keys())
    if strict and missing:
        raise RuntimeError(
            f"the checkpoint does not hold this module's weights: missing {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + " (set the module's strict_loading = False to load the ones it holds)"
        )
    set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full optimizer state (keyed by parameter name, or by index as ``Optimizer.state_dict`` writes it); one
    without per-parameter state (saved before the first step, or of a stateless optimizer such as plain SGD) holds
    only its groups' settings, a scheduler's learning rate among them."""
    if not state["state"]:
        _load_group_settings(optimizer, state["param_groups"])
        return
    state = _keyed_by_name(module, optimizer, state)
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _load_group_settings(optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """Set each parameter group's settings (``lr``, ``momentum``, ...) to the saved group's, in order, as
    ``Optimizer.load_state_dict`` does."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


def _keyed_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """Re-key an index-keyed optimizer state (a plain ``Optimizer.state_dict()``) by parameter names."""
    if all(isinstance(key, str) for key in state["state"]):
        return dict(state)
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    index_to_name = {
        index: names[id(parameter)]
        for saved_group, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
        for index, parameter in zip(saved_group["params"], group["params"], strict=True)
    }
    groups = [{**group, "params": [index_to_name[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {index_to_name[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def save_distributed(
    checkpoint: dict[str, Any], path: Path, is_global_zero: bool, broadcast: Callable[[Any], Any]
) -> None:
    """Write a checkpoint folder from every rank: the shards of ``state_dict`` and ``optimizer_states`` through DCP,
    the rest as ``meta.pt``; written under ``<name>.partial`` and renamed, so an interrupted save leaves no folder
    under the real name. A failure of global rank 0's file work is the same ``RuntimeError`` on every rank
    (``broadcast`` shares its outcome), never a rank left waiting."""
    partial = path.with_name(path.name + ".partial")
    replaced = path.with_name(path.name + ".replaced")
    _on_global_zero(is_global_zero, broadcast, path, lambda: shutil.rmtree(partial, ignore_errors=True))
    shards = {"state_dict": checkpoint.pop("state_dict")}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(shards, checkpoint_id=partial)

    def publish() -> None:
        with (partial / META_FILE).open("wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        shutil.rmtree(replaced, ignore_errors=True)  # left by a save killed while it cleaned up
        if path.is_dir():
            path.rename(replaced)
        elif path.exists():
            path.unlink()
        partial.rename(path)
        shutil.rmtree(replaced, ignore_errors=True)

    _on_global_zero(is_global_zero, broadcast, path, publish)


def _on_global_zero(
    is_global_zero: bool, broadcast: Callable[[Any], Any], path: Path, work: Callable[[], None]
) -> None:
    """Run ``work`` on global rank 0 and give every rank its outcome: nothing, or the same error."""
    failure = None
    if is_global_zero:
        try:
            work()
        except Exception as error:  # noqa: BLE001 - any failure must reach the other ranks, or they wait for ever
            failure = f"{type(error).__name__}: {error}"
    failure = broadcast(failure)
    if failure is not None:
        raise RuntimeError(f"checkpoint folder {path} not written: {failure}")


def load_distributed(
    path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load a checkpoint folder into the module and optimizers (DCP reshards to this run's layout) and return the
    rest of the checkpoint; not ``strict``, weights the folder lacks keep their values."""
    model_shards = {"state_dict": model_state(module, full=False)}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing, unexpected = _weight_differences(set(model_shards["state_dict"]), saved)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"checkpoint folder {path} does not hold this module's weights: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (set the module's strict_loading = False to load the ones it holds)"
        )
    dcp.load(model_shards, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(module, model_shards["state_dict"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        if not any(name.startswith(f"{key}.state.") for name in saved):
            groups = {key: optimizer_state(module, optimizer, full=False)}  # no per-parameter state: the settings
            dcp.load(groups, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
            _load_group_settings(optimizer, groups[key]["param_groups"])
            continue
        if missing:
            raise RuntimeError(
                f"checkpoint folder {path} lacks weights of this module ({missing[:5]}), so its optimizer state "
                "cannot resume this module's optimizer: load the weights alone (ckpt_path of validate, test or "
                "predict, or checkpoint.init_from)"
            )
        optimizer_shards = {key: get_optimizer_state_dict(module, optimizer)}  # the template DCP fills
        dcp.load(optimizer_shards, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optimizer_shards[key])
    return torch.load(path / META_FILE, map_location="cpu", weights_only=True)


def _weight_differences(names: set[str], saved: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The module's weight names a folder lacks and the folder's weights the module lacks, sorted."""
    prefix = "state_dict."
    saved_names = {key.removeprefix(prefix) for key in saved if key.startswith(prefix)}
    return sorted(names - saved_names), sorted(saved_names - names)


def load_distributed_weights(module: nn.Module, path: str | Path) -> None:
    """Load the weights of a checkpoint folder into an unsharded module, in one process (``init_from``); weights the
    module ties together (one tensor) that the folder holds as different tensors are refused, naming them."""
    own = module.state_dict()
    first_of: dict[int, str] = {}
    weights = {}
    for name, tensor in own.items():  # a tied entry gets a buffer of its own, to compare with the first
        weights[name] = tensor if first_of.setdefault(tensor.data_ptr(), name) == name else tensor.clone()
    dcp.load({"state_dict": weights}, checkpoint_id=Path(path), no_dist=True)
    apart = [name for name, tensor in weights.items() if tensor is not own[name] and not torch.equal(tensor, own[name])]
    if apart:
        raise ValueError(
            f"checkpoint folder {path} holds {', '.join(apart)} apart from the weights this module ties them to "
            f"({', '.join(first_of[own[name].data_ptr()] for name in apart)}): it is another model's"
        )
    module.load_state_dict(own)
