"""What a model card is built from, read and validated: `refusion eval` JSON reports and `trainer_state.json`.

Both readers are tolerant of extra keys (the formats grow) and strict about the keys the card needs: a missing or
mistyped one raises `CardSourceError` naming the file, the key and what to do. Each comes out as the card shows
it (an `EvalReport`'s table rows, note and model-index entries; a `TrainingSummary`'s facts and loss table), so the
template only lays them out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult

from ..evaluation.tasks import SYNTHETIC_TIERS
from ..generation.refusion_generation_config import DECODING_KNOBS
from .errors import CardSourceError

# Settings of a `refusion eval` report that the card repeats (metric args in the model-index, notes in the body).
REPORTED_SETTINGS = (*DECODING_KNOBS, "temperature", "max_new_tokens")
RUN_SETTINGS = ("seed", "limit", "split", "families", "num_problems", "batch_size", "dtype")
REQUIRED_RATES = ("accuracy", "tokens_per_second", "tokens_per_forward")
OPTIONAL_RATES = ("num_forward_passes",)


@dataclass(frozen=True)
class SuiteInfo:
    """How an evaluation suite appears in a model-index (`dataset` and `metric` identifiers on the Hub)."""

    dataset_type: str
    dataset_name: str
    accuracy_metric: str
    dataset_config: str | None = None
    dataset_split: str | None = "test"


# The seeded suites under their own names, and the Hub dataset ids of the public benchmarks `refusion eval` runs;
# unknown suites are reported under their own name.
SUITES: dict[str, SuiteInfo] = {
    **{
        suite: SuiteInfo(
            suite, "refusion_hf synthetic suite" + ("" if tier == "standard" else f", {tier} tier"), "accuracy"
        )
        for suite, tier in SYNTHETIC_TIERS.items()
    },
    "humaneval": SuiteInfo("openai/openai_humaneval", "HumanEval", "pass@1"),
    "gsm8k": SuiteInfo("openai/gsm8k", "GSM8K", "accuracy", dataset_config="main"),
    "mbpp": SuiteInfo("google-research-datasets/mbpp", "MBPP", "pass@1"),
}


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and not (isinstance(value, float) and not math.isfinite(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class EvalReport:
    """One `refusion eval --json` report: both decodings of the same weights on one suite."""

    path: Path
    suite: str
    settings: dict[str, Any]
    refusion: dict[str, float]
    autoregressive: dict[str, float] | None

    @property
    def suite_info(self) -> SuiteInfo:
        return SUITES.get(self.suite, SuiteInfo(self.suite, self.suite, "accuracy", dataset_split=None))

    @property
    def dataset_config(self) -> str | None:
        # The synthetic suite draws its test problems from the seed: the seed *is* the dataset configuration.
        if self.suite in SYNTHETIC_TIERS and self.settings.get("seed") is not None:
            return f"seed-{self.settings['seed']}"
        return self.suite_info.dataset_config

    @property
    def dataset_split(self) -> str | None:
        split = self.settings.get("split")  # the synthetic suite has a train and a test split
        return split if isinstance(split, str) and split else self.suite_info.dataset_split

    @property
    def limit(self) -> int | None:
        limit = self.settings.get("limit")
        return limit if isinstance(limit, int) and not isinstance(limit, bool) else None

    @property
    def subset(self) -> str | None:
        """Which problems the numbers cover, in words, when a limit was set: the synthetic suite draws its
        problems from the seed, the public suites take the first N."""
        if self.limit is None:
            return None
        if self.suite in SYNTHETIC_TIERS:
            seed = self.settings.get("seed")
            return f"{self.limit} problems drawn with seed {seed}" if seed is not None else f"{self.limit} problems"
        return f"the first {self.limit} problems only"

    @property
    def speedup(self) -> float | None:
        """ReFusion tokens/s over autoregressive tokens/s, measured in the same run."""
        if not self.autoregressive or not self.autoregressive.get("tokens_per_second"):
            return None
        return self.refusion["tokens_per_second"] / self.autoregressive["tokens_per_second"]

    @property
    def label(self) -> str:
        """The suite as the card's evaluation table names it."""
        return self.suite_info.dataset_name + (f" ({self.dataset_config})" if self.dataset_config else "")

    @property
    def decodings(self) -> list[tuple[str, dict[str, float]]]:
        """(decoding, rates) of the card's table rows: ReFusion, then the autoregressive baseline when it ran."""
        return [(mode, rates) for mode, rates in (("ReFusion", self.refusion), ("autoregressive", self.autoregressive))
                if rates is not None]  # fmt: skip

    @property
    def note(self) -> str:
        """What the card says under the table: the settings that define the numbers, the problems, the speed-up."""
        settings = ", ".join(f"`{key}={value}`" for key, value in self.decoding_args().items()) or "defaults"
        note = f"{self.suite_info.dataset_name}: settings {settings}"
        if self.subset:
            note += f"; {self.subset}"
        if self.speedup is not None:
            note += f"; ReFusion decoding ran at {self.speedup:.2f}x the tokens/s of autoregressive decoding"
        return note + "."

    def decoding_args(self) -> dict[str, Any]:
        """The settings that define the numbers: decoding knobs (the resolved ones of `settings.refusion_decoding`
        when present, else the top-level ones) and run settings. Local paths, sandbox options and token ids are
        left out; unset values too."""
        args: dict[str, Any] = {}
        resolved = self.settings.get("refusion_decoding")
        resolved = resolved if isinstance(resolved, dict) else {}
        for key in REPORTED_SETTINGS:
            value = resolved.get(key, self.settings.get(key))
            if _is_scalar(value):
                args[key] = value
        for key in RUN_SETTINGS:
            value = self.settings.get(key)
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                value = ",".join(value)
            if _is_scalar(value):
                args[key] = value
        return args

    def eval_results(self) -> list[EvalResult]:
        """The ReFusion-decoding results as model-index entries (the autoregressive baseline stays in the card's
        body: it is a comparison, not this model's score)."""
        info = self.suite_info
        subset = f", {self.subset}" if self.subset else ""
        common = dict(
            task_type="text-generation",
            task_name="Text Generation",
            dataset_type=info.dataset_type,
            dataset_name=info.dataset_name,
            dataset_config=self.dataset_config,
            dataset_split=self.dataset_split,
        )
        args = self.decoding_args() or None
        measures = (
            (info.accuracy_metric, "accuracy", info.accuracy_metric),
            ("tokens_per_second", "tokens_per_second", "tokens/s"),
            ("tokens_per_forward", "tokens_per_forward", "tokens per forward pass"),
        )
        return [
            EvalResult(
                **common,
                metric_type=metric,
                metric_value=self.refusion[key],
                metric_name=f"{name} (ReFusion decoding{subset})",
                metric_args=args,
            )
            for metric, key, name in measures
        ]


def _read_json(path: Path, what: str, option: str) -> Any:
    if not path.is_file():
        raise CardSourceError(f"{option} {path}: no such file. Pass the path of {what}.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CardSourceError(f"{option} {path}: not valid JSON ({error}). Pass {what}.") from None


def load_eval_report(path: str | Path) -> EvalReport:
    """Read and validate one `refusion eval --json` report."""
    path = Path(path)
    what = "the JSON written by `refusion eval --json OUT`"
    data = _read_json(path, what, "--eval")
    if not isinstance(data, dict):
        raise CardSourceError(f"--eval {path}: expected a JSON object, got {type(data).__name__}. Pass {what}.")

    def missing(key: str, expected: str) -> CardSourceError:
        return CardSourceError(f"--eval {path}: {key} is missing or not {expected}. Pass {what}.")

    settings = data.get("settings")
    if not isinstance(settings, dict):
        raise missing("'settings'", "an object")
    suite = settings.get("suite")
    if not isinstance(suite, str) or not suite:
        raise missing("'settings.suite'", "a non-empty string (synthetic, humaneval, gsm8k, mbpp, ...)")

    def rates(mode: str) -> dict[str, float]:
        block = data[mode]
        if not isinstance(block, dict):
            raise missing(f"'{mode}'", "an object")
        values = {}
        for key in REQUIRED_RATES:
            if not _is_number(block.get(key)) or block[key] < 0:
                raise missing(f"'{mode}.{key}'", "a finite number >= 0")
            values[key] = block[key]
        for key in OPTIONAL_RATES:
            if _is_number(block.get(key)):
                values[key] = block[key]
        return values

    if "refusion" not in data and settings.get("decodings") == ["autoregressive"]:
        raise CardSourceError(
            f"--eval {path}: this report has autoregressive results only (`refusion eval --decodings "
            "autoregressive`); the card reports ReFusion decoding: pass a report of `refusion eval` run with both "
            "decodings (the default)."
        )
    if "refusion" not in data:
        raise missing("'refusion'", "an object")
    return EvalReport(
        path=path,
        suite=suite,
        settings=dict(settings),
        refusion=rates("refusion"),
        autoregressive=rates("autoregressive") if data.get("autoregressive") is not None else None,
    )


def eval_results_of(reports: list[EvalReport]) -> list[EvalResult]:
    """Model-index entries of several reports; two reports of the same suite and configuration are refused."""
    seen: dict[tuple, Path] = {}
    results: list[EvalResult] = []
    for report in reports:
        key = (report.suite, report.dataset_config)
        if key in seen:
            raise CardSourceError(
                f"--eval {report.path} and --eval {seen[key]} both report suite {report.suite!r}"
                f"{f' ({report.dataset_config})' if report.dataset_config else ''}: pass one report per suite."
            )
        seen[key] = report.path
        results.extend(report.eval_results())
    return results


@dataclass
class TrainingSummary:
    """The card's "Training details" of a Trainer run (`trainer_state.json`, or the live trainer's state): facts as
    sentences, and a table of the logged losses (at most `max_rows` rows, the first and last logged steps kept)."""

    path: Path | None
    facts: list[str]
    columns: list[str]
    rows: list[list[str]]


def _loss_columns(entries: list[dict]) -> list[str]:
    columns = []
    for entry in entries:
        for key, value in entry.items():
            if key.endswith("loss") and _is_number(value) and key not in columns and key != "train_loss":
                columns.append(key)
    # `loss` first, then the parts (e.g. ar_loss, mdm_loss), then evaluation losses.
    return sorted(columns, key=lambda key: (key != "loss", key.startswith("eval"), key))


def _subsample(rows: list[dict], at_most: int) -> list[dict]:
    if len(rows) <= at_most:
        return rows
    picks = sorted({round(i * (len(rows) - 1) / (at_most - 1)) for i in range(at_most)})
    return [rows[i] for i in picks]


def format_cell(value: Any, spec: str = "g") -> str:
    """A table cell: integers as they are (steps, pass counts), floats with `spec`, nothing as a dash; `|` escaped
    (Markdown needs it even inside code spans, e.g. `<|mask|>`)."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, {"g": ".4g", "f1": ".1f", "f2": ".2f", "e": ".2e"}[spec])
    return str(value).replace("|", "\\|")


def load_training_summary(path: str | Path, max_rows: int = 10) -> TrainingSummary:
    """Read and validate a Trainer's `trainer_state.json`."""
    path = Path(path)
    what = "the trainer_state.json a `transformers.Trainer` run (`refusion train`) saves"
    data = _read_json(path, what, "--trainer-state")
    if not isinstance(data, dict) or not isinstance(data.get("log_history"), list):
        raise CardSourceError(f"--trainer-state {path}: no 'log_history' list. Pass {what}.")
    return training_summary(data, path, max_rows)


def training_summary(state: dict, path: Path | None = None, max_rows: int = 10) -> TrainingSummary:
    """The card's view of a Trainer's state: the saved `trainer_state.json`, or `dataclasses.asdict(trainer.state)`
    of a live trainer (`RefusionTrainer.create_model_card`)."""
    history = [entry for entry in state.get("log_history") or [] if isinstance(entry, dict)]
    losses = _loss_columns(history)
    final = next((entry for entry in reversed(history) if "train_loss" in entry or "train_runtime" in entry), {})

    def number(key: str, source: dict = state):
        return source.get(key) if _is_number(source.get(key)) else None

    max_steps = number("max_steps")
    last_loss = next((entry["loss"] for entry in reversed(history) if number("loss", entry) is not None), None)
    candidates = (
        ("Optimizer steps", number("global_step"), "{}" + (f" of {max_steps}" if max_steps else "")),
        ("Epochs", number("epoch"), "{:.3g}"),
        ("Batch size per device", number("train_batch_size"), "{}"),
        ("Last logged training loss", last_loss, "{:.4g}"),
        ("Mean training loss over the run", number("train_loss", final), "{:.4g}"),
        ("Training time", number("train_runtime", final), "{:.0f} s"),
    )
    logged = [entry for entry in history if any(number(key, entry) is not None for key in losses)]
    return TrainingSummary(
        path=path,
        facts=[f"{label}: {spec.format(value)}" for label, value, spec in candidates if value is not None],
        columns=["Step", "Epoch", *losses, "Learning rate"],
        rows=[
            [
                *(format_cell(entry.get(key)) for key in ("step", "epoch", *losses)),
                format_cell(entry.get("learning_rate"), "e"),
            ]  # fmt: skip
            for entry in _subsample(logged, max_rows)
        ],
    )
