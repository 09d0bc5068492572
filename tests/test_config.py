"""Configuration merging, validation errors, packaged configs and the in-process console script."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_cp.train.cli import main
from lightning_cp.train.config import Config, ConfigError, load_config, packaged_configs, plain

REPO = Path(__file__).resolve().parents[1]
PACKAGED = packaged_configs()


def test_defaults_then_file_then_overrides(tmp_path) -> None:
    cfg = load_config()
    assert cfg == OmegaConf.structured(Config)
    assert cfg.strategy.context_parallel_size == 2 and cfg.trainer.devices == 2
    path = tmp_path / "my.yaml"
    path.write_text("model:\n  hidden_size: 64\n  num_layers: 2\ntrainer:\n  max_steps: 7\n")
    cfg = load_config(str(path), ["trainer.max_steps=9", "data.sources=[a.txt,b.jsonl]", "run.name=x"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.trainer.max_steps) == (64, 2, 9)
    assert list(cfg.data.sources) == ["a.txt", "b.jsonl"] and cfg.run.name == "x"
    assert cfg.model.num_heads == 4
    whole_node = load_config(
        None,
        [
            "strategy.context_parallel_size=null",
            "strategy.tensor_parallel_size=2",
            "strategy.data_parallel=fsdp",
            "trainer.devices=4",
        ],
    )
    assert whole_node.strategy.context_parallel_size is None


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.hiden_size=64"], r"unknown key 'model.hiden_size'.*allowed keys in model: vocab_size, hidden_size"),
        (["modle.hidden_size=64"], r"unknown key 'modle'.*allowed keys in top level: seed, run, model"),
        (["model.hidden_size=big"], r"model.hidden_size: got 'big'.*expected a value of type int"),
        (["data.sources=[null]"], r"data.sources\[0\]: got 'None'; expected a value of type str"),
        (["optim.betas=[0.9,abc]"], r"optim.betas\[1\]: got 'abc'; expected a value of type float"),
        (["model.tie_embeddings=perhaps"], r"model.tie_embeddings: got 'perhaps'.*type bool"),
        (["strategy.context_parallel_size=two"], r"strategy.context_parallel_size: got 'two'.*int or null"),
        (
            ["strategy.attention_mode=tree"],
            r"strategy.attention_mode: got 'tree'; expected one of allgather, ring, ulysses, hybrid",
        ),
        (["trainer.precision=8"], r"trainer.precision: got '8'; expected one of 64-true"),
        (["trainer.devices=3"], r"world size 3 .* not divisible by .* = 2"),
        (["trainer.devices=4", "strategy.tensor_parallel_size=3"], r"world size 4 .* = 6"),
        (["model.num_layers=0"], r"model.num_layers: got 0; expected an integer >= 1"),
        (
            ["model.layer_types=[attention,recurrent]"],
            r"model.layer_types: got \['attention', 'recurrent'\]; "
            r"expected 4 entries \(num_layers\), each one of \('attention', 'recurrent', 'convolution', 'mamba'\)",
        ),
        (["model.layer_types=[attention,delta_rule,attention,attention]"], r"model.layer_types: got .*'delta_rule'"),
        (
            [
                "model.layer_types=[attention,recurrent,attention,recurrent]",
                "strategy.data_parallel=fsdp",
                "trainer.devices=4",
                "strategy.tensor_parallel_size=2",
            ],
            r"strategy.tensor_parallel_size=2 with recurrent layers in "
            r"model.layer_types: tensor parallelism has a plan for attention layers only",
        ),
        (["data.val_fraction=1.0"], r"data.val_fraction: got 1.0; expected a number in \[0, 1\)"),
        (["optim.betas.0=0.8"], r"optim.betas \(from the command line\) is a list: give it whole, e.g. optim.betas="),
        (["model.layer_types.1=recurrent"], r"model.layer_types \(from the command line\) is a list: give it whole"),
        (["trainer.max_steps"], r"not of the form key=value"),
    ],
)
def test_bad_values_name_the_key_and_what_it_accepts(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_bad_key_in_a_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    expected = r"unknown key 'optim.learning_rate' in .*bad.yaml; allowed keys in optim: lr,"
    with pytest.raises(ConfigError, match=expected):
        load_config(str(path))
    with pytest.raises(ConfigError, match="no such file and no packaged config.*default"):
        load_config(str(tmp_path / "missing.yaml"))


def test_top_level_configs_folder_is_the_packaged_one() -> None:
    assert (REPO / "configs").resolve() == PACKAGED.resolve()
    assert {"default.yaml", "cp4_cpu.yaml", "gpu.yaml", "hybrid.yaml"} <= {p.name for p in PACKAGED.glob("*.yaml")}


def test_default_yaml_is_exactly_the_built_in_defaults() -> None:
    assert load_config("default") == load_config()


def test_every_packaged_config_loads_by_name_and_path() -> None:
    gpu = load_config("gpu")
    assert gpu.trainer.precision == "bf16-mixed" and gpu.strategy.process_group_backend == "nccl"
    assert gpu.data.tokens_per_sample >= 32768
    cp4 = load_config(str(REPO / "configs" / "cp4_cpu.yaml"))
    assert cp4.strategy.context_parallel_size == 4 and cp4.trainer.devices == 4
    hybrid = load_config("hybrid")
    assert list(hybrid.model.layer_types) == ["attention", "recurrent", "attention", "mamba"]


def test_print_config_prints_the_merged_yaml(capsys) -> None:
    assert main(["print-config", "--config", "cp4_cpu", "optim.lr=0.5"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.optim.lr == 0.5 and printed.strategy.context_parallel_size == 4


def test_cli_bad_config_is_one_line_and_exit_code_2(capsys) -> None:
    assert main(["fit", "model.hiden_size=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-cp: error: unknown key 'model.hiden_size'")


def test_a_choice_given_as_a_number_finds_its_spelling(tmp_path) -> None:
    """``trainer.precision: 32`` in YAML (an int) and ``=32`` on the command line both mean the choice "32"."""
    path = tmp_path / "precision.yaml"
    path.write_text("trainer:\n  precision: 32\n")
    assert plain(load_config(str(path)).trainer)["precision"] == "32"
    assert plain(load_config(None, ["trainer.precision=32"]).trainer)["precision"] == "32"
    path.write_text("trainer:\n  precision: 64\n")
    assert plain(load_config(str(path)).trainer)["precision"] == "64-true"
    for alias, choice in (("64", "64-true"), ("16", "16-mixed"), ("bf16", "bf16-mixed")):  # as Lightning reads them
        assert plain(load_config(None, [f"trainer.precision={alias}"]).trainer)["precision"] == choice


def test_a_pretrained_model_takes_saved_configs_but_no_changed_architecture() -> None:
    """The built-in defaults (``default.yaml``, a run's ``config.yaml``) may sit next to ``model.pretrained``; a changed
    architecture key may not."""
    assert load_config("default", ["model.pretrained=/some/folder"]).model.pretrained == "/some/folder"
    with pytest.raises(ConfigError, match="model.hidden_size .from the command line. is an architecture key"):
        load_config("default", ["model.pretrained=/some/folder", "model.hidden_size=64"])
    chunked = load_config("default", ["model.pretrained=/some/folder", "model.loss_chunk_tokens=1024"])
    assert chunked.model.loss_chunk_tokens == 1024  # how the model runs, not what it is


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optim.lr=-1"], r"optim.lr: got -1.0; expected a number in \(0, 10\]"),
        (["optim.lr=0"], r"optim.lr: got 0.0"),
        (["optim.lr=1e9"], r"optim.lr: got 1000000000.0"),
        (["optim.betas=[2.0,0.95]"], r"optim.betas: got \[2.0, 0.95\]"),
        (["optim.warmup_steps=-3"], r"warmup_steps=-3"),
        (["trainer.max_steps=-5"], r"trainer.max_steps: got -5"),
        (["trainer.max_steps=0"], r"trainer.max_steps: got 0"),
        (["trainer.val_check_interval=0"], r"trainer.val_check_interval: got 0"),
        (["model.num_heads=3"], r"num_heads=3.*expected hidden_size divisible by num_heads"),
        (["model.num_kv_heads=3"], r"num_kv_heads=3"),
        (["model.vocab_size=10"], r"model.vocab_size: got 10; the byte tokenizer needs at least 257"),
        (["checkpoint.save_top_k=-2"], r"checkpoint.save_top_k: got -2; expected -1 \(keep every"),
        (["strategy.sequence_parallel=true"], r"sequence_parallel: true needs strategy.tensor_parallel_size > 1"),
        (["strategy.data_parallel_size=foo"], r"strategy.data_parallel_size: got 'foo'"),
        (["run.name=../x"], r"run.name='../x': expected a plain folder name"),
        (
            ["strategy.tensor_parallel_size=2", "strategy.context_parallel_size=1"],
            r"strategy.tensor_parallel_size: 2 needs strategy.data_parallel=fsdp",
        ),
        (["strategy.cpu_offload=true"], r"strategy.cpu_offload: true needs strategy.data_parallel=fsdp"),
        (["model.loss_chunk_tokens=-1"], r"model.loss_chunk_tokens: got -1"),
        (["model.init_std=-1"], r"model.init_std: got -1.0; expected a standard deviation > 0"),
        (["data.tokens_per_sample=1"], r"data.tokens_per_sample: got 1; expected at least 2"),
        (["trainer.max_epochs=0"], r"trainer.max_epochs: got 0; expected null, -1 or an integer >= 1"),
        (["trainer.max_epochs=-5"], r"trainer.max_epochs: got -5"),
        (["trainer.gradient_clip_val=-1"], r"trainer.gradient_clip_val: got -1.0; expected null or 0"),
        (["trainer.limit_val_batches=abc"], r"trainer.limit_val_batches: got abc; expected batches"),
        (["trainer.devices=[0,1]"], r"trainer.devices: got \[0, 1\]; on CPU give the number of processes"),
        (["trainer.devices=-1"], r"trainer.devices: got -1; on CPU give the number of processes"),
        (["trainer.devices=auto"], r"trainer.devices: got 'auto'; on CPU give the number of processes"),
        (["trainer.limit_val_batches=1.5"], r"trainer.limit_val_batches: got 1.5"),
        (
            ["strategy.data_parallel_size=1", "strategy.context_parallel_size=1"],
            r"strategy.data_parallel_size=1 x context_parallel_size x tensor_parallel_size = 1 is not the world size 2",
        ),
        (["strategy.attention_mode=hybrid"], r"strategy.attention_mode='hybrid' with ulysses_size=None: 'hybrid'"),
        (["strategy.ulysses_size=2"], r"strategy.attention_mode='allgather' with ulysses_size=2: .* take none"),
        (
            [
                "trainer.devices=6",
                "strategy.context_parallel_size=6",
                "strategy.attention_mode=hybrid",
                "strategy.ulysses_size=4",
            ],
            r"strategy.ulysses_size=4 must divide context_parallel_size=6",
        ),
        (
            [
                "trainer.devices=4",
                "strategy.context_parallel_size=null",
                "strategy.attention_mode=hybrid",
                "strategy.ulysses_size=4",
            ],
            r"strategy.ulysses_size=4 must divide context_parallel_size=4 and be smaller",
        ),
        (
            [
                "strategy.tensor_parallel_size=2",
                "strategy.data_parallel=fsdp",
                "strategy.context_parallel_size=1",
                "trainer.precision=16-mixed",
            ],
            r"16-mixed with strategy.tensor_parallel_size > 1",
        ),
    ],
)
def test_values_that_cannot_train_are_config_errors(overrides: list[str], expected: str) -> None:
    from lightning_cp.train.runfolder import check_run_name

    with pytest.raises(ConfigError, match=expected):
        cfg = load_config(None, overrides)
        check_run_name(cfg.run.name or "fine")


def test_a_yaml_list_is_not_a_configuration(tmp_path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="not a YAML mapping of sections"):
        load_config(str(path))


def test_auto_accelerator_on_a_host_without_gpus_needs_a_process_count(monkeypatch) -> None:
    """``accelerator=auto`` is the CPU where no GPU is: ``devices=-1`` is refused as it is with ``accelerator=cpu``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.devices: got -1; on CPU give the number of processes"):
        load_config(None, ["trainer.accelerator=auto", "trainer.devices=-1"])


def test_a_text_file_given_as_configuration_is_named_in_one_short_line(tmp_path) -> None:
    """Plain text reads as YAML with one long key: the error shows its start, not the whole file."""
    path = tmp_path / "notes.txt"
    path.write_text(" ".join(["words"] * 200) + "\n")
    with pytest.raises(ConfigError, match=r"unknown key 'words words .{40,50}\.\.\.' in ") as raised:
        load_config(str(path))
    assert len(str(raised.value)) < 300
