"""`refusion`, an lm-evaluation-harness model: lm-eval's `HFLM` with ReFusion's decoding knobs and speed figures.

lm-eval does the rest (`HFLM`): loading (`pretrained`, `dtype`, `peft`, ...), tokenization, left-padded batches,
chat templates (`--apply_chat_template`, `chat_template_args`, `enable_thinking`, as the authors evaluate), stop
sequences, tasks, filters and metrics. Added here:

* every model folder loads as the installed package's `RefusionConfig` / `RefusionForCausalLM`, whatever its
  config.json says: official checkpoints (`model_type: qwen3` plus a mask token, with or without the official
  `auto_map`, whose remote code does not import on transformers 5) and the folders this package writes alike. So
  decoding is always ReFusion's from the installed decoder, and no code of the folder runs: not its modeling or
  configuration files, nor its `custom_generate/` (transformers would run that in place of `generate` for a model
  loaded with `trust_remote_code=True`). `trust_remote_code` defaults to False, as in HFLM; True is passed on to
  the tokenizer only (`AutoTokenizer` then runs a tokenizer `auto_map`'s code and the configuration code it needs),
  with a warning that says so. lm-eval's own `hf` model is the one that runs a folder's modeling code. A tokenizer
  that transformers loads only by running its code, without `trust_remote_code=True`, is a one-line `InputError`
  (`check_tokenizer`, `_create_tokenizer`), not transformers' traceback;
* model args: every tunable ReFusion knob (`DECODING_KNOBS`, from their declaration in `KNOBS`), `decoding`, and
  `preset` (the authors' per-task settings, `DECODING_PRESETS`; explicit knobs win over it), validated against
  the folder's generation_config.json before anything loads (`check_folder_args`);
* `continuous_batching=True`: each task's requests go to `model.generate_batch` (at most `batch_size` rows at
  once, a finished row replaced by the next request at once) instead of HFLM's fixed batches; prompts, lengths,
  sampling arguments and the cut at `until` are HFLM's (lm-eval's `normalize_gen_kwargs`,
  `handle_stop_sequences`, `postprocess_generated_text`). The answers are the same; stop strings are applied
  after decoding rather than during it (a continuous batch cannot call criteria batch-wide), so a row runs on to
  its EOS or `max_gen_toks`;
* per task, generated tokens, forward passes, tokens per forward and tokens/s of `generate_until`, written into the
  results JSON by `refusion lm-eval` (`results["refusion_decoding"]`) and kept on `self.decoding_stats`. With
  batches, a forward serves every row: tokens per forward is then the batch's generated tokens per batched forward;
* under `accelerate launch --num_processes N` (on CPU with `ACCELERATE_USE_CPU=1`), each process decodes its share
  of the requests, also where HFLM would have every process decode everything (a process that sees fewer than 2
  GPUs: on CPU), and the speed figures are those of all processes together.

Loglikelihood requests are scored with the causal forward (HFLM's own): the log-probability of each continuation
token given everything before it, the quantity ReFusion's verification step uses. The authors' harness instead
estimates a masked-diffusion likelihood by Monte-Carlo (mask random subsets of the continuation and average the
weighted MDM loss over many draws): that is a bound on a different model of the sequence, costs dozens of forwards
per request, and is not offered here.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import GenerationConfig

from .._compat.lm_eval import set_rank, stock_model_generate
from ..errors import InputError, first_line
from ..generation.refusion_generate import answer_lengths, eos_token_ids, merge_generation_config
from ..generation.refusion_generation_config import DECODING_KNOBS, RefusionGenerationConfig, preset_settings
from ..modeling import RefusionConfig, RefusionForCausalLM

INSTANCES: list[RefusionLM] = []  # models lm-eval built from `--model refusion`: `refusion lm-eval` reads their figures
KNOBS = (*DECODING_KNOBS, "decoding")  # model args that go to generate()


@dataclass
class GenerateRecord:
    """One timed `generate` call of a batch."""

    sequences: torch.LongTensor | list[str]  # [B, W + N]; a continuous batch: the answers
    answer_lengths: list[int]  # per row, generated tokens up to and including its end
    row_forward_passes: list[int] | None  # per row, the forward passes it took part in (None: not told apart)
    forward_passes: int  # model forward calls of the call (a batched forward counts once)
    seconds: float
    revised_tokens: int | None = None  # positions remasked by revisions (`remask_threshold`); None: not reported


@register_model("refusion")
class RefusionLM(HFLM):
    AUTO_MODEL_CLASS = RefusionForCausalLM  # HFLM loads `pretrained` with it: never the folder's auto_map classes

    def __init__(
        self,
        pretrained,
        preset: str | None = None,
        continuous_batching: bool = False,
        backend: str = "causal",
        trust_remote_code: bool = False,
        **kwargs,
    ):
        knobs = {name: kwargs.pop(name) for name in KNOBS if kwargs.get(name) is not None}
        preset_knobs = self.check_model_args(preset=preset, continuous_batching=continuous_batching, backend=backend)
        self.check_folder_args(pretrained, preset=preset, **knobs)
        if trust_remote_code:
            warnings.warn(
                "trust_remote_code=True reaches the tokenizer only (AutoTokenizer may run the folder's tokenizer and "
                "configuration code): the `refusion` model always loads the installed refusion_hf classes and "
                "decodes with them, so the folder's modeling code and custom_generate/ do not run (lm-eval's `hf` "
                "model runs them).",
                stacklevel=2,
            )
        self.continuous_batching = continuous_batching
        super().__init__(pretrained=pretrained, backend=backend, trust_remote_code=trust_remote_code, **kwargs)
        self._share_requests_with_the_launched_processes(tensor_parallel=kwargs.get("tp_plan") is not None)
        preset_knobs.pop("max_new_tokens", None)  # the task's max_gen_toks decides the length
        self.decoding_kwargs = {**preset_knobs, **knobs}
        self.preset = preset
        self.decoding_stats: dict[str, dict[str, float]] = defaultdict(
            lambda: {"requests": 0, "tokens": 0, "forward_passes": 0, "seconds": 0.0}
        )
        self._task = None

    @staticmethod
    def check_model_args(preset=None, continuous_batching=False, backend="causal", **_) -> dict:
        """The model args of this class's own, checked before anything loads (`refusion lm-eval` calls it before
        lm-eval indexes its tasks); an `InputError` (a ValueError) is one line there. Returns the preset's knobs."""
        if not isinstance(continuous_batching, bool):
            raise InputError(f"model arg continuous_batching must be True or False, got {continuous_batching!r}.")
        if backend != "causal":
            raise InputError(f"model arg backend={backend!r}: a ReFusion model is a causal LM; drop the argument.")
        try:
            return preset_settings(preset) if preset is not None else {}
        except ValueError as error:
            raise InputError(f"model arg preset: {error}") from None

    @staticmethod
    def check_folder_args(pretrained, preset=None, **model_args) -> None:
        """The decoding knobs among the model args (and `preset`), merged over the folder's generation_config.json as
        `generate` merges them (`merge_generation_config`) and validated before anything loads: a value out of range
        (`slot_size=0`) failed at the first request, with a traceback. A `InputError`, one line in `refusion
        lm-eval`."""
        if not isinstance(pretrained, (str, os.PathLike)):  # a model object: HFLM's, nothing of a folder to check
            return
        folder = Path(pretrained)
        knobs = {name: value for name, value in model_args.items() if name in KNOBS and value is not None}
        settings = {**(preset_settings(preset) if preset is not None else {}), **knobs}
        settings.pop("max_new_tokens", None)  # the task's max_gen_toks decides the length
        saved = _json_object(folder / "generation_config.json")
        stand_in = SimpleNamespace(generation_config=GenerationConfig.from_dict(saved) if saved else None,
                                   config=SimpleNamespace(eos_token_id=None))  # fmt: skip
        try:
            merge_generation_config(stand_in, None, settings)
        except (ValueError, TypeError) as error:
            given = ", ".join(f"{name}={value}" for name, value in {"preset": preset, **knobs}.items()
                              if value is not None)  # fmt: skip
            if given:
                raise InputError(
                    f"--model_args {given}: {first_line(error)} Fix it, or drop it (the checkpoint's "
                    "generation_config.json and the defaults then apply)."
                ) from None
            raise InputError(
                f"--model_args pretrained={pretrained}: the folder's generation_config.json does not validate "
                f"({first_line(error)}); fix it, or pass the decoding knobs as model args."
            ) from None

    def _share_requests_with_the_launched_processes(self, tensor_parallel: bool) -> None:
        """Under `accelerate launch` with N processes, each process decodes its 1/N of the requests (lm-eval gathers
        the answers on process 0). HFLM shares them only when a process sees 2+ GPUs, so on CPU (`ACCELERATE_USE_CPU=1`:
        gloo) every process would decode every request; it is set up here whatever the device. A launch
        that accelerate does not see as distributed is refused (each process would evaluate alone)."""
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched <= 1 or self.world_size > 1 or tensor_parallel:  # tensor parallel: every process, every request
            return
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None:
            raise InputError(
                f"{launched} processes were launched (WORLD_SIZE) but accelerate sees no distributed setup, so each "
                "would evaluate every request alone. Without GPUs, launch with ACCELERATE_USE_CPU=1 (gloo): "
                "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m lm_eval --model refusion "
                "...`."
            )
        set_rank(self, accelerator.process_index, accelerator.num_processes)

    def _get_config(self, pretrained, *, revision="main", trust_remote_code=False, gguf_file=None, subfolder=""):
        """The folder's config as a `RefusionConfig` (an official `model_type: qwen3` config included), without its
        `auto_map`'s code."""
        self._config = RefusionConfig.from_pretrained(
            pretrained, revision=revision, gguf_file=gguf_file, subfolder=subfolder
        )

    def _create_tokenizer(self, pretrained, tokenizer, *args, **kwargs):
        """HFLM's; a tokenizer that transformers loads only by running its own code (a tokenizer_config.json
        `auto_map` with no built-in class to fall back on) without `trust_remote_code=True` is one `InputError`
        naming the folder and the fix, instead of transformers' traceback."""
        try:
            super()._create_tokenizer(pretrained, tokenizer, *args, **kwargs)
        except ValueError as error:
            raise _tokenizer_code_error(error, pretrained, tokenizer) from None

    @staticmethod
    def check_tokenizer(pretrained, tokenizer=None, trust_remote_code=False, revision="main", subfolder="", **_):
        """`_create_tokenizer`'s refusal, before anything loads (`refusion lm-eval` calls it before lm-eval indexes
        its tasks and HFLM loads the weights): the tokenizer is loaded once without remote code. Other failures are
        left to HFLM's own load, which reports them."""
        if trust_remote_code is True:  # the folder's tokenizer code runs in HFLM's load, once
            return
        source = tokenizer if tokenizer is not None else pretrained
        if not isinstance(source, (str, os.PathLike)):
            return
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(source, trust_remote_code=False, revision=revision, subfolder=subfolder or "")
        except ValueError as error:
            raised = _tokenizer_code_error(error, pretrained, tokenizer)
            if isinstance(raised, InputError):
                raise raised from None
        except Exception:  # noqa: BLE001 - HFLM's load reports it
            return

    def _create_model(self, *args, trust_remote_code=False, **kwargs):
        """HFLM's, with `AUTO_MODEL_CLASS` and without remote code: for our class, `from_pretrained(...,
        trust_remote_code=True)` would run the folder's `custom_generate/generate.py` in place of `generate`."""
        super()._create_model(*args, trust_remote_code=False, **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        model = super().create_from_arg_string(arg_string, additional_config)
        INSTANCES.append(model)
        return model

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        model = super().create_from_arg_obj(arg_dict, additional_config)
        INSTANCES.append(model)
        return model

    def generate_until(self, requests, disable_tqdm: bool = False):
        """HFLM's, one task at a time (so each task's speed is measured on its own), answers in request order. Under a
        launch, lm-eval pads a process that has fewer requests than another by repeating its last one (the same
        request object beyond its `repeats` copies): those copies get the answer already decoded instead of being
        decoded and counted again, so the speed figures are those of the real requests."""
        copy_of = self._padding_copies(requests) if self.world_size > 1 else {}
        by_task = defaultdict(list)
        for index, request in enumerate(requests):
            if index not in copy_of:
                by_task[request.task_name].append(index)
        answers = [None] * len(requests)
        for task, indices in by_task.items():
            self._task = task
            start = time.perf_counter()
            group = [requests[i] for i in indices]
            decoded = (
                self._generate_continuously(group)
                if self.continuous_batching
                else super().generate_until(group, disable_tqdm)
            )
            for index, answer in zip(indices, decoded):
                answers[index] = answer
            stats = self.decoding_stats[task]
            stats["seconds"] += time.perf_counter() - start
            stats["requests"] += len(indices)
        self._task = None
        for index, original in copy_of.items():
            answers[index] = answers[original]
        return answers

    @staticmethod
    def _padding_copies(requests) -> dict[int, int]:
        """For each of lm-eval's padding entries (an occurrence of a request object beyond its `repeats`), the index
        of the occurrence it repeats."""
        occurrences = defaultdict(list)
        copy_of = {}
        for index, request in enumerate(requests):
            seen = occurrences[id(request)]
            repeats = max(int(getattr(request, "repeats", 1) or 1), 1)
            if len(seen) >= repeats:
                copy_of[index] = seen[len(seen) % repeats]
            seen.append(index)
        return copy_of

    def _generate_continuously(self, requests) -> list[str]:
        """One task's requests through `model.generate_batch` (see the module docstring); answers in request
        order."""
        answers, lengths, forwards = self.stream_requests(requests)
        self.decoding_stats[self._task]["tokens"] += sum(lengths)
        self.decoding_stats[self._task]["forward_passes"] += forwards
        return answers

    def stream_requests(self, requests, decoding_kwargs: dict | None = None) -> tuple[list[str], list[int], int]:
        """`requests` through `model.generate_batch`, grouped by generation arguments, with `decoding_kwargs`
        (default: the model args' knobs): the answers in request order, each request's generated tokens, and the
        model's forward passes (a batched forward counts once)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        rows = self.batch_size if isinstance(self.batch_size, int) else 16
        config = ContinuousBatchingConfig(max_requests_per_batch=rows)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[repr(sorted(request.args[1].items()))].append(index)
        answers: list[str | None] = [None] * len(requests)
        lengths = [0] * len(requests)
        decoding_kwargs = self.decoding_kwargs if decoding_kwargs is None else decoding_kwargs
        forwards = [0]
        hook = self.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        try:
            for indices in groups.values():
                kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                if not kwargs.get("do_sample"):
                    kwargs.pop("temperature", None)  # greedy, as HFLM's generate call makes it
                prompts = [
                    self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen_toks)
                    for i in indices
                ]
                # The settings travel in a generation config: transformers' own generate_batch (autoregressive
                # decoding) reads no other keyword than max_new_tokens.
                generation_config = copy.deepcopy(
                    RefusionGenerationConfig.from_generation_config(self.model.generation_config)
                )
                settings = {**decoding_kwargs, **kwargs, "pad_token_id": self.tokenizer.pad_token_id}
                unused = generation_config.update(**settings)
                if unused:
                    raise ValueError(
                        f"generation arguments {sorted(unused)} are not fields of the model's generation config, so "
                        "generate_batch would ignore them; drop them from the task's generation_kwargs or model args."
                    )
                results = self.model.generate_batch(
                    prompts,
                    generation_config=generation_config,
                    continuous_batching_config=config,
                    max_new_tokens=max_gen_toks,
                )
                for position, index in enumerate(indices):
                    tokens = results[f"req_{position}"].generated_tokens
                    lengths[index] = len(tokens)
                    text = postprocess_generated_text(
                        generation=self.tok_decode(tokens), stop=until, think_end_token=None
                    )
                    answers[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
        finally:
            hook.remove()
        return answers, lengths, forwards[0]

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        record = self.timed_generate(context, max_length, stop, {**self.decoding_kwargs, **generation_kwargs})
        stats = self.decoding_stats[self._task]
        stats["tokens"] += sum(record.answer_lengths)
        stats["forward_passes"] += record.forward_passes
        return record.sequences

    def timed_generate(self, context, max_length, stop, generation_kwargs: dict) -> GenerateRecord:
        """HFLM's generate call (its stopping criteria, pad id, length) with `generation_kwargs`, timed."""
        start = time.perf_counter()
        output = stock_model_generate(
            self, context, max_length, stop, **generation_kwargs, return_dict_in_generate=True
        )
        seconds = time.perf_counter() - start
        revised = None
        if hasattr(output, "forward_passes_per_row"):  # ReFusion decoding
            lengths = output.answer_lengths.tolist()
            row_passes, passes = output.forward_passes_per_row.tolist(), int(output.num_forward_passes)
            revised = int(output.revised_tokens.sum())
        else:  # decoding="autoregressive": one forward per generated position of the batch, rows until their end
            lengths = answer_lengths(
                output.sequences[:, context.shape[1] :], set(eos_token_ids(self.model.generation_config))
            )
            row_passes, passes = [max(n, 1) for n in lengths], output.sequences.shape[1] - context.shape[1]
        return GenerateRecord(output.sequences, lengths, row_passes, passes, max(seconds, 1e-9), revised)

    def decoding_report(self) -> dict:
        """Per task: requests, generated tokens, forward passes, tokens per forward, tokens/s; and the knobs. Under
        `accelerate launch`, of every process together (every process must call it): requests, tokens and forward
        passes add up, seconds is the slowest process's (they decode at the same time), so tokens/s is the launch's
        throughput."""
        per_process = [{task: dict(stats) for task, stats in self.decoding_stats.items()}]
        if self.world_size > 1:
            from accelerate.utils import gather_object

            per_process = gather_object(per_process)
        merged: dict[str, dict[str, float]] = {}
        for process_stats in per_process:
            for task, stats in process_stats.items():
                total = merged.setdefault(task, {"requests": 0, "tokens": 0, "forward_passes": 0, "seconds": 0.0})
                for key in ("requests", "tokens", "forward_passes"):
                    total[key] += stats[key]
                total["seconds"] = max(total["seconds"], stats["seconds"])
        tasks = {}
        for task, stats in merged.items():
            tasks[task] = {
                **stats,
                "tokens_per_forward": stats["tokens"] / stats["forward_passes"] if stats["forward_passes"] else None,
                "tokens_per_second": stats["tokens"] / stats["seconds"] if stats["seconds"] else None,
            }
        return {"preset": self.preset, "settings": self.decoding_kwargs, "tasks": tasks}


def _json_object(path: Path) -> dict:
    """The JSON object in `path`; empty when there is none (a Hub id, no such file: checked where it loads)."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _tokenizer_code_error(error: ValueError, pretrained, tokenizer) -> ValueError:
    """transformers' refusal to load a tokenizer without running its code, as a one-line `InputError` with the fix;
    any other error as it is."""
    if "trust_remote_code=True" not in str(error):
        return error
    named = isinstance(tokenizer, (str, os.PathLike))  # else the pretrained folder's tokenizer
    flag, source = ("tokenizer", tokenizer) if named else ("pretrained", pretrained)
    auto_map = _json_object(Path(str(source)) / "tokenizer_config.json").get("auto_map")
    return InputError(
        f"--model_args {flag}={source}: the tokenizer needs its own code (tokenizer_config.json auto_map {auto_map}), "
        "which transformers runs only with trust_remote_code=True: add trust_remote_code=True to --model_args if you "
        "trust that code, or remove auto_map from tokenizer_config.json if tokenizer.json is the whole tokenizer."
    )
