"""Document sources: the embedded Python documentation corpus, text files, folders and JSONL files of examples."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from lightning_cp.train.data.tokenizer import Example

EMBEDDED = "pydoc"
logger = logging.getLogger("lightning_cp.data")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl",)


def embedded_documents() -> list[str]:
    """Return the distinct topics of Python's own documentation (``pydoc_data.topics``), sorted by topic name."""
    from pydoc_data.topics import topics

    return list(dict.fromkeys(topics[name] for name in sorted(topics)))


EXAMPLE_KEYS = ("text", "prompt", "messages")


def read_jsonl(path: Path) -> list[Example]:
    """Return the examples of a JSONL file: ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages"}`` records."""
    documents: list[Example] = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not any(key in record for key in EXAMPLE_KEYS):
                raise ValueError(
                    f'{path}:{line_number}: expected a JSON object with "text", "prompt"/"completion" or "messages"'
                )
            documents.append(record["text"] if isinstance(record.get("text"), str) else record)
    if not documents:
        raise ValueError(f"{path}: holds no examples")
    return documents


def read_path(path: Path) -> list[Example]:
    """Return the documents of one file (a text file is one document) or of every text/JSONL file in a folder."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            raise ValueError(f"folder {path} holds no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
        return [doc for file in files for doc in read_path(file)]
    if not path.is_file():
        raise ValueError(f"data source {path} does not exist")
    if path.suffix in JSONL_SUFFIXES:
        return read_jsonl(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if "\ufffd" in text:
        logger.warning("%s: bytes that are not UTF-8 were replaced by U+FFFD", path)
    return [text]


def load_documents(sources: Sequence[str]) -> list[Example]:
    """Return the examples of every source, in order; ``"pydoc"`` names the embedded corpus."""
    documents: list[Example] = []
    for source in sources:
        documents.extend(embedded_documents() if source == EMBEDDED else read_path(Path(source).expanduser()))
    return [doc for doc in documents if doc]


def split_documents(
    documents: Sequence[Example], val_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Hold out a seeded random ``val_fraction`` of the documents (at least one when the fraction is positive)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(val_fraction * len(documents))) if val_fraction > 0 else 0
    held_out = set(order[:n_val])
    train = [doc for i, doc in enumerate(documents) if i not in held_out]
    val = [doc for i, doc in enumerate(documents) if i in held_out]
    return train, val
