"""``CPZigzagStrategy`` (``strategy="cp_zigzag"``): DDP over data x context parallel ranks of a device mesh."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cp.core import comm
from lightning_cp.core.attention.api import MODES, AttentionMode
from lightning_cp.core.attention.cost import choose_attention_mode, model_head_counts
from lightning_cp.core.mesh import (
    ContextParallelMesh,
    build_context_parallel_mesh,
    resolve_parallel_dims,
    validate_parallel_sizes,
)
from lightning_cp.core.step import ContextParallelSetting
from lightning_cp.core.zigzag import LAYOUT_NAMES
from lightning_cp.lightning import dtensor_params
from lightning_cp.lightning.callback import ContextParallelLayoutCallback


class CPZigzagStrategy(DDPStrategy):
    """Context parallelism for any LightningModule: a data x context x tensor parallel mesh, DDP over DP x CP.

    Args:
        context_parallel_size: ranks sharing one sequence; ``None`` = the devices of a node (divided by tp).
        tensor_parallel_size: ranks of one tensor-parallel group (applied by the module's ``configure_model``).
        data_parallel_size: replicas; ``"auto"`` = world size / (cp x tp).
        sequence_parallel: the residual stream is also sharded over the TP ranks (needs tp > 1).
        boundary_layout: layout of the residual stream outside the wrapped layers, ``"contiguous"`` or ``"zigzag"``.
        attention_mode: ``"allgather"`` (all-gather K/V), ``"ring"`` (pass K/V blocks around the CP ring),
            ``"ulysses"`` (exchange heads for the sequence; the heads must divide by cp), ``"hybrid"`` (Ulysses
            within groups of ``ulysses_size`` neighbouring ranks, ring attention across the groups) or ``"auto"``
            (the mode that sends the fewest bytes for the model's head counts, chosen when processes start).
        ulysses_size: the Ulysses part of CP under ``"hybrid"`` (it divides cp and is smaller).
        **kwargs: the usual ``DDPStrategy`` options (``process_group_backend``, ``timeout``, ``start_method``) and
            keyword arguments of ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph``, ...).

    Every CP and TP rank of a replica sees the same batch (the sampler splits over DP only); gradients are averaged
    over DP x CP; checkpoints hold the plain, full module state and load at any cp or under any other strategy. The
    mesh is ``trainer.strategy.device_mesh`` and ``LightningModule.device_mesh`` in ``configure_model``, where
    tensor parallelism is applied with DTensors (DDP reduces their local shards). With ``sequence_parallel`` every
    parameter must be a DTensor: plain parameters get no gradient reduction over the TP ranks.
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
        if attention_mode not in (*MODES, "auto"):
            expected = ", ".join(repr(mode) for mode in (*MODES, "auto"))
            raise ValueError(f"attention_mode={attention_mode!r} is invalid: expected one of {expected}")
        hybrid = attention_mode == AttentionMode.HYBRID.value
        bad_size = isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 2
        mismatch = hybrid != (ulysses_size is not None)
        if mismatch or (ulysses_size is not None and bad_size):
            raise ValueError(
                f"attention_mode={attention_mode!r} with ulysses_size={ulysses_size!r}: 'hybrid' needs an integer "
                "ulysses_size >= 2, the other modes take none ('auto' picks its own)"
            )
        if hybrid and sequence_parallel:
            raise ValueError("attention_mode='hybrid' does not combine with sequence_parallel=True")
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
        self._cp_setting: ContextParallelSetting | None = None
        self._localized_parameters: dtensor_params.LocalizedTensorParallelParameters | None = None

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
        context_parallel_size = self.context_parallel_size or max(1, self.num_processes // self.tensor_parallel_size)
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
        mode, ulysses = ("allgather", None) if counts is None else choose_attention_mode(context_parallel_size, *counts)
        if mode == "hybrid" and self.sequence_parallel:
            mode, ulysses = "allgather", None
        found = "no head counts found" if counts is None else f"{counts[0]} query / {counts[1]} key-value heads"
        rank_zero_info(f"cp_zigzag: attention_mode='auto' chose {mode!r} (cp={context_parallel_size}, {found})")
        self.attention_mode, self.ulysses_size = mode, ulysses

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Like ``DDPStrategy.setup``, but evaluation synchronises weights over DP x CP instead of the whole world."""
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)
        else:
            comm.broadcast_module_states(self.model, self.cp_mesh.dp_cp_group)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """Wrap the model in DDP over the DP x CP group (tensor-parallel DTensor parameters reduced as local shards)."""
        self._localized_parameters = dtensor_params.LocalizedTensorParallelParameters(model)
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model, device_ids=device_ids, process_group=self.cp_mesh.dp_cp_group, **self._ddp_kwargs
        )

    @override
    def teardown(self) -> None:
        """Make tensor-parallel parameters DTensors again, then tear down as DDP does."""
        if self._localized_parameters is not None:
            self._localized_parameters.restore()
            self._localized_parameters = None
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Return the module state with tensor-parallel parameters gathered, so checkpoints load at any parallelism."""
        assert self.lightning_module is not None
        return dtensor_params.full_module_state(self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a full-state checkpoint, cutting this rank's shard of every tensor-parallel parameter.

        The module is put in the Trainer's precision first (Lightning restores before it converts), so ``64-true``
        weights never pass through float32 and a resumed run continues bit-exactly.
        """
        assert self.lightning_module is not None
        self.precision_plugin.convert_module(self.lightning_module)
        dtensor_params.load_full_module_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"cp_zigzag"``."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Context parallelism with zigzag attention over a device mesh"
            )


CPZigzagStrategy.register_strategies(StrategyRegistry)
