"""Tokenisers: the built-in byte tokeniser, and any Hugging Face tokenizer behind the same small interface.

An example becomes one document: ``tokenize_example`` returns its token ids and its (unshifted) labels, ``-100``
where a token is no target: the prompt of a prompt/completion pair, every turn but the assistant's in a chat.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

IGNORE_INDEX = -100
Example = str | Mapping[str, Any]
SURROGATES = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> tuple[str, int]:
    """Return ``text`` with every lone surrogate (a JSON ``\\ud800`` escape, say: not encodable as UTF-8)
    replaced by U+FFFD, and how many there were."""
    return SURROGATES.subn("\ufffd", text)


class Tokenizer(Protocol):
    """What packing needs of a tokeniser.

    Optional: ``vocab_size`` (the largest id plus one; ids below 65536 are stored in 2 bytes), ``fingerprint``, a
    string that changes whenever the tokens would (without one the datamodule cannot share a cache and prepares data in
    each process), and ``unit``, what one token is ("byte", "token": the loss plot's unit).
    """

    eos_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return the token ids of ``text`` (with the tokeniser's own special tokens unless told otherwise)."""

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Return the token ids of a conversation rendered by the chat template."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Map text to its UTF-8 bytes (ids 0..255); ``eos_id`` (256) ends every document."""

    eos_id = 256
    vocab_size = 257
    fingerprint = "bytes:utf-8"
    unit = "byte"  # what a token is: losses are nats per byte

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return the UTF-8 bytes of ``text``."""
        return list(self.encode_bytes(text))

    def encode_bytes(self, text: str) -> bytes:
        """Return the UTF-8 bytes of ``text``, lone surrogates encoded as U+FFFD."""
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return replace_surrogates(text)[0].encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``, dropping special ids and invalid byte sequences."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Chats need a chat template, which bytes do not have."""
        raise ValueError('{"messages": ...} examples need a tokenizer with a chat template: set model.pretrained')


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer.from_pretrained``) behind the ``Tokenizer`` interface."""

    unit = "token"

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_id = self.tokenizer.eos_token_id
        # ids may have gaps (an added token far past the rest): the vocabulary is the largest id plus one
        self.vocab_size = max(len(self.tokenizer), max(self.tokenizer.get_vocab().values(), default=-1) + 1)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the files ``save_pretrained`` writes: equal for tokenizers that tokenise alike."""
        digest = hashlib.sha256(type(self.tokenizer).__qualname__.encode())
        with tempfile.TemporaryDirectory() as folder:
            self.tokenizer.save_pretrained(folder)
            for file in sorted(Path(folder).rglob("*")):
                if file.is_file():
                    digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return f"hf:{digest.hexdigest()}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return ``tokenizer(text)["input_ids"]`` (lone surrogates, which it refuses, as U+FFFD)."""
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception:
            text, count = replace_surrogates(text)
            if not count:
                raise
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Return the chat template's token ids of ``messages`` (lone surrogates as U+FFFD)."""
        if not self.tokenizer.chat_template:
            raise ValueError('{"messages": ...} examples need a tokenizer with a chat template; this one has none')
        messages = [
            {key: replace_surrogates(value)[0] if isinstance(value, str) else value for key, value in m.items()}
            for m in messages
        ]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        return list(rendered["input_ids"])

    def save_pretrained(self, path: str) -> None:
        """Save the tokenizer files next to a saved model."""
        self.tokenizer.save_pretrained(path)


def _with_eos(ids: list[int], labels: list[int], eos_id: int | None) -> tuple[list[int], list[int]]:
    """Append the end-of-document id (a target) unless there is none or the ids already end with it."""
    if eos_id is None or (ids and ids[-1] == eos_id):
        return ids, labels
    return [*ids, eos_id], [*labels, eos_id]


def _chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[int]]:
    """Render a conversation turn by turn; the tokens each assistant turn adds are the targets."""
    ids: list[int] = []
    labels: list[int] = []
    for turn in range(1, len(messages) + 1):
        rendered = tokenizer.render_chat(messages[:turn])
        if rendered[: len(ids)] != ids:
            raise ValueError("the chat template does not render a conversation's turns as prefixes of each other")
        added = rendered[len(ids) :]
        target = messages[turn - 1].get("role") == "assistant"
        ids, labels = rendered, [*labels, *(added if target else [IGNORE_INDEX] * len(added))]
    return ids, labels


def example_problem(example: Any) -> str | None:
    """Why ``example`` is none of the shapes an example takes (None: it is one): text, ``{"text"}``,
    ``{"prompt", "completion"}`` (strings) or ``{"messages"}`` (a non-empty list of objects)."""
    if isinstance(example, str):
        return None
    if isinstance(example, Mapping):
        messages = example.get("messages")
        if (
            isinstance(example.get("text"), str)
            or (isinstance(example.get("prompt"), str) and isinstance(example.get("completion"), str))
            or (isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages))
        ):
            return None
        got = "{" + ", ".join(f'"{key}": {type(value).__name__}' for key, value in example.items()) + "}"
    else:
        got = f"a {type(example).__name__}"
    return (
        'expected {"text": str}, {"prompt": str, "completion": str} or {"messages": [{"role": ..., "content": ...}, '
        f"...]}}, got {got}"
    )


def tokenize_example(tokenizer: Tokenizer, example: Example, where: str = "") -> tuple[list[int], list[int]]:
    """Return the token ids and labels of one example (see ``example_problem``); ``where`` names it in errors.

    The end-of-document id follows as a target unless the ids end with it: after a text, after a completion (a
    tokenizer that also ends its prompts with it has that one dropped), and after a chat whose last turn is the
    assistant's (unless its template marks the turns' ends with it itself, as ChatML's ``<|im_end|>`` does)."""
    problem = example_problem(example)
    if problem is not None:
        raise ValueError(f"{where or 'example'}: {problem}")
    if isinstance(example, str):
        example = {"text": example}
    eos_id = tokenizer.eos_id
    if isinstance(example.get("text"), str):
        ids = tokenizer.encode(example["text"])
        return _with_eos(ids, list(ids), eos_id)
    if isinstance(example.get("prompt"), str) and isinstance(example.get("completion"), str):
        prompt = tokenizer.encode(example["prompt"])
        if eos_id is not None and prompt and prompt[-1] == eos_id:
            plain = tokenizer.encode(example["prompt"], add_special_tokens=False)
            prompt = prompt if plain and plain[-1] == eos_id else prompt[:-1]  # the tokenizer's own end-of-text
        completion = tokenizer.encode(example["completion"], add_special_tokens=False)
        return _with_eos([*prompt, *completion], [IGNORE_INDEX] * len(prompt) + completion, eos_id)
    messages = example["messages"]
    ids, labels = _chat(tokenizer, messages)
    if eos_id in ids or messages[-1].get("role") != "assistant":
        return ids, labels
    return _with_eos(ids, labels, eos_id)
