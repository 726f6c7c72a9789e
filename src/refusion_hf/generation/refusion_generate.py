"""`refusion_generate(model, ...)`: `generate()` with ReFusion decoding, for any Qwen3-shaped causal LM.

It is `RefusionForCausalLM.generate` and, exported as `custom_generate/generate.py`, what a stock
`Qwen3ForCausalLM` runs with `generate(..., custom_generate=DIR_OR_REPO, trust_remote_code=True)`. The call
contract is stock `GenerationMixin.generate`'s, and transformers does the stock parts:

* the generation config is merged exactly as stock `generate` merges it (the passed config, then the model's
  for every field left unset, then the defaults, then keyword overrides), and lengths, special tokens, logits
  processors and stopping criteria are prepared by `GenerationMixin`'s own private helpers (through
  `_compat/transformers.py`);
* the decoding method is decided once, at the first step: `decoding="autoregressive"`, `custom_generate=` and
  drafting for stock assisted decoding hand the whole call to stock `GenerationMixin.generate` (`stock_generate`);
* without a prompt, each row starts from BOS, as stock `_maybe_initialize_input_ids_for_generation` starts it.

Every stock argument is honoured by ReFusion decoding or refused with a `ValueError` that names it
(`ARGUMENT_SUPPORT`: one entry per `GenerationConfig` field, from `stock_fields.STOCK_FIELDS`). `generate_batch`
(generate_batch.py) runs the same steps on a padded batch of requests. The algorithm is in `batch_scheduler.py` and its
stages, the drafting under logits processors in `draft_policy.py`.

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteria, StoppingCriteriaList

from .._compat.transformers import (
    prepare_generated_length,
    prepare_special_tokens_and_mask,
    settled_pad_token_id,
    stock_logits_processor,
    stock_stopping_criteria,
    without_eos_tensor,
)
from .batch_scheduler import decode_batch
from .draft_policy import DraftPolicy
from .generate_arguments import (
    GENERATE_SIGNATURE,
    bound_arguments,
    check_generation_config,
    check_left_padding,
    check_stop_strings,
    check_token_ids,
    eos_token_ids,
    refuse_unsupported,
)
from .prefix_stopping import PrefixStopping
from .refusion_generation_config import (
    REFUSION_FIELDS,
    RefusionGenerationConfig,
    RefusionGenerationOutput,
    decoding_knob_values,
    preset_settings,
)
from .sequence_state import DecodingSettings, SequenceState
from .stock_fields import STOCK_ARGUMENTS

DEFAULT_BATCH_ROWS = 16  # `generate_batch`: requests decoded at once unless `max_requests_per_batch` says


def refusion_generate(model, *args, **kwargs):
    """`model.generate(...)` with ReFusion decoding; see `RefusionGenerationMixin.generate` for the arguments. Its
    signature is stock `GenerationMixin.generate`'s (`GENERATE_SIGNATURE`, from the declaration of stock generate's
    named arguments: `stock_fields.STOCK_ARGUMENTS`)."""
    call = bound_arguments(GENERATE_SIGNATURE, (model, *args), kwargs)
    stock_arguments = {name: call[name] for name in STOCK_ARGUMENTS}
    inputs, generation_config = call["inputs"], call["generation_config"]
    return generate_steps(model, inputs, generation_config, stock_arguments, call["custom_generate"], call["kwargs"])


refusion_generate.__signature__ = GENERATE_SIGNATURE


def generate_steps(
    model, inputs, generation_config, stock_arguments: dict, custom_generate, kwargs: dict, merged=None, **batching
):
    """`refusion_generate` in numbered steps, as `GenerationMixin.generate`. `stock_arguments`: its `STOCK_ARGUMENTS`;
    `kwargs`: the rest. `merged`: the config and model keyword arguments `merged_config` already gave (for
    `refusion_generate_batch`, which merges once), and `batching`: `decode_batch`'s `max_rows` / `on_finish`."""
    # 1. The decoding method, decided once (stock generate's step 0 loads `custom_generate` the same way): stock
    #    generate makes the whole call for `custom_generate=`, for `decoding="autoregressive"` and for drafts asked of
    #    this model by stock assisted decoding (`is_assistant`: it scores them token by token, so they are drafted
    #    left to right).
    if merged is None and custom_generate is None:
        assisting = getattr(generation_config, "is_assistant", False)
        merged = merged_config(model, generation_config, kwargs, assisting)
    config, model_kwargs = merged or (None, None)
    if config is None or config.decoding == "autoregressive":
        stock_arguments = dict(generation_config=generation_config, custom_generate=custom_generate, **stock_arguments)
        return stock_generate(model, inputs, stock_arguments, kwargs, config, model_kwargs)

    # 2. The prompts (BOS without any, as in stock generate); refuse every argument ReFusion decoding cannot honour.
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    attention_mask = model_kwargs.pop("attention_mask", None)
    if input_ids is None:
        input_ids = bos_prompts(model, config, model_kwargs, attention_mask)
    check_token_ids(input_ids, attention_mask, config, model.get_input_embeddings().num_embeddings)
    tokenizer = model_kwargs.pop("tokenizer", None)  # used for stop strings, as in stock generate
    refuse_unsupported(config, model_kwargs, stock_arguments)
    check_stop_strings(config, tokenizer)

    # 3. Special tokens, the attention mask (inferred from padding when none is given) and lengths: stock preparation.
    has_default_max_length, has_default_min_length = (
        kwargs.get(name) is None
        and (generation_config is None or getattr(generation_config, name) is None)
        and getattr(model.generation_config, name, None) is None
        for name in ("max_length", "min_length")
    )
    device = model.device
    input_ids = input_ids.to(device)
    width = input_ids.shape[1]
    attention_mask = prepare_special_tokens_and_mask(model, config, input_ids, attention_mask)
    attention_mask = check_left_padding(input_ids, attention_mask.to(device), config)
    config = prepare_generated_length(model, config, has_default_max_length, has_default_min_length, input_ids)

    # 4. The decoder's settings, drafting under the logits processors, and the stopping criteria.
    prompt_lengths = attention_mask.sum(1).tolist()  # left padding: each row's prompt is its last n tokens
    settings = decoding_settings(model, config, width, max(prompt_lengths))
    pad_token_id = settled_pad_token_id(config)
    repeats = config.num_return_sequences or 1
    if repeats > 1:
        input_ids = input_ids.repeat_interleave(repeats, dim=0)
        attention_mask = attention_mask.repeat_interleave(repeats, dim=0)
    policy = draft_policy(model, config, settings, input_ids, attention_mask)
    stopping = prefix_stopping(model, config, stock_arguments["stopping_criteria"], tokenizer, input_ids, pad_token_id)

    # 5. Decode each row's prompt (the last `prompt_length` tokens of its padded row), streaming batch-1 calls.
    stream = _StreamForwarder.start(stock_arguments["streamer"], input_ids)
    row_lengths = [n for n in prompt_lengths for _ in range(repeats)]  # as input_ids.repeat_interleave
    prompts = [row[width - n :] for row, n in zip(input_ids, row_lengths)]
    on_step = stream.on_step if stream is not None else None
    result = decode_batch(
        model, prompts, settings, pad_token_id, policy=policy, stopping=stopping, on_step=on_step, **batching
    )
    if stream is not None:
        stream.finish()

    # 6. The output: the padded prompts and answers, or a `RefusionGenerationOutput` with the decoding's counts.
    return generation_output(config, input_ids, result)


def stock_generate(model, inputs, stock_arguments: dict, kwargs: dict, config, model_kwargs):
    """Stock `GenerationMixin.generate` makes the whole call (`stock_arguments`: its named arguments). For
    `custom_generate=` and assisted drafting (`config` None) with the arguments as given; for
    `decoding="autoregressive"` after the argument checks that turn its TypeErrors and IndexErrors into
    ValueErrors, but none of ReFusion's own requirements (a mask token, an EOS, special ids >= 0, left padding).
    ReFusion knobs mean nothing to left-to-right decoding and are dropped; the prompt goes in positionally (without
    one, stock starts from `inputs_embeds` or from BOS)."""
    if config is None:
        return GenerationMixin.generate(model, inputs, **stock_arguments, **kwargs)
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    attention_mask = model_kwargs.pop("attention_mask", None)
    check_token_ids(input_ids, attention_mask, config, model.get_input_embeddings().num_embeddings)
    check_stop_strings(config, model_kwargs.get("tokenizer"))
    stock_kwargs = stock_keywords(stock_arguments["generation_config"], kwargs, "input_ids", "attention_mask")
    if attention_mask is not None:
        stock_kwargs["attention_mask"] = attention_mask
    return GenerationMixin.generate(model, input_ids, **stock_arguments, **stock_kwargs)


def stock_keywords(generation_config, kwargs: dict, *dropped: str) -> dict:
    """The keyword arguments stock `generate` (or `generate_batch`) gets for `decoding="autoregressive"`: ReFusion's
    knobs, `preset` and `dropped` left out (they mean nothing to left-to-right decoding), a preset's length kept
    (it applies to both), and the caller's `max_length` winning over the checkpoint's `max_new_tokens`, as in
    ReFusion decoding (`merge_generation_config`)."""
    stock_kwargs = {k: v for k, v in kwargs.items() if k not in (*REFUSION_FIELDS, "preset", *dropped)}
    if kwargs.get("preset") is not None and "max_new_tokens" not in kwargs:
        stock_kwargs["max_new_tokens"] = preset_settings(kwargs["preset"])["max_new_tokens"]
    if callers_length_wins(generation_config, stock_kwargs):
        stock_kwargs["max_new_tokens"] = None
    return stock_kwargs


def bos_prompts(model, config, model_kwargs: dict, attention_mask) -> torch.LongTensor:
    """Stock `_maybe_initialize_input_ids_for_generation` for ReFusion decoding, which decodes from token ids: one
    BOS per row (rows as in `attention_mask`, else 1) when no prompt is given."""
    if "inputs_embeds" in model_kwargs:
        raise ValueError(
            "ReFusion decoding needs `input_ids` (the prompts as token ids: its decoder feeds prompts and canvases "
            "as tokens); `inputs_embeds` alone works with `decoding='autoregressive'`."
        )
    if config.bos_token_id is None:
        raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
    rows = attention_mask.shape[0] if torch.is_tensor(attention_mask) and attention_mask.dim() > 0 else 1
    return torch.full((rows, 1), config.bos_token_id, dtype=torch.long, device=model.device)


def prefix_stopping(model, config, stopping_criteria, tokenizer, input_ids, pad_token_id) -> PrefixStopping | None:
    """Stock stopping criteria (`_get_stopping_criteria`: the caller's, `stop_strings`, `max_time`) applied to each
    row's final left-to-right prefix; None when there are none. Lengths and EOS are the decoder's own."""
    if isinstance(stopping_criteria, StoppingCriteria):
        stopping_criteria = StoppingCriteriaList([stopping_criteria])
    criteria_config = without_eos_tensor(copy.copy(config))
    criteria_config.max_length = None  # the decoder ends rows itself
    criteria = stock_stopping_criteria(model, criteria_config, stopping_criteria or StoppingCriteriaList(), tokenizer)
    return PrefixStopping(criteria, input_ids, pad_token_id) if len(criteria) else None


def generation_output(config, input_ids: torch.LongTensor, result) -> torch.LongTensor | RefusionGenerationOutput:
    """What `generate()` returns for `decode_batch`'s `result`: prompts and answers as one tensor, or with
    `return_dict_in_generate=True` a `RefusionGenerationOutput` with the forward-pass counts."""
    sequences = torch.cat([input_ids, result.tokens], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    lengths = torch.tensor(result.answer_lengths, dtype=torch.long)
    passes = torch.tensor(result.forward_passes_per_row, dtype=torch.long)
    return RefusionGenerationOutput(
        sequences=sequences,
        num_forward_passes=result.num_forward_passes,
        tokens_per_forward=lengths / passes,
        answer_lengths=lengths,
        forward_passes_per_row=passes,
        commit_step=result.commit_step,
        chosen_slots=result.chosen_slots,
        revised_tokens=torch.tensor(result.revised_tokens, dtype=torch.long),
        revision_counts=result.revision_counts,
    )


# ----------------------------------------------------------------------------------------------- preparation
def merged_config(model, generation_config, kwargs: dict, assisting: bool = False):
    """Step 1's checks and merge, shared by `generate` and `generate_batch`: `generation_config` must be a
    `GenerationConfig` (or None), `trust_remote_code` is dropped from `kwargs` (it only means something with
    `custom_generate`, as in stock generate), and the config is merged (`merge_generation_config`); None when
    `assisting` (stock assisted decoding's drafts: stock generate makes that call as given)."""
    check_generation_config(generation_config)
    kwargs.pop("trust_remote_code", None)
    return None if assisting else merge_generation_config(model, generation_config, kwargs)


def merge_generation_config(model, generation_config, kwargs: dict) -> tuple[RefusionGenerationConfig, dict]:
    """Stock `GenerationMixin._prepare_generation_config`'s merge, into a `RefusionGenerationConfig`: the passed
    config (copied), then the model's generation config for every field still unset, then the defaults, then the
    keyword overrides. Returns the config and the keyword arguments that are not config fields."""
    kwargs = dict(kwargs)
    preset = kwargs.pop("preset", None)
    if preset is not None:  # the preset's knobs stand in for keyword arguments; explicit ones win
        kwargs = {**preset_settings(preset), **kwargs}
    if generation_config is None:
        config = RefusionGenerationConfig()
    else:  # the caller's config is never changed: a plain one is upcast into a new object, ours is copied
        config = RefusionGenerationConfig.from_generation_config(generation_config)
        if config is generation_config:
            config = copy.deepcopy(config)
    if model.generation_config is not None:
        defaults = model.generation_config.to_dict()
        if callers_length_wins(config, kwargs):
            defaults.pop("max_new_tokens", None)
        config.update(**defaults, defaults_only=True, allow_custom_entries=True)
    config.update(**RefusionGenerationConfig.default_generation_params(), defaults_only=True)
    model_kwargs = config.update(**kwargs)
    # As in stock generate, a keyword given as None overrides with None; a ReFusion knob that None leaves without a
    # value gets its default (block_size None *is* its default: 128 rounded to the slot size).
    if any(kwargs.get(name, 0) is None for name in REFUSION_FIELDS):
        config.update(**{k: v for k, v in REFUSION_FIELDS.items() if v is not None}, defaults_only=True)
    if config.mask_token_id is None:
        config.mask_token_id = getattr(model.config, "mask_token_id", None)
    if config.eos_token_id is None and "eos_token_id" not in kwargs:  # an explicit None means no EOS, as in stock
        config.eos_token_id = model.config.eos_token_id
    if config.pad_token_id is None:
        config.pad_token_id = getattr(model.config, "pad_token_id", None)
    return config, model_kwargs


def callers_length_wins(generation_config: GenerationConfig | None, kwargs: dict) -> bool:
    """Whether the caller gives `max_length` and no `max_new_tokens` (in the passed config or as keywords): that
    length then wins over the checkpoint's `max_new_tokens`, where stock generate would let a `max_new_tokens` of
    generation_config.json override it (lm-eval's `max_gen_toks` arrives as `max_length`)."""
    passed = {name: getattr(generation_config, name, None) for name in ("max_length", "max_new_tokens")}
    given = {**{k: v for k, v in passed.items() if v is not None}, **kwargs}
    return given.get("max_length") is not None and given.get("max_new_tokens") is None


def answer_lengths(new_tokens: torch.LongTensor, eos_ids: set[int]) -> list[int]:
    """Per row of generated tokens `new_tokens` [B, N]: the answer's length, up to and including the first EOS (all
    N when there is none)."""
    is_eos = torch.isin(new_tokens, torch.tensor(sorted(eos_ids), dtype=new_tokens.dtype, device=new_tokens.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new_tokens.shape[1])
    return first.tolist()


def decoding_settings(model, config: RefusionGenerationConfig, width: int, longest_prompt: int) -> DecodingSettings:
    """The decoder's settings from a merged, length-prepared config (`config.max_length` counts the padded
    prompt, as in stock generate)."""
    knobs = decoding_knob_values(config)  # every knob the decoder reads, unset ones resolved
    max_new_tokens = config.max_length - width
    slot_size = knobs["slot_size"]
    canvas_length = -(-max_new_tokens // slot_size) * slot_size
    if longest_prompt + canvas_length > torch.iinfo(torch.long).max:  # positions are int64 tensors
        raise ValueError(
            f"`max_new_tokens` ({max_new_tokens}) is beyond what torch can index: the longest prompt "
            f"({longest_prompt} tokens) plus `max_new_tokens` rounded up to a multiple of `slot_size` ({slot_size}) "
            "must be at most 2**63 - 1 positions. Pass a smaller `max_new_tokens`; memory and time follow the "
            "answer, not `max_new_tokens`, so any bound the answers stay under costs the same."
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and slot_size > limit:  # refused before the canvas (one slot at least) is allocated
        raise ValueError(
            f"`slot_size` ({slot_size}) is larger than the model's maximum length ({limit} positions): no answer can "
            f"fill one slot, and each slot is drafted whole. Pass a `slot_size` of at most {limit} (the paper uses "
            "4 to 32)."
        )
    if limit is not None and longest_prompt + max_new_tokens > limit:
        warnings.warn(
            f"The longest prompt ({longest_prompt} tokens) plus `max_new_tokens` ({max_new_tokens}) exceeds the "
            f"model's predefined maximum length ({limit} positions). Depending on the model, you may observe "
            "exceptions, performance degradation, or nothing at all (answers that end early never reach it).",
            UserWarning,
            stacklevel=3,
        )
    knobs["block_size"] = min(knobs["block_size"], canvas_length)  # a block larger than the canvas means one block
    return DecodingSettings(**knobs, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids(config))


def draft_policy(model, config, settings: DecodingSettings, input_ids, attention_mask) -> DraftPolicy:
    """Drafting under the config's logits processors, built by stock `_get_logits_processor`."""
    device, width = input_ids.device, input_ids.shape[1]
    eos = set(settings.eos_token_ids)
    never = {settings.mask_token_id} | {t for t in (config.pad_token_id, config.bos_token_id) if t is not None} - eos
    constraint_config = copy.copy(config)
    # Positional constraints are applied by answer offset in `DraftPolicy`; the rest are context-free.
    constraint_config.do_sample = False
    constraint_config.min_length, constraint_config.min_new_tokens, constraint_config.begin_suppress_tokens = (
        0,
        None,
        None,
    )
    build = dict(model=model, input_ids_seq_length=width, encoder_input_ids=input_ids, device=device)
    constraints = stock_logits_processor(
        generation_config=constraint_config,
        model_kwargs={"attention_mask": attention_mask},
        **build,
    )
    warpers = None
    if config.do_sample:
        names = ("temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
        warper_config = GenerationConfig(do_sample=True, num_beams=1, **{name: getattr(config, name) for name in names})
        without_eos_tensor(warper_config)
        warpers = stock_logits_processor(generation_config=warper_config, **build)
    # Offsets past the canvas never occur: the bound keeps the comparison inside int64 (2**63 would wrap).
    min_new_tokens = min(max(0, (config.min_length or 0) - width), settings.canvas_length)
    return DraftPolicy(
        never_drafted=torch.tensor(sorted(never), dtype=torch.long, device=device),
        constraints=constraints or None,
        warpers=warpers,
        eos_ids=torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device),
        min_new_tokens=min_new_tokens,
        begin_suppress=(
            torch.tensor(config.begin_suppress_tokens, dtype=torch.long, device=device)
            if config.begin_suppress_tokens
            else None
        ),
    )


class _StreamForwarder:
    """Feeds a (batch-1) streamer: final tokens via `put` as the left-to-right prefix grows; drafts via
    `put_draft` when the streamer has it."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.sent = 0
        self.takes_drafts = callable(getattr(streamer, "put_draft", None))

    @classmethod
    def start(cls, streamer, input_ids: torch.LongTensor) -> _StreamForwarder | None:
        """The forwarder for `streamer` (None without one), after sending it the prompt as stock generate does;
        `ValueError` unless there is one row to follow."""
        if streamer is None:
            return None
        if input_ids.shape[0] > 1:
            raise ValueError(
                f"`streamer` follows one sequence, but there are {input_ids.shape[0]} rows (`input_ids` rows times "
                "`num_return_sequences`): stream batch-1 calls."
            )
        streamer.put(input_ids.cpu())
        return cls(streamer)

    def on_step(self, sequences: list[SequenceState]) -> None:
        sequence = sequences[0]
        ready = sequence.finished_prefix
        if ready > self.sent:
            self.streamer.put(sequence.canvas[self.sent : ready].cpu())
            self.sent = ready
        if self.takes_drafts and sequence.chosen is not None:
            self.streamer.put_draft(sequence.draft_view()[self.sent :].cpu())

    def finish(self) -> None:
        self.streamer.end()
