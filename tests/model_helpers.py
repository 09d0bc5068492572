"""A small RoPE transformer (and hybrids with token-shift or linear recurrent blocks) for the strategy tests, plus an
independent reference.

The reference trains the same model in one process without Lightning or ``lightning_cp``'s batch preparation:
labels shifted per document, positions and attention masks are computed here from the raw batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_cp import cp_attention, cp_cross_entropy, cp_previous_state, cp_previous_tokens
from lightning_cp.core import comm
from lightning_cp.core.step import active_step

VOCAB = 32
HIDDEN = 16
HEADS = 2
LEARNING_RATE = 0.2
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


TRAINER_OPTIONS = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}
ATTENTION = ("attention", "attention")
HYBRID = ("attention", "attention", "recurrent", "recurrent", "attention")
LINEAR_HYBRID = ("attention", "attention", "linear", "linear", "attention")
POLICY = {"zigzag_layers": ["*AttentionBlock"], "contiguous_layers": ["blocks.2", "blocks.3"]}


def rotary(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, D]`` by RoPE angles of ``position_ids`` ``[B, S]``."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / (100.0 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angles = position_ids.to(x.dtype)[..., None] * frequencies
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention with RoPE and an MLP, both residual."""

    def __init__(self, owner: TinyTransformer) -> None:
        super().__init__()
        self.owner = [owner]
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return ``h`` plus attention and MLP updates (the attention part checkpointed on its own if asked)."""
        self.owner[0].record_layout(self, position_ids)
        if self.owner[0].checkpoint_attention and torch.is_grad_enabled():
            h = h + torch.utils.checkpoint.checkpoint(self.attention, h, position_ids, use_reentrant=False)
        else:
            h = h + self.attention(h, position_ids)
        return h + self.mlp(h)

    def attention(self, h: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the attention update of ``h``."""
        batch, seq, _ = h.shape
        q, k, v = self.qkv(self.norm(h)).view(batch, seq, 3, HEADS, HIDDEN // HEADS).unbind(2)
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        return self.out(self.owner[0].attention_fn(q, k, v).reshape(batch, seq, HIDDEN))


class RecurrentBlock(nn.Module):
    """Token shift within documents: each token mixes in the previous token, which needs the contiguous layout."""

    def __init__(self, owner: TinyTransformer) -> None:
        super().__init__()
        self.owner = [owner]
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return ``h + tanh(mix(previous token))`` where the previous token is in the same document."""
        self.owner[0].record_layout(self, position_ids)
        previous = torch.cat([cp_previous_tokens(h), h[:, :-1]], dim=1)
        same_document = (position_ids > 0).unsqueeze(-1).to(h.dtype)
        return h + torch.tanh(self.mix(previous)) * same_document


def linear_scan(inputs: torch.Tensor, decays: torch.Tensor) -> torch.Tensor:
    """States ``h_t = a_t * h_{t-1} + x_t`` along dim 1 from a zero state, one step at a time."""
    state, states = torch.zeros_like(inputs[:, 0]), []
    for step in range(inputs.shape[1]):
        state = decays[:, step] * state + inputs[:, step]
        states.append(state)
    return torch.stack(states, 1)


class LinearRecurrentBlock(nn.Module):
    """A gated diagonal linear recurrence within documents (the decay is zero at a document's start): each shard
    scans from zero and takes the state entering it from ``cp_previous_state``, as a Mamba-style block would."""

    def __init__(self, owner: TinyTransformer) -> None:
        super().__init__()
        self.owner = [owner]
        self.gate = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Return ``h + tanh(states)`` of the recurrence over ``value(h)`` with decays ``sigmoid(gate(h))``."""
        self.owner[0].record_layout(self, position_ids)
        decays = torch.sigmoid(self.gate(h)) * (position_ids > 0).unsqueeze(-1).to(h.dtype)
        from_zero = linear_scan(self.value(h), decays)
        cumulative = torch.cumprod(decays, 1)
        entering = cp_previous_state(from_zero[:, -1], cumulative[:, -1])
        return h + torch.tanh(from_zero + cumulative * entering.unsqueeze(1))


class TinyTransformer(pl.LightningModule):
    """Embedding, blocks by ``kinds`` (``"attention"``, ``"recurrent"``, ``"linear"``), a head; SGD on
    ``cp_cross_entropy``.

    ``checkpoint_blocks`` recomputes whole blocks in backward, ``checkpoint_attention`` only the attention inside each
    attention block (``reentrant``: the reentrant variant for blocks); plain ``torch.utils.checkpoint``, no CP code.
    """

    def __init__(
        self,
        kinds: Sequence[str] = ("attention", "attention"),
        checkpoint_blocks: bool = False,
        tensor_parallel: bool = False,
        checkpoint_attention: bool = False,
        reentrant: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        block_types = {"attention": AttentionBlock, "recurrent": RecurrentBlock, "linear": LinearRecurrentBlock}
        self.blocks = nn.ModuleList(block_types[kind](self) for kind in kinds)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.double()
        self.checkpoint_blocks = checkpoint_blocks
        self.checkpoint_attention = checkpoint_attention
        self.reentrant = reentrant
        self.tensor_parallel = tensor_parallel
        self.attention_fn: AttentionFn = cp_attention
        self.train_losses: list[float] = []
        self.val_losses: list[float] = []
        self.seen_layouts: list[tuple[str, str, list[int]]] = []
        self.batch_indices: list[int] = []
        self.forward_conversions: list[int] = []

    def record_layout(self, block: nn.Module, position_ids: torch.Tensor) -> None:
        """Remember, for the first forward, the layout ``block`` runs in and the positions of its first row."""
        step = active_step()
        if step is not None and len(self.seen_layouts) < len(self.blocks):
            name = comm.original_class_name(block)  # FSDP2 renames the class
            self.seen_layouts.append((name, step.current_layout.value, position_ids[0].tolist()))

    def configure_model(self) -> None:
        """With ``tensor_parallel``, shard each attention block's MLP column- then row-wise over the TP mesh (once)."""
        if not self.tensor_parallel or isinstance(self.blocks[0].mlp[0].weight, DTensor):
            return
        mesh = self.device_mesh["tensor_parallel"]
        for block in self.blocks:
            if isinstance(block, AttentionBlock):
                parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return logits ``[B, S, VOCAB]``."""
        h = self.embed(input_ids)
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                if self.reentrant:
                    layer = functools.partial(block, position_ids=position_ids)
                    h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)
                else:
                    h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, position_ids=position_ids)
            else:
                h = block(h, position_ids=position_ids)
        return self.head(h)

    def _loss(self, batch: dict[str, Any]) -> Any:
        logits = self(batch["input_ids"], batch["position_ids"])
        return cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Return the CP-scaled loss and record the replica mean."""
        result = self._loss(batch)
        self.train_losses.append(result.mean.item())
        self.batch_indices.append(int(batch["index"]))
        step = active_step()
        self.forward_conversions.append(step.layer_conversion_count if step is not None else 0)
        return result.loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Record the replica mean loss."""
        self.val_losses.append(self._loss(batch).mean.item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD, so the reference is a few lines."""
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)


def dense_batches(count: int, batch_size: int = 2, seq_len: int = 22) -> list[dict[str, torch.Tensor]]:
    """Random dense batches; ``seq_len`` 22 needs padding at cp 2 and 4."""
    generator = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator), "index": torch.tensor(index)}
        for index in range(count)
    ]


def packed_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """Random packed batches of documents of lengths 1 to 13 (some below 2 x cp), some labels masked."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for index in range(count):
        lengths = torch.randint(1, 14, (5,), generator=generator).tolist()
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        input_ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator)
        batch = {"input_ids": input_ids, "cu_seqlens": cu_seqlens, "index": torch.tensor(index)}
        if index % 2:
            labels = input_ids.clone()
            labels[0, torch.randint(0, sum(lengths), (3,), generator=generator)] = -100
            batch["labels"] = labels
        batches.append(batch)
    return batches


def reference_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return shifted labels, positions and document ids of a raw batch, token by token."""
    input_ids = batch["input_ids"]
    labels = batch.get("labels", input_ids)
    rows, length = input_ids.shape
    cu_seqlens = batch.get("cu_seqlens", torch.tensor([0, length])).tolist()
    targets = torch.full((rows, length), -100, dtype=torch.long)
    positions = torch.zeros((rows, length), dtype=torch.long)
    documents = torch.zeros((rows, length), dtype=torch.long)
    for document, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        for token in range(start, end):
            positions[:, token] = token - start
            documents[:, token] = document
            if token + 1 < end:
                targets[:, token] = labels[:, token + 1]
    return targets, positions, documents


def reference_attention(documents: torch.Tensor) -> AttentionFn:
    """Return explicit-softmax causal attention masked to each token's document."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        length = q.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        visible = causal & (documents[:, None, :, None] == documents[:, None, None, :])
        return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)

    return attend


def reference_run(
    kinds: Sequence[str], batches: Sequence[dict[str, torch.Tensor]], order: Sequence[Sequence[int]]
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Train in one process: step ``s`` averages the mean losses of batches ``order[s]`` (one per replica).

    Returns each step's per-replica mean losses and the final weights.
    """
    model = TinyTransformer(kinds)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step_indices in order:
        replica_losses = []
        for index in step_indices:
            batch = batches[index]
            targets, positions, documents = reference_targets(batch)
            model.attention_fn = reference_attention(documents)
            logits = model(batch["input_ids"], positions)
            replica_losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100))
        optimizer.zero_grad()
        (sum(replica_losses) / len(replica_losses)).backward()
        optimizer.step()
        losses.append([loss.item() for loss in replica_losses])
    return losses, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
