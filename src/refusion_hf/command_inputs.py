"""What the `refusion` commands share on the command line: their refusal (`CommandError`) and their flags' types.

A command's own refusal of its flags is a `CommandError`, an `errors.InputError` like every user error the library
raises (`refusion_hf.cli.main` prints any of them as one line `refusion <command>: error: <message>`, status 2).
The argparse types here refuse a bad value inside argparse's own one-line error; `add_decoding_arguments` and
`add_dtype_argument` add the flags several commands share. The checks of checkpoints and outputs are library code
(`modeling/checkpoint_checks.py`, `outputs.py`).
"""

from __future__ import annotations

import argparse
import importlib.util

from .errors import InputError


class CommandError(InputError):
    """A `refusion` command's refusal of its flags; its message names the flag and what to do instead."""


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0 (NaN refused), named in argparse's one-line error otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


SEED_LIMIT = 2**32  # transformers' `set_seed` (Trainer, lm-eval) also seeds numpy, whose seeds are 32-bit


def seed(text: str) -> int:
    """An argparse type: a random seed, an integer in [0, 2**32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {SEED_LIMIT - 1}, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {SEED_LIMIT - 1}, got {value}")
    return value


def knob_argument_type(knob):
    """An argparse type for a number-valued decoding knob (a `DecodingKnob`): its declared type and range, named in
    argparse's one-line error otherwise ("expected an integer >= 1, got 0"). A multiple of another knob is checked
    when the config is validated."""
    range_text = knob.range_text()
    expected = range_text or ("an integer" if knob.type is int else "a number")

    def parse(text: str):
        try:
            value = knob.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value != value or (range_text is not None and not knob.in_range(value)):  # NaN, or out of range
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


def add_decoding_arguments(parser, title: str | None = None) -> None:
    """One flag per tunable ReFusion decoding knob, typed, ranged and explained (its help's first sentence) by the
    knob's declaration (`refusion_generation_config.KNOBS`): `--slot-size N`, `--token-threshold X`,
    `--plan-ahead / --no-plan-ahead`... Each defaults to None: the model's generation config decides."""
    from .generation.refusion_generation_config import declared_knobs

    group = parser.add_argument_group(title) if title else parser
    for knob in declared_knobs(tunable=True):
        flag = f"--{knob.name.replace('_', '-')}"
        help_text = knob.help.split(". ")[0].rstrip(".") + " (default: the model's generation config)"
        if knob.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif knob.choices is not None:
            group.add_argument(flag, choices=knob.choices, default=None, help=help_text)
        else:
            argument_type = knob_argument_type(knob)
            group.add_argument(flag, type=argument_type, default=None, metavar=knob.name.upper(), help=help_text)


def require_extra(extra: str, *modules: str) -> None:
    """The packages a command needs beyond the core install must be there, else one line naming the extra."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise CommandError(
            f"this needs the `{extra}` extra ({', '.join(missing)} not installed): pip install 'refusion_hf[{extra}]'."
        )


def add_dtype_argument(parser) -> None:
    """`--dtype` of the commands that load a model with `loading.load_model_and_tokenizer`."""
    from .modeling.loading import DTYPES

    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="default: the checkpoint's own (the embedded model is bfloat16; float32 on a CPU without bfloat16 "
        "instructions)",
    )
