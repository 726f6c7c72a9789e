"""Evaluate ReFusion decoding and autoregressive decoding of the same weights side by side, in one process.

Batches are decoded with both decodings back to back (or with one of them, to evaluate a baseline model that
cannot decode with ReFusion), alternating which goes first from batch to batch, so that a slow spell of a shared
machine hits both alike. With `timing_repeats` > 1 every batch is decoded that many times per decoding
(interleaved, same seed, hence the same tokens: checked) and its time is the fastest repeat, the usual defence of
micro-benchmarks (`timeit`) against stalls caused by other processes. Accuracy comes from the local metrics
(numeric match, sandboxed pass@1, listing match), speed from the throughput metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..generation.cli import encode_prompt
from ..generation.refusion_generation_config import sampling_arguments
from .metrics import load_metric
from .sandbox import require_opt_in
from .suites import EvalProblem

DECODINGS = ("refusion", "autoregressive")
REFUSION_KNOBS = ("slot_size", "block_size", "slot_threshold", "token_threshold", "plan_ahead")


@dataclass
class EvalSettings:
    max_new_tokens: int
    batch_size: int = 1
    seed: int = 0
    temperature: float | None = None
    slot_size: int | None = None
    block_size: int | None = None
    slot_threshold: float | None = None
    token_threshold: float | None = None
    plan_ahead: bool | None = None
    preset: str | None = None  # DECODING_PRESETS: its knobs, unless set above (its length is max_new_tokens')
    allow_code_execution: bool = False
    code_timeout: float = 5.0
    warmup: bool = True
    timing_repeats: int = 1  # decode each batch this many times per decoding; its time is the fastest

    def refusion_kwargs(self) -> dict:
        kwargs = {"max_new_tokens": self.max_new_tokens, **sampling_arguments(self.temperature)}
        if self.preset is not None:
            kwargs["preset"] = self.preset
        for name in REFUSION_KNOBS:
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs

    def autoregressive_kwargs(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, **sampling_arguments(self.temperature)}


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise ValueError("the model has no eos_token_id (generation_config or config): evaluation needs one.")
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _pad_id(model, tokenizer, eos_ids: set[int]) -> int:
    for candidate in (tokenizer.pad_token_id, model.generation_config.pad_token_id, model.config.pad_token_id):
        if candidate is not None:
            return int(candidate)
    return min(eos_ids)


def answer_length(tokens: Sequence[int], eos_ids: set[int]) -> int:
    """Generated tokens up to and including the first EOS; all of them when there is none."""
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return index + 1
    return len(tokens)


def _left_pad(rows: list[torch.LongTensor], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    width = max(row.numel() for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - row.numel() :] = row
        attention_mask[index, width - row.numel() :] = 1
    return input_ids, attention_mask


def _decode_batch(model, decoding, input_ids, attention_mask, settings: EvalSettings, eos_ids, max_new_tokens=None):
    """One timed generate call. Returns (per-row new tokens, lengths, per-row forward passes, call passes, s)."""
    kwargs = settings.refusion_kwargs() if decoding == "refusion" else settings.autoregressive_kwargs()
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    width = input_ids.shape[1]
    start = time.perf_counter()
    if decoding == "refusion":
        output = model.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True, **kwargs)
        seconds = time.perf_counter() - start
        new = output.sequences[:, width:]
        lengths = [answer_length(row.tolist(), eos_ids) for row in new]
        row_passes = []
        for length, rate in zip(lengths, output.tokens_per_forward.tolist()):
            passes = length / rate
            if abs(passes - round(passes)) > 1e-3:
                raise RuntimeError(f"inconsistent ReFusion output: {length} tokens at {rate} tokens/forward")
            row_passes.append(int(round(passes)))
        call_passes = int(output.num_forward_passes)
    else:
        sequences = model.generate(input_ids, attention_mask=attention_mask, decoding="autoregressive", **kwargs)
        seconds = time.perf_counter() - start
        new = sequences[:, width:]
        lengths = [answer_length(row.tolist(), eos_ids) for row in new]
        row_passes = list(lengths)  # one token per forward for each row until its EOS
        call_passes = int(new.shape[1])  # one forward per generated position of the batch
    return new, lengths, row_passes, call_passes, max(seconds, 1e-9)


def _score(problems: list[EvalProblem], answers: list[str], settings: EvalSettings, metrics: dict) -> list[dict]:
    """Per problem: {"correct": bool, "detail": str}."""
    scores: list[dict | None] = [None] * len(problems)
    for family in ("arithmetic", "listing", "code"):
        indices = [i for i, problem in enumerate(problems) if problem.family == family]
        if not indices:
            continue
        if family == "arithmetic":
            result = metrics["numeric_match"].compute(
                predictions=[answers[i] for i in indices], references=[problems[i].reference for i in indices]
            )
            details = [f"extracted {value!r}" for value in result["extracted"]]
            correct = result["correct"]
        elif family == "listing":
            result = metrics["listing_match"].compute(
                predictions=[answers[i] for i in indices], references=[problems[i].reference for i in indices]
            )
            correct, details = result["correct"], [""] * len(indices)
        else:
            result = metrics["code_execution"].compute(
                predictions=[problems[i].candidate_program(answers[i]) for i in indices],
                references=[problems[i].reference for i in indices],
                allow_code_execution=settings.allow_code_execution,
                timeout=settings.code_timeout,
                extract_code=False,
            )
            correct, details = result["passed"], result["results"]
        for i, ok, detail in zip(indices, correct, details):
            scores[i] = {"correct": bool(ok), "detail": detail}
    return scores


def check_decodings(decodings: Sequence[str]) -> tuple[str, ...]:
    """`decodings` as a tuple, or a ValueError unless it is a non-empty subset of DECODINGS without repeats."""
    decodings = tuple(decodings)
    if not decodings or len(set(decodings)) != len(decodings) or not set(decodings) <= set(DECODINGS):
        raise ValueError(f"--decodings must be a non-empty subset of {','.join(DECODINGS)}, got {decodings!r}.")
    return decodings


def evaluate_decodings(
    model,
    tokenizer,
    problems: list[EvalProblem],
    settings: EvalSettings,
    progress: Callable | None = None,
    decodings: Sequence[str] = DECODINGS,
) -> dict:
    """Decode every problem with each of `decodings` (default: both) and score them; returns the results.

    `progress(done, total)` is called after each batch (every decoding) with the number of problems decoded.
    `"speedup"` and `"accuracy_difference"` (ReFusion minus autoregressive) are there when both decodings ran.
    """
    decodings = check_decodings(decodings)
    if not problems:
        raise ValueError("there are no problems to evaluate: raise --limit.")
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {settings.batch_size}.")
    if settings.timing_repeats < 1:
        raise ValueError(f"--timing-repeats must be >= 1, got {settings.timing_repeats}.")
    if any(problem.family == "code" for problem in problems):
        require_opt_in(settings.allow_code_execution)
    eos_ids = _eos_ids(model)
    pad_id = _pad_id(model, tokenizer, eos_ids)
    metrics = {name: load_metric(name) for name in ("numeric_match", "listing_match", "code_execution", "throughput")}
    encoded = [encode_prompt(tokenizer, problem.prompt)[0] for problem in problems]
    batches = [
        list(range(i, min(i + settings.batch_size, len(problems))))
        for i in range(0, len(problems), settings.batch_size)
    ]

    if settings.warmup:  # first calls pay one-off costs (allocations, lazy inits): keep them out of the timing
        input_ids, attention_mask = _left_pad([encoded[i] for i in batches[0]], pad_id)
        for decoding in decodings:
            _decode_batch(
                model, decoding, input_ids, attention_mask, settings, eos_ids, min(8, settings.max_new_tokens)
            )

    records = {
        d: {"num_tokens": [], "row_forward_passes": [], "num_forward_passes": [], "seconds": []} for d in decodings
    }
    answers = {d: [""] * len(problems) for d in decodings}
    lengths_of = {d: [0] * len(problems) for d in decodings}
    for batch_index, batch in enumerate(batches):
        input_ids, attention_mask = _left_pad([encoded[i] for i in batch], pad_id)
        order = decodings if batch_index % 2 == 0 else decodings[::-1]
        decoded, fastest = {}, {}
        for repeat in range(settings.timing_repeats):
            for decoding in order:
                torch.manual_seed(settings.seed + batch_index)
                new, lengths, row_passes, call_passes, seconds = _decode_batch(
                    model, decoding, input_ids, attention_mask, settings, eos_ids
                )
                if repeat == 0:
                    decoded[decoding] = (new, lengths, row_passes, call_passes)
                elif not torch.equal(new, decoded[decoding][0]):
                    raise RuntimeError(
                        f"{decoding} decoding gave different tokens when repeated with the same seed, so repeats "
                        "cannot be timed as one: use --timing-repeats 1."
                    )
                fastest[decoding] = min(seconds, fastest.get(decoding, seconds))
        for decoding in order:
            new, lengths, row_passes, call_passes = decoded[decoding]
            seconds = fastest[decoding]
            for row, index in enumerate(batch):
                answers[decoding][index] = tokenizer.decode(new[row, : lengths[row]], skip_special_tokens=True)
                lengths_of[decoding][index] = lengths[row]
            record = records[decoding]
            record["num_tokens"].append(lengths)
            record["row_forward_passes"].append(row_passes)
            record["num_forward_passes"].append(call_passes)
            record["seconds"].append(seconds)
        if progress is not None:
            progress(batch[-1] + 1, len(problems))

    results: dict = {}
    per_problem = [
        {"id": problem.id, "family": problem.family, "prompt": problem.prompt, "reference": problem.reference}
        for problem in problems
    ]
    for decoding in decodings:
        scores = _score(problems, answers[decoding], settings, metrics)
        speed = metrics["throughput"].compute(**records[decoding])
        families = sorted({problem.family for problem in problems})
        per_family = {}
        for family in families:
            flags = [s["correct"] for s, p in zip(scores, problems) if p.family == family]
            per_family[family] = {"accuracy": sum(flags) / len(flags), "num_problems": len(flags)}
        results[decoding] = {
            "accuracy": sum(s["correct"] for s in scores) / len(scores),
            "num_correct": sum(s["correct"] for s in scores),
            "num_problems": len(scores),
            **speed,
            "per_family": per_family,
        }
        for entry, score, answer, length in zip(per_problem, scores, answers[decoding], lengths_of[decoding]):
            entry[decoding] = {"answer": answer, "num_tokens": length, **score}
    if len(decodings) == len(DECODINGS):
        ar_speed = results["autoregressive"]["tokens_per_second"]
        results["speedup"] = results["refusion"]["tokens_per_second"] / ar_speed if ar_speed else None
        results["accuracy_difference"] = results["refusion"]["accuracy"] - results["autoregressive"]["accuracy"]
    results["settings"] = {
        **asdict(settings),
        "decodings": list(decodings),
        "eos_token_ids": sorted(eos_ids),
        "pad_token_id": pad_id,
    }
    results["problems"] = per_problem
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
    repeats = results.get("settings", {}).get("timing_repeats", 1)
    if repeats > 1:
        lines += ["", f"Times: the fastest of {repeats} interleaved runs of every problem with each decoding."]
    if results.get("speedup") is not None:
        lines += [
            "",
            f"ReFusion / autoregressive tokens per second: {results['speedup']:.2f}x; accuracy difference "
            f"{100 * results['accuracy_difference']:+.1f} points.",
        ]
    return "\n".join(lines)
