"""Failures in the Lightning glue and the main job that must reach every rank or name their cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_cp.core.mesh import ContextParallelMesh
from lightning_cp.core.runtime import ContextParallelRuntime, LayerPolicy
from lightning_cp.core.step import ContextParallelSetting
from lightning_cp.lightning import state
from lightning_cp.train import runfolder
from lightning_cp.train.config import ConfigError, load_config
from lightning_cp.train.runner import build_trainer, load_fitting_weights, validate


@pytest.mark.parametrize("error", [OSError("disk full"), TypeError("cannot pickle 'generator' object")])
def test_a_failure_on_global_rank_0_reaches_every_rank(error: Exception) -> None:
    """Whatever rank 0's part of a checkpoint folder raises is broadcast, so the other ranks raise it too instead of
    waiting in the broadcast for ever."""

    def fail() -> None:
        raise error

    told = []
    for is_global_zero in (True, False):
        with pytest.raises(RuntimeError, match=f"not written: {type(error).__name__}: "):
            state._on_global_zero(is_global_zero, lambda failure: told.append(failure) or told[0], Path("x"), fail)
    assert told[0] == f"{type(error).__name__}: {error}"


def test_a_count_of_step_checkpoints_keeps_the_newest() -> None:
    """``checkpoint.save_top_k: 3`` builds a Trainer (Lightning needs a quantity to rank by: the step, newest kept)."""
    trainer = build_trainer(load_config(None, ["checkpoint.save_top_k=3"]), Path("unused"), log=False)
    (checkpoint,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert (checkpoint.save_top_k, checkpoint.monitor, checkpoint.mode) == (3, "step", "max")


@pytest.mark.parametrize(("bounds", "title"), [([], "Training"), (["trainer.max_epochs=3"], "Epoch 0/2")])
def test_the_progress_bar_names_no_epoch_bound_a_run_of_max_steps_alone_lacks(bounds: list[str], title: str) -> None:
    """With ``max_steps`` alone Lightning sets ``max_epochs=-1``, which its rich bar would show as "Epoch 0/-2"."""
    trainer = build_trainer(load_config(None, bounds), Path("unused"), log=False)
    bar = trainer.progress_bar_callback
    bar.setup(trainer, None, "fit")  # as Lightning does before training
    assert bar._get_train_description(0).strip() == title


def test_validate_without_validation_data_says_so() -> None:
    cfg = load_config(None, ["data.val_fraction=0", "checkpoint.init_from=/some/checkpoint.ckpt"])
    with pytest.raises(ConfigError, match="validate needs validation data"):
        validate(cfg)


def test_only_the_first_process_of_a_launch_checks_the_run_folder(tmp_path: Path, monkeypatch) -> None:
    """Under SLURM (``SLURM_PROCID``, no ``RANK``) or on a later node, other processes find the folder rank 0 has
    just written and must not call it another run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ConfigError, match="holds another run"):
        runfolder.check_fresh_or_resumed(run_dir, resuming=False)
    monkeypatch.setattr(runfolder.rank_zero_only, "rank", 3)
    runfolder.check_fresh_or_resumed(run_dir, resuming=False)
    monkeypatch.setattr(runfolder.rank_zero_only, "rank", 0)
    monkeypatch.setenv("NODE_RANK", "1")
    runfolder.check_fresh_or_resumed(run_dir, resuming=False)


class _KeywordBlock(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def test_a_block_given_its_residual_as_a_keyword_is_a_clear_error() -> None:
    model = nn.Sequential()
    model.add_module("AttentionBlock", _KeywordBlock())
    runtime = ContextParallelRuntime(
        ContextParallelSetting(ContextParallelMesh.single_process()),
        LayerPolicy(zigzag_layers=("AttentionBlock",), contiguous_layers=()),
    )
    runtime.wrap(model)
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    with runtime.step(batch), pytest.raises(TypeError, match="no residual stream as its first positional argument"):
        model.AttentionBlock(hidden_states=torch.zeros(1, 4, 8))


def test_a_checkpoint_file_replaces_a_checkpoint_folder_of_its_name(tmp_path: Path) -> None:
    """Resumed from a distributed checkpoint with ``checkpoint.distributed`` off, ``last.ckpt`` becomes a file."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"old")
    runfolder.AtomicCheckpointIO().save_checkpoint({"global_step": 4}, folder)
    assert folder.is_file() and torch.load(folder)["global_step"] == 4
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_checkpoint_folder_saved_before_the_first_optimizer_step_loads(tmp_path: Path) -> None:
    """An optimizer without state yet (saved before its first step, or one whose steps a grad scaler skipped) is
    saved as its groups alone; loading that folder leaves it fresh instead of asking DCP for state it never had."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    module, fresh = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    folder = tmp_path / "step000000.ckpt"
    shards = {"state_dict": state.model_state(module, full=False)}
    shards["optimizer_0"] = state.optimizer_state(module, optimizer, full=False)
    dcp.save(shards, checkpoint_id=folder)
    torch.save({"global_step": 0}, folder / state.META_FILE)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert state.load_distributed(folder, fresh, [fresh_optimizer])["global_step"] == 0
    assert torch.equal(fresh.weight, module.weight) and not fresh_optimizer.state


def test_a_checkpoint_folder_loads_non_strictly_into_a_module_with_more_parameters(tmp_path: Path) -> None:
    """``strict_loading = False`` (a module that grew a head since): the folder's weights load, the new ones stay as
    they were; strict loading names the missing key."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(3, 2))
    folder = tmp_path / "last.ckpt"
    state.save_distributed({"state_dict": state.model_state(saved, full=False)}, folder, True, lambda outcome: outcome)
    grown = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    new_head = grown[1].weight.detach().clone()
    state.load_distributed(folder, grown, [], strict=False)
    assert torch.equal(grown[0].weight, saved[0].weight) and torch.equal(grown[1].weight, new_head)
    with pytest.raises(RuntimeError, match=r"missing \[.1\.bias., .1\.weight.\], unexpected \[\]"):
        state.load_distributed(folder, nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)), [], strict=True)


def test_full_weights_lacking_some_of_the_module_are_refused_when_strict() -> None:
    """A checkpoint file's full weights into a module with more: strict names the missing ones (torch's full-state
    loading checks only extra ones), non-strict loads what the file holds."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(3, 2))
    grown = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"missing \['1\.bias', '1\.weight'\] \(set the module's strict_loading"):
        state.load_model_state(grown, saved.state_dict(), strict=True)
    state.load_model_state(grown, saved.state_dict(), strict=False)
    assert torch.equal(grown[0].weight, saved[0].weight)


def test_a_checkpoint_folder_lacking_weights_cannot_resume_the_optimizer(tmp_path: Path) -> None:
    """Non-strict, with optimizer state saved: the folder's state is not this module's optimizer's, a clear error
    (DCP's own is a ``BaseException``, which ``except Exception`` misses)."""
    saved = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(saved.parameters())
    saved(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    checkpoint = {"state_dict": state.model_state(saved, full=False)}
    checkpoint["optimizer_states"] = [state.optimizer_state(saved, optimizer, full=False)]
    folder = tmp_path / "last.ckpt"
    state.save_distributed(checkpoint, folder, True, lambda outcome: outcome)
    grown = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"lacks weights of this module \(\['1\.bias', '1\.weight'\]\)"):
        state.load_distributed(folder, grown, [torch.optim.AdamW(grown.parameters())], strict=False)


def test_initial_weights_that_do_not_fit_the_model_are_named_in_one_line() -> None:
    """Missing, unexpected and differently shaped entries, and two entries the model ties (one tensor) that the
    checkpoint holds apart: loading them would silently keep whichever came last."""
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    apart = {"0.weight": torch.randn(5, 3), "1.weight": torch.randn(5, 3)}
    with pytest.raises(ConfigError, match=r"^checkpoint.init_from=x.ckpt does not fit the model: 0.weight is tied"):
        load_fitting_weights(tied, apart, "x.ckpt")
    same = {"0.weight": apart["0.weight"], "1.weight": apart["0.weight"]}
    load_fitting_weights(tied, same, "x.ckpt")
    assert torch.equal(tied[1].weight, same["0.weight"])
    other = {"0.weight": torch.randn(6, 3), "2.weight": torch.randn(1)}
    with pytest.raises(
        ConfigError, match=r"fit the model: missing 1.weight; unexpected 2.weight; 0.weight is \[6, 3\] "
    ):
        load_fitting_weights(tied, other, "x.ckpt")


def test_a_checkpoint_folder_of_untied_weights_is_refused_by_a_module_that_ties_them(tmp_path: Path) -> None:
    """``init_from`` a folder: two entries the module ties (one tensor) but the folder holds apart would load
    silently as whichever came last; they are named. The untied module it was saved from loads it exactly."""
    torch.manual_seed(0)
    untied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    folder = tmp_path / "last.ckpt"
    state.save_distributed({"state_dict": state.model_state(untied, full=False)}, folder, True, lambda outcome: outcome)
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(
        ValueError, match=r"holds 1.weight apart from the weights this module ties them to \(0.weight\)"
    ):
        state.load_distributed_weights(tied, folder)
    again = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    state.load_distributed_weights(again, folder)
    assert all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), untied.state_dict().values(), strict=True)
    )
