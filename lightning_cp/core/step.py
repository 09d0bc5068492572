"""One step's context-parallel state: built from a sharded replica batch and the run's setting, active per step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_cp.core.attention.api import MODES, AttentionMode
from lightning_cp.core.layout.api import ContextParallelLayoutManager, ContextParallelLayoutState
from lightning_cp.core.mesh import ContextParallelMesh
from lightning_cp.core.packed import PackedSeqParams, host_copies, host_offsets
from lightning_cp.core.sharding import ShardedBatch
from lightning_cp.core.windows import CausalWindowPlan, build_causal_window_plan, shard_document_starts
from lightning_cp.core.zigzag import (
    CPLayout,
    RankTokens,
    ZigzagGeometry,
    as_layout,
    check_offsets,
    stream_tokens,
    zigzag_padded_lengths,
)


@dataclass(frozen=True)
class ContextParallelSetting:
    """What every step of a run shares: the mesh (groups and sizes) and the options that choose among them.

    ``sequence_parallel``: the residual stream is also sharded over the TP ranks; ``boundary_layout``: the layout of
    the residual stream outside the wrapped layers; ``attention_mode``: ``"allgather"``, ``"ring"``, ``"ulysses"``
    or ``"hybrid"`` (whose Ulysses part is the mesh's ``dims.ulysses``).
    """

    mesh: ContextParallelMesh = field(default_factory=ContextParallelMesh.single_process)
    sequence_parallel: bool = False
    boundary_layout: CPLayout = CPLayout.CONTIGUOUS
    attention_mode: str = "allgather"

    def __post_init__(self) -> None:
        """Accept the boundary layout as a string and check the attention mode."""
        object.__setattr__(self, "boundary_layout", as_layout(self.boundary_layout))
        if self.attention_mode not in MODES:
            expected = " or ".join(repr(mode) for mode in MODES)
            raise ValueError(f"attention_mode={self.attention_mode!r} is invalid: expected {expected}")
        object.__setattr__(self, "attention_mode", AttentionMode(self.attention_mode).value)
        hybrid = self.attention_mode == AttentionMode.HYBRID.value
        if hybrid != (self.mesh.dims.ulysses > 1):
            raise ValueError(
                f"attention_mode={self.attention_mode!r} with a Ulysses mesh part of {self.mesh.dims.ulysses}: "
                "'hybrid' needs ulysses_size >= 2, the other modes take no ulysses_size"
            )
        if hybrid and self.sequence_parallel:
            raise ValueError("attention_mode='hybrid' does not combine with sequence_parallel=True")

    def layer_layout(self, declared: CPLayout) -> CPLayout:
        """Return the layout a wrapped layer declared for attention runs in: ``ulysses`` attends in any layout, so its
        attention layers keep the boundary layout and cost no conversion."""
        if declared is CPLayout.ZIGZAG and self.attention_mode == AttentionMode.ULYSSES.value:
            return self.boundary_layout
        return declared

    @property
    def loss_group(self) -> ProcessGroup | None:
        """Return the group whose ranks together hold the replica's tokens (TP x CP with sequence parallelism)."""
        return self.mesh.tp_cp_group if self.sequence_parallel else self.mesh.cp_group

    def layout_manager(self, layer_layouts: tuple[CPLayout, ...], seq_dim: int) -> ContextParallelLayoutManager:
        """Return the layout manager of a stack of layers with these layouts, over this setting's groups.

        Under ``hybrid`` the zigzag layout spans the ring positions, each position's shard split over its Ulysses
        ranks: the sequence-parallel zigzag layout of the ring group (as CP) and the Ulysses group (as TP).
        """
        mesh = self.mesh
        if self.attention_mode == AttentionMode.HYBRID.value:
            groups = (True, mesh.ring_group, mesh.ulysses_group, mesh.cp_group)
        else:
            groups = (self.sequence_parallel, mesh.cp_group, mesh.tp_group, mesh.tp_cp_group)
        sequence_parallel, cp_group, tp_group, tp_cp_group = groups
        return ContextParallelLayoutManager(
            layer_layouts, self.boundary_layout, sequence_parallel, cp_group, tp_group, tp_cp_group, seq_dim=seq_dim
        )

    @property
    def head_exchange(self) -> int:
        """Return over how many ranks attention splits the heads: cp for ``ulysses``, the Ulysses part for
        ``hybrid``, 1 otherwise."""
        if self.attention_mode == AttentionMode.ULYSSES.value:
            return self.mesh.cp_size
        return self.mesh.dims.ulysses if self.attention_mode == AttentionMode.HYBRID.value else 1

    @property
    def zigzag_ranks(self) -> tuple[int, int]:
        """Return the ranks the zigzag layout spans and how many ranks split each of its shards (tp with SP, the
        Ulysses part under ``hybrid``)."""
        dims = self.mesh.dims
        if self.attention_mode == AttentionMode.HYBRID.value:
            return dims.context_parallel // dims.ulysses, dims.ulysses
        return dims.context_parallel, dims.tensor_parallel if self.sequence_parallel else 1


@dataclass(eq=False)
class ContextParallelStep:
    """What one training/evaluation step shares with the model: the setting, the batch's layout state and geometry.

    ``layout_state`` (``None`` only at cp=1) converts the wrapped layers' residual stream where their layout changes
    and any other per-token tensor of the batch; ``geometry`` describes the batch in the zigzag layout (what the
    attention plans from). Wrapped layers set the current layout on entry and reset it on exit, so ``cp_attention``
    sees the layout of the layer it runs in; outside every wrapped layer it sees the boundary layout. The layout
    state converts where the layer order says the layout changes, so wrapped layers must each run once per forward,
    in module order: ``stream_layout`` follows the residual stream, and a forward that strays is refused
    (``require_stream_at_boundary``, and on entry to a layer) rather than computed in a wrong token order.
    """

    setting: ContextParallelSetting = field(default_factory=ContextParallelSetting)
    contiguous_packed_seq_params: PackedSeqParams | None = None
    layout_state: ContextParallelLayoutState | None = None
    geometry: ZigzagGeometry | None = None
    stream_length: int = 0
    sequence_length: int = 0
    dense_padding: int = 0
    owner: Any = None
    layer_conversion_count: int = 0
    attention_calls: int = 0
    recomputing: bool = False
    marked_layers: set[int] = field(default_factory=set)
    _current_layout: CPLayout | None = None
    _stream_layout: CPLayout | None = None
    _backward_layer: int | None = None
    _active_before_backward: ContextParallelStep | None = None
    _side_input_cache: dict[tuple[int, CPLayout], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _causal_window_plans: dict[tuple, tuple[CausalWindowPlan, ProcessGroup | None]] = field(default_factory=dict)
    _document_starts: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)

    @property
    def cp_size(self) -> int:
        """Return the number of ranks sharing the sequence."""
        return self.setting.mesh.cp_size

    @property
    def cp_group(self) -> ProcessGroup | None:
        """Return the context-parallel group (``None`` at cp=1)."""
        return self.setting.mesh.cp_group

    @property
    def attention_mode(self) -> str:
        """Return the attention mode of the run."""
        return self.setting.attention_mode

    @property
    def boundary_layout(self) -> CPLayout:
        """Return the layout outside the wrapped layers."""
        return self.setting.boundary_layout

    @property
    def loss_group(self) -> ProcessGroup | None:
        """Return the group whose ranks together hold the replica's tokens."""
        return self.setting.loss_group

    @property
    def zigzag_packed_seq_params(self) -> PackedSeqParams | None:
        """Return the packed metadata of the zigzag layout (``None`` for dense batches and at cp=1)."""
        return None if self.layout_state is None else self.layout_state.zigzag_packed_seq_params

    @property
    def is_packed(self) -> bool:
        """Return whether this step's batch is packed."""
        return self.contiguous_packed_seq_params is not None

    @property
    def current_layout(self) -> CPLayout:
        """Return the layout of the wrapped layer running now, else the boundary layout."""
        return self.boundary_layout if self._current_layout is None else self._current_layout

    @property
    def stream_layout(self) -> CPLayout:
        """Return the layout the residual stream is in during the forward (between wrapped layers: the last one's)."""
        return self.boundary_layout if self._stream_layout is None else self._stream_layout

    def _in_forward(self) -> bool:
        """Whether the forward runs now (not a recomputation in backward), where the stream's layout is followed."""
        return not (self.recomputing or in_backward())

    def require_stream_at_boundary(self, what: str) -> None:
        """Raise when ``what`` (a loss, a gathered output, attention outside the wrapped layers) meets the residual
        stream in another layout than the boundary one during the forward: a wrapped layer ran out of order, twice,
        or not at all, or an unwrapped block sits between two wrapped ones."""
        if self._current_layout is not None or not self._in_forward():
            return
        if self.stream_layout != self.boundary_layout:
            raise ValueError(
                f"{what} met the residual stream in the {self.stream_layout.value} layout (the boundary layout is "
                f"{self.boundary_layout.value}): a wrapped layer did not run, or a block outside the layout policy "
                "runs between wrapped ones; wrapped layers must each run once per forward, in module order, and "
                "blocks that attend must match the policy"
            )

    def enter_layer(self, layer_index: int, layout: CPLayout, hidden_states: torch.Tensor) -> torch.Tensor:
        """Convert a wrapped layer's input to its layout and make that layout current; in the forward, refuse a layer
        whose input is not in the layout its predecessor in module order leaves (a layer run twice or out of order
        where that changes the layout it gets), since the conversion follows that order."""
        converted = hidden_states
        forward = self._in_forward()
        if self.layout_state is not None and forward:
            expected = self.layout_state.layout_of_layer(layer_index - 1)
            if self.stream_layout != expected:
                before = "the boundary" if layer_index == 0 else f"the one layer {layer_index - 1} leaves"
                raise ValueError(
                    f"wrapped layer {layer_index} got the residual stream in the {self.stream_layout.value} layout, "
                    f"not {before} ({expected.value}): wrapped layers must each run once per forward, in module "
                    "order"
                )
        if self.layout_state is not None:
            converted, _ = self.layout_state.prepare_layer(layer_index, hidden_states)
            if forward:
                self._stream_layout = layout
        self.layer_conversion_count += converted is not hidden_states and forward
        self._current_layout = layout
        return converted

    def exit_layer(self, layer_index: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Leave a wrapped layer, restoring the boundary layout after the last one."""
        self._current_layout = None
        if self.layout_state is None:
            return hidden_states
        restored = self.layout_state.finalize_layer(layer_index, hidden_states)
        forward = self._in_forward()
        if forward:
            last = layer_index == len(self.layout_state.manager.layer_layouts) - 1
            self._stream_layout = self.boundary_layout if last else self.layout_state.layout_of_layer(layer_index)
        self.layer_conversion_count += restored is not hidden_states and forward
        return restored

    def resume_in_backward(self, layer_index: int | None, layout: CPLayout | None) -> None:
        """Make this step and layer ``layer_index``'s layout current while autograd runs back through that layer.

        Whatever the layer recomputes there (activation checkpointing) sees its forward's state; conversions it
        repeats are not counted. ``layer_index`` ``None``: for one whole recomputed layer, whose hooks set the layout.
        """
        if not self.recomputing:
            self._active_before_backward = active_step()
        set_active_step(self)
        self.recomputing = True
        self._backward_layer = layer_index
        self._current_layout = layout

    def abandon_backward(self) -> None:
        """Undo ``resume_in_backward`` for a backward that raised before leaving the layer (its hook never ran)."""
        if self.recomputing:
            self.leave_in_backward(self._backward_layer)

    def leave_in_backward(self, layer_index: int | None) -> None:
        """Undo ``resume_in_backward`` once autograd has passed layer ``layer_index``'s input (if it is current)."""
        if self._backward_layer != layer_index or not self.recomputing:
            return
        self._current_layout = self._backward_layer = None
        self.recomputing = False
        set_active_step(self._active_before_backward)
        self._active_before_backward = None

    def causal_window_plan(
        self, count: int, local_tokens: int, device: torch.device
    ) -> tuple[CausalWindowPlan, ProcessGroup | None]:
        """Return this rank's plan for reading the ``count`` tokens before each of its ``local_tokens`` tokens in their
        documents, in the layout running now, and the group to exchange over (None: no rank needs anything from
        another); built once per batch, layout and count, so every layer, and the backward's recomputation, reuse it."""
        layout = self.current_layout if self.cp_size > 1 else CPLayout.CONTIGUOUS
        key = (layout, count, local_tokens, device)
        if key not in self._causal_window_plans:
            group, tokens = self._shards_of(layout, local_tokens)
            ranks, rank = (1, 0) if group is None else (group.size(), group.rank())
            plan = build_causal_window_plan(tokens, ranks, rank, count)
            moved = {name: getattr(plan, name).to(device) for name in ("send_slots", "window_rows", "output_positions")}
            plan = dataclasses.replace(plan, **moved)
            self._causal_window_plans[key] = (plan, group if plan.exchanged_rows else None)
        return self._causal_window_plans[key]

    def document_starts(self, local_tokens: int, device: torch.device) -> torch.Tensor:
        """``[local_tokens]`` booleans: a document starts at the token of this rank's contiguous shard (every rank of
        the loss group holds one, in rank order); built once per batch."""
        key = (local_tokens, device)
        if key not in self._document_starts:
            group, tokens = self._shards_of(CPLayout.CONTIGUOUS, local_tokens)
            ranks, rank = (1, 0) if group is None else (group.size(), group.rank())
            self._document_starts[key] = shard_document_starts(tokens, ranks, rank).to(device)
        return self._document_starts[key]

    def _shards_of(self, layout: CPLayout, local_tokens: int) -> tuple[ProcessGroup | None, RankTokens]:
        """Return the group whose ranks hold the stream's shards in ``layout`` and every rank's shard described, in
        group-rank order; refuse a shard of another length than the batch puts on each rank."""
        if layout is CPLayout.ZIGZAG:  # a CP rank's shard split further (SP, hybrid): its contiguous parts, in order
            group, tokens = self.loss_group, self.geometry.gathered_tokens(layout)
            expected = tokens.doc.numel() // group.size()
        else:
            group, lengths = self.loss_group, self._document_lengths()
            ranks = 1 if group is None else group.size()
            expected = self.stream_length // ranks
            fits = expected * ranks == self.stream_length >= sum(lengths)
            tokens = stream_tokens(lengths, self.stream_length) if fits else None
        if local_tokens != expected or tokens is None:
            raise ValueError(
                f"a shard of {local_tokens} tokens in a {layout.value} block, where this batch puts {expected} tokens "
                "on each rank"
            )
        return group, tokens

    def _document_lengths(self) -> tuple[int, ...]:
        """Return the batch's document lengths (a dense batch: one document per row)."""
        if self.contiguous_packed_seq_params is not None:
            offsets = host_offsets(self.contiguous_packed_seq_params.cu_seqlens_q)
            return tuple(end - start for start, end in zip(offsets, offsets[1:], strict=False))
        return (self.sequence_length,)

    def convert(self, tensor: torch.Tensor, source: CPLayout, target: CPLayout) -> torch.Tensor:
        """Convert a batch-first per-token tensor between layouts with this step's plan."""
        if source == target or self.layout_state is None:
            return tensor
        return self.layout_state.convert(tensor, source, target)

    def convert_side_input(self, tensor: torch.Tensor, layout: CPLayout) -> torch.Tensor:
        """Convert a per-token side input from the boundary layout to ``layout``, once per step unless it needs grad."""
        if tensor.requires_grad:
            return self.convert(tensor, self.boundary_layout, layout)
        key = (id(tensor), layout)
        cached = self._side_input_cache.get(key)
        if cached is None or cached[0] is not tensor:
            cached = (tensor, self.convert(tensor, self.boundary_layout, layout))
            self._side_input_cache[key] = cached
        return cached[1]


def contiguous_packed_seq_params(sharded: ShardedBatch) -> PackedSeqParams | None:
    """Return the metadata of a packed replica batch as the contiguous residual stream holds it."""
    if sharded.cu_seqlens is None or sharded.cu_seqlens_padded is None:
        return None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=sharded.cu_seqlens,
        cu_seqlens_kv=sharded.cu_seqlens,
        cu_seqlens_q_padded=sharded.cu_seqlens_padded,
        cu_seqlens_kv_padded=sharded.cu_seqlens_padded,
        max_seqlen_q=sharded.max_sequence_length,
        max_seqlen_kv=sharded.max_sequence_length,
        total_tokens=sharded.padded_sequence_length,
        pad_between_seqs=sharded.padding_token_count > 0,
    )


def build_step(
    setting: ContextParallelSetting,
    sharded: ShardedBatch,
    manager: ContextParallelLayoutManager | None = None,
    owner: Any = None,
) -> ContextParallelStep:
    """Build a step's state from this rank's shard of a replica batch: everything the batch needs, planned once.

    For a packed batch the offsets reach the host once; the layout plan (through ``manager``, or one with no layer
    of its own) and the zigzag geometry (for attention and the metrics) are both derived from that copy.
    """
    packed_seq_params = contiguous_packed_seq_params(sharded)
    step = ContextParallelStep(
        setting,
        packed_seq_params,
        stream_length=sharded.padded_sequence_length,
        sequence_length=sharded.sequence_length,
        dense_padding=0 if sharded.is_packed else sharded.padding_token_count,
        owner=owner,
    )
    mesh = setting.mesh
    if mesh.cp_size == 1:
        return step
    if manager is None:
        manager = setting.layout_manager((), seq_dim=1)
    zigzag_ranks, shard_split = setting.zigzag_ranks
    if packed_seq_params is None:
        step.geometry = ZigzagGeometry.dense(zigzag_ranks, sharded.padded_sequence_length)
    else:
        actual, physical = host_copies(sharded.cu_seqlens, sharded.cu_seqlens_padded)
        lengths = check_offsets("cu_seqlens", actual)
        padded = zigzag_padded_lengths(check_offsets("cu_seqlens_padded", physical), zigzag_ranks, shard_split)
        step.geometry = ZigzagGeometry.packed(zigzag_ranks, lengths.tolist(), padded.tolist())
    step.layout_state = manager.build_conversion_state(packed_seq_params)
    return step


def step_metrics(step: ContextParallelStep, sharded: ShardedBatch) -> Mapping[str, float]:
    """Return tokens, padding fraction and attention work imbalance (max/mean over CP ranks) of one replica batch."""
    batch_size = sharded.input_ids.shape[0]
    if sharded.is_packed and step.geometry is not None:
        slots = sum(step.geometry.padded_lengths)
    else:
        slots = batch_size * sharded.padded_sequence_length
    if step.geometry is None or step.attention_mode == AttentionMode.ULYSSES.value:
        imbalance = 1.0  # one rank, or every rank attends the whole sequence for an equal share of the heads
    elif sharded.is_packed:
        imbalance = step.geometry.imbalance(causal=True)
    else:
        zigzag_ranks = step.geometry.cp_size
        real = ZigzagGeometry.dense(zigzag_ranks, sharded.sequence_length, sharded.padded_sequence_length)
        imbalance = real.imbalance(causal=True)
    return {
        "tokens": float(sharded.real_token_count),
        "padding_fraction": 1.0 - sharded.real_token_count / max(slots, 1),
        "attention_imbalance": imbalance,
    }


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (reentrant checkpointing recomputes there)."""
    return torch._C._current_graph_task_id() != -1


_active_step: ContextParallelStep | None = None


def active_step() -> ContextParallelStep | None:
    """Return the active step state, or ``None`` outside a CP step."""
    return _active_step


def set_active_step(step: ContextParallelStep | None) -> None:
    """Make ``step`` the active state (``None`` clears it); a module global so autograd threads see it too."""
    global _active_step
    _active_step = step


@contextmanager
def activated(step: ContextParallelStep | None) -> Iterator[ContextParallelStep | None]:
    """Make ``step`` active inside the block (``None``: no step, as on one device)."""
    previous = _active_step
    set_active_step(step)
    try:
        yield step
    finally:
        set_active_step(previous)
