"""The ``lightning-cp`` console script end to end, in subprocesses (Lightning's launcher re-runs the command line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_cp.train.data import ByteTokenizer, HFTokenizer
from lightning_cp.train.runfolder import read_metrics
from tests.cli_helpers import SCRIPT, TIMEOUT, assert_same, assert_same_losses, cli_env, run_cli, run_losses

SHORT = [
    "trainer.max_steps=24",
    "trainer.val_check_interval=8",
    "trainer.limit_val_batches=8",
    "checkpoint.every_n_steps=6",
    "data.tokens_per_sample=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.intermediate_size=176",
    "optim.warmup_steps=4",
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    result = run_cli("fit", *SHORT, f"run.root={root}", "run.name=full")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "full"


def test_fit_writes_a_complete_run_folder_and_the_loss_falls(full_run: Path) -> None:
    assert {"config.yaml", "metrics.csv", "loss.png"} <= {p.name for p in full_run.iterdir()}
    assert (full_run / "checkpoints" / "last.ckpt").is_file()
    assert (full_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = (full_run / "config.yaml").read_text()
    assert "max_steps: 24" in config and "name: full" in config
    (steps, train), (val_steps, val) = run_losses(full_run)
    assert steps == list(range(24))
    assert val_steps == [0, 8, 16, 24]
    assert val[-1] < 0.75 * val[0] and sum(train[-4:]) < 0.75 * sum(train[:4])
    assert torch.load(full_run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 24


def test_resuming_under_other_data_settings_names_them(full_run: Path) -> None:
    """A checkpoint keeps the settings that made its training stream; a resume that changes them is told which (the
    saved sample count then applies to another stream)."""
    from lightning_cp.train.config import load_config
    from lightning_cp.train.runner import _stream_changes

    checkpoint = torch.load(full_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert _stream_changes(load_config(None, SHORT), checkpoint) == []
    changed = load_config(None, [*SHORT, "data.tokens_per_sample=256", "seed=7"])
    seed = load_config(None, SHORT).seed
    assert _stream_changes(changed, checkpoint) == [
        "data.tokens_per_sample=256 (the checkpoint's: 512)",
        f"seed=7 (the checkpoint's: {seed})",
    ]


def test_validate_reports_the_checkpoint_loss(full_run: Path) -> None:
    result = run_cli("validate", *SHORT, f"checkpoint.init_from={full_run}/checkpoints/last.ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    reported = float(result.stdout.strip().splitlines()[-1].rsplit(":", 1)[1])
    assert_same([reported], [run_losses(full_run)[1][1][-1]], rel=1e-6)


def test_fine_tuning_starts_from_the_checkpoint_weights(full_run: Path) -> None:
    root = full_run.parent
    ckpt = full_run / "checkpoints" / "last.ckpt"
    overrides = ["trainer.max_steps=2", f"checkpoint.init_from={ckpt}", f"run.root={root}", "run.name=ft"]
    result = run_cli("fit", *SHORT, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    (steps, _), (val_steps, val) = run_losses(root / "ft")
    assert steps == [0, 1] and val_steps[0] == 0
    assert_same([val[0]], [run_losses(full_run)[1][1][-1]], rel=1e-6)


def test_checkpoint_or_data_that_does_not_fit_is_a_clear_error(full_run: Path, tmp_path: Path) -> None:
    ckpt = full_run / "checkpoints" / "last.ckpt"
    cases = [
        ([*SHORT, "model.hidden_size=32", f"checkpoint.init_from={ckpt}"], "model.hidden_size is 64 in the checkpoint"),
        (["data.sources=[/no/such/corpus.jsonl]"], "data.sources: /no/such/corpus.jsonl does not exist"),
        ([f"run.root={tmp_path}", "run.name=none", "checkpoint.resume_from=last"], "checkpoint"),
    ]
    for overrides, message in cases:
        result = run_cli("fit", *overrides)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr and message in result.stderr
        assert result.stderr.count("\n") == 1
    assert not (tmp_path / "none").exists()


def test_attention_spelled_out_for_every_layer_fits_a_checkpoint_without_layer_types(full_run: Path) -> None:
    """``model.layer_types`` null and attention for every layer are one architecture; a recurrent layer is another."""
    from lightning_cp.train.config import ConfigError, load_config
    from lightning_cp.train.runner import check_checkpoint_fits

    model = [override for override in SHORT if override.startswith("model.")]
    ckpt = str(full_run / "checkpoints" / "last.ckpt")
    check_checkpoint_fits(load_config(None, [*model, "model.layer_types=[attention,attention]"]), ckpt, "resume")
    hybrid = load_config(None, [*model, "model.layer_types=[attention,recurrent]"])
    with pytest.raises(ConfigError, match=r"model.layer_types is None in the checkpoint but \['attention', 'recurrent"):
        check_checkpoint_fits(hybrid, ckpt, "resume")


def test_a_built_in_checkpoint_with_model_pretrained_names_that_mismatch(full_run: Path) -> None:
    """Not the architecture defaults that ``model.pretrained`` leaves unset, which the user would then set in vain."""
    from lightning_cp.train.config import ConfigError, load_config
    from lightning_cp.train.runner import check_checkpoint_fits

    cfg = load_config(None, ["model.pretrained=some/model"])
    ckpt = str(full_run / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError, match="holds the built-in model, but model.pretrained is set: leave it out"):
        check_checkpoint_fits(cfg, ckpt, "checkpoint.resume_from")


def test_the_hybrid_config_matches_one_device_with_one_conversion_per_layout_change(tmp_path: Path) -> None:
    """Attention blocks in turn with a recurrent and a Mamba2 block (4 layers): cp=2 writes cp=1's float64 losses
    (relative 1e-9), with 4 layout conversions per forward."""
    parity = [*SHORT[2:], "model.num_layers=4", "trainer.max_steps=4", "trainer.val_check_interval=2"]
    for devices in (1, 2):
        overrides = [f"trainer.devices={devices}", f"strategy.context_parallel_size={devices}"]
        run = [*parity, *overrides, "trainer.precision=64-true", f"run.root={tmp_path}", f"run.name=cp{devices}"]
        result = run_cli("fit", "--config", "hybrid", *run)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(tmp_path / "cp2", tmp_path / "cp1", 4, [0, 2, 4])
    rows = read_metrics(tmp_path / "cp2" / "metrics.csv")
    assert {row["cp/layout_conversions"] for row in rows if row.get("cp/layout_conversions")} == {"4.0"}


@pytest.mark.parametrize("variant", [[], ["--hybrid"]], ids=["attention", "hybrid"])
def test_own_module_example_trains(variant: list[str]) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "own_module.py"
    result = subprocess.run(
        [sys.executable, str(example), "--max-steps", "6", *variant],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=cli_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the untrained model starts near 6.0 and a uniform guess over 257 bytes is ln 257 = 5.55; 6 steps reach ~4.6
    # (~4.0 for the hybrid)
    assert float(result.stdout.strip().splitlines()[-1].split()[-1]) < 5.0


def test_resume_after_a_kill_continues_with_the_same_steps_and_losses(full_run: Path) -> None:
    root = full_run.parent
    killed = root / "killed"
    process = subprocess.Popen(
        [SCRIPT, "fit", *SHORT, f"run.root={root}", "run.name=killed", "checkpoint.resume_from=auto"],  # fresh
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline and process.poll() is None:
            steps = run_losses(killed)[0][0] if (killed / "metrics.csv").is_file() else []
            if steps and steps[-1] >= 13:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert torch.load(killed / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] in (12, 18)
    result = run_cli("fit", *SHORT, f"run.root={root}", "run.name=killed", "checkpoint.resume_from=auto")  # resumed
    assert result.returncode == 0, result.stderr[-3000:]
    (steps, train), (val_steps, val) = run_losses(killed)
    (full_steps, full_train), (full_val_steps, full_val) = run_losses(full_run)
    assert steps == full_steps and val_steps == full_val_steps
    assert_same(train, full_train, rel=1e-9)
    assert_same(val, full_val, rel=1e-9)


def test_cp1_and_cp2_write_the_same_float64_losses(tmp_path: Path) -> None:
    """cp=2 with all-gather and with Ulysses attention, cp=4 hybrid (u=2), all match cp=1 in float64 (relative 1e-9)."""
    parity = [*SHORT[2:], "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.precision=64-true"]
    runs = {
        "cp1": (1, ["strategy.attention_mode=allgather"]),
        "cp2": (2, ["strategy.attention_mode=allgather"]),
        "cp2-ulysses": (2, ["strategy.attention_mode=ulysses"]),
        "cp4-hybrid": (4, ["strategy.attention_mode=hybrid", "strategy.ulysses_size=2"]),
    }
    for name, (devices, mode) in runs.items():
        overrides = [f"trainer.devices={devices}", f"strategy.context_parallel_size={devices}", *mode]
        result = run_cli("fit", *parity, *overrides, f"run.root={tmp_path}", f"run.name={name}")
        assert result.returncode == 0, result.stderr[-3000:]
    (steps1, train1), (val_steps1, val1) = run_losses(tmp_path / "cp1")
    for name in ("cp2", "cp2-ulysses", "cp4-hybrid"):
        (steps2, train2), (val_steps2, val2) = run_losses(tmp_path / name)
        assert steps1 == steps2 == list(range(6)) and val_steps1 == val_steps2 == [0, 3, 6]
        assert_same(train2, train1, rel=1e-9)
        assert_same(val2, val1, rel=1e-9)
    assert train1[0] != train1[-1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.hidden_sise=64"], "unknown key 'model.hidden_sise'"),
        (["trainer.max_steps=many"], "trainer.max_steps: got 'many'"),
        (["trainer.devices=3"], "world size 3 (trainer.devices=3 x trainer.num_nodes=1)"),
        (["strategy.context_parallel_size=4"], "world size 2 (trainer.devices=2 x trainer.num_nodes=1)"),
    ],
)
def test_bad_config_gives_one_clear_line_and_exit_code_2(overrides: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_cp", "fit", *overrides],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=cli_env(),
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"lightning-cp: error: {message}")


@pytest.mark.parametrize(("tokenizer", "unit"), [(ByteTokenizer, "byte"), (HFTokenizer, "token")])
def test_the_loss_plot_names_the_unit_of_the_run_tokenizer(tokenizer, unit: str, tmp_path, monkeypatch) -> None:
    """The y axis says nats per byte for the byte tokenizer and per token for a Hugging Face one."""
    from matplotlib.figure import Figure

    from lightning_cp.train import runfolder

    (tmp_path / runfolder.METRICS_FILE).write_text("step,train_loss,trained_steps,val_loss\n0,5.0,,\n,,0,4.0\n")
    labels = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: labels.append(figure.axes[0].get_ylabel()))
    runfolder.plot_losses(tmp_path, tokenizer.unit)
    assert labels == [f"cross-entropy (nats per {unit})"]
