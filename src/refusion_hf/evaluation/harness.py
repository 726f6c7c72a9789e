"""ReFusion decoding and autoregressive decoding of the same weights (or of a baseline model), side by side on one
lm-eval task.

lm-eval does the evaluation. `HFLM` (through `RefusionLM`) tokenizes, applies the chat template, batches with left
padding, stops at the task's `until` strings and cuts the answers there; `lm_eval.evaluator.evaluate` applies the
task's filters and metrics. Added here is what makes the comparison fair:

* `SideBySideLM._model_generate` decodes every batch with each decoding back to back, alternating which goes first
  from batch to batch, so that a slow spell of a shared machine hits both alike; with `timing_repeats` > 1 each
  decoding runs that many times per batch (interleaved, same seed, hence the same tokens: checked) and its time is
  the fastest repeat (the usual defence of micro-benchmarks, `timeit`, against stalls caused by other processes);
* the first `evaluate` run scores the first decoding's answers; every other decoding is scored by a second run in
  which the same batches return that decoding's recorded sequences (no decoding happens), so lm-eval scores each
  decoding exactly as it would score a model of its own;
* speed: generated tokens, forward passes and seconds of every timed call (`throughput`);
* the accuracy difference with a 95% interval paired over the same problems (`paired_difference`);
* `continuous_batching`: each decoding serves the task's whole request stream through `generate_batch` (at most
  `batch_size` rows at once, a finished row replaced by the next problem at once), timed as one call, the decodings
  in turn (the order alternating between repeats); tokens per forward are then the stream's generated tokens per
  batched forward;
* `baseline_model`: the autoregressive decoding runs on another model that encodes text the same way (e.g. the
  controlled AR baseline trained like the ReFusion model), still batch by batch beside ReFusion decoding.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..generation.refusion_generation_config import DECODING_KNOBS, preset_settings, sampling_arguments
from .lm_eval_model import GenerateRecord, RefusionLM
from .paired_difference import paired_difference
from .sandbox import require_opt_in
from .tasks import executes_code

DECODINGS = ("refusion", "autoregressive")
WARMUP_TOKENS = 8


@dataclass
class EvalSettings:
    max_new_tokens: int | None = None  # None: the task's max_gen_toks
    batch_size: int = 1
    seed: int = 0
    temperature: float | None = None
    knobs: dict[str, Any] = field(default_factory=dict)  # ReFusion decoding knobs (DECODING_KNOBS) to set
    preset: str | None = None  # DECODING_PRESETS: its knobs, unless in `knobs` (the task decides the length)
    apply_chat_template: bool = True
    warmup: bool = True
    timing_repeats: int = 1  # decode each batch this many times per decoding; its time is the fastest
    continuous_batching: bool = False  # the task's problems through generate_batch, batch_size rows at once

    def __post_init__(self):
        unknown = sorted(set(self.knobs) - set(DECODING_KNOBS))
        if unknown:
            raise ValueError(f"EvalSettings.knobs: unknown decoding knobs {unknown}; choose from {DECODING_KNOBS}.")

    def refusion_kwargs(self) -> dict:
        kwargs = preset_settings(self.preset) if self.preset is not None else {}
        kwargs.pop("max_new_tokens", None)  # the task's max_gen_toks (or --max-new-tokens) decides the length
        kwargs.update({name: value for name, value in self.knobs.items() if value is not None})
        return kwargs

    def generation_kwargs(self) -> dict:
        """Overrides of the task's generation arguments (lm-eval's names)."""
        kwargs = sampling_arguments(self.temperature)
        if self.max_new_tokens is not None:
            kwargs["max_gen_toks"] = self.max_new_tokens
        return kwargs


def check_decodings(decodings: Sequence[str]) -> tuple[str, ...]:
    """`decodings` as a tuple, or a ValueError unless it is a non-empty subset of DECODINGS without repeats."""
    decodings = tuple(decodings)
    if not decodings or len(set(decodings)) != len(decodings) or not set(decodings) <= set(DECODINGS):
        raise ValueError(f"--decodings must be a non-empty subset of {','.join(DECODINGS)}, got {decodings!r}.")
    return decodings


def throughput(records: list[GenerateRecord]) -> dict:
    """Speed of a set of timed calls: tokens/s (overall and median call), tokens per forward (all tokens over all
    per-row forward passes, and the mean of the per-row ratios), forward passes, tokens, sequences, seconds."""
    tokens = sum(sum(r.answer_lengths) for r in records)
    # A continuous batch does not tell rows' forward passes apart: its rows share every batched forward.
    row_passes = sum(r.forward_passes if r.row_forward_passes is None else sum(r.row_forward_passes) for r in records)
    seconds = sum(r.seconds for r in records)
    ratios = [n / p for r in records for n, p in zip(r.answer_lengths, r.row_forward_passes or ())]
    return {
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "median_call_tokens_per_second": statistics.median(sum(r.answer_lengths) / r.seconds for r in records)
        if records
        else 0.0,
        "tokens_per_forward": tokens / row_passes if row_passes else 0.0,
        "mean_tokens_per_forward": statistics.fmean(ratios) if ratios else 0.0,
        "num_forward_passes": sum(r.forward_passes for r in records),
        "num_revised_tokens": None
        if any(r.revised_tokens is None for r in records)
        else sum(r.revised_tokens for r in records),
        "num_tokens": tokens,
        "num_sequences": sum(len(r.answer_lengths) for r in records),
        "seconds": seconds,
    }


class SideBySideLM(RefusionLM):
    """`RefusionLM` that decodes every batch with several decodings (see the module docstring)."""

    def __init__(
        self, model, tokenizer, settings: EvalSettings, decodings: Sequence[str], progress=None, baseline_model=None
    ):
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=settings.batch_size,
            continuous_batching=settings.continuous_batching,
        )
        self.settings = settings
        self.decoding_models = {"refusion": model, "autoregressive": baseline_model or model}
        self.decodings = check_decodings(decodings)
        self.progress = progress
        self.records: dict[str, list[GenerateRecord]] = {d: [] for d in self.decodings}
        self.row_lengths: dict[str, dict[tuple[int, ...], int]] = {d: {} for d in self.decodings}
        self._recorded: dict[str, dict[tuple, list[torch.LongTensor]]] = {d: defaultdict(list) for d in self.decodings}
        self.replaying: str | None = None  # while set, batches return this decoding's recorded sequences
        self._batches = 0
        self._warm = not settings.warmup

    def _kwargs(self, decoding: str) -> dict:
        if decoding == "refusion":
            return self.settings.refusion_kwargs()
        return {"decoding": "autoregressive"}

    @contextlib.contextmanager
    def _running(self, decoding: str):
        """HFLM's `self.model` is the model `decoding` runs on for the duration of the block."""
        self._model = self.decoding_models[decoding]
        try:
            yield
        finally:
            self._model = self.decoding_models["refusion"]

    def _decode(self, decoding: str, context, max_length, stop, generation_kwargs: dict) -> GenerateRecord:
        """One timed `generate` of a fixed batch with `decoding`."""
        with self._running(decoding):
            return self.timed_generate(context, max_length, stop, {**self._kwargs(decoding), **generation_kwargs})

    def _stream(self, decoding: str, requests) -> GenerateRecord:
        """One timed `generate_batch` of `requests` with `decoding`."""
        with self._running(decoding):
            start = time.perf_counter()
            answers, lengths, forwards = self.stream_requests(requests, self._kwargs(decoding))
            seconds = time.perf_counter() - start
        return GenerateRecord(answers, lengths, None, forwards, max(seconds, 1e-9))

    def _side_by_side(self, key, prompts, decode: Callable[[str], GenerateRecord], warm_up: Callable[[str], object],
                      order: Callable[[int], Sequence[str]], seed: int):  # fmt: skip
        """Every decoding `timing_repeats` times in `order(repeat)`, each call seeded with `seed`: the first record of
        each (with the fastest time) is kept, under `key`, and each prompt's answer length. Returns the first
        decoding's sequences, which lm-eval scores first."""
        if not self._warm:  # first calls pay one-off costs (allocations, lazy inits): keep them out of the timing
            for decoding in self.decodings:
                warm_up(decoding)
            self._warm = True
        kept: dict[str, GenerateRecord] = {}
        for repeat in range(self.settings.timing_repeats):
            for decoding in order(repeat):
                torch.manual_seed(seed)
                record = decode(decoding)
                first = kept.setdefault(decoding, record)
                if isinstance(record.sequences, torch.Tensor):  # fixed batches: tokens; continuous: answers
                    same = torch.equal(record.sequences, first.sequences)
                else:
                    same = record.sequences == first.sequences
                if not same:
                    raise RuntimeError(
                        f"{decoding} decoding gave different tokens when repeated with the same seed, so repeats "
                        "cannot be timed as one: use --timing-repeats 1."
                    )
                first.seconds = min(first.seconds, record.seconds)
        for decoding, record in kept.items():
            self.records[decoding].append(record)
            self._recorded[decoding][key].append(record.sequences)
            self.row_lengths[decoding].update(zip(prompts, record.answer_lengths))
        if self.progress is not None:
            self.progress(sum(len(r.answer_lengths) for r in self.records[self.decodings[0]]))
        return self._recorded[self.decodings[0]][key].pop(0)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """A fixed batch: the decodings back to back, which goes first alternating from batch to batch."""
        key = (context.cpu().numpy().tobytes(), tuple(context.shape), max_length, tuple(stop),
               repr(sorted(generation_kwargs.items())))  # fmt: skip
        if self.replaying is not None:
            recorded = self._recorded[self.replaying][key]
            if not recorded:
                raise RuntimeError("lm-eval asked for a batch that was not decoded in the first run")
            return recorded.pop(0)
        batch = self._batches
        self._batches += 1
        short = min(max_length, context.shape[1] + WARMUP_TOKENS)
        return self._side_by_side(
            key,
            [tuple(row[mask].tolist()) for row, mask in zip(context, self._context_mask.bool())],
            decode=lambda decoding: self._decode(decoding, context, max_length, stop, generation_kwargs),
            warm_up=lambda decoding: self._decode(decoding, context, short, stop, generation_kwargs),
            order=lambda repeat: self.decodings if batch % 2 == 0 else self.decodings[::-1],
            seed=self.settings.seed + batch,
        )

    def _generate_continuously(self, requests) -> list[str]:
        """`continuous_batching`: the task's requests through `generate_batch` with each decoding in turn, which
        goes first alternating from repeat to repeat; a replay returns its decoding's recorded answers."""
        key = tuple((request.args[0], repr(sorted(request.args[1].items()))) for request in requests)
        if self.replaying is not None:
            return self._recorded[self.replaying][key].pop(0)
        return self._side_by_side(
            key,
            [tuple(self.tok_encode(request.args[0])) for request in requests],
            decode=lambda decoding: self._stream(decoding, requests),
            warm_up=lambda decoding: self._stream(decoding, requests[:1]),
            order=lambda repeat: self.decodings if repeat % 2 == 0 else self.decodings[::-1],
            seed=self.settings.seed,
        )

    def tok_batch_encode(self, strings, *args, **kwargs):
        """HFLM's; the attention mask of the batch is kept to tell each row's prompt tokens from the padding."""
        input_ids, self._context_mask = super().tok_batch_encode(strings, *args, **kwargs)
        return input_ids, self._context_mask

    def request_length(self, decoding: str, context: str) -> int | None:
        """Generated tokens of the request with this context (None when it cannot be told)."""
        input_ids, _ = self.tok_batch_encode([context])
        return self.row_lengths[decoding].get(tuple(input_ids[0].tolist()))


def primary_filter(task) -> str:
    """The filter whose first metric is reported as `accuracy` (e.g. GSM8K's strict-match)."""
    filters = task.config.filter_list
    return filters[0]["name"] if filters else "none"


def evaluate_decodings(
    model,
    tokenizer,
    task,
    settings: EvalSettings,
    decodings: Sequence[str] = DECODINGS,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
    baseline_model=None,
) -> dict:
    """Decode `task` (an lm-eval Task) with each of `decodings` side by side and score each with lm-eval.

    Returns per decoding: accuracy (the primary metric), lm-eval's metrics of every filter, speed, per-family
    accuracy (the docs' `family` field when they have one); `speedup` and `accuracy_difference` (ReFusion minus
    autoregressive) when both ran; the settings; and per problem its input, reference and each decoding's answer.
    With `baseline_model`, the autoregressive decoding runs on it (same tokenizer) instead of on `model`.
    """
    from lm_eval.evaluator import evaluate

    decodings = check_decodings(decodings)
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {settings.batch_size}.")
    if settings.timing_repeats < 1:
        raise ValueError(f"--timing-repeats must be >= 1, got {settings.timing_repeats}.")
    runs_code = executes_code(task)
    if runs_code:
        require_opt_in()  # before any decoding, not when the first answer is scored
    task.set_config(key="generation_kwargs", value=settings.generation_kwargs(), update=True)
    if baseline_model is not None and "autoregressive" not in decodings:
        raise ValueError("a baseline model runs the autoregressive decoding, which `decodings` leaves out.")
    lm = SideBySideLM(model, tokenizer, settings, decodings, progress=progress, baseline_model=baseline_model)
    name = task.task_name
    filter_name = primary_filter(task)
    results: dict = {}
    per_problem: dict[int, dict] = {}
    for decoding in decodings:
        lm.replaying = None if decoding == decodings[0] else decoding
        out = evaluate(
            lm,
            {"tasks": {name: task}, "groups": {}, "group_map": {}},
            limit=limit,
            log_samples=True,
            apply_chat_template=settings.apply_chat_template,
            fewshot_as_multiturn=settings.apply_chat_template,
            bootstrap_iters=0,
            confirm_run_unsafe_code=runs_code,  # the opt-in was checked above
        )
        samples = [s for s in out["samples"][name] if s.get("filter", filter_name) == filter_name]
        if not samples:
            raise ValueError(f"there are no problems to evaluate in task {name!r}: raise --limit.")
        metric = samples[0]["metrics"][0]
        scores = [float(s[metric]) for s in samples]
        families: dict[str, list[float]] = defaultdict(list)
        for sample, score in zip(samples, scores):
            families[str(sample["doc"].get("family", name))].append(score)
            entry = per_problem.setdefault(
                sample["doc_id"],
                {
                    "id": str(sample["doc"].get("id", sample["doc"].get("task_id", sample["doc_id"]))),
                    "family": str(sample["doc"].get("family", name)),
                    "prompt": sample["arguments"][0][0],
                    "reference": str(sample["target"]),
                },
            )
            entry[decoding] = {
                "answer": sample["resps"][0][0],
                "extracted": sample["filtered_resps"][0],
                "num_tokens": lm.request_length(decoding, sample["arguments"][0][0]),
                "correct": score >= 1.0,
                "score": score,
            }
        metrics = {k: v for k, v in out["results"][name].items() if "," in k and "_stderr" not in k}
        results[decoding] = {
            "accuracy": sum(scores) / len(scores),
            "num_correct": sum(score >= 1.0 for score in scores),
            "num_problems": len(scores),
            **throughput(lm.records[decoding]),
            "per_family": {
                f: {"accuracy": sum(v) / len(v), "num_problems": len(v)} for f, v in sorted(families.items())
            },
            "lm_eval_metrics": metrics,
        }
    if len(decodings) == len(DECODINGS):
        ar_speed = results["autoregressive"]["tokens_per_second"]
        results["speedup"] = results["refusion"]["tokens_per_second"] / ar_speed if ar_speed else None
        results["accuracy_difference"] = results["refusion"]["accuracy"] - results["autoregressive"]["accuracy"]
        if len(per_problem) >= 2:  # the same problems on both sides: an interval that uses the pairing
            rows = [per_problem[i] for i in sorted(per_problem)]
            results["accuracy_difference_interval"] = paired_difference(
                [row["refusion"]["score"] for row in rows], [row["autoregressive"]["score"] for row in rows]
            )
    results["settings"] = {
        **asdict(settings),
        "decodings": list(decodings),
        "lm_eval_task": name,
        "primary_metric": f"{metric},{filter_name}",
        "num_fewshot": task.config.num_fewshot,
        "generation_kwargs": dict(task.config.generation_kwargs),
    }
    results["problems"] = [per_problem[i] for i in sorted(per_problem)]
    return results


def markdown_table(results: dict) -> str:
    header = "| decoding | accuracy | tokens/s | tokens/forward | forward passes | answer tokens | seconds |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    decodings = [decoding for decoding in DECODINGS if decoding in results]
    for decoding in decodings:
        r = results[decoding]
        lines.append(
            f"| {decoding} | {r['accuracy']:.3f} ({r['num_correct']}/{r['num_problems']}) | "
            f"{r['tokens_per_second']:.1f} | {r['tokens_per_forward']:.2f} | {r['num_forward_passes']} | "
            f"{r['num_tokens']} | {r['seconds']:.2f} |"
        )
    families = sorted(results[decodings[0]]["per_family"])
    if len(families) > 1:
        lines += [
            "",
            "| family | problems | " + " | ".join(f"{d} accuracy" for d in decodings) + " |",
            "|---|---:|" + "---:|" * len(decodings),
        ]
        for family in families:
            parts = [results[d]["per_family"][family] for d in decodings]
            accuracies = " | ".join(f"{part['accuracy']:.3f}" for part in parts)
            lines.append(f"| {family} | {parts[0]['num_problems']} | {accuracies} |")
    settings = results.get("settings", {})
    if settings.get("primary_metric"):
        lines += ["", f"Accuracy: lm-eval task {settings['lm_eval_task']}, {settings['primary_metric']}."]
    if settings.get("baseline_model"):
        lines += ["", f"Autoregressive decoding ran on the baseline model {settings['baseline_model']}."]
    if settings.get("continuous_batching"):
        lines += ["", f"Continuous batching: at most {settings['batch_size']} problems decoded at once, a finished "
                  "one replaced by the next at once; tokens/forward per batched forward."]  # fmt: skip
        if "autoregressive" in decodings:
            lines += ["Autoregressive decoding ran on transformers' own continuous batching, which is built for GPUs: "
                      "on a CPU compare the two decodings' speed with fixed batches."]  # fmt: skip
    repeats = settings.get("timing_repeats", 1)
    if repeats > 1:
        lines += ["", f"Times: the fastest of {repeats} interleaved runs of every problem with each decoding."]
    if results.get("speedup") is not None:
        interval = results.get("accuracy_difference_interval")
        spread = (
            f" ({100 * interval['level']:.0f}% interval {100 * interval['low']:+.1f} to {100 * interval['high']:+.1f}, "
            f"paired over {interval['num_problems']} problems; ReFusion alone right on {interval['first_better']}, "
            f"autoregressive alone on {interval['second_better']})"
            if interval
            else ""
        )
        lines += [
            "",
            f"ReFusion / autoregressive tokens per second: {results['speedup']:.2f}x; accuracy difference "
            f"{100 * results['accuracy_difference']:+.1f} points{spread}.",
        ]
    return "\n".join(lines)
