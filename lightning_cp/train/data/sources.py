"""Document sources: the embedded Python documentation corpus, text files, folders and JSONL files of examples.

A file named ``*.jsonl`` or ``*.json`` (any case) is read as JSON Lines, one example per line (what
``datasets.Dataset.to_json`` writes); a folder holds the text and ``*.jsonl`` files under it. A byte-order mark
opening a file is dropped.

Sources are read lazily (``iter_documents``), one line of a JSONL file at a time. Undecodable bytes and lone
surrogates (JSON escapes such as ``"\\ud800"``, which no UTF-8 encoder or Hugging Face tokenizer accepts) become
U+FFFD, with one warning per file naming the count and the first lines.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_cp.train.data.tokenizer import Example, example_problem, replace_surrogates

EMBEDDED = "pydoc"
logger = logging.getLogger("lightning_cp.data")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl",)
JSON_LINES_FILE_SUFFIXES = (*JSONL_SUFFIXES, ".json")  # a file named so is JSON Lines (a folder takes .jsonl only)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LINES_NAMED = 5
Advance = Callable[[int], None]
_ARRAY_HINT = "; write one example per line (JSON Lines), not one JSON array"


def embedded_documents() -> list[str]:
    """Return the distinct topics of Python's own documentation (``pydoc_data.topics``), sorted by topic name."""
    from pydoc_data.topics import topics

    return list(dict.fromkeys(topics[name] for name in sorted(topics)))


def _replace_in(value: Any) -> tuple[Any, int]:
    """Replace lone surrogates in every string of a JSON value; return it and how many were replaced."""
    if isinstance(value, str):
        return replace_surrogates(value)
    if isinstance(value, list):
        parts = [_replace_in(item) for item in value]
        return [part for part, _ in parts], sum(count for _, count in parts)
    if isinstance(value, dict):
        parts = {key: _replace_in(item) for key, item in value.items()}
        return {key: part for key, (part, _) in parts.items()}, sum(count for _, count in parts.values())
    return value, 0


def _warn_replaced(path: Path, what: str, lines: list[int], count: int) -> None:
    """One warning per file: how many characters were replaced by U+FFFD, and on which lines."""
    named = ", ".join(map(str, lines[:LINES_NAMED])) + (", ..." if len(lines) > LINES_NAMED else "")
    logger.warning("%s: %d %s on %d line(s) (%s) replaced by U+FFFD", path, count, what, len(lines), named)


def iter_jsonl(path: Path, advance: Advance | None = None) -> Iterator[Example]:
    """Yield the examples of a JSONL file: ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages"}`` records
    (``advance(n)`` is told the bytes read)."""
    found = False
    undecodable: list[int] = []
    surrogate_lines: list[int] = []
    surrogates = 0
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if advance is not None:
                advance(len(raw))
            encoding = "utf-8-sig" if line_number == 1 else "utf-8"
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError:
                line = raw.decode(encoding, errors="replace")
                undecodable.append(line_number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                array = line_number == 1 and line.lstrip().startswith("[")
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg}){_ARRAY_HINT * array}") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{line_number}: expected a JSON object (one example per line), got a JSON "
                    f"{type(record).__name__}{_ARRAY_HINT * isinstance(record, list)}"
                )
            problem = example_problem(record)
            if problem is not None:
                raise ValueError(f"{path}:{line_number}: {problem}")
            if "\\u" in line and SURROGATE_ESCAPE.search(line):
                record, count = _replace_in(record)
                if count:
                    surrogates += count
                    surrogate_lines.append(line_number)
            found = True
            yield record["text"] if isinstance(record.get("text"), str) else record
    if undecodable:
        _warn_replaced(path, "undecodable byte sequence(s)", undecodable, len(undecodable))
    if surrogate_lines:
        _warn_replaced(path, "lone surrogate(s)", surrogate_lines, surrogates)
    if not found:
        raise ValueError(f"{path}: holds no examples")


def source_files(path: Path) -> list[Path]:
    """Return the file ``path``, or the text and JSONL files of the folder ``path`` in sorted order."""
    if path.is_dir():
        suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
        if not files:
            raise ValueError(f"folder {path} holds no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files")
        return files
    if not path.is_file():
        raise ValueError(f"data source {path} does not exist")
    return [path]


def _read_text(path: Path, advance: Advance | None) -> str:
    """Return a text file's contents; bytes that are not UTF-8 become U+FFFD (with a warning)."""
    raw = path.read_bytes()
    if advance is not None:
        advance(len(raw))
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        logger.warning("%s: bytes that are not UTF-8 were replaced by U+FFFD", path)
        return raw.decode("utf-8-sig", errors="replace")


def iter_path(path: Path, advance: Advance | None = None) -> Iterator[Example]:
    """Yield the documents of one file (a text file is one document) or of every text/JSONL file in a folder."""
    for file in source_files(path):
        if file.suffix.lower() in JSON_LINES_FILE_SUFFIXES:
            yield from iter_jsonl(file, advance)
        else:
            yield _read_text(file, advance)


def iter_documents(sources: Sequence[str], advance: Advance | None = None) -> Iterator[Example]:
    """Yield the non-empty examples of every source, in order; ``"pydoc"`` names the embedded corpus."""
    for source in sources:
        documents = iter(embedded_documents()) if source == EMBEDDED else iter_path(Path(source).expanduser(), advance)
        yield from (doc for doc in documents if doc)


def load_documents(sources: Sequence[str]) -> list[Example]:
    """Return the examples of every source, in order; ``"pydoc"`` names the embedded corpus."""
    return list(iter_documents(sources))


def describe_sources(sources: Sequence[str]) -> tuple[list[list[Any]], int]:
    """Return what identifies the sources' contents (each file's path, size and modification time; Python's
    version for the embedded corpus) and their total size in bytes."""
    described: list[list[Any]] = []
    total = 0
    for source in sources:
        if source == EMBEDDED:
            described.append([EMBEDDED, sys.version])
            continue
        for file in source_files(Path(source).expanduser()):
            stat = file.stat()
            described.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
            total += stat.st_size
    return described, total


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
