"""`RefusionGenerationConfig` (the decoding knobs) and `RefusionGenerationOutput` (what `generate` returns).

Each ReFusion knob is declared once, as a `DecodingKnob` in `KNOBS` (its type, default, value range and help, as
TRL's configs declare theirs with `dataclasses.field(metadata={"help": ...})`). Everything else is derived from
that declaration: the config's attributes (`__init__`), its defaults (`_get_default_generation_params`), the type
and range checks (`check_argument_types`, `validate`: `stock_fields.ArgumentValues`, the one check of knobs and
stock fields alike), the knobs' section of the class docstring, the decoder's
`DecodingSettings` (its fields, and their values: `decoding_knob_values`), the commands' flags
(`command_inputs.add_decoding_arguments`) and the model card's table (`hub_card.card`). Adding a knob is adding
one `DecodingKnob`. Of the stock fields, the config declares only which ReFusion decoding honours (the whitelist
`honoured_fields`) and the values they take, from `stock_fields.STOCK_FIELDS`.

transformers' `GenerationConfig` does the rest: every stock field, `update`, saving and loading, its own
validation (which runs after the type checks added here) and its default values (`_get_default_generation_params`,
extended here with ReFusion's).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from .._compat.transformers import original_object_hash, set_original_object_hash, stock_default_generation_params
from .stock_fields import HONOURED_FIELDS, NEVER_ID, STOCK_FIELDS, TOKEN_ID, ArgumentValues

# Tokens per serial block when `block_size` is unset: inside the 32-128 range the paper reports as robust
# (appendix C.7), and fixed, so a step's cost does not grow with `max_new_tokens`.
DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class DecodingKnob(ArgumentValues):
    """The one declaration of a ReFusion generation-config field. Like a stock field it is None (unset) until the
    call, the passed config, the model's generation config or `default` gives it a value.

    `type` is the value's Python type (`int`, `float`, `bool` or `str`; an integer is a valid `float`). Values are
    limited by `low` / `high` (inclusive; `low_open=True` excludes `low`), `choices`, `multiple_of` (the name of the
    knob this one must be a positive multiple of) or `token_id` (an id >= 0, or >= `NEVER_ID` with
    `decoding="autoregressive"`, as stock generate allows). `tunable` knobs are the ones a user tunes: the commands
    take a flag for each, presets set them, reports record them. `in_settings` knobs are read by the decoder: each is
    a field of `DecodingSettings`, filled by `decoding_knob_values`, where `resolve_unset(config)` (if given) gives
    the value of an unset knob from the others."""

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    multiple_of: str | None = None
    token_id: bool = False
    tunable: bool = True
    in_settings: bool = True
    resolve_unset: Callable[[GenerationConfig], Any] | None = None

    @property
    def value_kind(self) -> Any:
        """The kind `ArgumentValues` checks: `TOKEN_ID` for a token id, else `type`."""
        return TOKEN_ID if self.token_id else self.type

    def value_error(self, config: GenerationConfig) -> str | None:
        """The `ValueError` message when the config's value (of the right type) is not a multiple of the knob it must
        be a multiple of, not among the choices or outside the range (`ArgumentValues.range_error`)."""
        value = getattr(config, self.name, None)
        if value is not None and self.multiple_of is not None:
            other = getattr(config, self.multiple_of, None)
            if value < 1 or value % (other or 1):
                unset = "; leave it unset (None) for the default" if self.default is None else ""
                requirement = f"a positive multiple of `{self.multiple_of}` ({other})"
                return f"`{self.name}` must be {requirement}, got {value!r}{unset}."
        return self.range_error(self.name, value)

    def doc_entry(self) -> str:
        """The knob's entry in the class docstring, as transformers documents its fields."""
        if self.default is None:
            default = "*optional*"
        elif isinstance(self.default, str):
            default = f'defaults to `"{self.default}"`'
        elif isinstance(self.default, bool):
            default = f"defaults to `{self.default}`"
        else:
            default = f"defaults to {self.default}"
        text = textwrap.fill(self.help, width=112, initial_indent=" " * 8, subsequent_indent=" " * 8)
        return f"    {self.name} (`{self.type.__name__}`, {default}):\n{text}\n"


def _default_block_size(config: GenerationConfig) -> int:
    return -(-DEFAULT_BLOCK_SIZE // config.slot_size) * config.slot_size


DECODING_MODES = ("refusion", "autoregressive")

# Every ReFusion knob, declared once (see `DecodingKnob`). The defaults are the values a knob takes when neither
# the call, nor the passed config, nor the model's generation config sets it (the way
# `GenerationConfig._get_default_generation_params` fills stock fields); they follow the authors' GSM8K / HumanEval
# / MBPP evaluation settings (slot 32, thresholds 0.9 / 0.4). A checkpoint's generation_config.json overrides them.
KNOBS: tuple[DecodingKnob, ...] = (
    DecodingKnob(
        name="decoding", type=str, default="refusion", choices=DECODING_MODES, tunable=False, in_settings=False,
        help='`"refusion"` for slot-parallel decoding, `"autoregressive"` for transformers\' own left-to-right '
        "decoding with the same weights (the baseline to compare against; every stock argument then has its stock "
        "meaning).",
    ),
    DecodingKnob(
        name="slot_size", type=int, default=32, low=1,
        help="k, the number of consecutive tokens in a slot. The canvas of `max_new_tokens` is rounded up to a "
        "multiple of k internally; positions past `max_new_tokens` are never returned.",
    ),
    DecodingKnob(
        name="block_size", type=int, default=None, low=1, multiple_of="slot_size", resolve_unset=_default_block_size,
        help="Tokens per serial block (a positive multiple of `slot_size`). Blocks are decoded left to right; slots "
        f"inside a block in any order. Unset: {DEFAULT_BLOCK_SIZE} rounded up to a multiple of `slot_size` (at most "
        "the canvas).",
    ),
    DecodingKnob(
        name="slot_threshold", type=float, default=0.9, low=0,
        help="A slot is chosen in a step when the probability of its first drafted token exceeds this; when none "
        "does, the single most confident slot is chosen. Values above 1 force one slot per step.",
    ),
    DecodingKnob(
        name="token_threshold", type=float, default=0.4, low=0,
        help="A drafted token is accepted when its autoregressive probability exceeds this. 0 accepts every draft, "
        "values above 1 accept only the tokens that are always accepted (one per round).",
    ),
    DecodingKnob(
        name="mask_token_id", type=int, default=None, token_id=True, tunable=False,
        help="Id of `<|mask|>`; taken from the model config when unset.",
    ),
    DecodingKnob(
        name="plan_ahead", type=bool, default=True,
        help="When every draft of the current step was drafted above `token_threshold`, run the next step's plan "
        "inside the forward that verifies the current step, and use it if that step commits everything it verified "
        "(otherwise it is discarded); with `remask_threshold` set, run the next block's plan inside the block's "
        "re-score, and use it if the block closes. Same tokens (up to float rounding), fewer forward passes; "
        "`False` runs every plan as a forward of its own, as the authors' decoder does.",
    ),
    DecodingKnob(
        name="remask_threshold", type=float, default=None, low=0, low_open=True, high=1,
        help="Sub-slot remasking (off when unset): when a block's slots are all written, re-score each with the rest "
        "of the block in view; its first token whose probability is below this and that the re-score would not "
        "choose is replaced by the re-score's choice, and the rest of its slot is decoded again (each position at "
        "most twice; the slot holding the EOS is kept). Tokens are final, streamed and seen by stopping criteria "
        "once their block is closed.",
    ),
)  # fmt: skip


def declared_knobs(*, tunable: bool = False) -> tuple[DecodingKnob, ...]:
    """The declared knobs (`KNOBS`, read when called), in declaration order; only the tunable ones if `tunable`."""
    return tuple(knob for knob in KNOBS if knob.tunable or not tunable)


# Derived names for callers that need only names and defaults.
REFUSION_FIELDS: dict[str, Any] = {knob.name: knob.default for knob in KNOBS}
# The knobs a user tunes (what presets set, CLIs expose and reports record); `decoding` picks the method and
# `mask_token_id` comes from the checkpoint.
DECODING_KNOBS: tuple[str, ...] = tuple(knob.name for knob in declared_knobs(tunable=True))


def decoding_knob_values(config: GenerationConfig) -> dict[str, Any]:
    """The values of the knobs the decoder reads (`in_settings`) in a merged config (defaults filled in), as
    `DecodingSettings` takes them: an unset knob resolved from the others (`resolve_unset`), each converted to its
    declared type (a float knob given as 0 is 0.0)."""
    values = {}
    for knob in KNOBS:
        if not knob.in_settings:
            continue
        value = getattr(config, knob.name)
        if value is None and knob.resolve_unset is not None:
            value = knob.resolve_unset(config)
        values[knob.name] = value if value is None else knob.type(value)
    return values


def _settings_field(knob: DecodingKnob) -> tuple:
    """`DecodingSettings`' field for a knob the decoder reads: required when an unset knob is resolved at the call
    (`resolve_unset`, token ids), else defaulting to the knob's default (None included: `remask_threshold` off)."""
    required = knob.resolve_unset is not None or knob.token_id
    kind = knob.type if knob.default is not None or required else knob.type | None
    metadata = {"help": knob.help}
    return knob.name, kind, field(metadata=metadata) if required else field(default=knob.default, metadata=metadata)


def _canvas_length(self) -> int:
    """`max_new_tokens` rounded up to a multiple of `slot_size`."""
    return -(-self.max_new_tokens // self.slot_size) * self.slot_size


def _num_blocks(self) -> int:
    return -(-self.canvas_length // self.block_size)


# What the decoder reads (`batch_scheduler.decode_batch` and its stages): the `in_settings` knobs, resolved by
# `decoding_knob_values`, plus the answer's length and end from the stock fields (keyword arguments only).
DecodingSettings = make_dataclass(
    "DecodingSettings",
    [
        ("max_new_tokens", int, field(metadata={"help": "Tokens returned per sequence at most."})),
        ("eos_token_ids", tuple[int, ...], field(metadata={"help": "Every id that ends an answer."})),
        *(_settings_field(knob) for knob in KNOBS if knob.in_settings),
    ],
    namespace={"canvas_length": property(_canvas_length), "num_blocks": property(_num_blocks), "__module__": __name__},
    frozen=True,
    kw_only=True,
)


# The authors' per-task evaluation settings (their eval.sh: generation length 512, the canvas cut into N serial
# blocks, so block_size = 512 / N). `generate(..., preset=NAME)`, `RefusionGenerationConfig.from_preset(NAME)`,
# `refusion eval --preset`, `refusion lm-eval --model refusion --model_args preset=NAME`.
DECODING_PRESETS: dict[str, dict[str, Any]] = {
    "gsm8k_cot": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "mbpp": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.3),
    "humaneval_instruct_noprefix": dict(slot_size=32, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "minerva_math": dict(slot_size=32, block_size=64, slot_threshold=0.8, token_threshold=0.6),
    "mmlu_pro": dict(slot_size=16, block_size=128, slot_threshold=0.9, token_threshold=0.4),
    "gpqa_main_generative_n_shot": dict(slot_size=8, block_size=16, slot_threshold=0.8, token_threshold=0.2),
    "arc_challenge_chat": dict(slot_size=8, block_size=8, slot_threshold=0.8, token_threshold=0.1),
}
PRESET_MAX_NEW_TOKENS = 512  # the authors' generation length for every preset


def preset_settings(name: str) -> dict[str, Any]:
    """The decoding knobs of a preset (with its generation length), or a `ValueError` listing the presets."""
    if name not in DECODING_PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(DECODING_PRESETS)}, got {name!r}.")
    return {**DECODING_PRESETS[name], "max_new_tokens": PRESET_MAX_NEW_TOKENS}


class RefusionGenerationConfig(GenerationConfig):
    r"""
    A [`GenerationConfig`] with the parameters of ReFusion's plan-and-infill decoding. Every stock field keeps
    its meaning; ReFusion decoding honours those in `honoured_fields` (listed below) and refuses the others with a
    `ValueError` naming them when they are set (but inert ones; `stock_fields.STOCK_FIELDS`, and
    docs/generate_arguments.md, say which and why), while `decoding="autoregressive"` is stock generate with every
    field. The knobs listed below (declared in `KNOBS`) are added, and like stock fields they are `None` (unset)
    until the call, the passed config, the model's generation config or their defaults give them a value.

    Sampling follows stock semantics: `do_sample=True` draws every draft (plan and infill) from the distribution
    shaped by transformers' logits warpers (`temperature`, `top_k`, `top_p`, `min_p`, ...); `do_sample=False` is
    greedy whatever `temperature` says. Confidences (slot scores, verification) are always the model's own
    probabilities after the hard constraints (`suppress_tokens`, `bad_words_ids`, `min_new_tokens`, ...).

    """

    honoured_fields: tuple[str, ...] = HONOURED_FIELDS  # the stock fields ReFusion decoding honours (the whitelist)

    def __init__(self, **kwargs):
        for knob in KNOBS:
            setattr(self, knob.name, kwargs.pop(knob.name, None))
        super().__init__(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> RefusionGenerationConfig:
        """A config with the authors' settings for a task (`DECODING_PRESETS`); keyword arguments override them."""
        return cls(**{**preset_settings(name), **overrides})

    @staticmethod
    def default_generation_params() -> dict[str, Any]:
        """Stock defaults for unset fields, and the knobs' defaults."""
        defaults = stock_default_generation_params()
        defaults.update({knob.name: knob.default for knob in KNOBS if knob.default is not None})
        return defaults

    _get_default_generation_params = default_generation_params  # what stock generate merges (_compat/transformers.py)

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> RefusionGenerationConfig:
        """Upcast a plain `GenerationConfig` (as transformers reloads generation_config.json) keeping every value."""
        if isinstance(config, cls):
            return config
        upcast = cls.from_dict(config.to_dict())
        set_original_object_hash(upcast, original_object_hash(config))
        return upcast

    def to_dict(self) -> dict[str, Any]:
        # A stock `GenerationConfig` reading a file marked `_from_model_config: true` ignores every field it does
        # not know, i.e. all of ours: never write that marker, so generation_config.json reloads completely.
        config_dict = super().to_dict()
        config_dict.pop("_from_model_config", None)
        return config_dict

    @classmethod
    def from_model_config(cls, model_config) -> RefusionGenerationConfig:
        # The stock implementation compares every field with a plain `GenerationConfig()`, which lacks ours.
        upcast = cls.from_generation_config(GenerationConfig.from_model_config(model_config))
        set_original_object_hash(upcast, hash(upcast))
        return upcast

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None):
        # Types first: stock validation compares values and would raise `TypeError` on a string or a list.
        check_argument_types(self)
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        message = next(filter(None, (knob.value_error(self) for knob in KNOBS)), None) or next(
            filter(None, (field.range_error(name, getattr(self, name, None)) for name, field in _RANGED_STOCK)), None
        )
        if message is not None:
            raise ValueError(message)
        if self.do_sample and self.temperature is not None and 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(
                f"`temperature` {self.temperature!r} is too small to sample at (the scaled logits overflow); pass "
                "`do_sample=False` for greedy decoding, the limit of sampling as the temperature goes to 0."
            )


# The honoured stock fields and the knobs' section of the docstring (so `help(RefusionGenerationConfig)` documents
# them), from their declarations.
RefusionGenerationConfig.__doc__ = (
    RefusionGenerationConfig.__doc__.rstrip(" ")
    + textwrap.fill(
        "Stock fields honoured by ReFusion decoding: " + ", ".join(f"`{name}`" for name in HONOURED_FIELDS) + ".",
        width=116,
        initial_indent=" " * 4,
        subsequent_indent=" " * 4,
    )
    + "\n\n    ReFusion's fields:\n\n"
    + "".join(knob.doc_entry() for knob in KNOBS)
)


def sampling_arguments(temperature: float | None) -> dict[str, Any]:
    """The command-line convention for `--temperature T` in `generate()` terms: T > 0 samples at T
    (`do_sample=True`), 0 is greedy, None leaves the model's generation config in charge."""
    if temperature is None:
        return {}
    return {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}


MIN_SAMPLING_TEMPERATURE = 1e-4


# The declared fields whose values are checked, knobs first: (name, declaration).
_TYPED = tuple(
    [(knob.name, knob) for knob in KNOBS]
    + [(name, field) for name, field in STOCK_FIELDS.items() if field.kind is not None]
)
_RANGED_STOCK = tuple((name, field) for name, field in STOCK_FIELDS.items() if field.low is not None)


def check_argument_types(config: GenerationConfig) -> None:
    """`ValueError` naming the first knob, then the first stock field (`stock_fields.STOCK_FIELDS`), whose value has
    the wrong type (None always passes; `ArgumentValues.type_error`). Token ids are integers >= 0; with
    `decoding="autoregressive"` special ids may be negative, as stock generate allows."""
    lowest = NEVER_ID if getattr(config, "decoding", None) == "autoregressive" else 0
    get = vars(config).get  # every field is an instance attribute (GenerationConfig.__init__ sets them all)
    for name, declared in _TYPED:
        value = get(name)
        if value is not None and (expected := declared.type_error(value, lowest)) is not None:
            raise ValueError(f"`{name}` must be {expected}, got {value!r}.")


@dataclass
class RefusionGenerationOutput(ModelOutput):
    """
    What `generate(..., return_dict_in_generate=True)` returns with ReFusion decoding.

    sequences (`torch.LongTensor` of shape `(batch_size * num_return_sequences, prompt_length + answer_length)`):
        The prompts as given, then the generated tokens in their original order, `pad_token_id` after each row's
        end; as wide as the longest answer in the batch (like stock `generate` when every row ends early).
    num_forward_passes (`int`):
        Model forward calls made by this `generate` call (one call serves every row of the batch).
    tokens_per_forward (`torch.FloatTensor` of shape `(batch_size,)`):
        Generated tokens of each row (up to and including its end) divided by the forward passes it took part in.
    answer_lengths (`torch.LongTensor` of shape `(batch_size,)`):
        Generated tokens of each row, up to and including its end (EOS, a stopping criterion's cut or the limit).
    forward_passes_per_row (`torch.LongTensor` of shape `(batch_size,)`):
        The forward passes each row took part in (a row leaves the batch when its answer is decoded).
    commit_step (`torch.LongTensor` of shape `(batch_size, answer_length)`):
        For each generated position, the decoding step (planning iteration, from 0) that committed it; -1 for
        positions after the end of the row's answer.
    revised_tokens (`torch.LongTensor` of shape `(batch_size,)`):
        Positions of each row remasked by revisions (`remask_threshold`) and decoded again; 0 when it is unset.
    revision_counts (`torch.LongTensor` of shape `(batch_size, answer_length)`):
        For each generated position, how many times a revision remasked it (its token is the last decoding's); 0
        everywhere when `remask_threshold` is unset and after the end of the row's answer.
    chosen_slots (`list[list[list[int]]]`):
        For each row and each step, the start offsets (relative to the first generated position) of the slots
        chosen by that step's plan (or, with `remask_threshold`, remasked by that step's revision).
    """

    sequences: torch.LongTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_forward: torch.FloatTensor | None = None
    answer_lengths: torch.LongTensor | None = None
    forward_passes_per_row: torch.LongTensor | None = None
    commit_step: torch.LongTensor | None = None
    chosen_slots: list | None = None
    revised_tokens: torch.LongTensor | None = None
    revision_counts: torch.LongTensor | None = None
