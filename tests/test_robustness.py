"""What a user types or a machine does: one line and a non-zero exit, nothing run from a checkpoint, nothing lost."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_cp.train import runfolder
from lightning_cp.train.cli import main, report
from lightning_cp.train.config import load_config
from lightning_cp.train.runner import EndRanksOnFailure, StopOnNonFiniteLoss, end_ranks_left_behind
from tests.cli_helpers import SCRIPT, cli_env, run_cli


class _Exploit:
    """Unpickling this runs code: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "ran.txt"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Exploit(marker)}, evil)
    assert main(["validate", f"checkpoint.init_from={evil}", f"run.root={tmp_path}"]) == 2
    assert not marker.exists(), "code inside the checkpoint ran"
    assert "refused to open" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content", [b"", b"hello, not a checkpoint", b"PK\x03\x04truncated", "a plain state dict", "a tensor"]
)
def test_what_is_not_a_checkpoint_is_named_as_such(tmp_path: Path, content: bytes | str, capsys) -> None:
    """Unreadable bytes, and readable torch files that are no Lightning checkpoint (weights alone), alike."""
    broken = tmp_path / "broken.ckpt"
    if isinstance(content, bytes):
        broken.write_bytes(content)
    else:
        torch.save({"weight": torch.zeros(2)} if content == "a plain state dict" else torch.zeros(2), broken)
    assert main(["validate", f"checkpoint.init_from={broken}", f"run.root={tmp_path}"]) == 2
    assert f"not a checkpoint (truncated or not written by lightning-cp): {broken}" in capsys.readouterr().err


def test_a_new_run_never_writes_into_an_existing_run_folder(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.yaml").write_text("seed: 1\n")
    os.environ.pop(runfolder.RUN_DIR_ENV, None)
    assert main(["fit", f"run.root={tmp_path}", "run.name=base"]) == 2
    error = capsys.readouterr().err
    assert "holds another run" in error and "checkpoint.resume_from=auto run.name=base" in error
    assert (folder / "config.yaml").read_text() == "seed: 1\n"


def test_run_folder_files_are_never_written_through_links(tmp_path: Path, capsys) -> None:
    target = tmp_path / "elsewhere.csv"
    target.write_text("precious\n")
    folder = tmp_path / "linked"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "metrics.csv").symlink_to(target)
    os.environ.pop(runfolder.RUN_DIR_ENV, None)
    assert main(["fit", f"run.root={tmp_path}", "run.name=linked", "checkpoint.resume_from=last"]) != 0
    assert target.read_text() == "precious\n"
    assert "symbolic link" in capsys.readouterr().err


def test_unnamed_runs_get_unique_folders(tmp_path: Path) -> None:
    first = runfolder.default_run_name(tmp_path)
    (tmp_path / first).mkdir()
    second = runfolder.default_run_name(tmp_path)
    assert second != first and (second.startswith(first) or second > first)


def test_an_interrupted_checkpoint_write_leaves_the_old_file_whole(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "last.ckpt"
    io = runfolder.AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def dies(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError, match="No space"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "no temporary file is left behind"


def test_resume_from_last_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("step000004.ckpt", "step000008.ckpt"):
        torch.save({"global_step": int(name[4:10]), "state_dict": {}}, folder / name)
    (folder / "last.ckpt").write_bytes(b"")  # killed mid-save
    from lightning_cp.train.runner import is_readable_checkpoint

    resolved = runfolder.resolve_checkpoint("last", tmp_path, is_readable_checkpoint)
    assert resolved == str(folder / "step000008.ckpt")


def test_resume_from_auto_resumes_a_checkpoint_or_restarts_a_folder_without_one(tmp_path: Path, monkeypatch) -> None:
    """``auto`` (for requeued jobs): the newest readable checkpoint when the folder has one, else a fresh start that
    drops the metrics of the run that ended before its first checkpoint."""
    from lightning_cp.train.runner import is_readable_checkpoint, prepare_run

    monkeypatch.setenv(runfolder.RUN_DIR_ENV, "")  # prepare_run pins the run folder here; undone afterwards

    run_dir = tmp_path / "job"
    overrides = [f"run.root={tmp_path}", "run.name=job", "checkpoint.resume_from=auto"]
    assert prepare_run(load_config(overrides=overrides)) == (run_dir, None)
    metrics = run_dir / runfolder.METRICS_FILE
    runfolder.write_metrics(metrics, [{"step": "0", "train/loss": "5.0"}], ["step", "train/loss"])
    assert prepare_run(load_config(overrides=overrides)) == (run_dir, None), "a folder without checkpoints restarts"
    assert runfolder.read_metrics(metrics) == []
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")  # killed mid-save, and nothing older: restart
    assert runfolder.resolve_checkpoint("auto", run_dir, is_readable_checkpoint) is None
    torch.save({"global_step": 3, "state_dict": {}}, run_dir / "checkpoints" / "step000003.ckpt")
    assert runfolder.resolve_checkpoint("auto", run_dir, is_readable_checkpoint) == str(
        run_dir / "checkpoints" / "step000003.ckpt"
    )


class _ExplodingLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        return self.weight.sum() * (float("nan") if batch_idx == 2 else 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_stops_at_the_first_non_finite_loss(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[StopOnNonFiniteLoss()],
        default_root_dir=tmp_path,
    )  # fmt: skip
    model = _ExplodingLoss()
    with pytest.raises(FloatingPointError, match="not finite at step 2"):
        trainer.fit(model, torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=1))
    assert torch.isfinite(model.weight).all(), "the non-finite step never reached the weights"


def test_a_failure_inside_the_run_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """A run that dies inside Lightning (here: a JSONL line that is not JSON) prints one line per rank, no wall."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    started = time.monotonic()
    result = run_cli("fit", f"data.sources=[{bad}]", f"run.root={tmp_path}", "run.name=bad", timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 120
    lines = [line for line in result.stderr.splitlines() if line.startswith("lightning-cp: error")]
    assert lines and all(f"{bad}:2: not valid JSON" in line for line in lines), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


def test_tensor_parallelism_without_fsdp_is_refused_up_front_by_the_main_job(tmp_path: Path, capsys) -> None:
    overrides = ["trainer.devices=2", "strategy.context_parallel_size=1", "strategy.tensor_parallel_size=2"]
    assert main(["fit", *overrides, f"run.root={tmp_path}", "run.name=tp"]) == 2
    assert "strategy.tensor_parallel_size: 2 needs strategy.data_parallel=fsdp" in capsys.readouterr().err
    assert not (tmp_path / "tp").exists()


def _resume_losses(checkpoints: str, precision: str) -> tuple[list[float], list[float]]:
    """Rank body: 4 steps straight, and 2 steps resumed from the step-2 checkpoint of that run; both loss lists."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_cp import CPZigzagStrategy
    from lightning_cp.train.data import collate_packed, pack_documents
    from lightning_cp.train.models import LlamaLM
    from tests.model_helpers import TRAINER_OPTIONS

    os.environ["WORLD_SIZE"] = "1"
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 256, (length,), generator=generator).tolist() for length in (40, 17, 33, 9)]
    batches = [collate_packed(pack_documents(documents[i : i + 2], 64)) for i in (0, 2)]  # one epoch = 2 steps

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def run(ckpt_path: str | None) -> list[float]:
        torch.manual_seed(1)
        recorder = Recorder()
        saver = ModelCheckpoint(
            dirpath=checkpoints, filename="s{step}", every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False
        )
        options = {**TRAINER_OPTIONS, "enable_checkpointing": True}
        trainer = pl.Trainer(
            devices=1, strategy=CPZigzagStrategy(), precision=precision, max_steps=4, callbacks=[recorder, saver],
            use_distributed_sampler=False, **options,
        )  # fmt: skip
        model = LlamaLM(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, lr=1e-2)
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
        return recorder.losses

    straight = run(None)
    resumed = run(os.path.join(checkpoints, "s2.ckpt"))
    return straight, resumed


@pytest.mark.parametrize("precision", ["64-true", "32-true"])
def test_a_resumed_run_continues_bit_exactly(tmp_path: Path, precision: str) -> None:
    from tests.distributed_harness import run_on_ranks

    ((straight, resumed),) = run_on_ranks(_resume_losses, 1, str(tmp_path), precision, init_process_group=False)
    assert len(straight) == 4 and len(resumed) == 2
    assert resumed == straight[2:], f"resumed {resumed} vs uninterrupted {straight[2:]}"


TINY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=176", "data.tokens_per_sample=512"]


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _processes(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose stat ``field`` (1: parent, 3: session) is ``value``."""
    found = []
    for entry in os.listdir("/proc"):
        stat = _proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None and int(stat[field]) == value and stat[0] != "Z":
            found.append(int(entry))
    return found


def _start_cli(*args: str, stderr: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the console script in its own session (so everything it starts can be found and ended)."""
    command = [SCRIPT, *args] if not args[0].endswith(".py") else [sys.executable, *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr.open("w"), env=env or cli_env(),
                            start_new_session=True)  # fmt: skip


def _end_session(process: subprocess.Popen) -> None:
    """Leave nothing behind: continue and kill whatever of the session still runs, reap the launcher."""
    for pid in _processes(3, process.pid):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    process.wait()


def _error_lines(stderr: Path) -> list[str]:
    return [line for line in stderr.read_text().splitlines() if line.startswith("lightning-cp: error")]


def _held_port() -> socket.socket:
    """A listening socket on a free port: what another program holding MASTER_PORT looks like."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_taken_master_port_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.txt"
    with _held_port() as holder:
        port = holder.getsockname()[1]
        started = time.monotonic()
        process = _start_cli("fit", "trainer.max_steps=2", f"run.root={tmp_path / 'runs'}", stderr=stderr,
                             env={**cli_env(), "MASTER_PORT": str(port)})  # fmt: skip
        try:
            returncode = process.wait(timeout=60)
            assert time.monotonic() - started < 60 and returncode == 2
            assert not _processes(3, process.pid), "a rank was left running"
        finally:
            _end_session(process)
    lines = _error_lines(stderr)
    assert len(lines) == 1 and f"MASTER_PORT={port} cannot be used" in lines[0] and "unset it" in lines[0], lines
    assert "Traceback" not in stderr.read_text()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "a run folder was written"


def test_a_launcher_that_fails_to_start_ends_the_ranks_it_started(tmp_path: Path) -> None:
    """The port taken between the check and the launch (the check skipped here): the rank already started, waiting
    for the launcher's rendezvous, is ended with it instead of waiting strategy.timeout_s, orphaned."""
    wrapper = tmp_path / "unchecked.py"
    wrapper.write_text(
        "import sys\nfrom lightning_cp.train import cli, runner\n"
        "runner.check_main_port = lambda: None\nsys.exit(cli.main(sys.argv[1:]))\n"
    )
    stderr = tmp_path / "stderr.txt"
    with _held_port() as holder:
        port = holder.getsockname()[1]
        started = time.monotonic()
        process = _start_cli(str(wrapper), "fit", "trainer.max_steps=2", f"run.root={tmp_path / 'runs'}",
                             stderr=stderr, env={**cli_env(), "MASTER_PORT": str(port)})  # fmt: skip
        try:
            returncode = process.wait(timeout=90)
            assert time.monotonic() - started < 90 and returncode != 0
            assert not _processes(3, process.pid), "a rank was left running"
        finally:
            _end_session(process)
    lines = _error_lines(stderr)
    assert len(lines) == 1 and f"port: {port}" in lines[0] and "set MASTER_PORT to a free port" in lines[0], lines


def test_ranks_left_behind_get_a_grace_then_are_killed() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stopped.send_signal(signal.SIGSTOP)
    failing = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(3)"])
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[sleeper, stopped, failing])))
    EndRanksOnFailure().on_exception(trainer, None, RuntimeError("failed here"))
    started = time.monotonic()
    try:
        end_ranks_left_behind(grace_s=2.0)
    finally:
        for process in (sleeper, stopped, failing):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert time.monotonic() - started < 10
    assert sleeper.returncode == stopped.returncode == -signal.SIGKILL
    assert failing.returncode == 3, "a rank that ends within the grace keeps its own exit"


@pytest.mark.parametrize("stopped_rank", [0, 1])
def test_a_stopped_rank_ends_the_others_within_the_timeout(tmp_path: Path, stopped_rank: int) -> None:
    """SIGSTOP one rank mid-training: gloo's collectives honour strategy.timeout_s, so the other rank fails with one
    line within it; the launcher kills a stopped rank it started, and a stopped launcher dies once continued."""
    timeout_s, margin_s = 10, 30  # the rendezvous waits timeout_s too: a rank starting on busy cores needs a few s
    stderr, metrics = tmp_path / "stderr.txt", tmp_path / "runs" / "stop" / "metrics.csv"
    args = ["fit", *TINY, "trainer.max_steps=100000", "data.val_fraction=0", f"strategy.timeout_s={timeout_s}"]
    process = _start_cli(*args, f"run.root={tmp_path / 'runs'}", "run.name=stop", stderr=stderr)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) > 3):
            assert process.poll() is None, stderr.read_text()[-2000:]
            time.sleep(0.1)
        (child,) = _processes(1, process.pid)
        stopped, other = (process.pid, child) if stopped_rank == 0 else (child, process.pid)
        os.kill(stopped, signal.SIGSTOP)
        stop_time = time.monotonic()
        while time.monotonic() - stop_time < timeout_s + margin_s and other in _processes(3, process.pid):
            process.poll()  # reaps the launcher once it has ended
            time.sleep(0.05)
        assert other not in _processes(3, process.pid), f"rank {1 - stopped_rank} still runs"
        if stopped_rank == 1:
            assert process.wait(timeout=margin_s) != 0
            assert _proc_stat(stopped) is None, "the launcher left its stopped rank behind"
        else:
            os.kill(stopped, signal.SIGCONT)
            assert process.wait(timeout=margin_s) != 0
        assert not _processes(3, process.pid)
    finally:
        _end_session(process)
    text = stderr.read_text()
    gloo_timeouts = (f"Timed out waiting {timeout_s * 1000}ms", "Application timeout caused pair closure")
    timed_out = [line for line in _error_lines(stderr) if any(form in line for form in gloo_timeouts)]
    assert timed_out and "within strategy.timeout_s" in timed_out[0], text[-2000:]
    assert "Traceback" not in text


@pytest.mark.parametrize(
    "message",
    [
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv to complete",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Application timeout caused pair closure",
    ],
)
def test_either_form_of_a_gloo_timeout_is_one_line_with_the_timeout_hint(message: str, capsys) -> None:
    assert report(RuntimeError(message)) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "within strategy.timeout_s" in lines[0] and "gloo/transport" not in lines[0], lines
