"""`refusion` command line: a thin dispatcher. Each command lives with the subpackage that does the work and
exposes `register(subparsers)`, which adds its parser and sets `func` (called with the parsed arguments)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module that registers it
COMMANDS = {
    "generate": "refusion_hf.generation.cli",
    "eval": "refusion_hf.evaluation.cli",
    "publish": "refusion_hf.hub_card.cli",
    "train": "refusion_hf.training.train_cli",
    "convert": "refusion_hf.training.convert",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refusion", description="ReFusion masked-diffusion LLMs on Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.extra_args = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
