"""Byte tokeniser, document sources, first-fit packing, collators and the packed-text datamodule."""

from lightning_cp.train.data.collate import collate_dense, collate_packed
from lightning_cp.train.data.datamodule import PackedTextDataModule
from lightning_cp.train.data.packing import Pack, first_fit, pack_documents
from lightning_cp.train.data.sampler import ResumableSampler
from lightning_cp.train.data.sources import load_documents, split_documents
from lightning_cp.train.data.tokenizer import ByteTokenizer, HFTokenizer, tokenize_example

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Pack",
    "PackedTextDataModule",
    "ResumableSampler",
    "collate_dense",
    "collate_packed",
    "first_fit",
    "load_documents",
    "pack_documents",
    "split_documents",
    "tokenize_example",
]
