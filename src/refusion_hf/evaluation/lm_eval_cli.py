"""`refusion lm-eval ...`: lm-evaluation-harness's own CLI (every flag of `lm_eval run`), with the `refusion` model
registered, the package's own tasks (`refusion_synthetic`: the seeded synthetic suite) on the task path, code tasks'
`code_eval` metric run in the bubblewrap sandbox (code_eval.py; still behind lm-eval's `--confirm_run_unsafe_code`
and `HF_ALLOW_CODE_EVAL=1`), and ReFusion's per-task speed figures added to the results JSON it writes.

    refusion lm-eval --model refusion --model_args pretrained=DIR,preset=gsm8k_cot,dtype=float32 \\
        --tasks gsm8k_cot --batch_size 8 --apply_chat_template --output_path out/ [--limit N --log_samples ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..command_inputs import CommandError, require_extra
from ..errors import first_line
from ..modeling.checkpoint_checks import check_checkpoint_folder, check_tokenizer_files
from ..outputs import check_output_file, check_output_folder, staged_output


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness (its flags) with the `refusion` model registered",
        description=__doc__.split("\n\n")[0],
        add_help=False,  # --help is lm-eval's
    )
    parser.set_defaults(func=run, accepts_extra_args=True)


def run(args: argparse.Namespace) -> int:
    require_extra("eval", "lm_eval")
    from .._compat.lm_eval import harness_cli
    from . import lm_eval_model  # registers the `refusion` model
    from .code_eval import sandboxed_code_eval
    from .tasks import TASKS_DIR

    argv = list(getattr(args, "extra_args", []))
    if argv and argv[0] not in ("ls", "validate"):  # the package's own tasks (refusion_synthetic) are known too
        argv = [*argv, "--include_path", str(TASKS_DIR)] if "--include_path" not in argv else argv
    start = time.time()
    command = argv if argv and argv[0] in ("run", "ls", "validate") else ["run", *argv]
    with sandboxed_code_eval(), harness_cli(command) as cli:
        parsed = cli.parse_args()
        if command[0] == "run":
            check_run_arguments(parsed)
        cli.execute(parsed)
    reports = [model.decoding_report() for model in lm_eval_model.INSTANCES]  # of every launched process together
    main_process = all(model.rank == 0 for model in lm_eval_model.INSTANCES)  # as lm-eval, which writes on rank 0
    lm_eval_model.INSTANCES.clear()
    leave_process_group()
    if not reports or not main_process:
        return 0
    report = reports[-1]
    for task, stats in report["tasks"].items():
        rate = stats["tokens_per_second"]
        print(
            f"[refusion] {task}: {stats['tokens']} tokens, {stats['forward_passes']} forward passes, "
            f"{stats['tokens_per_forward'] or 0:.2f} tokens/forward, {rate or 0:.1f} tokens/s"
        )
    output = getattr(parsed, "output_path", None)  # as lm-eval parsed it
    if output is not None:
        for results in Path(output).rglob("results_*.json"):
            if results.stat().st_mtime >= start:
                data = json.loads(results.read_text())
                data["refusion_decoding"] = report
                with staged_output(results, "--output_path") as staged:  # lm-eval's file stays whole on a failure
                    staged.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 0


def leave_process_group() -> None:
    """Under `accelerate launch`, every process leaves torch.distributed's process group together once lm-eval and
    the speed report's gather are done: a barrier, then `destroy_process_group` (accelerate's `PartialState` does
    neither at exit, nor does lm-eval). Without it, a process that finished first exits with gloo's process group
    alive: the interpreter's teardown destroys it while its worker threads are still joinable, and the process dies
    of SIGABRT ("terminate called without an active exception"), or its peer's pending receive fails on the closed
    connection. One process, no group: nothing to do."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_run_arguments(parsed: argparse.Namespace) -> None:
    """What `lm_eval run` finds out late, or not at all, checked before any task or model loads: lm-eval's own
    argument validation, `--tasks` given, the `refusion` model's own args and checkpoint folder (as every command
    checks it), its decoding knobs against the folder's, a tokenizer that transformers loads only with its own code
    (without trust_remote_code=True), and that `--output_path` can be written (lm-eval logs a failed save as a
    warning, and exits 0)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    try:
        config = EvaluatorConfig.from_cli(parsed)
    except (ValueError, TypeError, OSError) as error:
        raise CommandError(first_line(error)) from None
    if not config.tasks:
        raise CommandError("no --tasks given; pass --tasks NAME[,NAME...] (`refusion lm-eval ls tasks` lists them).")
    if config.model == "refusion":
        from .lm_eval_model import RefusionLM

        RefusionLM.check_model_args(**config.model_args)
        pretrained = config.model_args.get("pretrained")
        if not pretrained:
            raise CommandError("--model_args: the refusion model needs pretrained=DIR (a checkpoint folder or Hub id).")
        check_checkpoint_folder(str(pretrained), "--model_args pretrained", config.model_args.get("dtype"))
        check_tokenizer_files(str(pretrained), "--model_args pretrained")
        RefusionLM.check_folder_args(**config.model_args)  # the decoding knobs, against the folder's
        RefusionLM.check_tokenizer(**config.model_args)  # a tokenizer that needs its own code
    if config.output_path:  # lm-eval's meaning: a .json file (dated), or a folder
        output = Path(config.output_path)
        if output.suffix == ".json":
            check_output_file(output, "--output_path")
        else:
            check_output_folder(output, "--output_path")
