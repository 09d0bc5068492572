"""Examples as users write them: JSON Lines files of any name, byte-order marks, malformed records named by file and
line, where the end-of-document target goes (completion, chat ending on another turn), tokenizers whose ids have
gaps or that end prompts with EOS, and a tokenizer larger than the built-in model's vocabulary (one-line error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from lightning_cp.train.data import HFTokenizer, PackedTextDataModule
from lightning_cp.train.data.datamodule import CACHE_ENV
from lightning_cp.train.data.sources import iter_path
from lightning_cp.train.data.tokenizer import IGNORE_INDEX, tokenize_example
from tests.cli_helpers import run_cli

WORDS = "the a cat dog sat ran on mat what is two plus four".split()  # noqa: SIM905
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
RECORDS = [{"prompt": "what is two", "completion": "four"}, {"text": "the cat sat"}]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "data-cache"))


def word_tokenizer(folder: Path, eos_after_text: bool = False, vocab: dict[str, int] | None = None) -> HFTokenizer:
    """A word-level tokenizer with BOS (and, with ``eos_after_text``, EOS) added to every text and a chat template
    that does not use EOS; ``vocab`` gives the ids outright."""
    specials = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    if vocab is None:
        word_level = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        word_level.pre_tokenizer = pre_tokenizers.Whitespace()
        word_level.train_from_iterator([" ".join(WORDS)] * 3, trainers.WordLevelTrainer(special_tokens=specials))
    else:
        word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    bos, eos = word_level.token_to_id("<s>"), word_level.token_to_id("</s>")
    template = "<s> $A </s>" if eos_after_text else "<s> $A"
    word_level.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return HFTokenizer(str(folder))


def _lines(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def test_json_lines_files_are_read_as_examples_whatever_their_suffix_case(tmp_path: Path) -> None:
    """``x.json`` (what ``datasets.Dataset.to_json`` writes) and ``X.JSONL`` are JSON Lines, not one text document;
    a folder takes ``*.jsonl`` in any case; a file of one JSON array is refused naming JSON Lines."""
    for name in ("a.jsonl", "b.json", "C.JSONL"):
        assert list(iter_path(_lines(tmp_path / name, RECORDS))) == [RECORDS[0], "the cat sat"], name
    folder = tmp_path / "folder"
    folder.mkdir()
    _lines(folder / "D.JSONL", RECORDS)
    assert list(iter_path(folder)) == [RECORDS[0], "the cat sat"]
    for text in (json.dumps(RECORDS), json.dumps(RECORDS, indent=2)):
        (tmp_path / "array.json").write_text(text)
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'array.json'}:1: .*one example per line \(JSON Lines\)"):
            list(iter_path(tmp_path / "array.json"))


def test_a_byte_order_mark_is_no_token(tmp_path: Path) -> None:
    (tmp_path / "bom.txt").write_bytes("\ufeffhi".encode())
    assert list(iter_path(tmp_path / "bom.txt")) == ["hi"]
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + json.dumps(RECORDS[1]) + "\n").encode())
    assert list(iter_path(tmp_path / "bom.jsonl")) == ["the cat sat"]


@pytest.mark.parametrize(
    ("record", "got"),
    [
        ({"text": 5}, '{"text": int}'),
        ({"prompt": "q"}, '{"prompt": str}'),
        ({"prompt": "q", "completion": None}, '{"prompt": str, "completion": NoneType}'),
        ({"messages": "hi"}, '{"messages": str}'),
        ({"messages": []}, '{"messages": list}'),
        ({"body": "x"}, '{"body": str}'),
        ("just text", "a JSON str"),
    ],
)
def test_a_malformed_record_is_named_by_file_and_line(tmp_path: Path, record, got: str) -> None:
    path = _lines(tmp_path / "data.jsonl", [RECORDS[1], "", json.dumps(record)])
    with pytest.raises(ValueError, match=rf"^{path}:3: .*got {got}"):
        list(iter_path(path))


def test_the_end_of_document_is_a_target_only_after_what_the_model_should_end(tmp_path: Path) -> None:
    """After a completion and a chat's final assistant turn, EOS is a target; after a chat ending on the user's turn,
    nothing is appended (the model must not learn to stop after a question); a tokenizer that adds EOS to every
    text does not put one between prompt and completion."""
    tokenizer = word_tokenizer(tmp_path / "tok")
    eos = tokenizer.eos_id
    user, assistant = {"role": "user", "content": "what is two"}, {"role": "assistant", "content": "four"}
    ids, labels = tokenize_example(tokenizer, {"messages": [user, assistant]})
    assert ids[-1] == labels[-1] == eos and ids.count(eos) == 1
    ids, labels = tokenize_example(tokenizer, {"messages": [user]})
    assert ids == tokenizer.render_chat([user]) and set(labels) == {IGNORE_INDEX}
    chat = [user, assistant, user]
    ids, labels = tokenize_example(tokenizer, {"messages": chat})
    assert ids == tokenizer.render_chat(chat) and eos not in ids and labels[-1] == IGNORE_INDEX
    ending = word_tokenizer(tmp_path / "ending", eos_after_text=True)
    prompt = ending.encode("what is two", add_special_tokens=False)
    completion = ending.encode("four", add_special_tokens=False)
    bos = ending.tokenizer.bos_token_id
    ids, labels = tokenize_example(ending, RECORDS[0])
    assert ids == [bos, *prompt, *completion, eos]
    assert labels == [IGNORE_INDEX] * (1 + len(prompt)) + [*completion, eos]


def test_token_ids_past_the_tokenizers_length_are_stored_whole(tmp_path: Path) -> None:
    """A special token far past the others (id 70000, four tokens in all): ids are kept in 4 bytes, exactly."""
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "<s>": 3, "</s>": 70000, "<|user|>": 4, "<|assistant|>": 5}
    tokenizer = word_tokenizer(tmp_path / "tok", vocab=vocab)
    assert tokenizer.vocab_size == 70001
    data = PackedTextDataModule(
        [str(_lines(tmp_path / "d.jsonl", [{"text": "the cat"}]))], val_fraction=0, tokens_per_sample=8,
        tokenizer=tokenizer,
    )  # fmt: skip
    data.setup("fit")
    assert data.train_samples[0].input_ids.tolist() == [3, 1, 2, 70000]


def test_sources_without_a_document_are_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "full.txt").write_text("x")
    data = PackedTextDataModule([str(tmp_path / "empty.txt"), str(tmp_path / "empty.txt")], val_fraction=0)
    with pytest.raises(ValueError, match="^the training sources hold no non-empty document: add documents"):
        data.setup("fit")
    data = PackedTextDataModule([str(tmp_path / "full.txt")], val_fraction=0.5)
    with pytest.raises(ValueError, match="holds out at least one document"):
        data.setup("fit")


def test_a_tokenizer_larger_than_the_built_in_models_vocabulary_is_one_line(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "<s>": 3, "</s>": 349, "<|user|>": 4, "<|assistant|>": 5}
    word_tokenizer(tmp_path / "tok", vocab=vocab)
    _lines(tmp_path / "d.jsonl", [{"text": "the cat"}])
    args = [f"data.tokenizer={tmp_path / 'tok'}", f"data.sources=[{tmp_path / 'd.jsonl'}]", "data.val_fraction=0"]
    done = run_cli(
        "fit", *args, f"run.root={tmp_path / 'runs'}", "trainer.devices=1", "strategy.context_parallel_size=1"
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "lightning-cp: error: data.tokenizer has 350 token ids, but the model's vocabulary has 257: set "
        "model.vocab_size=350 (or more)\n"
    )


@pytest.mark.parametrize("packed", [True, False])
def test_a_piece_or_row_without_a_target_is_left_out(tmp_path: Path, packed: bool) -> None:
    """A prompt longer than the sample cut into pieces (or dense rows) that hold no completion token, and a last
    piece of one token (predicted from nothing): they would train nothing, so every sample served predicts some
    target, and every completion token is still served."""
    prompt, completion = "p" * 150, "c" * 20
    text = "t" * 64  # with EOS 65 bytes: its second piece (packed) is one token
    source = _lines(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": completion}, {"text": text}])
    data = PackedTextDataModule([str(source)], val_fraction=0, tokens_per_sample=64, packed=packed)
    data.setup("fit")
    samples = [data.train_samples[i] for i in range(len(data.train_samples))]
    if packed:
        pieces = [(s.input_ids.tolist(), s.labels.tolist(), s.cu_seqlens.tolist()) for s in samples]
        documents = [
            (ids[a:b], labels[a:b]) for ids, labels, cu in pieces for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]
    else:
        documents = [(ids.tolist(), labels.tolist()) for ids, labels in samples]
    assert documents and all(any(label != IGNORE_INDEX for label in labels[1:]) for _, labels in documents)
    targets = [label for _, labels in documents for label in labels if label != IGNORE_INDEX]
    assert targets.count(ord("c")) == len(completion)
    # packed: the prompt's first two pieces and the text's last token; dense: the first two of three rows (and the
    # tail, as ever)
    assert sorted(len(ids) for ids, _ in documents) == ([43, 64] if packed else [64])


@pytest.mark.parametrize("key", ["model.pretrained", "data.tokenizer"])
def test_a_missing_model_or_tokenizer_folder_is_named_not_looked_up_on_the_hub(tmp_path: Path, key: str) -> None:
    done = run_cli("fit", f"{key}={tmp_path / 'missing'}", f"run.root={tmp_path / 'runs'}")
    assert done.returncode == 2 and done.stderr == f"lightning-cp: error: {key}: no folder {tmp_path / 'missing'}\n"
