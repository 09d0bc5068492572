"""Peak memory of one loss forward + backward of a Hugging Face causal LM through ``HFCausalLM``, with the whole
logits (``loss_chunk_tokens=0``) and made a chunk at a time, side by side in one run.

A Llama of 2 layers x 128 wide with a 32k-token vocabulary (the vocabulary, not the layers, decides this memory), one
packed row of N tokens on one process; each setting in a fresh interpreter, after a warm-up step (the chunked path's
probe runs there). Peak = resident growth during the step, glibc returning freed buffers at once, so it follows the
live tensors. Run from the repository root: ``python benchmarks/hf_loss_memory.py [--quick]``; the table is printed
and saved to ``benchmarks/results/hf_loss_memory.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "hf_loss_memory.md"
VOCAB = 32768
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def measure(tokens: int, chunk: int) -> dict[str, float]:
    """In this process: the peak resident growth (MiB) of one loss step and its loss."""
    import transformers

    from lightning_cp.hf import HFCausalLM

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=tokens,
    )  # fmt: skip
    module = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config), loss_chunk_tokens=chunk)
    ids = torch.randint(0, VOCAB, (1, tokens))
    batch = {"input_ids": ids, "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32)}
    for _ in range(2):  # the first is the warm-up
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        resident = _kib("VmRSS")
        out, _ = module._loss(dict(batch))
        out.loss.backward()
        peak = (_kib("VmHWM") - resident) / 1024
        module.zero_grad(set_to_none=False)
    return {"peak": peak, "loss": out.mean.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4k tokens only")
    parser.add_argument("--chunk", type=int, default=1024, help="loss_chunk_tokens of the chunked rows")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        tokens, chunk = json.loads(args.trial)
        print(json.dumps(measure(tokens, chunk)))
        return
    torch.set_num_threads(1)
    start = time.time()
    rows = []
    for tokens in (4096,) if args.quick else (4096, 8192, 16384):
        runs = {}
        for chunk in (0, args.chunk):
            trial = [sys.executable, __file__, "--trial", json.dumps([tokens, chunk])]
            runs[chunk] = json.loads(subprocess.run(trial, capture_output=True, text=True, check=True).stdout)
        whole, chunked = runs[0], runs[args.chunk]
        logits = tokens * VOCAB * 4 / 2**20
        rows.append(
            f"| {tokens} | {logits:.0f} | {whole['peak']:.0f} | {chunked['peak']:.0f} | "
            f"{whole['peak'] / chunked['peak']:.1f} | {abs(whole['loss'] - chunked['loss']):.1e} |"
        )
    lines = [
        "# Hugging Face loss memory: whole logits against a chunked loss",
        "",
        f"`python benchmarks/hf_loss_memory.py{' --quick' if args.quick else ''}`: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, {platform.machine()}, "
        f"{time.time() - start:.0f} s. Llama 2 x 128, vocabulary {VOCAB}, float32, one process; peak = resident growth "
        f"of one loss forward + backward (MiB); chunked: `HFCausalLM(..., loss_chunk_tokens={args.chunk})`.",
        "",
        "| tokens | one copy of the logits | whole logits | chunked | whole / chunked | loss difference |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
