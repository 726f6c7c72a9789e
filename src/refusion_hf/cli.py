"""`refusion` command line: a thin dispatcher. Each command lives with the subpackage that does the work and
exposes `register(subparsers)`, which adds its parser and sets `func` (called with the parsed arguments).

User errors (the library's `errors.InputError`, the commands' `CommandError`, and argparse's own) print one line
`refusion <command>: error: ...` and exit with status 2; see `errors.py`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import InputError

# command name -> module that registers it
COMMANDS = {
    "generate": "refusion_hf.generation.cli",
    "eval": "refusion_hf.evaluation.cli",
    "lm-eval": "refusion_hf.evaluation.lm_eval_cli",
    "publish": "refusion_hf.hub_card.cli",
    "train": "refusion_hf.training.train_cli",
    "convert": "refusion_hf.training.convert",
    "serve": "refusion_hf.serving.cli",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors as one line (`refusion <command>: error: ...`, status 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="refusion", description="ReFusion masked-diffusion LLMs on Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=OneLineErrorParser
    )
    for module in COMMANDS.values():
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        print(f"refusion {args.command}: error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    if extra:
        args.extra_args = extra
    try:
        return int(args.func(args) or 0)
    except InputError as error:  # a command's refusal (`CommandError`) or the library's
        print(f"refusion {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
