"""Each ReFusion decoding knob is declared once (`refusion_generation_config.KNOBS`): the config's attributes and
defaults, its type and range checks, its docstring, the commands' flags, the model card's table and the decoder's
settings are all derived from the declaration, so a new knob is one more `DecodingKnob`."""

import argparse
import dataclasses
import inspect
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion_hf.command_inputs import add_decoding_arguments
from refusion_hf.generation.refusion_generation_config import (
    DECODING_KNOBS,
    DECODING_PRESETS,
    DEFAULT_BLOCK_SIZE,
    KNOBS,
    REFUSION_FIELDS,
    DecodingKnob,
    RefusionGenerationConfig,
    decoding_knob_values,
)
from refusion_hf.generation.sequence_state import DecodingSettings
from refusion_hf.hub_card.card import decoding_defaults, decoding_rows
from refusion_hf.hub_card.sources import format_cell


def one_line(text: str) -> str:
    return " ".join(text.split())


def decoding_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refusion generate", exit_on_error=False)
    add_decoding_arguments(parser)
    return parser


def flag(knob: DecodingKnob) -> str:
    return f"--{knob.name.replace('_', '-')}"


def valid_value(knob: DecodingKnob):
    """A value inside the knob's declared range, other than its default."""
    if knob.choices is not None:
        return knob.choices[-1]
    if knob.type is bool:
        return not knob.default
    if knob.multiple_of is not None:
        return 3 * REFUSION_FIELDS[knob.multiple_of]
    if knob.high is not None:
        return knob.type(knob.high)
    return (knob.low or 0) + 2 if knob.type is int else (knob.low or 0) + 0.25


def check_derived_artefacts(knob: DecodingKnob) -> None:
    """The config field, its default, its type and range checks, the CLI flag (tunable knobs) and the card row of
    one declared knob."""
    # The config field: unset by default, set from a keyword, saved, and defaulted like a stock field.
    assert getattr(RefusionGenerationConfig(), knob.name) is None
    value = valid_value(knob)
    config = RefusionGenerationConfig(**{knob.name: value})
    assert getattr(config, knob.name) == value and config.to_dict()[knob.name] == value
    config.validate()
    defaults = RefusionGenerationConfig._get_default_generation_params()
    assert defaults.get(knob.name) == knob.default

    # The CLI flag: typed, ranged, explained by the help's first sentence, None unless given.
    parser = decoding_parser()
    options = {action.dest: action for action in parser._actions}
    if not knob.tunable:
        assert knob.name not in options
    else:
        assert options[knob.name].default is None
        assert knob.help.split(". ")[0].rstrip(".") in options[knob.name].help
        if knob.type is bool:
            given = [flag(knob) if value else f"--no-{flag(knob)[2:]}"]
        else:
            given = [flag(knob), str(value)]
        parsed = getattr(parser.parse_args(given), knob.name)
        assert parsed == value and type(parsed) is knob.type
        assert getattr(parser.parse_args([]), knob.name) is None

    # The card's row: the default and the declared help.
    rows = {row["name"]: row for row in decoding_rows(decoding_defaults(RefusionGenerationConfig()), None)}
    assert rows[knob.name]["meaning"] == format_cell(knob.help)
    assert str(knob.default) in rows[knob.name]["value"]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: knob.name)
def test_every_declared_knob_is_a_config_field_a_flag_a_card_row_and_documented(knob):
    check_derived_artefacts(knob)
    # The names other modules import (derived when the module loads).
    assert REFUSION_FIELDS[knob.name] == knob.default and (knob.name in DECODING_KNOBS) == knob.tunable
    docstring = one_line(inspect.getdoc(RefusionGenerationConfig))
    assert f"{knob.name} (`{knob.type.__name__}`, " in docstring and one_line(knob.help) in docstring


def test_the_card_lists_the_declared_knobs_then_the_stock_fields():
    rows = decoding_rows(decoding_defaults(RefusionGenerationConfig(slot_size=8, plan_ahead=False)), 256)
    assert [row["name"] for row in rows] == [*REFUSION_FIELDS, "temperature", "max_new_tokens"]
    values = {row["name"]: row["value"] for row in rows}
    assert values["slot_size"] == "8" and values["plan_ahead"] == "False" and values["decoding"] == '"refusion"'


def wrong_type_values(knob: DecodingKnob) -> list:
    values = ["1", [1], 1.5j]
    if knob.type is not bool:
        values.append(True)
    if knob.type is int:
        values.append(2.0)
    if knob.type is float:
        values.append(math.nan)
    if knob.type is bool:
        values.append(1)
    if knob.type is str:
        values.append(1)
    return values


def out_of_range_values(knob: DecodingKnob) -> list:
    values = []
    if knob.choices is not None:
        values.append("not-a-choice")
    if knob.low is not None:
        values.append(knob.low if knob.low_open else knob.low - 1)
    if knob.high is not None:
        values.append(knob.high + 1)
    if knob.multiple_of is not None:
        values.append(REFUSION_FIELDS[knob.multiple_of] + 1)
    if knob.token_id:
        values.append(-1)
    return values


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: knob.name)
def test_a_wrong_type_or_out_of_range_value_is_refused_naming_the_knob(knob):
    others = {knob.multiple_of: REFUSION_FIELDS[knob.multiple_of]} if knob.multiple_of else {}
    for value in wrong_type_values(knob) + out_of_range_values(knob):
        with pytest.raises(ValueError, match=rf"^`{knob.name}` must be .*, got {re.escape(repr(value))}"):
            RefusionGenerationConfig(**{knob.name: value}, **others).validate()
    if knob.tunable and knob.type is not bool:
        for value in out_of_range_values(knob):
            if knob.multiple_of is None:  # a multiple is checked by the config, with the other knob's value
                with pytest.raises(argparse.ArgumentError, match=rf"^argument {flag(knob)}: expected .*, got"):
                    decoding_parser().parse_args([flag(knob), str(value)])
        with pytest.raises(argparse.ArgumentError, match=rf"^argument {flag(knob)}: expected"):
            decoding_parser().parse_args([flag(knob), "x"])


def is_valid(knob: DecodingKnob, value) -> bool:
    """The declaration read as a specification, independently of `DecodingKnob`'s own checks."""
    if knob.type is bool:
        return type(value) is bool
    if knob.type is str:
        return type(value) is str and (knob.choices is None or value in knob.choices)
    if type(value) is not int and not (knob.type is float and type(value) is float):
        return False
    if knob.token_id:
        return value >= 0
    if knob.multiple_of is not None:
        return value >= 1 and value % REFUSION_FIELDS[knob.multiple_of] == 0
    low_ok = knob.low is None or value > knob.low or (value == knob.low and not knob.low_open)
    return low_ok and (knob.high is None or value <= knob.high)


@settings(max_examples=200, deadline=None)
@given(
    knob=st.sampled_from(KNOBS),
    value=st.one_of(
        st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
        st.sampled_from(["refusion", "autoregressive", "beam", "32"]), st.lists(st.integers(), max_size=2),
    ),
)  # fmt: skip
def test_validation_accepts_exactly_the_declared_values(knob, value):
    others = {knob.multiple_of: REFUSION_FIELDS[knob.multiple_of]} if knob.multiple_of else {}
    if is_valid(knob, value):
        RefusionGenerationConfig(**{knob.name: value}, **others).validate()
    else:
        with pytest.raises(ValueError, match=rf"^`{knob.name}` must be "):
            RefusionGenerationConfig(**{knob.name: value}, **others).validate()  # __init__ validates too


def test_the_decoder_reads_the_declared_settings_knobs():
    in_settings = [knob.name for knob in KNOBS if knob.in_settings]
    fields = {field.name: field for field in dataclasses.fields(DecodingSettings)}
    assert list(fields) == ["max_new_tokens", "eos_token_ids", *in_settings]  # derived: no second knob list
    for knob in KNOBS:  # a knob resolved at the call is required; the others default to the declared default
        if knob.in_settings and knob.resolve_unset is None and not knob.token_id:
            assert fields[knob.name].default == knob.default, knob.name
    assert {name for name, field in fields.items() if field.default is dataclasses.MISSING} == {
        "max_new_tokens",
        "eos_token_ids",
        "block_size",
        "mask_token_id",
    }
    config = RefusionGenerationConfig(slot_size=12, slot_threshold=1, token_threshold=0, mask_token_id=3)
    config.update(**RefusionGenerationConfig._get_default_generation_params(), defaults_only=True)
    values = decoding_knob_values(config)
    assert list(values) == in_settings
    assert values == dict(slot_size=12, block_size=132, slot_threshold=1.0, token_threshold=0.0, mask_token_id=3,
                          plan_ahead=True, remask_threshold=None)  # fmt: skip
    assert type(values["slot_threshold"]) is float and 132 == -(-DEFAULT_BLOCK_SIZE // 12) * 12
    settings = DecodingSettings(**values, max_new_tokens=40, eos_token_ids=(1,))
    assert (settings.slot_size, settings.block_size, settings.token_threshold) == (12, 132, 0.0)


def test_presets_set_tunable_knobs_with_valid_values():
    tunable = {knob.name: knob for knob in KNOBS if knob.tunable}
    for name, preset in DECODING_PRESETS.items():
        assert set(preset) <= set(tunable), name
        for knob_name, value in preset.items():
            assert tunable[knob_name].type_error(value) is None, (name, knob_name)
        RefusionGenerationConfig.from_preset(name).validate()


def test_a_new_knob_is_one_declaration():
    """Issue 31's knob (`remask_threshold`: a float in (0, 1], None = off) was added as one declaration; from it
    alone it is a config field, validated, a CLI flag, a card row, documented, and handed to the decoder."""
    remask = next(knob for knob in KNOBS if knob.name == "remask_threshold")
    check_derived_artefacts(remask)
    for value in (0, 1.5, "0.5", math.nan):
        with pytest.raises(ValueError, match=r"^`remask_threshold` must be a number"):
            RefusionGenerationConfig(remask_threshold=value).validate()
    with pytest.raises(ValueError, match=r"^`remask_threshold` must be a number in \(0, 1\], got 0\.$"):
        RefusionGenerationConfig(remask_threshold=0).validate()
    with pytest.raises(argparse.ArgumentError, match=r"--remask-threshold: expected a number in \(0, 1\], got 0"):
        decoding_parser().parse_args(["--remask-threshold", "0"])
    assert decoding_knob_values(RefusionGenerationConfig(slot_size=4, remask_threshold=1))["remask_threshold"] == 1.0
    assert remask.doc_entry().startswith("    remask_threshold (`float`, *optional*):\n        Sub-slot remasking")


def test_the_arguments_page_has_a_row_for_every_tunable_knob():
    """docs/generate_arguments.md's knob table is written by hand: it must not miss a declared knob."""
    page = (Path(__file__).parents[2] / "docs" / "generate_arguments.md").read_text()
    table = page.split("## ReFusion's decoding knobs", 1)[1].split("\n## ", 1)[0]
    missing = [knob.name for knob in KNOBS if knob.tunable and f"| `{knob.name}` |" not in table]
    assert not missing, f"add a row for {missing} to docs/generate_arguments.md"
