"""Publishing: turn a checkpoint (ours, official-format, or a LoRA adapter) into a complete Hub folder, and push it.

A published model folder holds everything `AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)`
needs where `refusion_hf` is not installed: safetensors weights, config.json with `model_type: refusion` and
`auto_map`, the flat remote-code bundle, generation_config.json with the ReFusion decoding defaults, the tokenizer,
and README.md (the model card). Official-format checkpoints (`model_type: qwen3` plus `mask_token_id`) come out in
this format. An adapter folder holds the adapter config (with a Hub `base_model_name_or_path`), the adapter
weights as safetensors, the tokenizer when there is one, and its card.

The folder is built next to `out` and moved into place only when complete, so a failed run never leaves a
half-written folder behind. Inputs are validated before any heavy work. Only the source folder's own files are read
(own_files.py: a symbolic link leaving it at any depth, a hard link with a name outside it, a mount point or a
special file is refused by name: its content would be published), and what would be published differently from the
source is refused too (a tokenizer `auto_map`, whose code publish does not carry; a corrupt adapter).

A push makes the repository's model the folder's: model files of an earlier push that the folder does not have
(weights, a shard index, an adapter, this package's remote-code modules, tokenizer files: `_managed_patterns()` at
the top level, and every file under `custom_generate/`) are deleted
in the same commit, so they cannot be loaded beside the new ones; any other file already there is kept and named.
"""

from __future__ import annotations

import fnmatch
import glob
import importlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from safetensors import SafetensorError

from ..checkpoint_identity import weights_sha256
from ..errors import InputError, first_line
from ..generation.refusion_generation_config import DECODING_KNOBS
from ..modeling.checkpoint_checks import check_checkpoint_folder
from ..modeling.configuration_refusion import OFFICIAL_MODEL_TYPE
from ..modeling.remote_code import CUSTOM_GENERATE_DIR, collect_bundle_modules
from ..outputs import staged_output
from .card import (
    DEFAULT_EXAMPLE_PROMPT,
    DEFAULT_LICENSE,
    build_adapter_card,
    build_model_card,
    check_card_arguments,
    check_hub_id,
    check_repo_id,
)
from .errors import CardInputError, PublishError, PushError
from .own_files import check_own_files
from .sources import EvalReport, load_eval_report, load_training_summary

# Top-level files that make up a model or an adapter in a Hub repository (what `from_pretrained` may read), besides
# the remote-code modules this package writes (`_managed_patterns`); other files (a `handler.py`, notes) are the
# repository owner's.
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.index.json",
    "*.model",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
)
# Decoding defaults that can be baked into the published generation_config.json, with their CLI options.
DECODING_OVERRIDES = {name: f"--{name.replace('_', '-')}" for name in (*DECODING_KNOBS, "max_new_tokens")}
# What is downloaded when `model` is a Hub id (the remote code is always written fresh, so no *.py).
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass
class PublishResult:
    folder: Path
    kind: str  # "model" or "adapter"
    files: list[str]
    card: ModelCard
    official_source: bool = False
    commit_url: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class PushResult:
    commit_url: str
    deleted: list[str]  # model files of an earlier push that the folder does not have, deleted by this commit
    kept: list[str]  # other files already in the repository, left as they were


# ------------------------------------------------------------------------------------------------- inputs
def _resolve_source(model: str | Path) -> tuple[Path, str | None]:
    """The local folder of `model`, and its Hub id when it had to be downloaded."""
    path = Path(model)
    if path.is_dir():
        return path, None
    if path.exists():
        raise CardInputError(f"--model {model}: is a file; pass the checkpoint folder (with config.json).")
    try:
        repo_id = check_hub_id(str(model), "--model", "GSAI-ML/ReFusion")
    except CardInputError:
        raise CardInputError(f"--model {model}: no such folder (and not a Hub repository id).") from None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=SOURCE_PATTERNS)), repo_id
    except Exception as error:  # noqa: BLE001 - any download failure becomes one message
        raise PublishError(
            f"--model {model}: not a local folder, and downloading it from the Hub failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Pass a local folder, "
            "or check the network and the repository id."
        ) from None


def _check_decoding_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    from ..generation.refusion_generation_config import RefusionGenerationConfig

    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    unknown = sorted(set(overrides) - set(DECODING_OVERRIDES))
    if unknown:
        raise CardInputError(f"unknown decoding defaults {unknown}; choose from {sorted(DECODING_OVERRIDES)}.")
    # Each value is checked on its own here; `block_size` against the checkpoint's `slot_size` once it is loaded.
    probe = RefusionGenerationConfig(slot_size=1)
    for key, value in overrides.items():
        setattr(probe, key, value)
        option = DECODING_OVERRIDES[key]
        if key == "max_new_tokens" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CardInputError(f"{option} must be an integer >= 1, got {value!r}.")
    try:
        probe.validate()
    except ValueError as error:
        options = ", ".join(DECODING_OVERRIDES[key] for key in overrides)
        raise CardInputError(f"invalid decoding defaults ({options}): {error}") from None
    return overrides


def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    out_resolved, source_resolved = out.resolve(), source.resolve()
    if out_resolved == source_resolved or source_resolved in out_resolved.parents:
        raise CardInputError(f"--out {out} is inside --model {source}; choose a folder outside the checkpoint.")
    if out_resolved in source_resolved.parents:
        raise CardInputError(f"--out {out} contains --model {source}; choose another folder.")
    if out.exists() and not out.is_dir():
        raise CardInputError(f"--out {out} is a file; choose a folder (it is created if missing).")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CardInputError(
                f"--out {out} is not empty; choose an empty or new folder, or pass --overwrite to replace its contents."
            )
        # --overwrite deletes the folder: only ever a flat folder of files, as a previous publish leaves it.
        cwd = Path.cwd().resolve()
        if out_resolved in (cwd, Path.home().resolve()) or out_resolved in cwd.parents:
            raise CardInputError(f"--out {out} is the working or home directory; --overwrite will not replace it.")
        if any(entry.is_dir() and entry.name != CUSTOM_GENERATE_DIR for entry in out.iterdir()):
            raise CardInputError(
                f"--out {out} has subfolders other than {CUSTOM_GENERATE_DIR}/, so it is not a published folder; "
                "--overwrite only replaces those. Choose a new folder."
            )


def _check_checkpoint(folder: Path, flag: str) -> None:
    """The checks every command runs on a checkpoint folder (`check_checkpoint_folder`: config.json validated,
    its parameters fit in memory, a readable generation_config.json), as publish's errors."""
    try:
        check_checkpoint_folder(folder, flag)
    except InputError as error:
        raise CardInputError(str(error)) from None


def _load_tokenizer(*candidates: Path | str | None):
    from transformers import AutoTokenizer

    for candidate in candidates:
        if candidate is not None and (Path(candidate) / "tokenizer_config.json").is_file():
            tokenizer_config = _read_json_object(Path(candidate) / "tokenizer_config.json", "the tokenizer in")
            if "auto_map" in tokenizer_config:
                raise CardInputError(
                    f"the tokenizer in {candidate} names its own code in tokenizer_config.json (auto_map "
                    f"{tokenizer_config['auto_map']}), which publish does not run or copy: the published folder "
                    "would load another tokenizer. Remove auto_map if tokenizer.json is the whole tokenizer, or pass "
                    "--tokenizer DIR with a tokenizer without code."
                )
            try:
                return AutoTokenizer.from_pretrained(candidate, trust_remote_code=False)
            except (OSError, ValueError) as error:
                raise CardInputError(f"the tokenizer in {candidate} does not load ({first_line(error)}).") from None
    return None


def _check_reports_are_of(reports: list[EvalReport], source: Path, allow_mismatch: bool) -> None:
    """Each report must have measured these weights (`settings.model_sha256`, written by `refusion eval`)."""
    expected = weights_sha256(source)
    for report in reports:
        recorded = report.settings.get("model_sha256")
        if recorded == expected or allow_mismatch:
            continue
        what = (
            f"evaluated other weights (sha256 {str(recorded)[:12]}..., the folder's {str(expected)[:12]}...)"
            if recorded
            else "does not say which weights it evaluated (no settings.model_sha256: written before refusion eval "
            "recorded it)"
        )
        raise CardInputError(
            f"--eval {report.path} {what}; evaluate this folder (`refusion eval --model {source} --json ...`), or pass "
            "--allow-eval-mismatch to put that report on the card anyway."
        )


def _read_json_object(path: Path, flag: str) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CardInputError(f"{flag} {path.parent}: {path.name} is not readable JSON ({first_line(error)}).") from None
    if not isinstance(loaded, dict):
        raise CardInputError(f"{flag} {path.parent}: {path.name} is not a JSON object.")
    return loaded


# --------------------------------------------------------------------------------------------- full models
def _write_model(
    source: Path, staging: Path, tokenizer_source: str | Path | None, overrides: dict[str, Any]
) -> tuple[bool, Any, list[str]]:
    """Save the checkpoint at `source` into `staging` in our format; returns (official format?, config, notes)."""
    from ..generation.refusion_generation_config import REFUSION_FIELDS
    from ..modeling import RefusionConfig, RefusionForCausalLM

    raw = _read_json_object(source / "config.json", "--model")
    model_type = raw.get("model_type")
    if model_type not in (RefusionConfig.model_type, OFFICIAL_MODEL_TYPE):
        raise CardInputError(
            f"--model {source}: config.json has model_type {model_type!r}; publish expects a ReFusion checkpoint "
            f"({RefusionConfig.model_type!r}, or the official {OFFICIAL_MODEL_TYPE!r} format with a mask_token_id)."
        )
    official = model_type == OFFICIAL_MODEL_TYPE
    _check_checkpoint(source, "--model")
    if raw.get("mask_token_id") is None:
        raise CardInputError(
            f"--model {source}: config.json has no mask_token_id, so this is not a ReFusion checkpoint. Convert an "
            "autoregressive checkpoint first with `refusion convert`."
        )
    tokenizer = _load_tokenizer(tokenizer_source, source)
    if tokenizer is None:
        raise CardInputError(
            f"--model {source} has no tokenizer (tokenizer_config.json); pass --tokenizer DIR with the tokenizer the "
            "model was trained with."
        )
    mask_id = raw["mask_token_id"]
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id != mask_id:
        raise CardInputError(
            f"the tokenizer's mask token {tokenizer.mask_token!r} has id {tokenizer.mask_token_id}, but the model's "
            f"config.json says mask_token_id {mask_id}; pass the matching tokenizer with --tokenizer."
        )
    try:
        model = RefusionForCausalLM.from_pretrained(source, dtype="auto")
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise PublishError(f"--model {source}: the checkpoint does not load ({first_line(error)}).") from None
    generation_config = model.generation_config
    for key, value in overrides.items():
        setattr(generation_config, key, value)
    if generation_config.mask_token_id is None:
        generation_config.mask_token_id = mask_id
    try:  # the published generation_config.json states every ReFusion knob, defaults included
        generation_config.update(
            **{name: value for name, value in REFUSION_FIELDS.items() if value is not None}, defaults_only=True
        )
    except ValueError as error:
        options = ", ".join(DECODING_OVERRIDES[key] for key in overrides) or "the checkpoint's generation_config.json"
        raise CardInputError(f"invalid decoding defaults ({options}): {error}") from None
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    notes = []
    if official:
        notes.append("official-format checkpoint (model_type qwen3) republished with model_type refusion")
    return official, model.config, notes


# ------------------------------------------------------------------------------------------------ adapters
def _adapter_weights(source: Path, staging: Path) -> None:
    """The adapter's weights as safetensors, each tensor read once to refuse a corrupt file (adapters are small)."""
    import torch
    from safetensors.torch import load_file, save_file

    safetensors_file = source / "adapter_model.safetensors"
    bin_file = source / "adapter_model.bin"
    if not safetensors_file.is_file() and not bin_file.is_file():
        raise CardInputError(f"--model {source}: adapter_config.json but no adapter_model.safetensors (or .bin).")
    weights = safetensors_file if safetensors_file.is_file() else bin_file
    try:
        if weights is safetensors_file:
            load_file(str(weights))
            shutil.copy2(weights, staging / weights.name)
            return
        state = torch.load(weights, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError("not a dictionary of tensors")
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise CardInputError(f"--model {source}: {weights.name} is not readable ({first_line(error)}).") from None
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(staging / "adapter_model.safetensors"))


def _write_adapter(
    source: Path, staging: Path, base_model: str | None, tokenizer_source: str | Path | None
) -> tuple[str, dict[str, Any], list[str]]:
    """Copy the adapter at `source` into `staging` with a Hub base model id; returns (base id, base info, notes)."""
    adapter_config = _read_json_object(source / "adapter_config.json", "--model")
    recorded = adapter_config.get("base_model_name_or_path")
    base_local = Path(recorded) if recorded and Path(recorded).is_dir() else None
    if base_local is not None:  # its tokenizer and config are read
        check_own_files(base_local, "adapter_config.json base_model_name_or_path")
    if base_model is None:
        if not recorded:
            raise CardInputError(
                f"--model {source}: adapter_config.json has no base_model_name_or_path; pass --base-model HUB_ID."
            )
        if base_local is not None or recorded.startswith((".", "/", "~")):
            raise CardInputError(
                f"--model {source}: the adapter's base model is the local path {recorded!r}, which Hub users cannot "
                "load; pass --base-model with the Hub id of that model (it is written into the published "
                "adapter_config.json)."
            )
        base_model = check_hub_id(recorded, "adapter_config.json base_model_name_or_path", "GSAI-ML/ReFusion")
    notes = []
    if recorded != base_model:
        notes.append(f"adapter_config.json base_model_name_or_path: {recorded!r} -> {base_model!r}")
    adapter_config["base_model_name_or_path"] = base_model
    (staging / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    _adapter_weights(source, staging)
    tokenizer = _load_tokenizer(tokenizer_source, source, base_local)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    base_info: dict[str, Any] = {}
    if base_local is not None and (base_local / "config.json").is_file():
        _check_checkpoint(base_local, "adapter_config.json base_model_name_or_path")
        from ..generation.refusion_generation_config import RefusionGenerationConfig
        from ..modeling import RefusionConfig

        base_info["base_max_positions"] = RefusionConfig.from_pretrained(base_local).max_position_embeddings
        if (base_local / "generation_config.json").is_file():
            base_info["base_generation_config"] = RefusionGenerationConfig.from_pretrained(base_local)
    return base_model, base_info, notes


# ----------------------------------------------------------------------------------------------------- API
def publish(
    model: str | Path,
    out: str | Path,
    *,
    eval_paths: list[str | Path] | None = None,
    trainer_state: str | Path | None = None,
    tokenizer: str | Path | None = None,
    repo_id: str | None = None,
    push: bool = False,
    private: bool = False,
    license: str = DEFAULT_LICENSE,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    example_prompt: str = DEFAULT_EXAMPLE_PROMPT,
    decoding_defaults: dict[str, Any] | None = None,
    overwrite: bool = False,
    allow_eval_mismatch: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> PublishResult:
    """Write the complete Hub folder of `model` (a folder or Hub id) into `out`; with `push`, upload it to
    `repo_id`. Raises `PublishError` (with a message naming the argument and the fix) on bad input or a failed
    push; with a failed push, the folder is still complete in `out`."""
    out = Path(out)
    # Cheap checks first: nothing is loaded or written before the arguments are known to be usable.
    check_card_arguments(license=license, repo_id=repo_id, base_model=base_model, datasets=datasets)
    if push and repo_id is None:
        raise CardInputError("--push needs --repo-id NAMESPACE/NAME (the Hub repository to create or update).")
    if private and not push:
        raise CardInputError("--private only applies to the repository --push creates; add --push --repo-id ID.")
    if not isinstance(example_prompt, str) or not example_prompt.strip():
        raise CardInputError("--example-prompt must be a non-empty prompt for the card's usage example.")
    reports: list[EvalReport] = [load_eval_report(path) for path in eval_paths or []]
    training = load_training_summary(trainer_state) if trainer_state is not None else None
    if tokenizer is not None and not (Path(tokenizer) / "tokenizer_config.json").is_file():
        raise CardInputError(f"--tokenizer {tokenizer}: no tokenizer_config.json there; pass a tokenizer folder.")
    overrides = _check_decoding_overrides(decoding_defaults)
    if push:  # before any heavy work: without a token the run would end in a failed push
        token = resolve_token(token, "Nothing was written.")

    source, source_hub_id = _resolve_source(model)
    if source_hub_id is None:  # a Hub snapshot's files are links into the download cache, by design
        check_own_files(source, "--model")
    if tokenizer is not None:
        check_own_files(Path(tokenizer), "--tokenizer")
    _check_reports_are_of(reports, source, allow_eval_mismatch)
    is_adapter = (source / "adapter_config.json").is_file()
    if not is_adapter and not (source / "config.json").is_file():
        raise CardInputError(
            f"--model {model}: no config.json (model) or adapter_config.json (LoRA adapter) in {source}; pass a "
            "checkpoint folder saved with save_pretrained."
        )
    if is_adapter and overrides:
        raise CardInputError(
            "decoding defaults (" + ", ".join(DECODING_OVERRIDES[key] for key in overrides) + ") live in the base "
            "model's generation_config.json; an adapter cannot set them. Publish the merged model instead."
        )
    _check_out(out, source, overwrite)
    if training is None and (source / "trainer_state.json").is_file():
        training = load_training_summary(source / "trainer_state.json")

    target = out.resolve()  # `out` may be spelled ".", whose parent is itself
    target.parent.mkdir(parents=True, exist_ok=True)
    common = dict(
        repo_id=repo_id,
        license=license,
        datasets=datasets,
        eval_reports=reports,
        training=training,
        example_prompt=example_prompt,
        name=target.name,
    )
    official = False
    with staged_output(target, "--out") as staging:  # moved into place only when complete
        staging.mkdir()
        if is_adapter:
            kind = "adapter"
            base_id, base_info, notes = _write_adapter(source, staging, base_model, tokenizer)
            card = build_adapter_card(staging, base_model=base_id, **common, **base_info)
        else:
            kind = "model"
            official, _, notes = _write_model(source, staging, tokenizer, overrides)
            card = build_model_card(staging, base_model=base_model or source_hub_id, official_source=official, **common)
        card.save(staging / "README.md")
        if target.exists():  # empty, or a flat folder of files with --overwrite (checked above): its files go
            for entry in target.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    files = sorted(str(path.relative_to(target)) for path in target.rglob("*") if path.is_file())
    result = PublishResult(folder=out, kind=kind, files=files, card=card, official_source=official, notes=notes)
    if push:
        pushed = push_folder(out, repo_id, private=private, token=token, endpoint=endpoint)
        result.commit_url = pushed.commit_url
        if pushed.deleted:
            result.notes.append(
                f"deleted from {repo_id} the model files of an earlier push that this folder does not have: "
                + ", ".join(pushed.deleted)
            )
        if pushed.kept:
            result.notes.append(
                f"kept in {repo_id} files that are not part of the model: {', '.join(pushed.kept)} (delete the "
                f"stale ones with `hf repos delete-files {repo_id} PATH...`)"
            )
    return result


# ------------------------------------------------------------------------------------------------------ push
def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def resolve_token(token: str | None, consequence: str) -> str:
    """`token`, or the one `huggingface_hub` finds (HF_TOKEN, `hf auth login`); `PushError` when there is none."""
    try:
        token = token or get_token()
    except Exception as error:  # noqa: BLE001 - e.g. a failed OIDC token exchange
        raise PushError(
            f"--push could not obtain a Hugging Face token ({type(error).__name__}: {error}). {consequence}"
        ) from None
    if not token:
        raise PushError(
            "--push needs a Hugging Face access token with write permission, and none is set: run `hf auth login` "
            f"or set the HF_TOKEN environment variable, then run the command again. {consequence}"
        )
    return token


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Create `repo_id` if needed (`HfApi.create_repo`) and upload `folder` to it (`HfApi.upload_folder`), deleting
    in the same commit the repository's model files (`MODEL_FILE_PATTERNS`) that the folder does not have. Every
    failure (no token, rejected token, no network...) is one `PushError` message."""
    from ..version import __version__

    folder = Path(folder)
    check_repo_id(repo_id)
    later = f"The folder {folder} is complete: push it later with `hf upload {repo_id} {folder} .`."
    token = resolve_token(token, later)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        deleted, kept = _stale_remote_files(api.list_repo_files(repo_id, repo_type="model"), folder)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            delete_patterns=[glob.escape(path) for path in deleted] or None,
            commit_message=commit_message or f"Publish ReFusion model (refusion_hf {__version__})",
        )
    except HfHubHTTPError as error:
        status = error.response.status_code if getattr(error, "response", None) is not None else None
        detail = error.server_message or str(error).splitlines()[0]
        if status == 401:
            reason = (
                "the token was rejected (401 Unauthorized): it is invalid or expired; run `hf auth login` with a "
                "write token or set HF_TOKEN"
            )
        elif status == 403:
            reason = (
                f"the token may not write to {repo_id.split('/')[0]!r} (403 Forbidden): use a token with write "
                "permission, or a namespace you own in --repo-id"
            )
        else:
            reason = f"the Hub answered HTTP {status}: {detail}"
        raise PushError(f"pushing to {repo_id} at {api.endpoint} failed: {reason}. {later}") from None
    except OfflineModeIsEnabled:
        raise PushError(f"pushing to {repo_id} is impossible while HF_HUB_OFFLINE is set; unset it. {later}") from None
    except _network_errors() as error:
        raise PushError(
            f"could not reach the Hub at {api.endpoint} to push {repo_id} ({type(error).__name__}: {error}); check "
            f"the network connection (and HF_ENDPOINT if set). {later}"
        ) from None
    except Exception as error:  # noqa: BLE001 - the boundary with a remote service: one message, no traceback
        raise PushError(f"pushing to {repo_id} failed ({type(error).__name__}: {error}). {later}") from None
    return PushResult(commit_url=str(info.commit_url), deleted=deleted, kept=kept)


def _managed_patterns() -> tuple[str, ...]:
    from ..modeling import RefusionConfig, RefusionForCausalLM

    return (*MODEL_FILE_PATTERNS, *collect_bundle_modules(RefusionConfig, RefusionForCausalLM))


def _stale_remote_files(remote: list[str], folder: Path) -> tuple[list[str], list[str]]:
    """Split the repository's files that `folder` does not have into model files (to delete) and others (kept).
    `.gitattributes` is the Hub's own and never listed."""
    local = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
    extra = sorted(set(remote) - local - {".gitattributes"})
    managed = _managed_patterns()
    deleted = [
        path
        for path in extra
        if ("/" not in path and any(fnmatch.fnmatchcase(path, p) for p in managed))
        or path.startswith(f"{CUSTOM_GENERATE_DIR}/")
    ]
    return deleted, [path for path in extra if path not in deleted]
