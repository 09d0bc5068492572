"""The ``lightning-cp`` console script: ``fit``, ``validate`` and ``print-config``."""

from __future__ import annotations

import argparse
import os
import re
import sys

from lightning_cp.train.config import ConfigError, load_config, to_yaml

COMMANDS = {
    "fit": "train from scratch, fine-tune from checkpoint.init_from, or resume with checkpoint.resume_from",
    "validate": "report the validation loss of checkpoint.init_from (or checkpoint.resume_from)",
    "print-config": "print the merged configuration",
}
TRACEBACK_ENV = "LIGHTNING_CP_TRACEBACK"
SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+:\d+\]\s*")  # "[.../unbound_buffer.cc:78] " before torch's C++ messages
TIMEOUT_HINT = "another rank did not answer within strategy.timeout_s: it stopped, hung or is far behind"
HINTS = {  # a fragment of torch.distributed's message -> what to do about it
    "Timed out": TIMEOUT_HINT,
    "Application timeout caused pair closure": TIMEOUT_HINT,  # gloo's socket-level form of the same timeout
    "EADDRINUSE": "MASTER_PORT is taken: set MASTER_PORT to a free port, or unset it to let lightning-cp pick one",
}
DESCRIPTION = "Train, fine-tune and validate a model with context parallelism (strategy cp_zigzag)."
EPILOG = """configuration: built-in defaults, then --config FILE (a path or a packaged name: default, cp4_cpu, gpu,
hybrid, sft_gpu), then dotted overrides such as trainer.max_steps=100 model.hidden_size=256
checkpoint.resume_from=last."""


def parser() -> argparse.ArgumentParser:
    """Return the argument parser."""
    ap = argparse.ArgumentParser(prog="lightning-cp", description=DESCRIPTION, epilog=EPILOG)
    ap.add_argument("command", choices=list(COMMANDS), help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    ap.add_argument("--config", "-c", metavar="FILE", help="YAML file or packaged config name")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="dotted configuration overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command; configuration errors print one line and return 2, failures of a run one line and 1."""
    args = parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as error:
        return report(error)
    if args.command == "print-config":
        print(to_yaml(cfg), end="")
        return 0
    from lightning_cp.train import runner

    try:
        if args.command == "fit":
            runner.fit(cfg)
        else:
            runner.validate(cfg)
    except Exception as error:  # noqa: BLE001 - every failure of a run reaches the user as one line
        if os.environ.get(TRACEBACK_ENV) and not isinstance(error, (ConfigError, FileNotFoundError)):
            raise
        return report(error)
    finally:
        runner.end_ranks_left_behind()
    return 0


def report(error: Exception) -> int:
    """Print ``error`` as one line and return the exit code: 2 for configuration errors, else 1."""
    if isinstance(error, (ConfigError, FileNotFoundError)):
        print(f"lightning-cp: error: {error}", file=sys.stderr)
        return 2
    first = SOURCE_LOCATION.sub("", str(error).strip().splitlines()[0]) if str(error).strip() else ""
    first += "".join(f" ({hint})" for fragment, hint in HINTS.items() if fragment in first)
    print(f"lightning-cp: error: {type(error).__name__}: {first} (set {TRACEBACK_ENV}=1 for the traceback)",
          file=sys.stderr)  # fmt: skip
    return 1
