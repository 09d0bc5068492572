"""Context parallelism in your own LightningModule: ``strategy="cp_zigzag"``, ``cp_attention``, ``cp_cross_entropy``.

    python examples/own_module.py            # 2 CPU processes, cp=2, gloo
    python examples/own_module.py --hybrid   # attention blocks and gated linear recurrences in turn (4 blocks)

What changes against a plain single-device module:
- attention calls ``cp_attention(q, k, v)`` on batch-first ``[B, S_local, H, D]`` tensors;
- the loss is ``cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])``;
- blocks whose class name matches the layout policy (here ``*TransformerBlock``) take the residual stream as their
  first argument; per-token side inputs they need (``position_ids`` for RoPE) go in as keyword arguments, so the
  callback converts them along.
- a recurrent block (``RecurrentBlock``, run on contiguous shards by the default policy) takes what precedes its
  shard from the ranks before: the tokens before each token of a document for its convolution
  (``cp_causal_conv1d``), the state entering the shard for its scan (``cp_previous_state``); here the built-in
  model's mixer, ``GatedRecurrence``, does both.
The strategy's callback hands ``training_step`` this rank's shard: ``input_ids``, ``labels`` (shifted per document),
``position_ids`` and ``loss_token_count``. The dataloader yields whole packed batches: ``input_ids`` ``[1, T]`` and
int32 ``cu_seqlens`` (here from ``PackedTextDataModule``; any loader yielding that dict works).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_cp import cp_attention, cp_cross_entropy  # importing lightning_cp registers "cp_zigzag"
from lightning_cp.train.data import PackedTextDataModule
from lightning_cp.train.models import GatedRecurrence


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and MLP; attention runs across the CP ranks through ``cp_attention``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Run the block on this rank's hidden states ``[B, S_local, dim]``."""
        batch, seq, dim = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        h = h + self.out(cp_attention(q, k, v, causal=True).reshape(batch, seq, dim))
        return h + self.mlp(self.norm2(h))


class RecurrentBlock(nn.Module):
    """Pre-norm recurrent mixer and MLP, run on contiguous shards (the default policy matches ``*RecurrentBlock``).

    The mixer is the built-in model's ``GatedRecurrence``: a short causal convolution per document across the
    shards (``cp_causal_conv1d``), and a gated linear recurrence scanned from a zero state that adds
    the state entering the shard (``cp_previous_state``) times its cumulative decay; both restart at each document's
    start (``position_ids == 0``), so the block computes what it computes on one device.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = GatedRecurrence(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        """Run the block on this rank's contiguous hidden states ``[B, S_local, dim]``."""
        h = h + self.mixer(self.norm1(h), position_ids)
        return h + self.mlp(self.norm2(h))


class TinyLM(pl.LightningModule):
    """A byte-level language model with learned absolute positions; ``hybrid``: every second block recurrent."""

    def __init__(
        self, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 4096, hybrid: bool = False
    ) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(257, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            RecurrentBlock(dim) if hybrid and index % 2 else TransformerBlock(dim, heads) for index in range(layers)
        )
        self.head = nn.Linear(dim, 257)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the logits ``[B, S_local, 257]`` of this rank's shard."""
        h = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            h = block(h, position_ids=position_ids) if isinstance(block, RecurrentBlock) else block(h)
        return self.head(h)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Compute the CP-aware loss of this rank's shard."""
        logits = self(batch["input_ids"], batch["position_ids"])
        out = cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])
        self.log("train_loss", out.mean, prog_bar=True)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain AdamW."""
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    """Train for a few steps on the embedded corpus with cp=2 on 2 CPU processes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--hybrid", action="store_true", help="every second block recurrent (4 blocks)")
    args = ap.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="cp_zigzag",  # or CPZigzagStrategy(context_parallel_size=2, attention_mode="ring")
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # every CP rank of a replica must see the same batch
        logger=False,
        enable_checkpointing=False,
    )
    model = TinyLM(layers=4 if args.hybrid else 2, hybrid=args.hybrid)
    trainer.fit(model, datamodule=PackedTextDataModule(tokens_per_sample=1024))
    if trainer.is_global_zero:
        print(f"final train loss {float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
