"""LightningDataModule over packed (or dense) byte-tokenised documents with a resumable data order."""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_cp.train.data.collate import collate_dense, collate_packed
from lightning_cp.train.data.packing import pack_documents
from lightning_cp.train.data.sampler import ResumableSampler
from lightning_cp.train.data.sources import EMBEDDED, load_documents, split_documents
from lightning_cp.train.data.tokenizer import ByteTokenizer, Tokenizer, tokenize_example


def dense_rows(
    documents: Sequence[Sequence[int]], seq_len: int, labels: Sequence[Sequence[int]] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Concatenate documents (and labels) and cut the stream into rows of ``seq_len`` tokens (the tail is dropped)."""
    labels = documents if labels is None else labels
    rows = []
    for values in (documents, labels):
        stream = torch.tensor([token for doc in values for token in doc], dtype=torch.long)
        rows.append(list(stream[: stream.numel() // seq_len * seq_len].view(-1, seq_len)))
    return list(zip(*rows, strict=True))


class PackedTextDataModule(pl.LightningDataModule):
    """Tokenise examples, pack them into ``tokens_per_sample`` budgets and serve replica batches.

    ``tokenizer``: the byte tokeniser by default, or an ``HFTokenizer``; examples are text, ``{"text"}``,
    ``{"prompt", "completion"}`` (targets: the completion) or ``{"messages"}`` (targets: the assistant turns).

    Every context-parallel rank of a data-parallel replica gets the same batch; batches are split over the
    data-parallel ranks only (``trainer.strategy.distributed_sampler_kwargs``), so run the Trainer with
    ``use_distributed_sampler=False``.
    """

    def __init__(
        self,
        sources: Sequence[str] = (EMBEDDED,),
        val_sources: Sequence[str] | None = None,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        tokens_per_sample: int = 1024,
        samples_per_batch: int = 1,
        packed: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        super().__init__()
        self.sources = list(sources)
        self.val_sources = list(val_sources) if val_sources else None
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.tokens_per_sample = tokens_per_sample
        self.samples_per_batch = samples_per_batch
        self.packed = packed
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = tokenizer or ByteTokenizer()
        self.train_samples: list = []
        self.val_samples: list = []

    def setup(self, stage: str | None = None) -> None:
        """Load, split, tokenise and pack the documents once."""
        if self.train_samples:
            return
        documents = load_documents(self.sources)
        if self.val_sources is None:
            train_docs, val_docs = split_documents(documents, self.val_fraction, self.split_seed)
        else:
            train_docs, val_docs = documents, load_documents(self.val_sources)
        self.train_samples = self._samples(train_docs)
        self.val_samples = self._samples(val_docs)

    def _samples(self, documents: Sequence[str]) -> list:
        """Tokenise and pack (or cut into dense rows) a list of documents."""
        examples = [tokenize_example(self.tokenizer, doc, f"example {index}") for index, doc in enumerate(documents)]
        ids, labels = [pair[0] for pair in examples], [pair[1] for pair in examples]
        if self.packed:
            return pack_documents(ids, self.tokens_per_sample, labels)
        return dense_rows(ids, self.tokens_per_sample, labels)

    def _replicas(self) -> tuple[int, int]:
        """Return ``(num_replicas, rank)`` of the data-parallel split."""
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _loader(self, samples: list, sampler: ResumableSampler) -> DataLoader:
        """Wrap samples in a DataLoader whose batches follow the batch contract."""
        return DataLoader(
            samples,
            batch_size=self.samples_per_batch,
            sampler=sampler,
            collate_fn=collate_packed if self.packed else collate_dense,
            num_workers=self.num_workers,
            drop_last=True,
        )

    def train_dataloader(self) -> DataLoader:
        """Serve enough seeded passes for ``max_steps`` (or one per epoch), starting where a resumed run stopped."""
        num_replicas, rank = self._replicas()
        trainer = self.trainer
        passes = 1
        if trainer is not None and trainer.max_steps > 0:
            needed = trainer.max_steps * trainer.accumulate_grad_batches * self.samples_per_batch * num_replicas
            passes = max(1, math.ceil(needed / len(self.train_samples)))
        sampler = ResumableSampler(
            len(self.train_samples),
            self.samples_per_batch,
            seed=self.seed,
            shuffle=self.shuffle,
            passes=passes,
            num_replicas=num_replicas,
            rank=rank,
        )
        if trainer is not None:
            done = trainer.global_step * trainer.accumulate_grad_batches
            sampler.skip_batches(trainer.current_epoch, done - trainer.current_epoch * sampler.batches_per_epoch)
        return self._loader(self.train_samples, sampler)

    def val_dataloader(self) -> DataLoader:
        """Serve the held-out documents in a fixed order."""
        num_replicas, rank = self._replicas()
        sampler = ResumableSampler(
            len(self.val_samples), self.samples_per_batch, shuffle=False, num_replicas=num_replicas, rank=rank
        )
        return self._loader(self.val_samples, sampler)
