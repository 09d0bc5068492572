"""Unit tests of the byte tokeniser, first-fit packing, collators, sources, sampler and datamodule."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
from lightning_cp.train.data.packing import split_document


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
    resumed.skip_batches(epoch=0, batches=7)
    assert list(resumed) == full[14:] and len(resumed) == 40
    resumed.set_epoch(1)
    next_epoch = ResumableSampler(20, 2, seed=3, passes=2)
    next_epoch.set_epoch(1)
    assert list(resumed) == list(next_epoch) != full
    with pytest.raises(ValueError, match="cannot fill"):
        ResumableSampler(3, 2, num_replicas=2)


def _fake_trainer(global_step: int) -> SimpleNamespace:
    strategy = SimpleNamespace(distributed_sampler_kwargs=None)
    return SimpleNamespace(
        max_steps=30, accumulate_grad_batches=1, global_step=global_step, current_epoch=0, strategy=strategy
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


def test_dense_mode_cuts_fixed_rows() -> None:
    dm = PackedTextDataModule(tokens_per_sample=128, samples_per_batch=3, packed=False)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 128)
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_no_validation_documents_when_val_fraction_is_zero() -> None:
    dm = PackedTextDataModule(tokens_per_sample=256, val_fraction=0.0)
    dm.setup("fit")
    assert dm.train_samples and dm.val_samples == []
