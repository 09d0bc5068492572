"""``lightning-cp fit model.pretrained=DIR``: a tiny Hugging Face model and tokenizer made here, nothing downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from lightning_cp.train.runfolder import read_metrics
from tests.cli_helpers import assert_same_losses, run_cli

WORDS = "the a cat dog sat ran on under mat log why how what is did yes no it there here".split()  # noqa: SIM905
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
PROMPTS = [
    {"prompt": "what did the cat do", "completion": "it sat on the mat"},
    {"prompt": "how is the dog", "completion": "the dog ran under the log"},
    {"prompt": "why is it there", "completion": "it is here yes"},
]
VAL = [{"prompt": "what is the dog", "completion": "a dog sat there"}, {"prompt": "is it", "completion": "no"}]
CHATS = [
    {"messages": [{"role": "user", "content": "how is the cat"}, {"role": "assistant", "content": "the cat sat"}]},
    {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "no"},
                  {"role": "user", "content": "what"}, {"role": "assistant", "content": "the log"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A word-level tokenizer with a chat template and a tiny float32 Llama, saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("pretrained")
    specials = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    word_level = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator([" ".join(WORDS)] * 3, trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["lfm2", "bamba", "jamba", "qwen3_5"])
def pretrained_hybrid(pretrained: Path, tmp_path_factory, request) -> Path:
    """The same tokenizer with a tiny float32 hybrid: LFM2 (a short-convolution layer, then an attention layer), Bamba
    (a Mamba2 layer, then an attention layer), Jamba (a Mamba layer, then an attention layer; dense MLPs,
    ``num_experts=1``, as a saved model's experts run torch's grouped matmul, which takes no float64) or Qwen3.5 (a
    Gated DeltaNet layer, then an attention layer)."""
    folder = tmp_path_factory.mktemp(f"pretrained_{request.param}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    tokenizer.save_pretrained(folder)
    common = {
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }  # fmt: skip
    if request.param == "lfm2":
        config = transformers.Lfm2Config(
            **common, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False
        )
    elif request.param == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(
            **common, layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
    elif request.param == "jamba":
        config = transformers.JambaConfig(
            **common, attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4,
        )  # fmt: skip
    else:
        config = transformers.BambaConfig(
            **common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
            mamba_chunk_size=8, mamba_expand=2,
        )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _independent_val_loss(folder: Path) -> float:
    """Step-0 validation loss by hand: the unmodified model, each example alone, targets = completion + eos."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64)
    total, count = 0.0, 0
    for example in VAL:
        prompt = tokenizer(example["prompt"])["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        total += F.cross_entropy(logits, torch.tensor(completion), reduction="sum").item()
        count += len(completion)
    return total / count


def test_fine_tuning_a_pretrained_folder(pretrained: Path, tmp_path: Path) -> None:
    """cp=1 and cp=2 (with the loss made 8 tokens at a time) write the same float64 losses on prompt/completion and
    chat data; the step-0 validation loss is the unmodified model's; ``hf/`` reloads in plain transformers with the
    trained weights."""
    sources = f"data.sources=[{_write(tmp_path / 'p.jsonl', PROMPTS)},{_write(tmp_path / 'c.jsonl', CHATS)}]"
    common = [
        f"model.pretrained={pretrained}", sources, f"data.val_sources=[{_write(tmp_path / 'v.jsonl', VAL)}]",
        "data.tokens_per_sample=32", "trainer.max_steps=4", "trainer.val_check_interval=2",
        "trainer.precision=64-true", "checkpoint.every_n_steps=2", "optim.lr=1e-2", "optim.warmup_steps=1",
        f"run.root={tmp_path}",
    ]  # fmt: skip
    for name, devices in (("cp1", 1), ("cp2", 2)):
        cp = [f"trainer.devices={devices}", f"strategy.context_parallel_size={devices}", f"run.name={name}"]
        chunked = ["model.loss_chunk_tokens=8"] if devices == 2 else []
        result = run_cli("fit", *common, *cp, *chunked)
        assert result.returncode == 0, result.stderr[-3000:]
    val1 = assert_same_losses(tmp_path / "cp2", tmp_path / "cp1", 4, [0, 2, 4])
    assert abs(val1[0] - _independent_val_loss(pretrained)) <= 1e-9 * val1[0]
    assert read_metrics(tmp_path / "cp2" / "metrics.csv")
    reload = (
        "import sys, torch, transformers\n"
        "assert 'lightning_cp' not in sys.modules\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float64)\n"
        "tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = torch.tensor([tokenizer('the cat sat on the mat')['input_ids']])\n"
        "torch.save({'weights': model.state_dict(), 'logits': model(ids).logits, 'ids': ids}, sys.argv[2])\n"
    )
    saved = tmp_path / "reloaded.pt"
    subprocess.run([sys.executable, "-c", reload, str(tmp_path / "cp2" / "hf"), str(saved)], check=True)
    reloaded = torch.load(saved)
    trained = torch.load(tmp_path / "cp2" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, value in reloaded["weights"].items():
        assert torch.equal(value, trained[f"model.{name}"].to(torch.float64)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float64)
    model.load_state_dict({name.removeprefix("model."): value for name, value in trained.items()})
    # the same weights in another process (maybe another thread count): equal up to float64 summation order
    torch.testing.assert_close(model(reloaded["ids"]).logits, reloaded["logits"], rtol=1e-12, atol=1e-12)


def test_fine_tuning_a_pretrained_hybrid_folder(pretrained_hybrid: Path, tmp_path: Path) -> None:
    """A hybrid folder (LFM2's short convolutions, Bamba's Mamba2, Jamba's Mamba or Qwen3.5's Gated DeltaNet layers, and
    attention) at cp=2 with ring attention writes cp=1's float64 losses on prompt/completion data packed several
    examples to a row."""
    common = [
        f"model.pretrained={pretrained_hybrid}", f"data.sources=[{_write(tmp_path / 'p.jsonl', PROMPTS * 2)}]",
        f"data.val_sources=[{_write(tmp_path / 'v.jsonl', VAL)}]", "data.tokens_per_sample=32",
        "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.precision=64-true", "optim.lr=1e-2",
        f"run.root={tmp_path}",
    ]  # fmt: skip
    for name, devices, mode in (("cp1", 1, "allgather"), ("cp2", 2, "ring")):
        cp = [f"trainer.devices={devices}", f"strategy.context_parallel_size={devices}", f"run.name={name}"]
        result = run_cli("fit", *common, *cp, f"strategy.attention_mode={mode}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(tmp_path / "cp2", tmp_path / "cp1", 3, [0, 3])


def test_architecture_keys_next_to_a_pretrained_model_are_an_error(pretrained: Path) -> None:
    result = run_cli("fit", f"model.pretrained={pretrained}", "model.num_layers=3")
    assert result.returncode == 2 and "model.num_layers" in result.stderr and "remove it" in result.stderr
