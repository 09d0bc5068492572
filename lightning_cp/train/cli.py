"""The ``lightning-cp`` console script: ``fit``, ``validate`` and ``print-config``."""

from __future__ import annotations

import argparse
import os
import sys

from lightning_cp.train.config import ConfigError, load_config, to_yaml

COMMANDS = {
    "fit": "train from scratch, fine-tune from checkpoint.init_from, or resume with checkpoint.resume_from",
    "validate": "report the validation loss of checkpoint.init_from (or checkpoint.resume_from)",
    "print-config": "print the merged configuration",
}
TRACEBACK_ENV = "LIGHTNING_CP_TRACEBACK"
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
    """Run one command; configuration errors print one line and return 2."""
    args = parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "print-config":
            print(to_yaml(cfg), end="")
            return 0
        from lightning_cp.train import runner

        if args.command == "fit":
            runner.fit(cfg)
        else:
            runner.validate(cfg)
    except (ConfigError, FileNotFoundError) as error:
        print(f"lightning-cp: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - every failure of a run reaches the user as one line
        if os.environ.get(TRACEBACK_ENV):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"lightning-cp: error: {type(error).__name__}: {first} (set {TRACEBACK_ENV}=1 for the traceback)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
