"""Unit tests of the byte tokeniser, first-fit packing, collators, sources, sampler and datamodule."""

from __future__ import annotations

import json
import logging
import math
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_cp.train.data import (
    ByteTokenizer,
    PackedTextDataModule,
    ResumableSampler,
    collate_packed,
    first_fit,
    load_documents,
    pack_documents,
    split_documents,
    tokenize_example,
)
from lightning_cp.train.data import datamodule as datamodule_module
from lightning_cp.train.data.datamodule import CACHE_ENV
from lightning_cp.train.data.packing import split_document
from lightning_cp.train.data.tokenizer import IGNORE_INDEX
from tests.cli_helpers import run_cli


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch) -> Path:
    """Every test's prepared data goes to its own folder, not the user's cache."""
    cache = tmp_path / "data-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache


def test_tokenizer_round_trips_unicode_and_appends_eos() -> None:
    tokenizer = ByteTokenizer()
    ids, labels = tokenize_example(tokenizer, "héllo ✓")
    assert ids[-1] == ByteTokenizer.eos_id == 256 and labels == ids
    assert max(ids[:-1]) < 256 and len(ids) == len("héllo ✓".encode()) + 1
    assert tokenizer.decode(ids) == "héllo ✓"
    assert tokenizer.encode("ab") == [97, 98]


def test_prompt_completion_examples_target_the_completion_only() -> None:
    ids, labels = tokenize_example(ByteTokenizer(), {"prompt": "Q?", "completion": "A."})
    assert ids == [*b"Q?A.", 256]
    assert labels == [-100, -100, *b"A.", 256]


def test_split_document_cuts_at_the_budget() -> None:
    assert [(p.start, p.end) for p in split_document(0, 10, 4)] == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ValueError, match="budget"):
        split_document(0, 3, 0)


def test_first_fit_puts_each_piece_into_the_first_bin_with_room() -> None:
    bins = first_fit([5, 3, 4, 2], budget=6)
    assert [[p.doc for p in b] for b in bins] == [[0], [1, 3], [2]]
    bins = first_fit([10, 2], budget=4)
    assert [[(p.doc, p.length) for p in b] for b in bins] == [[(0, 4)], [(0, 4)], [(0, 2), (1, 2)]]


def test_pack_documents_keeps_every_token_and_describes_documents_with_cu_seqlens() -> None:
    documents = [list(range(100, 100 + n)) for n in (7, 3, 12, 1, 5)]
    packs = pack_documents(documents, budget=8)
    pieces = []
    for pack in packs:
        assert pack.num_tokens <= 8
        assert pack.cu_seqlens.dtype == torch.int32 and int(pack.cu_seqlens[0]) == 0
        assert int(pack.cu_seqlens[-1]) == pack.num_tokens
        bounds = pack.cu_seqlens.tolist()
        pieces += [pack.input_ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert sorted(t for p in pieces for t in p) == sorted(t for d in documents for t in d)
    assert all(any(_is_slice(p, d) for d in documents) for p in pieces)
    assert [p.cu_seqlens.tolist() for p in packs] == [[0, 7, 8], [0, 3, 7], [0, 8], [0, 5]]
    assert packs[0].input_ids.tolist() == [*documents[0], *documents[3]]
    assert packs[1].input_ids.tolist() == [*documents[1], *documents[2][8:]]
    assert packs[2].input_ids.tolist() == documents[2][:8]


def _is_slice(piece: list[int], document: list[int]) -> bool:
    return any(document[i : i + len(piece)] == piece for i in range(len(document) - len(piece) + 1))


def test_collate_packed_concatenates_rows_and_offsets() -> None:
    packs = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], budget=5)
    batch = collate_packed(packs)
    assert batch["input_ids"].shape == (1, 9)
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_sources_read_text_files_folders_and_jsonl(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("beta", encoding="utf-8")
    (sub / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}) + "\n")
    (sub / "ignored.bin").write_bytes(b"\x00")
    assert load_documents([str(tmp_path / "a.txt")]) == ["alpha"]
    assert load_documents([str(tmp_path)]) == ["alpha", "beta", "gamma", "delta"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"txt": "x"}) + "\n")
    with pytest.raises(ValueError, match='bad.jsonl:1.*"text"'):
        load_documents([str(tmp_path / "bad.jsonl")])
    with pytest.raises(ValueError, match="does not exist"):
        load_documents([str(tmp_path / "missing.txt")])


def test_embedded_corpus_and_held_out_split_are_deterministic() -> None:
    documents = load_documents(["pydoc"])
    assert len(documents) >= 70
    train, val = split_documents(documents, 0.1, seed=0)
    assert len(val) == round(0.1 * len(documents)) and len(train) + len(val) == len(documents)
    assert not set(train) & set(val)
    assert split_documents(documents, 0.1, seed=0) == (train, val)
    assert split_documents(documents, 0.1, seed=1)[1] != val


def test_sampler_is_deterministic_splits_over_replicas_and_resumes() -> None:
    full = list(ResumableSampler(20, 2, seed=3, passes=2))
    assert full == list(ResumableSampler(20, 2, seed=3, passes=2)) and len(full) == 40
    assert sorted(full[:20]) == list(range(20)) and full[:20] != full[20:]
    ranks = [list(ResumableSampler(20, 2, seed=3, num_replicas=2, rank=r)) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == list(range(20))
    resumed = ResumableSampler(20, 2, seed=3, passes=2)
    resumed.resume(epoch=0, samples=14, batches=7)
    assert list(resumed) == full[14:] and len(resumed) == 40
    resumed.set_epoch(1)
    next_epoch = ResumableSampler(20, 2, seed=3, passes=2)
    next_epoch.set_epoch(1)
    assert list(resumed) == list(next_epoch) != full
    long = ResumableSampler(20, 2, seed=3, passes=5)
    one_stream = ResumableSampler(20, 2, seed=3, passes=5, follows_epochs=False)
    one_stream.resume(epoch=0, samples=46, batches=3)
    one_stream.set_epoch(1)  # Lightning's next epoch: the stream goes on
    assert list(one_stream) == list(long)[46:] and len(one_stream) == 3 * 2 + 54
    with pytest.raises(ValueError, match="cannot fill"):
        ResumableSampler(3, 2, num_replicas=2)


@pytest.mark.parametrize(("samples", "batch", "replicas"), [(9, 2, 2), (8, 2, 2), (5, 2, 3), (1, 4, 2), (7, 1, 4)])
def test_a_complete_sampler_serves_every_sample_once_in_equal_steps(samples: int, batch: int, replicas: int) -> None:
    """Evaluation: every sample exactly once over the replicas, the same number of batches on each; a replica the
    last round does not reach gets the filler index ``samples`` (one, as its last batch)."""
    served = [list(ResumableSampler(samples, batch, shuffle=False, num_replicas=replicas, rank=r, complete=True))
              for r in range(replicas)]  # fmt: skip
    real = sorted(index for mine in served for index in mine if index != samples)
    assert real == list(range(samples))
    steps = [math.ceil(len(mine) / batch) for mine in served]
    assert steps == [math.ceil(samples / (batch * replicas))] * replicas
    tail = samples % (batch * replicas)
    filled = [mine for mine in served if samples in mine]
    assert len(filled) == (max(0, replicas - tail) if tail else 0)  # the replicas the last round misses
    for mine in filled:  # one filler, alone in its replica's last batch
        assert mine.count(samples) == 1 and mine[-1] == samples and (len(mine) - 1) % batch == 0
    sampler = ResumableSampler(samples, batch, shuffle=False, num_replicas=replicas, rank=replicas - 1, complete=True)
    assert len(sampler) == len(served[-1])


def test_the_validation_loader_serves_every_sample_and_fillers_score_nothing() -> None:
    """Validation batches hold every held-out sample once, the last one shorter; a filler batch has no target."""
    dm = PackedTextDataModule(tokens_per_sample=512, samples_per_batch=2)
    dm.setup("fit")
    count = len(dm.val_samples)
    assert count % 2, "an odd count, so the last batch is shorter"
    dm.trainer = _fake_trainer(0)
    batches = list(dm.val_dataloader())
    assert len(batches) == math.ceil(count / 2)
    served = torch.cat([batch["input_ids"][0] for batch in batches])
    assert torch.equal(served, torch.cat([dm.val_samples[i].input_ids for i in range(count)]))
    dm.trainer.strategy.distributed_sampler_kwargs = {"num_replicas": count + 1, "rank": count}
    (filler,) = list(dm.val_dataloader())
    assert torch.equal(filler["input_ids"][0], dm.val_samples[0].input_ids)
    assert bool((filler["labels"] == -100).all())


def _fake_trainer(batches_done: int) -> SimpleNamespace:
    """A trainer of ``max_steps=30`` resumed after ``batches_done`` batches (none: a fresh run)."""
    strategy = SimpleNamespace(distributed_sampler_kwargs=None)
    progress = SimpleNamespace(current=SimpleNamespace(processed=batches_done), is_last_batch=False)
    return SimpleNamespace(
        max_steps=30,
        max_epochs=None,
        accumulate_grad_batches=1,
        global_step=batches_done,
        current_epoch=0,
        strategy=strategy,
        fit_loop=SimpleNamespace(
            epoch_loop=SimpleNamespace(batch_progress=progress),
            restarting=batches_done > 0,
            _loaded_from_state_dict=batches_done > 0,
        ),
    )


def test_datamodule_batches_follow_the_contract_and_resume_in_order() -> None:
    dm = PackedTextDataModule(tokens_per_sample=256, samples_per_batch=2, seed=5)
    dm.setup("fit")
    dm.trainer = _fake_trainer(0)
    batches = list(dm.train_dataloader())
    assert len(batches) >= 30
    for batch in batches[:5]:
        assert set(batch) == {"input_ids", "labels", "cu_seqlens"}
        assert torch.equal(batch["labels"], batch["input_ids"]), "text documents: every token is a target"
        assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].dtype == torch.long
        assert int(batch["cu_seqlens"][-1]) == batch["input_ids"].shape[1] <= 512
    dm.trainer = _fake_trainer(12)
    resumed = list(dm.train_dataloader())
    assert len(resumed) == len(batches) - 12
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches[12:], resumed, strict=True))
    val, again = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert val and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(val, again, strict=True))


class _TokenCounter(pl.LightningModule):
    """The least module a Trainer fits on the datamodule's batches: one weight, a loss over the batch's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.tokens = 0

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.tokens += batch["input_ids"].numel()
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_single_device_trainer_fits_on_the_datamodule() -> None:
    """A plain ``Trainer`` on one device (a strategy without sampler arguments) serves one replica's batches."""
    dm = PackedTextDataModule(tokens_per_sample=256, samples_per_batch=2, seed=5)
    module = _TokenCounter()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and module.tokens == 3 * 2 * 256


def test_dense_mode_cuts_fixed_rows() -> None:
    dm = PackedTextDataModule(tokens_per_sample=128, samples_per_batch=3, packed=False)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 128)
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_no_validation_documents_when_val_fraction_is_zero() -> None:
    dm = PackedTextDataModule(tokens_per_sample=256, val_fraction=0.0)
    dm.setup("fit")
    assert len(dm.train_samples) > 0 and len(dm.val_samples) == 0


def _scan_first_fit(
    lengths: list[int], budget: int, keep: Callable[[int, int, int], bool] = lambda *piece: True
) -> list[list[tuple[int, int, int]]]:
    """The plain first-fit: each piece (those ``keep(doc, start, end)`` allows) scans every bin from the first."""
    bins: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    for doc, length in enumerate(lengths):
        for start in range(0, length, budget):
            size = min(budget, length - start)
            if not keep(doc, start, start + size):
                continue
            target = next((i for i, free in enumerate(room) if free >= size), None)
            if target is None:
                bins.append([])
                room.append(budget)
                target = len(bins) - 1
            bins[target].append((doc, start, start + size))
            room[target] -= size
    return bins


@pytest.mark.timeout(120)
def test_first_fit_gives_the_bins_of_a_plain_scan() -> None:
    rng = random.Random(0)
    for budget in (1, 2, 3, 7, 64, 1000):
        for _ in range(40):
            lengths = [
                rng.choice([0, rng.randint(1, 3 * budget), rng.randint(1, max(1, budget // 4))])
                for _ in range(rng.randint(0, 400))
            ]
            got = [[(p.doc, p.start, p.end) for p in b] for b in first_fit(lengths, budget)]
            assert got == _scan_first_fit(lengths, budget), (budget, lengths)


@pytest.mark.timeout(120)
def test_a_long_single_document_packs_fast(tmp_path: Path) -> None:
    """32 M tokens are 31,250 bins: a scan over all bins per piece takes minutes, the max-tree well under a second."""
    bins = first_fit([32_000_100, 5], budget=1024)
    assert len(bins) == 31_251
    assert all([(p.doc, p.start, p.end) for p in b] == [(0, i * 1024, (i + 1) * 1024)] for i, b in enumerate(bins[:-1]))
    assert [(p.doc, p.start, p.end) for p in bins[-1]] == [(0, 32_000_000, 32_000_100), (1, 0, 5)]
    text = "".join(random.Random(1).choice("abcdefgh é✓\n") for _ in range(4096)) * 4096  # ~21 MB, one document
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    dm = PackedTextDataModule([str(tmp_path / "long.txt")], tokens_per_sample=1024, val_fraction=0.0)
    dm.setup("fit")
    tokens = [*text.encode(), ByteTokenizer.eos_id]
    pieces = [tokens[start : start + 1024] for start in range(0, len(tokens), 1024)]
    pieces = [piece for piece in pieces if len(piece) > 1]  # a 1-token piece predicts nothing: left out
    assert len(dm.train_samples) == len(pieces) and math.ceil(len(tokens) / 1024) - len(pieces) in (0, 1)
    for index in (0, 1234, len(dm.train_samples) - 1):
        pack = dm.train_samples[index]
        assert pack.input_ids.tolist() == pieces[index] and pack.cu_seqlens.tolist() == [0, len(pieces[index])]


def _reference_samples(documents: list, budget: int, packed: bool) -> list[list[list[int]]]:
    """Tokenise with lists, pack with the plain scan (or cut the stream into rows), as Python lists."""
    examples = [tokenize_example(ByteTokenizer(), doc) for doc in documents]
    if not packed:
        ids = [t for e in examples for t in e[0]]
        labels = [t for e in examples for t in e[1]]
        rows = [
            [ids[i * budget : (i + 1) * budget], labels[i * budget : (i + 1) * budget]]
            for i in range(len(ids) // budget)
        ]
        return [row for row in rows if any(label != IGNORE_INDEX for label in row[1][1:])]
    samples = []

    def predicts(doc: int, start: int, end: int) -> bool:  # a target after the piece's first token
        return any(label != IGNORE_INDEX for label in examples[doc][1][start + 1 : end])

    for pieces in _scan_first_fit([len(e[0]) for e in examples], budget, predicts):
        ids = [t for d, a, b in pieces for t in examples[d][0][a:b]]
        labels = [t for d, a, b in pieces for t in examples[d][1][a:b]]
        cu = [0]
        for _, a, b in pieces:
            cu.append(cu[-1] + b - a)
        samples.append([ids, cu, labels])
    return samples


def _as_lists(samples) -> list[list[list[int]]]:
    out = []
    for i in range(len(samples)):
        sample = samples[i]
        parts = sample if isinstance(sample, tuple) else (sample.input_ids, sample.cu_seqlens, sample.labels)
        assert parts[0].dtype == torch.long and parts[-1].dtype == torch.long
        out.append([part.tolist() for part in parts])
    return out


def _mixed_jsonl(path: Path, count: int, seed: int) -> str:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        for i in range(count):
            if rng.random() < 0.5:
                record = {"text": f"doc {i} é " * rng.randint(0, 120)}
            else:
                record = {"prompt": f"q{i}? " * rng.randint(0, 20), "completion": f"a{i}. " * rng.randint(0, 60)}
            handle.write(json.dumps(record) + "\n")
    return str(path)


@pytest.mark.timeout(120)
def test_datamodule_samples_equal_the_list_pipeline(tmp_path: Path) -> None:
    """Same split, tokens, target masks and first-fit bins as tokenising into lists and scanning every bin."""
    mixed = _mixed_jsonl(tmp_path / "mixed.jsonl", 400, seed=2)
    held_out = _mixed_jsonl(tmp_path / "val.jsonl", 50, seed=3)
    documents = load_documents([mixed])
    for budget, packed, val_fraction in ((64, True, 0.1), (300, True, 0.3), (50, False, 0.2), (97, True, 0.0)):
        dm = PackedTextDataModule([mixed], val_fraction=val_fraction, split_seed=4, tokens_per_sample=budget,
                                  packed=packed)  # fmt: skip
        dm.setup("fit")
        train, val = split_documents(documents, val_fraction, seed=4)
        assert _as_lists(dm.train_samples) == _reference_samples(train, budget, packed)
        assert _as_lists(dm.val_samples) == _reference_samples(val, budget, packed)
    dm = PackedTextDataModule([mixed], val_sources=[held_out], tokens_per_sample=64)
    dm.setup("fit")
    assert _as_lists(dm.train_samples) == _reference_samples(documents, 64, True)
    assert _as_lists(dm.val_samples) == _reference_samples(load_documents([held_out]), 64, True)
    pydoc = PackedTextDataModule(tokens_per_sample=1024)
    pydoc.setup("fit")
    train, val = split_documents(load_documents(["pydoc"]), 0.1, seed=0)
    assert _as_lists(pydoc.train_samples) == _reference_samples(train, 1024, True)


def test_data_is_prepared_once_and_loaded_by_the_other_ranks(tmp_path: Path, monkeypatch, _data_cache) -> None:
    source = _mixed_jsonl(tmp_path / "a.jsonl", 200, seed=5)
    first = PackedTextDataModule([source], tokens_per_sample=128)
    first.prepare_data()
    assert first.train_samples is None, "prepare_data only writes the cache"
    folders = sorted(p.name.split("-")[0] for p in _data_cache.iterdir())
    assert folders == ["samples", "tokens"]

    def no_tokenising(*args, **kwargs):
        raise AssertionError("a rank after prepare_data tokenised again")

    monkeypatch.setattr(datamodule_module, "tokenize_example", no_tokenising)
    monkeypatch.setattr(ByteTokenizer, "encode_bytes", no_tokenising)
    other = PackedTextDataModule([source], tokens_per_sample=128)
    other.setup("fit")
    first.setup("fit")
    assert _as_lists(other.train_samples) == _as_lists(first.train_samples)
    assert _as_lists(other.val_samples) == _as_lists(first.val_samples)
    repacked = PackedTextDataModule([source], tokens_per_sample=64)
    repacked.setup("fit")  # another budget: packed again from the same tokens
    assert len(list(_data_cache.glob("tokens-*"))) == 1 and len(list(_data_cache.glob("samples-*"))) == 2
    assert max(p.num_tokens for p in _as_packs(repacked.train_samples)) == 64
    restored = pickle.loads(pickle.dumps(other.train_samples))  # a spawned DataLoader worker maps the files again
    assert len(pickle.dumps(other.train_samples)) < 0.5 * other.train_samples.segments.tokens.nbytes
    assert _as_lists(restored) == _as_lists(other.train_samples)
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(_data_cache))
    with open(source, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more"}) + "\n")
    changed = PackedTextDataModule([source], tokens_per_sample=128)
    changed.setup("fit")
    assert len(list(_data_cache.glob("tokens-*"))) == 2, "a changed source is tokenised again"


class _BytesWithoutFingerprint:
    """The byte tokeniser's ids from a tokenizer that has no fingerprint (and no vocabulary size)."""

    eos_id = ByteTokenizer.eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ByteTokenizer().encode(text)

    def render_chat(self, messages) -> list[int]:
        raise ValueError("no chat template")


def test_a_tokenizer_without_fingerprint_is_prepared_in_memory(tmp_path: Path, _data_cache) -> None:
    mixed = _mixed_jsonl(tmp_path / "mixed.jsonl", 200, seed=8)
    dm = PackedTextDataModule([mixed], tokens_per_sample=64, tokenizer=_BytesWithoutFingerprint())
    dm.prepare_data()
    dm.setup("fit")
    assert not _data_cache.exists(), "nothing is cached for a tokenizer whose tokens cannot be told apart"
    train, val = split_documents(load_documents([mixed]), 0.1, seed=0)
    assert _as_lists(dm.train_samples) == _reference_samples(train, 64, True)
    assert _as_lists(dm.val_samples) == _reference_samples(val, 64, True)


def _as_packs(samples) -> list:
    return [samples[i] for i in range(len(samples))]


def test_progress_bar_only_for_long_work_and_on_rank_zero(tmp_path: Path, monkeypatch, capsys) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    source = _mixed_jsonl(tmp_path / "a.jsonl", 100, seed=6)
    PackedTextDataModule([source], tokens_per_sample=128).setup("fit")
    assert "lightning-cp:" not in capsys.readouterr().err, "short work shows no bar"
    monkeypatch.setattr(datamodule_module, "PROGRESS_MIN_BYTES", 1)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    PackedTextDataModule([source], tokens_per_sample=64).setup("fit")
    assert "lightning-cp:" not in capsys.readouterr().err, "only rank 0 shows the bar"
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    PackedTextDataModule([source], tokens_per_sample=32, split_seed=1).setup("fit")
    err = capsys.readouterr().err
    assert "lightning-cp: packing" in err and "lightning-cp: data prepared in" in err


def test_a_split_too_small_for_one_batch_is_one_clear_error(tmp_path: Path) -> None:
    source = _mixed_jsonl(tmp_path / "a.jsonl", 100, seed=7)
    dm = PackedTextDataModule([source], tokens_per_sample=256, samples_per_batch=3)
    dm.setup("fit")
    count = len(dm.train_samples)
    two_replicas = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    dm.samples_per_batch = count
    dm.trainer = two_replicas
    with pytest.raises(ValueError, match=rf"samples_per_batch={count} on 2 data-parallel replicas needs {2 * count} "):
        dm.setup("fit")
    message = dm.size_problem(2, val=False)
    assert f"training documents pack into {count} sample(s)" in message and "at most" in message
    dm.setup("validate")  # validation serves any number of samples, here fewer than one batch per replica
    assert len(dm.val_samples) < 2 * count and dm.size_problem(2, train=False) is None
    dense = PackedTextDataModule([source], tokens_per_sample=10**7, packed=False)
    with pytest.raises(ValueError, match=r"data.tokens_per_sample=10000000 tokens \(data.packed=false\)"):
        dense.setup("fit")
    tokens = dense.val_samples.segments.num_tokens
    with pytest.raises(
        ValueError, match=rf"validation needs a sample for one batch, but .* at most {tokens}, or raise"
    ):
        dense.setup("validate")
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ValueError, match=r"training split holds no tokens \(data.val_fraction=0.1 holds out"):
        PackedTextDataModule([str(tmp_path / "one.txt")]).setup("fit")


@pytest.mark.timeout(240)
def test_cli_refuses_more_samples_per_batch_than_data_before_processes_start(tmp_path: Path) -> None:
    dm = PackedTextDataModule(tokens_per_sample=1024)
    dm.setup("fit")
    for overrides, expected in (
        (["data.samples_per_batch=100000"], f"the training documents pack into {len(dm.train_samples)} sample(s)"),
        (["data.packed=false", "data.tokens_per_sample=100000000"], "set data.tokens_per_sample to at most"),
    ):
        result = run_cli("fit", *overrides, "trainer.max_steps=2", f"run.root={tmp_path}", "run.name=small")
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert result.stderr.startswith("lightning-cp: error: data.") and expected in result.stderr
        assert "Initializing distributed" not in result.stdout + result.stderr, "refused before any rank starts"
    assert not (tmp_path / "small").exists()


@pytest.mark.timeout(240)
def test_cli_prepares_a_long_corpus_once_with_one_progress_bar(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(10):  # 18 MB in 10 documents
        (corpus / f"{index}.txt").write_text(f"{index} the quick brown fox jumps over the lazy dog\n" * 40_000)
    overrides = ["trainer.max_steps=1", "trainer.limit_val_batches=1", "model.hidden_size=32", "model.num_layers=1",
                 "model.intermediate_size=64", "data.tokens_per_sample=256", f"data.sources=[{corpus}]",
                 f"run.root={tmp_path}", "run.name=long"]  # fmt: skip
    result = run_cli("fit", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("lightning-cp: data prepared in") == 1
    assert result.stderr.count("lightning-cp: reading and tokenising") >= 1
    assert "Initializing distributed: GLOBAL_RANK: 1" in result.stderr + result.stdout, "two ranks ran"


def _write_jsonl_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_lone_surrogates_become_replacement_characters_with_a_warning(tmp_path: Path, caplog) -> None:
    source = _write_jsonl_lines(tmp_path / "s.jsonl", [
        '{"text": "ok"}',
        '{"text": "bad \\ud800 here \\udfff"}',
        '{"text": "pair \\ud83d\\ude00 is fine, \\\\ud800 is text"}',
        '{"prompt": "q \\udc00", "completion": "a"}',
    ])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_cp.data"):
        documents = load_documents([source])
    assert documents[1] == "bad \ufffd here \ufffd" and documents[2] == "pair \U0001f600 is fine, \\ud800 is text"
    assert documents[3] == {"prompt": "q \ufffd", "completion": "a"}
    warnings = [r.getMessage() for r in caplog.records if r.name == "lightning_cp.data"]
    assert len(warnings) == 1 and f"{source}: 3 lone surrogate(s) on 2 line(s) (2, 4)" in warnings[0]
    ids, _ = tokenize_example(ByteTokenizer(), "x \ud800")
    assert bytes(ids[:-1]) == "x \ufffd".encode()
    dm = PackedTextDataModule([source], tokens_per_sample=64, val_fraction=0.0)
    dm.setup("fit")
    stream = [t for p in _as_packs(dm.train_samples) for t in p.input_ids.tolist() if t != ByteTokenizer.eos_id]
    assert bytes(stream).decode().count("\ufffd") == 3


def test_lone_surrogates_reach_a_hugging_face_tokenizer_as_replacement_characters(tmp_path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lightning_cp.train.data import HFTokenizer

    word_level = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator(
        ["the cat sat \ufffd"] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(tmp_path / "tok")
    with pytest.raises(TypeError):
        fast("the \ud800 cat")  # what the tokenizer itself does with a lone surrogate
    tokenizer = HFTokenizer(str(tmp_path / "tok"))
    assert tokenizer.fingerprint == HFTokenizer(str(tmp_path / "tok")).fingerprint
    assert tokenizer.encode("the \ud800 cat") == tokenizer.encode("the \ufffd cat") != tokenizer.encode("the cat")
    chat = [{"role": "user", "content": "the \udfff"}, {"role": "assistant", "content": "cat"}]
    assert tokenizer.render_chat(chat) == tokenizer.render_chat([{**chat[0], "content": "the \ufffd"}, chat[1]])
    source = _write_jsonl_lines(tmp_path / "s.jsonl", ['{"text": "the \\ud800 cat"}', '{"text": "sat"}'])
    dm = PackedTextDataModule([source], tokens_per_sample=16, val_fraction=0.0, tokenizer=tokenizer)
    dm.setup("fit")
    expected = [*tokenizer.encode("the \ufffd cat"), tokenizer.eos_id, *tokenizer.encode("sat"), tokenizer.eos_id]
    assert [t for p in _as_packs(dm.train_samples) for t in p.input_ids.tolist()] == expected
