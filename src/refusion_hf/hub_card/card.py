"""Model cards for ReFusion checkpoints and LoRA adapters, built with `huggingface_hub`'s `ModelCard`.

Metadata goes through `ModelCardData` (evaluation results as `EvalResult`s, which it turns into a `model-index`);
the body is rendered from the templates shipped next to this module. Everything the card states about the
checkpoint (decoding defaults, architecture, tokenizer, parameter count) is read from the folder being published,
so the card cannot drift from the files it describes.
"""

from __future__ import annotations

import json
import re
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..generation.refusion_generation_config import RefusionGenerationConfig, declared_knobs
from ..modeling.loading import prompt_ids
from .errors import CardInputError
from .sources import EvalReport, TrainingSummary, eval_results_of, format_cell

# The usage snippet's answer length when the checkpoint's generation config sets none (stock generate would
# stop after 20 new tokens).
SNIPPET_MAX_NEW_TOKENS = 512

PAPER_ARXIV_ID = "2512.13586"
CITATION = """@article{li2025refusion,
  title   = {ReFusion: A Diffusion Large Language Model with Parallel Autoregressive Decoding},
  author  = {Li, Jia-Nan and Guan, Jian and Wu, Wei and Li, Chongxuan},
  journal = {arXiv preprint arXiv:2512.13586},
  year    = {2025}
}"""
BASE_TAGS = ["refusion", "diffusion", "masked-diffusion"]
MODEL_TAGS = [*BASE_TAGS, "custom_code", "qwen3", "text-generation", f"arxiv:{PAPER_ARXIV_ID}"]
DEFAULT_LICENSE = "apache-2.0"
DEFAULT_EXAMPLE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
_LICENSE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")

TEMPLATE = "card_template.md"  # one template, model and adapter cards


# --------------------------------------------------------------------------------------------- validation
def check_hub_id(value: str, option: str, example: str) -> str:
    """A Hub repository id (`namespace/name`), or `CardInputError` naming `option`."""
    if Path(value).exists():
        raise CardInputError(f"{option} {value!r} is a local path; it must be a Hub repository id such as {example}.")
    try:
        validate_repo_id(value)
    except HFValidationError as error:
        raise CardInputError(f"{option} {value!r} is not a Hub repository id ({error}); use e.g. {example}.") from None
    return value


def check_repo_id(repo_id: str) -> str:
    """A full `namespace/name` id (the usage snippet and `create_repo` need the namespace)."""
    check_hub_id(repo_id, "--repo-id", "your-name/refusion-8b")
    if "/" not in repo_id:
        raise CardInputError(
            f"--repo-id {repo_id!r} has no namespace; pass `namespace/{repo_id}` (your user or organisation name)."
        )
    return repo_id


def check_license(license: str) -> str:
    if not isinstance(license, str) or not _LICENSE_PATTERN.match(license):
        raise CardInputError(
            f"--license {license!r} is not a Hub license identifier; use a lowercase id from "
            "https://huggingface.co/docs/hub/repositories-licenses such as apache-2.0, mit or other."
        )
    return license


def check_card_arguments(*, license: str, repo_id: str | None = None, base_model: str | None = None,
                         datasets: list[str] | None = None) -> None:  # fmt: skip
    """The card's license and Hub ids (`publish` checks them before any heavy work, the card builders when called
    on their own)."""
    check_license(license)
    if repo_id is not None:
        check_repo_id(repo_id)
    if base_model is not None:
        check_hub_id(base_model, "--base-model", "GSAI-ML/ReFusion")
    for dataset in datasets or []:
        check_hub_id(dataset, "--dataset", "openai/gsm8k")


# ----------------------------------------------------------------------------------------------- helpers
_DISPLAY_NAMES = {"peft": "PEFT"}  # as PEFT's own cards write it


def framework_versions(*names: str) -> list[tuple[str, str]]:
    versions = []
    for name in names:
        try:
            versions.append((_DISPLAY_NAMES.get(name, name), metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return versions


def count_parameters(folder: Path) -> int:
    """Number of parameters stored in the folder's safetensors files (read from their headers only)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                count = 1
                for size in handle.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def human_count(count: int) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.2f}{suffix} ({count:,})"
    return f"{count:,}"


# --------------------------------------------------------------------------------------------- decoding
# The card's table explains ReFusion's fields with their declared help (`DecodingKnob.help`); the two stock fields
# it lists get what is particular to ReFusion decoding.
STOCK_FIELD_MEANINGS = {
    "temperature": "Read only with `do_sample=True` (stock semantics: drafts are then sampled after transformers' "
    "logits warpers; seed with `torch.manual_seed`); `do_sample=False` is greedy.",
    "max_new_tokens": "Answer length limit. The canvas is this rounded up to a multiple of `slot_size`; nothing past "
    "it is returned.",
}


def decoding_defaults(generation_config) -> dict[str, Any]:
    """What `generate()` uses with this generation config when the call sets nothing: its ReFusion fields (unset
    ones take the package defaults), `temperature`, and the answer length (the snippet's when it sets none)."""
    config = RefusionGenerationConfig.from_generation_config(generation_config)
    values = {knob.name: knob.default if getattr(config, knob.name) is None else getattr(config, knob.name)
              for knob in declared_knobs()}  # fmt: skip
    values.update(temperature=config.temperature, max_new_tokens=config.max_new_tokens or SNIPPET_MAX_NEW_TOKENS)
    return values


def fitting_max_new_tokens(defaults: dict[str, Any], prompt_length: int, max_positions: int | None) -> int:
    """The default answer length, lowered (to a multiple of `slot_size`) when prompt plus canvas would not fit in
    `max_positions`."""
    if not max_positions:
        return defaults["max_new_tokens"]
    room = (max_positions - prompt_length) // defaults["slot_size"] * defaults["slot_size"]
    return max(1, min(defaults["max_new_tokens"], room))


def decoding_rows(defaults: dict[str, Any], max_positions: int | None) -> list[dict[str, str]]:
    """The card's table of decoding defaults: every declared knob (in declaration order), then the stock fields of
    `STOCK_FIELD_MEANINGS`."""
    meanings = {**{knob.name: knob.help for knob in declared_knobs()}, **STOCK_FIELD_MEANINGS}
    rows = []
    for name in meanings:
        value, meaning = defaults[name], meanings[name]
        shown = f'"{value}"' if isinstance(value, str) else str(value) if value is None else format_cell(value)
        if name == "max_new_tokens" and max_positions:
            meaning += f" Prompt plus canvas must fit in {max_positions} positions."
        rows.append({"name": name, "value": shown, "meaning": format_cell(meaning)})
    return rows


# ------------------------------------------------------------------------------------------------ cards
def _card_data(*, library_name: str, license: str, base_model: str | None, datasets: list[str] | None,
               tags: list[str], model_name: str, reports: list[EvalReport]) -> ModelCardData:  # fmt: skip
    eval_results = eval_results_of(reports) if reports else None
    return ModelCardData(
        library_name=library_name,
        pipeline_tag="text-generation",
        license=license,
        base_model=base_model,
        datasets=list(datasets) if datasets else None,
        tags=tags,
        model_name=model_name if eval_results else None,
        eval_results=eval_results,
    )


def _render(card_data: ModelCardData, *, defaults: dict[str, Any], prompt: str, prompt_length: int, chat: bool,
            max_positions: int | None, reports: list[EvalReport], training: TrainingSummary | None,
            facts: list[tuple[str, Any]], literals: dict[str, str], **context) -> ModelCard:  # fmt: skip
    """The card from the one template (`adapter` in `context` switches the adapter's sections on); `literals` are
    the snippet's strings, written as Python literals."""
    max_new_tokens = fitting_max_new_tokens(defaults, prompt_length, max_positions)
    template = resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")
    literal = {name: json.dumps(value, ensure_ascii=False) for name, value in literals.items()}
    return ModelCard.from_template(
        card_data,
        template_str=template,
        literal={**literal, "prompt": json.dumps(prompt, ensure_ascii=False)},
        chat=chat,
        max_new_tokens=max_new_tokens,
        defaults=defaults,
        length_lowered=max_new_tokens < defaults["max_new_tokens"],
        decoding_rows=decoding_rows(defaults, max_positions),
        training=training,
        facts=[(name, format_cell(value)) for name, value in facts],
        citation=CITATION,
        eval_reports=reports,
        cell=format_cell,
        **context,
    )


def _model_name(repo_id: str | None, folder: Path, name: str | None) -> str:
    return repo_id.rsplit("/", 1)[-1] if repo_id else (name or folder.resolve().name)


def _model_id(repo_id: str | None, folder: Path, name: str | None) -> str:
    """The id the usage snippet loads: the repository, or a placeholder to fill in when none was given."""
    return repo_id or f"<your-namespace>/{name or folder.resolve().name}"


def build_model_card(
    folder: str | Path,
    *,
    repo_id: str | None = None,
    license: str = DEFAULT_LICENSE,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    eval_reports: list[EvalReport] | None = None,
    training: TrainingSummary | None = None,
    example_prompt: str = DEFAULT_EXAMPLE_PROMPT,
    official_source: bool = False,
    name: str | None = None,
) -> ModelCard:
    """The card of a saved ReFusion checkpoint folder (config, generation config, tokenizer and weights in it).
    `name` titles the card when there is no `repo_id` (default: the folder's name)."""
    from transformers import AutoTokenizer

    from ..modeling.configuration_refusion import RefusionConfig

    folder = Path(folder)
    check_card_arguments(license=license, repo_id=repo_id, base_model=base_model, datasets=datasets)
    config = RefusionConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    chat = bool(tokenizer.chat_template)
    reports = list(eval_reports or [])
    model_name = _model_name(repo_id, folder, name)
    mask_id, eos = config.mask_token_id, config.eos_token_id
    mask_token = tokenizer.convert_ids_to_tokens(mask_id) if mask_id is not None else None
    eos_token = tokenizer.convert_ids_to_tokens(eos) if isinstance(eos, int) else eos
    dtype = getattr(config, "dtype", None)
    facts = [
        ("Architecture", "Qwen3 decoder, causal attention (`RefusionForCausalLM`, a `Qwen3ForCausalLM` subclass)"),
        ("Parameters", human_count(count_parameters(folder))),
        ("Layers", config.num_hidden_layers),
        ("Hidden size", config.hidden_size),
        ("Attention heads", f"{config.num_attention_heads} query, {config.num_key_value_heads} key/value"),
        ("Vocabulary", f"{config.vocab_size:,}"),
        ("Context (`max_position_embeddings`)", f"{config.max_position_embeddings:,}"),
        ("Weights dtype", str(dtype).replace("torch.", "") if dtype is not None else "–"),
        ("Mask token", f"`{mask_token}` (id {mask_id})"),
        ("End of sequence", f"`{eos_token}` (id {eos})"),
        ("Chat template", "yes" if chat else "no (prompts are plain text)"),
    ]
    card_data = _card_data(library_name="transformers", license=license, base_model=base_model, datasets=datasets,
                           tags=MODEL_TAGS, model_name=model_name, reports=reports)  # fmt: skip
    return _render(
        card_data,
        defaults=decoding_defaults(RefusionGenerationConfig.from_pretrained(folder)),
        prompt=example_prompt,
        prompt_length=len(prompt_ids(tokenizer, example_prompt)),
        chat=chat,
        max_positions=config.max_position_embeddings,
        reports=reports,
        training=training,
        facts=facts,
        literals={"model_id": _model_id(repo_id, folder, name)},
        adapter=False,
        model_name=model_name,
        model_id=_model_id(repo_id, folder, name),
        base_model=base_model,
        official_source=official_source,
        max_position_embeddings=f"{config.max_position_embeddings:,}",
        mask_token=mask_token,
        framework_versions=framework_versions("transformers", "torch", "huggingface_hub", "refusion_hf"),
    )


def build_adapter_card(
    folder: str | Path,
    *,
    base_model: str,
    repo_id: str | None = None,
    license: str = DEFAULT_LICENSE,
    datasets: list[str] | None = None,
    eval_reports: list[EvalReport] | None = None,
    training: TrainingSummary | None = None,
    example_prompt: str = DEFAULT_EXAMPLE_PROMPT,
    base_generation_config=None,
    base_max_positions: int | None = None,
    name: str | None = None,
) -> ModelCard:
    """The card of a saved PEFT adapter folder, following PEFT's conventions (`library_name: peft`, `base_model`,
    `base_model:adapter:` and method tags, PEFT version); decoding defaults come from the base's generation config
    when it is given."""
    folder = Path(folder)
    check_card_arguments(license=license, repo_id=repo_id, base_model=base_model, datasets=datasets)
    adapter_config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    peft_type = str(adapter_config.get("peft_type", "LORA"))
    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    chat, prompt_length = False, 0
    if has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        chat = bool(tokenizer.chat_template)
        prompt_length = len(prompt_ids(tokenizer, example_prompt))
    reports = list(eval_reports or [])
    model_name = _model_name(repo_id, folder, name)
    tags = [
        *BASE_TAGS,
        peft_type.lower(),
        "transformers",
        f"base_model:adapter:{base_model}",
        f"arxiv:{PAPER_ARXIV_ID}",
    ]
    targets = adapter_config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        targets = ", ".join(f"`{name}`" for name in sorted(targets))
    facts = [
        ("PEFT method", peft_type),
        ("Base model", f"[{base_model}](https://huggingface.co/{base_model})"),
        ("Rank `r`", adapter_config.get("r", "–")),
        ("`lora_alpha`", adapter_config.get("lora_alpha", "–")),
        ("`lora_dropout`", adapter_config.get("lora_dropout", "–")),
        ("Target modules", targets or "–"),
        ("Trainable parameters", human_count(count_parameters(folder))),
        ("Tokenizer", "included" if has_tokenizer else "use the base model's"),
    ]
    card_data = _card_data(library_name="peft", license=license, base_model=base_model, datasets=datasets,
                           tags=tags, model_name=model_name, reports=reports)  # fmt: skip
    return _render(
        card_data,
        defaults=decoding_defaults(base_generation_config or RefusionGenerationConfig()),
        prompt=example_prompt,
        prompt_length=prompt_length,
        chat=chat,
        max_positions=base_max_positions,
        reports=reports,
        training=training,
        facts=facts,
        literals={"model_id": _model_id(repo_id, folder, name), "base_id": base_model},
        adapter=True,
        model_name=model_name,
        base_model=base_model,
        has_tokenizer=has_tokenizer,
        peft_method="LoRA" if peft_type == "LORA" else peft_type,
        decoding_from_base=base_generation_config is not None,
        framework_versions=framework_versions("peft", "transformers", "torch", "huggingface_hub", "refusion_hf"),
    )
