"""LightningDataModule over packed (or dense) tokenised documents with a resumable data order.

Data is prepared once: ``prepare_data`` (Lightning calls it on local rank 0 while the other ranks wait) reads,
tokenises, splits and packs into a cache folder keyed by everything the result depends on; ``setup`` on every rank
memory-maps it (the ranks of a node share its pages). Tokens are flat arrays of 2 bytes each (4 for vocabularies
over 65536), written as they are made, so memory stays bounded whatever the corpus size; tokens that are no target
(prompts, non-assistant turns) are kept as ranges.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from lightning_cp.lightning.module import max_steps_alone
from lightning_cp.train.data.collate import collate_dense, collate_packed
from lightning_cp.train.data.packing import (
    DenseRows,
    Pack,
    PackedSamples,
    cumulative,
    ignored_ranges,
    pack_pieces,
    piece_table,
    predicts_a_target,
    rows_predicting_a_target,
)
from lightning_cp.train.data.sampler import ResumableSampler
from lightning_cp.train.data.sources import EMBEDDED, describe_sources, iter_documents, split_documents
from lightning_cp.train.data.tokenizer import IGNORE_INDEX, ByteTokenizer, Example, Tokenizer, tokenize_example

CACHE_ENV = "LIGHTNING_CP_DATA_CACHE"
CACHE_FORMAT = 4  # raised whenever the same sources and tokenizer prepare to other tokens or targets
PROGRESS_MIN_BYTES = 16 << 20
FLUSH_TOKENS = 1 << 23
SPLITS = ("train", "val")
logger = logging.getLogger("lightning_cp.data")


def default_cache_dir() -> Path:
    """``$LIGHTNING_CP_DATA_CACHE``, else ``$XDG_CACHE_HOME/lightning_cp/data`` (``~/.cache/lightning_cp/data``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "lightning_cp" / "data"


def _key(*parts: Any) -> str:
    """A short hash of JSON-serialisable parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def token_dtype(tokenizer: Tokenizer) -> np.dtype:
    """2-byte ids for vocabularies up to 65536 ids (the byte tokeniser's 257), else 4-byte ids."""
    vocab = getattr(tokenizer, "vocab_size", None)
    return np.dtype(np.uint16) if isinstance(vocab, int) and vocab <= 1 << 16 else np.dtype(np.int32)


def example_arrays(
    tokenizer: Tokenizer, example: Example, where: str, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray | None]:
    """Return the token ids of one example as an array and which of them are targets (None: all of them)."""
    text = example if isinstance(example, str) else example.get("text")
    if type(tokenizer) is ByteTokenizer and isinstance(text, str):
        data = tokenizer.encode_bytes(text)
        ids = np.empty(len(data) + 1, dtype=dtype)
        ids[:-1] = np.frombuffer(data, dtype=np.uint8)
        ids[-1] = tokenizer.eos_id
        return ids, None
    ids_list, labels = tokenize_example(tokenizer, example, where)
    ids = np.asarray(ids_list, dtype=dtype)
    return ids, None if labels == ids_list else np.asarray(labels) == ids


@dataclass(frozen=True)
class TokenStore:
    """Every document's tokens one after another (document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``) and the
    token ranges that are no target (``ignored``: ``[2, n]`` starts and ends; None: every token is a target)."""

    tokens: np.ndarray
    ignored: np.ndarray | None
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        """Number of documents."""
        return int(self.offsets.size - 1)

    @classmethod
    def open(cls, folder: Path) -> TokenStore:
        """Memory-map a store that ``TokenWriter`` wrote into ``folder``."""
        meta = json.loads((folder / "meta.json").read_text())
        count, dtype = meta["tokens"], np.dtype(meta["dtype"])
        path = folder / "tokens.bin"
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        ignored = np.load(folder / "ignored.npy") if meta["ignored"] else None
        return cls(tokens, ignored, np.load(folder / "offsets.npy", mmap_mode="r"))


class TokenWriter:
    """Append documents' token ids to ``folder/tokens.bin`` (to memory when there is no folder), a few million
    tokens at a time, noting the ranges of tokens that are no target."""

    def __init__(self, folder: Path | None, dtype: np.dtype) -> None:
        self.folder, self.dtype = folder, dtype
        self.lengths: list[int] = []
        self.pending: list[np.ndarray] = []
        self.pending_tokens = self.written = 0
        self.ignored: list[np.ndarray] = []
        self.chunks: list[np.ndarray] = []
        self.file = (folder / "tokens.bin").open("wb") if folder is not None else None

    def add(self, ids: np.ndarray, targets: np.ndarray | None) -> None:
        """Append one document; ``targets``: which of its tokens are targets (None: all)."""
        if targets is not None and not targets.all():
            self.ignored.append(ignored_ranges(targets, self.written + self.pending_tokens))
        self.pending.append(ids)
        self.lengths.append(ids.size)
        self.pending_tokens += ids.size
        if self.pending_tokens >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        tokens = np.concatenate(self.pending).astype(self.dtype, copy=False)
        if self.file is None:
            self.chunks.append(tokens)
        else:
            tokens.tofile(self.file)
        self.written += self.pending_tokens
        self.pending, self.pending_tokens = [], 0

    def finish(self) -> TokenStore:
        """Write what is pending and return the store (memory-mapped from the folder, if any)."""
        self._flush()
        offsets = cumulative(np.asarray(self.lengths, dtype=np.int64))
        ignored = np.concatenate(self.ignored, axis=1) if self.ignored else None
        if self.file is None:
            return TokenStore(np.concatenate(self.chunks or [np.zeros(0, self.dtype)]), ignored, offsets)
        self.file.close()
        np.save(self.folder / "offsets.npy", offsets)
        if ignored is not None:
            np.save(self.folder / "ignored.npy", ignored)
        meta = {"dtype": self.dtype.str, "tokens": self.written, "ignored": ignored is not None,
                "documents": len(self.lengths)}  # fmt: skip
        (self.folder / "meta.json").write_text(json.dumps(meta))
        return TokenStore.open(self.folder)


@contextmanager
def _progress(show: bool, total: int, desc: str, unit: str) -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr when ``show``, else nothing; yields its ``update``."""
    if not show:
        yield lambda n: None
        return
    with tqdm(total=total, desc=f"lightning-cp: {desc}", unit=unit, unit_scale=True, file=sys.stderr) as bar:
        yield bar.update


def tokenize_sources(
    sources: Sequence[str], tokenizer: Tokenizer, folder: Path | None, show: bool = False, total_bytes: int = 0
) -> TokenStore:
    """Read and tokenise every example of ``sources`` into a store (in ``folder``, or in memory)."""
    writer = TokenWriter(folder, token_dtype(tokenizer))
    with _progress(show, total_bytes, "reading and tokenising", "B") as advance:
        for index, example in enumerate(iter_documents(sources, advance)):
            writer.add(*example_arrays(tokenizer, example, f"example {index}", writer.dtype))
    return writer.finish()


def split_arrays(
    store: TokenStore, docs: np.ndarray, budget: int, packed: bool, show: bool = False
) -> dict[str, np.ndarray]:
    """The samples of documents ``docs`` of ``store`` as arrays: segments ``src`` (where each starts in the store)
    and ``cum`` (their cumulative lengths), for packs ``bounds`` (each pack's first segment), for dense rows ``rows``
    (those served). A piece or row with no target after its first token, which would train nothing, is left out."""
    starts = np.asarray(store.offsets[:-1])[docs]
    lengths = np.diff(np.asarray(store.offsets))[docs]
    if not packed:
        cum = cumulative(lengths)
        return {"src": starts, "cum": cum, "rows": rows_predicting_a_target(starts, cum, budget, store.ignored)}
    doc, start, length = piece_table(lengths, budget)
    kept = predicts_a_target(starts[doc] + start, length, store.ignored)  # a piece is its own document
    doc, start, length = doc[kept], start[kept], length[kept]
    with _progress(show and doc.size > 0, doc.size, "packing", " pieces") as advance:
        plan = pack_pieces(doc, start, length, budget, advance)
    return {"src": starts[plan.doc] + plan.start, "cum": cumulative(plan.length), "bounds": plan.offsets}


def _build_folder(final: Path, build: Callable[[Path], object]) -> Path:
    """Return the folder ``final``, building it first if it does not exist: in a temporary folder renamed into place,
    so no reader sees half of it and of builders racing for it (ranks of several nodes) the first one wins."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    work.chmod(0o755)
    try:
        build(work)
        try:
            work.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


class StreamPosition(NamedTuple):
    """Where training stands in an epoch's sample stream: ``samples`` of it done (over all replicas), and, as
    Lightning counts them on this rank, ``batches``; ``replicas`` is the data-parallel size (None: not recorded)."""

    epoch: int
    samples: int
    batches: int = 0
    replicas: int | None = None


class PackedTextDataModule(pl.LightningDataModule):
    """Tokenise examples, pack them into ``tokens_per_sample`` budgets and serve replica batches.

    ``tokenizer``: the byte tokeniser by default, or an ``HFTokenizer``; examples are text, ``{"text"}``,
    ``{"prompt", "completion"}`` (targets: the completion) or ``{"messages"}`` (targets: the assistant turns).

    ``cache_dir``: where prepared data is kept (default ``default_cache_dir()``), one folder per set of sources and
    tokenizer and one per split and packing; runs with the same ones reuse it. A tokenizer without a ``fingerprint``
    (or an unwritable cache) is prepared in memory, in each process.

    Every context-parallel rank of a data-parallel replica gets the same batch; batches are split over the
    data-parallel ranks only (``trainer.strategy.distributed_sampler_kwargs``), so run the Trainer with
    ``use_distributed_sampler=False``. Its state (in every checkpoint) is where the epoch's sample stream stands, so a
    resumed fit continues with the next unseen sample.
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
        cache_dir: str | Path | None = None,
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
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.train_samples: Dataset | None = None
        self.val_samples: Dataset | None = None
        self._plan: dict[str, Any] | None = None
        self._saved_position: StreamPosition | None = None  # a checkpoint's, until the training loader reads it
        self._resumed_at = StreamPosition(0, 0)  # where the current training loader started

    def _cache_plan(self) -> dict[str, Any]:
        """The cache folder (None: prepare in memory), the folder names, the sources' size; worked out once."""
        if self._plan is None:
            described, size = describe_sources(self.sources)
            val_described, val_size = describe_sources(self.val_sources) if self.val_sources else (None, 0)
            fingerprint = getattr(self.tokenizer, "fingerprint", None)
            tokens = {"train": f"tokens-{_key(CACHE_FORMAT, described, fingerprint)}"}
            if val_described is not None:
                tokens["val"] = f"tokens-{_key(CACHE_FORMAT, val_described, fingerprint)}"
            packing = (self.val_fraction, self.split_seed, self.tokens_per_sample, self.packed)
            self._plan = {
                "root": self._writable_cache() if isinstance(fingerprint, str) else None,
                "tokens": tokens,
                "samples": f"samples-{_key(CACHE_FORMAT, tokens, *packing)}",
                "bytes": {"train": size, "val": val_size},
            }
        return self._plan

    def _writable_cache(self) -> Path | None:
        """The cache folder, created; None (with a warning) when it cannot be written."""
        root = self.cache_dir or default_cache_dir()
        try:
            root.mkdir(parents=True, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        except OSError:
            pass
        logger.warning("data cache %s cannot be written: preparing the data in memory, in each process", root)
        return None

    def prepare_data(self) -> None:
        """Read, tokenise, split and pack into the cache, unless it already holds the result (Lightning calls this
        on local rank 0 of each node while the other ranks wait; they load the result in ``setup``)."""
        if self._cache_plan()["root"] is not None:
            self._prepare()

    def setup(self, stage: str | None = None) -> None:
        """Load the prepared samples (preparing them first if ``prepare_data`` did not) and check that they fill a
        batch on each data-parallel replica."""
        self.load()
        trainer = self.trainer
        validating = trainer is None or getattr(trainer, "limit_val_batches", 1.0) != 0
        problem = self.size_problem(
            self._replicas()[0], train=stage in (None, "fit"), val=validating and stage in (None, "fit", "validate")
        )
        if problem:
            raise ValueError(problem)

    def load(self) -> None:
        """Load the prepared samples into ``train_samples`` and ``val_samples`` (preparing them if needed), once."""
        if self.train_samples is None:
            self.train_samples, self.val_samples = self._prepare()

    def _prepare(self) -> tuple[Dataset, Dataset]:
        """Return the train and val samples, from the cache (building what it lacks) or made in memory."""
        plan = self._cache_plan()
        root: Path | None = plan["root"]
        show = sum(plan["bytes"].values()) >= PROGRESS_MIN_BYTES and rank_zero_only.rank == 0
        started = time.monotonic()
        built = []

        def tokens(split: str) -> TokenStore:
            sources = self.sources if split == "train" else self.val_sources
            if root is None:
                return tokenize_sources(sources, self.tokenizer, None, show, plan["bytes"][split])
            folder = root / plan["tokens"][split]
            if not folder.is_dir():
                built.append(folder)
                size = plan["bytes"][split]
                _build_folder(folder, lambda work: tokenize_sources(sources, self.tokenizer, work, show, size))
            return TokenStore.open(folder)

        stores = {split: tokens(split) for split in plan["tokens"]}
        store_of = {"train": "train", "val": "val" if "val" in stores else "train"}
        if root is None:
            arrays = self._split(stores, show)
        else:
            folder = root / plan["samples"]
            if not folder.is_dir():
                built.append(folder)
                _build_folder(folder, lambda work: self._save(self._split(stores, show), work))
            arrays = {s: {p.name.split(".")[1]: np.load(p) for p in folder.glob(f"{s}.*.npy")} for s in SPLITS}
        if show and built:
            elapsed = time.monotonic() - started
            tqdm.write(f"lightning-cp: data prepared in {elapsed:.1f} s, cached in {root}", file=sys.stderr)
        samples = [self._samples(stores[store_of[split]], arrays[split]) for split in SPLITS]
        return samples[0], samples[1]

    def _split(self, stores: dict[str, TokenStore], show: bool) -> dict[str, dict[str, np.ndarray]]:
        """Hold out the validation documents (unless there are val sources) and pack (or cut) each split."""
        if "val" in stores:
            docs = {split: np.arange(store.num_documents) for split, store in stores.items()}
            held = {"train": stores["train"], "val": stores["val"]}
        else:
            train, val = split_documents(range(stores["train"].num_documents), self.val_fraction, self.split_seed)
            docs = {"train": np.asarray(train, dtype=np.int64), "val": np.asarray(val, dtype=np.int64)}
            held = {"train": stores["train"], "val": stores["train"]}
        return {s: split_arrays(held[s], docs[s], self.tokens_per_sample, self.packed, show) for s in SPLITS}

    @staticmethod
    def _save(arrays: dict[str, dict[str, np.ndarray]], folder: Path) -> None:
        for split, named in arrays.items():
            for name, values in named.items():
                np.save(folder / f"{split}.{name}.npy", values)

    def _samples(self, store: TokenStore, arrays: dict[str, np.ndarray]) -> Dataset:
        if self.packed:
            return PackedSamples(store.tokens, arrays["src"], arrays["cum"], arrays["bounds"], ignored=store.ignored)
        return DenseRows(
            store.tokens, arrays["src"], arrays["cum"], self.tokens_per_sample, store.ignored, arrays["rows"]
        )

    def size_problem(self, num_replicas: int = 1, train: bool = True, val: bool = True) -> str | None:
        """Describe, in one line naming the numbers and what to change, a training split too small for one batch of
        ``samples_per_batch`` samples on each of ``num_replicas`` data-parallel replicas, or a validation split with
        tokens but no sample (validation serves any number of samples on any number of replicas); None if neither."""
        training = f"data.samples_per_batch={self.samples_per_batch}"
        if num_replicas > 1:
            training += f" on {num_replicas} data-parallel replicas"
        budget = f"data.tokens_per_sample={self.tokens_per_sample}"
        for name, samples, check in (("training", self.train_samples, train), ("validation", self.val_samples, val)):
            if name == "training":
                need, asked = self.samples_per_batch * num_replicas, training
                samples_needed = f"{need} training sample" + ("s" if need > 1 else "")
            else:
                need, asked, samples_needed = 1, "validation", "a sample"
            count = len(samples) if samples is not None else 0
            if not check or samples is None or count >= need:
                continue
            if samples.segments.num_tokens == 0:
                if name == "validation":
                    continue  # no validation documents: no validation (the main job sets limit_val_batches=0)
                if self.val_sources or self.val_fraction == 0:  # nothing was held out of the training sources
                    return "the training sources hold no non-empty document: add documents to data.sources"
                return (
                    f"the training split holds no tokens (data.val_fraction={self.val_fraction} holds out at least "
                    "one document): add documents, or set data.val_fraction=0 or data.val_sources"
                )
            fixes = []
            if name == "training" and count >= num_replicas:
                fixes.append(f"set data.samples_per_batch to at most {count // num_replicas}")
            if self.packed:
                made = f"the {name} documents pack into {count} sample(s) of {budget} tokens"
                fixes.append("lower data.tokens_per_sample")
            else:
                tokens = samples.segments.num_tokens
                made = f"the {tokens} {name} tokens make {count} dense row(s) of {budget} tokens (data.packed=false)"
                if tokens >= need:
                    fixes.append(f"set data.tokens_per_sample to at most {tokens // need}")
            fixes.append("add documents" if name == "training" else "raise data.val_fraction (or add data.val_sources)")
            advice = ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]
            return f"{asked} needs {samples_needed} for one batch, but {made}: {advice}"
        return None

    def _replicas(self) -> tuple[int, int]:
        """Return ``(num_replicas, rank)`` of the data-parallel split (one replica under a single-device strategy,
        which has no sampler arguments)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _loader(self, samples: Dataset, sampler: ResumableSampler) -> DataLoader:
        """Wrap samples in a DataLoader whose batches follow the batch contract (an evaluation sampler's last batch
        may be shorter, or its filler)."""
        return DataLoader(
            _WithFiller(samples) if sampler.complete else samples,
            batch_size=self.samples_per_batch,
            sampler=sampler,
            collate_fn=collate_packed if self.packed else collate_dense,
            num_workers=self.num_workers,
            drop_last=not sampler.complete,
        )

    def train_dataloader(self) -> DataLoader:
        """Serve one seeded pass per epoch (or, with ``max_steps`` and no ``max_epochs``, one stream of as many passes
        as ``max_steps`` needs), a resumed run continuing with the next sample its checkpoint had not trained on.

        The loader's length is Lightning's count of the epoch's batches done plus the batches it serves; a checkpoint
        taken at an epoch's end resumes with the next epoch (so worker processes, which draw their indices as the
        loader is built, draw that epoch's). With ``max_steps`` alone a run extended with more steps continues the
        stream even where Lightning counts a new epoch (it does for a run that ended)."""
        num_replicas, rank = self._replicas()
        trainer = self.trainer
        epoch = samples = batches = 0
        saved = self._saved_position
        if trainer is not None:
            epoch = trainer.current_epoch
            if saved is not None and saved.samples and not trainer.fit_loop._loaded_from_state_dict:
                raise RuntimeError(
                    "the training loader was asked for before the checkpoint's loop state was restored (by "
                    "trainer.estimated_stepping_batches in configure_optimizers?), so it cannot continue where the "
                    "checkpoint stopped: work the schedule's length out from trainer.max_steps, or when it is first "
                    "needed, or resume under cp_zigzag, which rebuilds the loader"
                )
            if trainer.fit_loop.restarting or saved is not None:  # a resume, not a reload of the loader
                batches = self._batches_done(trainer)
                samples = self._resumed_samples(epoch, batches, num_replicas)
            if self._one_epoch_of_steps(trainer):
                return self._stream_loader(samples, batches, num_replicas, rank)
        sampler = self._sampler(1, num_replicas, rank)
        exhausted = samples > 0 and sampler.rounds_after(samples) == 0
        if saved is not None and saved.epoch < epoch:
            # the run had ended (Lightning counts the next epoch already), and this epoch starts at its beginning;
            # Lightning counts on from the ended epoch's ``batches`` (included in the length) only under max_steps
            batches = batches if trainer.fit_loop.restarting else 0
        elif exhausted or (trainer is not None and trainer.fit_loop.restarting and self._ended_an_epoch(trainer)):
            epoch, samples = epoch + 1, 0  # the epoch is done; Lightning moves on and restarts its count if it can
            # Lightning restarts its count only where it reaches the new length; else it counts on from ``batches``,
            # which the length must then include
            batches = 0 if batches >= sampler.batches_per_epoch else batches
        sampler.resume(epoch, samples, batches)
        self._resumed_at, self._saved_position = StreamPosition(epoch, samples, batches), None
        return self._loader(self.train_samples, sampler)

    def _stream_loader(self, samples: int, batches: int, num_replicas: int, rank: int) -> DataLoader:
        """The loader of a ``max_steps``-alone run: its one stream after the first ``samples``, as many passes as the
        steps left need and at least one more round, so Lightning, counting on from ``batches``, never finds the
        stream's end before ``max_steps`` (there it would start the stream over as a new epoch)."""
        sampler = self._sampler(self._passes(samples, num_replicas), num_replicas, rank, follows_epochs=False)
        sampler.resume(0, samples, batches)
        self._resumed_at, self._saved_position = StreamPosition(0, samples, batches), None
        return self._loader(self.train_samples, sampler)

    def _passes(self, samples_done: int, num_replicas: int) -> int:
        """Seeded passes per epoch: one, or with ``max_steps`` alone as many as the steps left need after the
        ``samples_done`` of the epoch's stream."""
        trainer = self.trainer
        if trainer is None or not self._one_epoch_of_steps(trainer):
            return 1
        steps_left = max(1, trainer.max_steps - trainer.global_step)
        needed = samples_done + steps_left * trainer.accumulate_grad_batches * self.samples_per_batch * num_replicas
        return max(1, math.ceil(needed / len(self.train_samples)))

    def _sampler(self, passes: int, num_replicas: int, rank: int, follows_epochs: bool = True) -> ResumableSampler:
        """The training sampler of this data-parallel rank."""
        return ResumableSampler(
            len(self.train_samples),
            self.samples_per_batch,
            seed=self.seed,
            shuffle=self.shuffle,
            passes=passes,
            num_replicas=num_replicas,
            rank=rank,
            follows_epochs=follows_epochs,
        )

    @staticmethod
    def _one_epoch_of_steps(trainer: pl.Trainer) -> bool:
        """Whether the run is ``max_steps`` alone, served as one epoch of as many passes as the steps need."""
        return max_steps_alone(trainer.max_steps, trainer.max_epochs)

    def _resumed_samples(self, epoch: int, batches: int, num_replicas: int) -> int:
        """The samples of ``epoch``'s stream the checkpoint had trained on (over all its replicas). A checkpoint
        without the datamodule's state is taken to be of this data-parallel size. With epochs, another data-parallel
        size is refused (Lightning keeps one length for every epoch of a loader)."""
        if self._saved_position is None:
            return batches * num_replicas * self.samples_per_batch
        saved = self._saved_position
        if saved.replicas not in (None, num_replicas) and not self._one_epoch_of_steps(self.trainer):
            raise ValueError(
                f"the checkpoint was saved on {saved.replicas} data-parallel replicas; with max_epochs a run resumes "
                f"on as many (Lightning keeps one loader length for every epoch), not {num_replicas}: resume on "
                f"{saved.replicas}, or train with max_steps alone"
            )
        if self._one_epoch_of_steps(self.trainer):  # one stream: epoch e of a run with max_epochs is its pass e
            return saved.epoch * len(self.train_samples) + saved.samples
        return saved.samples if saved.epoch == epoch else 0

    @staticmethod
    def _ended_an_epoch(trainer: pl.Trainer) -> bool:
        """Whether the checkpoint was taken after its epoch's last batch (Lightning resumes with the next epoch)."""
        return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    @staticmethod
    def _between_epochs(trainer: pl.Trainer) -> bool:
        """Whether Lightning has ended an epoch and not started the next (as a run ends, at ``max_steps`` too): its
        batch count is then still the ended epoch's, and ``current_epoch`` already the next."""
        progress = trainer.fit_loop.epoch_progress.current
        return progress.completed > 0 and progress.started == progress.completed

    @staticmethod
    def _batches_done(trainer: pl.Trainer) -> int:
        """This rank's batches of the current epoch that training has done (Lightning's count; restored on resume)."""
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def stream_settings(self) -> dict[str, Any]:
        """The settings that make the training sample stream, by their ``lightning-cp`` config keys: a saved position
        counts samples of the stream these made."""
        return {
            "data.sources": list(self.sources),
            "data.val_sources": self.val_sources,
            "data.val_fraction": self.val_fraction,
            "data.split_seed": self.split_seed,
            "data.tokens_per_sample": self.tokens_per_sample,
            "data.packed": self.packed,
            "data.shuffle": self.shuffle,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where training stands: the epoch, how many samples of its stream (over all replicas) are done, and over
        how many replicas, with the settings that made the stream. Saved in every checkpoint, so a resumed run
        continues with the next unseen sample. A run that has ended is still in its last epoch (Lightning counts the
        next one already); with ``max_steps`` alone the epoch is 0, that of the one stream."""
        if self.trainer is None:
            return {}
        start = self._resumed_at
        if not self._one_epoch_of_steps(self.trainer):
            epoch = self.trainer.current_epoch - self._between_epochs(self.trainer)
            if epoch != start.epoch:
                start = StreamPosition(epoch, 0)
        num_replicas = self._replicas()[0]
        since = self._batches_done(self.trainer) - start.batches
        done = start.samples + since * num_replicas * self.samples_per_batch
        return {"epoch": start.epoch, "samples": done, "replicas": num_replicas, "stream": self.stream_settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the position a checkpoint saved (read when the training loader is built; Lightning builds one only
        once, so a loader built before this restore is dropped). Lightning's warning that a mid-epoch resume of a
        plain loader is unreliable does not apply to this one: it is filtered out, process-wide."""
        if self.trainer is None or self.trainer.state.fn != TrainerFn.FITTING:
            return  # validate, test or predict from a checkpoint: no training to continue
        self._saved_position = StreamPosition(
            state_dict["epoch"], state_dict["samples"], replicas=state_dict.get("replicas")
        )
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
        if self.trainer.fit_loop._combined_loader is not None:
            self.trainer.fit_loop._combined_loader = None  # built before this restore (restored after setup): anew

    def val_dataloader(self) -> DataLoader:
        """Serve every held-out sample once, in a fixed order, the same number of batches on every replica."""
        num_replicas, rank = self._replicas()
        sampler = ResumableSampler(
            len(self.val_samples),
            self.samples_per_batch,
            shuffle=False,
            num_replicas=num_replicas,
            rank=rank,
            complete=True,
        )
        return self._loader(self.val_samples, sampler)


class _WithFiller(Dataset):
    """``samples`` and, at index ``len(samples)``, sample 0 with every label ignored: what an evaluation sampler's
    filler index loads, a step that runs like the others and scores nothing."""

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples) + 1

    def __getitem__(self, index: int) -> Any:
        if index < len(self.samples):
            return self.samples[index]
        sample = self.samples[0]
        if isinstance(sample, Pack):
            return replace(sample, labels=torch.full_like(sample.labels, IGNORE_INDEX))
        ids, labels = sample
        return ids, torch.full_like(labels, IGNORE_INDEX)
