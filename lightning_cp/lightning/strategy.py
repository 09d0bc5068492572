"""``CPZigzagStrategy`` (``strategy="cp_zigzag"``): DDP or FSDP2 over the data x context ranks of a device mesh."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Generator, Mapping, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.data import has_len
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cp.core import comm
from lightning_cp.core.attention.api import MODES, AttentionMode
from lightning_cp.core.attention.cost import choose_attention_mode, model_head_counts
from lightning_cp.core.mesh import (
    TENSOR_PARALLEL,
    ContextParallelMesh,
    build_context_parallel_mesh,
    check_ulysses_size,
    default_context_parallel_size,
    resolve_parallel_dims,
    validate_parallel_sizes,
)
from lightning_cp.core.runtime import select_layers
from lightning_cp.core.step import ContextParallelSetting
from lightning_cp.core.zigzag import LAYOUT_NAMES
from lightning_cp.lightning import fsdp, state
from lightning_cp.lightning.callback import ContextParallelLayoutCallback


def check_attention_settings(
    attention_mode: str, ulysses_size: int | None, sequence_parallel: bool, context_parallel_size: int | None
) -> None:
    """Check the strategy's attention arguments as far as they need no world size (``context_parallel_size`` None:
    not known yet); raise ``ValueError`` naming them. The strategy checks them when made, a run's config earlier."""
    if attention_mode not in (*MODES, "auto"):
        expected = ", ".join(repr(mode) for mode in (*MODES, "auto"))
        raise ValueError(f"attention_mode={attention_mode!r} is invalid: expected one of {expected}")
    hybrid = attention_mode == AttentionMode.HYBRID.value
    bad_size = isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 2
    if hybrid != (ulysses_size is not None) or (ulysses_size is not None and bad_size):
        raise ValueError(
            f"attention_mode={attention_mode!r} with ulysses_size={ulysses_size!r}: 'hybrid' needs an integer "
            "ulysses_size >= 2, the other modes take none ('auto' picks its own)"
        )
    if hybrid and sequence_parallel:
        raise ValueError("attention_mode='hybrid' does not combine with sequence_parallel=True")
    if hybrid and context_parallel_size is not None:
        check_ulysses_size(context_parallel_size, ulysses_size)


class CPZigzagStrategy(DDPStrategy):
    """Context parallelism for any LightningModule: a data x context x tensor parallel mesh, DDP or FSDP2 over DP x CP.

    Args:
        context_parallel_size: ranks sharing one sequence; ``None`` = the devices of a node (divided by tp).
        tensor_parallel_size: ranks of one tensor-parallel group (applied by the module's ``configure_model`` with
            ``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``; needs ``data_parallel="fsdp"``).
        data_parallel_size: replicas; ``"auto"`` = world size / (cp x tp).
        sequence_parallel: the residual stream is also sharded over the TP ranks (needs tp > 1).
        boundary_layout: layout of the residual stream outside the wrapped layers, ``"contiguous"`` or ``"zigzag"``.
        attention_mode: ``"allgather"`` (all-gather K/V), ``"ring"`` (pass K/V blocks around the CP ring),
            ``"ulysses"`` (exchange heads for the sequence; the heads must divide by cp), ``"hybrid"`` (Ulysses
            within groups of ``ulysses_size`` neighbouring ranks, ring attention across the groups) or ``"auto"``
            (the mode that sends the fewest bytes for the model's head counts, chosen when processes start).
        ulysses_size: the Ulysses part of CP under ``"hybrid"`` (it divides cp and is smaller).
        data_parallel: ``"ddp"`` (every rank holds the whole model; small models) or ``"fsdp"`` (FSDP2
            ``fully_shard`` over the flattened data x context mesh, per layer the layout policy wraps and at the root,
            unless ``configure_model`` sharded the module itself): parameters, gradients and optimizer state per rank
            are 1 / (dp x cp) of the whole.
        reshard_after_forward: (fsdp) free each layer's gathered weights after its forward and gather them again for
            the backward (less memory, one more all-gather per layer).
        cpu_offload: (fsdp) keep parameters, gradients and optimizer state on the CPU between uses.
        save_distributed_checkpoint: write checkpoints as a folder of shards from every rank (torch distributed
            checkpoint, loads at any world size) instead of one full-state file written by rank 0.
        **kwargs: the usual ``DDPStrategy`` options (``process_group_backend``, ``timeout``, ``start_method``) and
            keyword arguments of ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph``, ...).

    Every CP and TP rank of a replica sees the same batch (the sampler splits over DP only); gradients are averaged
    over DP x CP; checkpoints hold the full module and optimizer state keyed by parameter name (through
    ``torch.distributed.checkpoint.state_dict``) and load at any (dp, cp, tp, ddp|fsdp), the weights also under
    any other strategy. The mesh is ``trainer.strategy.device_mesh`` and ``LightningModule.device_mesh`` in
    ``configure_model``. With ``sequence_parallel`` every parameter must be a DTensor on the TP mesh (replicated
    ones as ``SequenceParallel`` makes them): a plain parameter's gradient would miss the other TP ranks' tokens.
    """

    strategy_name = "cp_zigzag"

    def __init__(
        self,
        context_parallel_size: int | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        sequence_parallel: bool = False,
        boundary_layout: Literal["contiguous", "zigzag"] = "contiguous",
        attention_mode: Literal["allgather", "ring", "ulysses", "hybrid", "auto"] = "allgather",
        ulysses_size: int | None = None,
        data_parallel: fsdp.DataParallel = "ddp",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        validate_parallel_sizes(context_parallel_size, tensor_parallel_size, data_parallel_size, sequence_parallel)
        if boundary_layout not in LAYOUT_NAMES:
            raise ValueError(f"boundary_layout={boundary_layout!r} is invalid: expected 'contiguous' or 'zigzag'")
        check_attention_settings(attention_mode, ulysses_size, sequence_parallel, context_parallel_size)
        if data_parallel not in fsdp.DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel={data_parallel!r} is invalid: expected 'ddp' or 'fsdp'")
        if start_method != "popen" and data_parallel == "fsdp":
            raise ValueError(
                f"start_method={start_method!r} with data_parallel='fsdp': the launching process would have to take "
                "the sharded weights back when fit ends, which it cannot; use start_method='popen' (the default) or "
                "data_parallel='ddp'"
            )
        if tensor_parallel_size != 1 and data_parallel != "fsdp":
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs data_parallel='fsdp': FSDP2 reduces the gradients "
                "of tensor-parallel DTensor parameters, DDP cannot"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self.context_parallel_size = context_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.sequence_parallel = sequence_parallel
        self.boundary_layout = boundary_layout
        self.attention_mode = attention_mode
        self.ulysses_size = ulysses_size
        self.data_parallel = data_parallel
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._cp_setting: ContextParallelSetting | None = None
        self._loaded_folder = False

    @property
    def cp_setting(self) -> ContextParallelSetting:
        """Return the run's parallel setting: the mesh and the CP options (available once processes are started)."""
        if self._cp_setting is None:
            raise RuntimeError("the cp_zigzag device mesh exists only after the strategy set up its processes")
        return self._cp_setting

    @property
    def cp_mesh(self) -> ContextParallelMesh:
        """Return the mesh and its groups (available once processes are initialised)."""
        return self.cp_setting.mesh

    @property
    def device_mesh(self) -> Any:
        """Return the ``DeviceMesh`` with dimensions ``data_parallel``, ``context_parallel``, ``tensor_parallel``
        (under ``hybrid``, ``context_parallel`` is flattened from ``context_parallel_ring`` x ``..._ulysses``)."""
        return self.cp_mesh.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Split data over the data-parallel replicas only."""
        return {"num_replicas": self.cp_mesh.dims.data_parallel, "rank": self.cp_mesh.dp_rank}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch and copy a dict batch, so the callback's in-place sharding never touches the dataset's."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return copy.copy(batch) if isinstance(batch, MutableMapping) else batch

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Attach the model and add a default ``ContextParallelLayoutCallback`` unless the trainer has one."""
        super().connect(model)
        trainer = model._trainer
        if trainer is not None and not any(isinstance(cb, ContextParallelLayoutCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(ContextParallelLayoutCallback())

    @override
    def setup_environment(self) -> None:
        """Check the sizes against the world size, start the process group, build the mesh and wait for all ranks."""
        context_parallel_size = default_context_parallel_size(
            self.context_parallel_size, self.num_processes, self.tensor_parallel_size
        )
        if self.attention_mode == "auto":
            self._choose_attention_mode(context_parallel_size)
        dims = resolve_parallel_dims(
            self.num_nodes * self.num_processes,
            context_parallel_size,
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.sequence_parallel,
            self.ulysses_size or 1,
        )
        if self.cpu_offload and self.root_device.type == "cuda" and self._process_group_backend in (None, "nccl"):
            self._process_group_backend = "cpu:gloo,cuda:nccl"  # offloaded DTensors (norms, checkpoints) reduce on CPU
        super().setup_environment()
        mesh = build_context_parallel_mesh(self.root_device.type, dims)
        self._cp_setting = ContextParallelSetting(
            mesh, self.sequence_parallel, self.boundary_layout, self.attention_mode
        )
        self.barrier("cp_zigzag mesh built")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh.device_mesh

    def _choose_attention_mode(self, context_parallel_size: int) -> None:
        """Resolve ``attention_mode="auto"`` from the module's head counts (all-gather when they cannot be found)."""
        counts = model_head_counts(self.lightning_module)
        if counts is not None:  # each tensor-parallel rank attends with its share of the heads
            counts = (max(1, counts[0] // self.tensor_parallel_size), max(1, counts[1] // self.tensor_parallel_size))
        mode, ulysses = ("allgather", None) if counts is None else choose_attention_mode(context_parallel_size, *counts)
        if mode == "hybrid" and self.sequence_parallel:
            mode, ulysses = "allgather", None
        found = "no head counts found" if counts is None else f"{counts[0]} query / {counts[1]} key-value heads"
        rank_zero_info(f"cp_zigzag: attention_mode='auto' chose {mode!r} (cp={context_parallel_size}, {found})")
        self.attention_mode, self.ulysses_size = mode, ulysses

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Like ``DDPStrategy.setup``, with FSDP2 under ``data_parallel="fsdp"``; evaluation under DDP synchronises
        weights over DP x CP instead of the whole world."""
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        mesh = self.cp_mesh
        sharded = fsdp.check_wrapping(self.model, self.data_parallel, mesh.dims.data_parallel * mesh.cp_size)
        if self.sequence_parallel and self.tensor_parallel_size > 1:
            self._require_tensor_parallel_parameters()
        if self.tensor_parallel_size > 1 and str(self.precision_plugin.precision) == "16-mixed":
            raise ValueError(
                "precision='16-mixed' with tensor_parallel_size > 1: the gradient scaler's inf check is not reduced "
                "over the tensor-parallel ranks, which would step apart; use 'bf16-mixed'"
            )
        if self.data_parallel == "fsdp":
            if not sharded:
                self._shard(trainer)
            self._clip_over_meshes()
        elif fitting:
            self.configure_ddp()
        else:
            comm.broadcast_module_states(self.model, mesh.dp_cp_group)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _require_tensor_parallel_parameters(self) -> None:
        """Under sequence parallelism every parameter must live on the TP mesh: a plain one would see only its TP
        rank's tokens (its gradient too) and drift apart, silently."""
        for name, parameter in self.lightning_module.named_parameters():
            mesh_names = parameter.device_mesh.mesh_dim_names if isinstance(parameter, DTensor) else None
            if TENSOR_PARALLEL not in (mesh_names or ()):
                raise ValueError(
                    f"sequence_parallel=True needs every parameter as a DTensor on the tensor-parallel mesh (a "
                    f"configure_model plan, replicated ones as SequenceParallel makes them), but {name!r} is not; "
                    "apply a tensor-parallel plan to the whole model, or turn sequence_parallel off"
                )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under ``fsdp`` with several replicas, refuse on every rank an evaluation or predict loader with a length
        that gives the replicas different numbers of batches: each forward gathers weights over every replica, so a
        replica with one batch more would wait for the others for good (the predict sampler does not pad; a loader
        that splits validation or test data itself may not either). Training is Lightning's as under DDP."""
        mesh, trainer = self.cp_mesh, self.lightning_module.trainer
        stage = trainer.state.stage
        limits = {
            RunningStage.VALIDATING: ("validation", trainer.limit_val_batches),
            RunningStage.SANITY_CHECKING: ("validation", trainer.limit_val_batches),
            RunningStage.TESTING: ("test", trainer.limit_test_batches),
            RunningStage.PREDICTING: ("predict", trainer.limit_predict_batches),
        }
        if stage not in limits or self.data_parallel != "fsdp" or mesh.dims.data_parallel == 1:
            return dataloader
        name, limit = limits[stage]
        count = len(dataloader) if has_len(dataloader) else -1
        if count > 0:  # as Lightning applies the limit (not the sanity check's: validation in fit reuses the loader)
            count = min(count, limit) if isinstance(limit, int) else int(count * limit)
        if comm.differing_fields([count], mesh.dp_cp_group):
            replicas = mesh.dims.data_parallel
            advice = (
                f"make the number of predict batches a multiple of {replicas} (the predict sampler does not pad), or "
                "predict with data_parallel='ddp'"
                if stage == RunningStage.PREDICTING
                else "give every replica as many batches (Lightning's distributed sampler pads them; with "
                "use_distributed_sampler=False that is up to your loader)"
            )
            raise ValueError(
                f"the {name} loader under data_parallel='fsdp' gives the {replicas} data-parallel replicas different "
                f"numbers of batches, and every forward gathers the weights over all of them: {advice}"
            )
        return dataloader

    @override
    def teardown(self) -> None:
        """Under FSDP2, as Lightning's ``ModelParallelStrategy``: the module stays where it is, since moving it to the
        CPU after a step that failed mid-forward (its parameters still gathered) would raise over that step's error."""
        if self.data_parallel != "fsdp":
            super().teardown()
            return
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def _shard(self, trainer: pl.Trainer) -> None:
        """Start every rank from global rank 0's weights (tensor-parallel shards from the DP x CP rank 0 holding the
        same shard), then ``fully_shard`` each layer the layout policy wraps, then the root."""
        assert self.model is not None
        mesh = self.cp_mesh
        comm.broadcast_module_states(self.model, mesh.dp_cp_group, mesh.tp_group)
        policy = next(cb for cb in trainer.callbacks if isinstance(cb, ContextParallelLayoutCallback)).policy
        blocks = [module for module, _ in select_layers(self.model, policy.zigzag_layers, policy.contiguous_layers)]
        fsdp.shard_module(
            self.model,
            blocks,
            mesh.data_context_mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=fsdp.mixed_precision_policy(str(self.precision_plugin.precision)),
            offload=fsdp.offload_policy(self.cpu_offload),
        )

    def _clip_over_meshes(self) -> None:
        """Clip gradient norms with ``fsdp.clip_grad_norm_``: FSDP2 and tensor parallelism leave DTensor gradients on
        two meshes, which the precision plugin's single ``clip_grad_norm_`` cannot combine."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            fsdp.clip_grad_norm_(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """Wrap the model in DDP over the DP x CP group."""
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model, device_ids=device_ids, process_group=self.cp_mesh.dp_cp_group, **self._ddp_kwargs
        )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduction of accumulation steps before the last (FSDP: reduce-scatter once per step)."""
        if not isinstance(self.model, FSDPModule):
            with super().block_backward_sync():
                yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _redirected_step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``LightningModule.<name>`` through the module's ``__call__``, so FSDP's root hooks run around it."""
        assert self.model is not None and self.lightning_module is not None
        with context:
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the training step (through FSDP's root hooks under ``fsdp``)."""
        if self.data_parallel != "fsdp":
            return super().training_step(*args, **kwargs)
        return self._redirected_step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the validation step (through FSDP's root hooks under ``fsdp``)."""
        if self.data_parallel != "fsdp":
            return super().validation_step(*args, **kwargs)
        return self._redirected_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the test step (through FSDP's root hooks under ``fsdp``)."""
        if self.data_parallel != "fsdp":
            return super().test_step(*args, **kwargs)
        return self._redirected_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the predict step (through FSDP's root hooks under ``fsdp``)."""
        if self.data_parallel != "fsdp":
            return super().predict_step(*args, **kwargs)
        return self._redirected_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after ``setup``: states load into the sharded module and its optimizer, in the Trainer's
        precision (``64-true`` weights never pass through float32, so a resumed run continues bit-exactly)."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """Let Lightning restore the optimizers, unless a checkpoint folder already loaded them."""
        return not self._loaded_folder

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Return the module state: full tensors on global rank 0, or this rank's shards for a checkpoint folder."""
        assert self.lightning_module is not None
        return state.model_state(self.lightning_module, full=not self.save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Return the optimizer state keyed by parameter name (full on global rank 0, or shards for a folder)."""
        assert self.lightning_module is not None
        full = not self.save_distributed_checkpoint
        return state.optimizer_state(self.lightning_module, _unwrapped(optimizer), full=full)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a full-state checkpoint, cutting this rank's shard of every sharded parameter (a checkpoint folder
        was loaded by ``load_checkpoint`` already)."""
        assert self.lightning_module is not None
        if not self._loaded_folder:
            state.load_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's full state (keyed by parameter name, or by index as ``Optimizer.state_dict``)."""
        assert self.lightning_module is not None
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            state.load_optimizer_state(self.lightning_module, _unwrapped(optimizer), saved)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint: one file from global rank 0, or a folder of shards from every rank. A file replaces
        a checkpoint folder of the same name (``last.ckpt`` after switching formats), which would otherwise swallow
        it."""
        if not self.save_distributed_checkpoint:
            path, replaced, problem = Path(filepath), None, None
            if self.is_global_zero and path.is_dir():
                if state.is_distributed_checkpoint(path) or not any(path.iterdir()):
                    replaced = path.with_name(path.name + ".replaced")  # kept until the file is written
                    shutil.rmtree(replaced, ignore_errors=True)
                    path.rename(replaced)
                else:
                    problem = f"cannot save the checkpoint file {path}: a folder that is no checkpoint is there"
            problem = self.broadcast(problem)
            if problem:
                raise ValueError(problem)
            try:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            except BaseException:
                if replaced is not None and not path.exists():
                    replaced.rename(path)
                raise
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            return
        state.save_distributed(checkpoint, Path(self.broadcast(str(filepath))), self.is_global_zero, self.broadcast)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint file, or load a checkpoint folder straight into the module and optimizers (resharded)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self._loaded_folder = state.is_distributed_checkpoint(path)
        if not self._loaded_folder:
            return super().load_checkpoint(path, weights_only)
        assert self.lightning_module is not None
        optimizers = [_unwrapped(optimizer) for optimizer in self.optimizers]
        return state.load_distributed(path, self.lightning_module, optimizers, self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint file or folder (global rank 0); a folder is renamed first, so an interrupted removal
        never leaves something that still looks like a checkpoint."""
        path = Path(filepath)
        if self.is_global_zero and path.is_dir():
            self._remove_folder(path)
        else:
            super().remove_checkpoint(filepath)

    @staticmethod
    def _remove_folder(path: Path) -> None:
        """Rename ``path`` aside, then delete it: an interrupted removal never leaves a half folder under its name."""
        removing = path.with_name(path.name + ".removing")
        shutil.rmtree(removing, ignore_errors=True)  # left by a removal that was interrupted
        path.rename(removing)
        shutil.rmtree(removing, ignore_errors=True)  # the other ranks go on: a failure here must not stop rank 0

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"cp_zigzag"``."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Context parallelism with zigzag attention over a device mesh"
            )


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return the torch optimizer behind a ``LightningOptimizer``."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


CPZigzagStrategy.register_strategies(StrategyRegistry)
