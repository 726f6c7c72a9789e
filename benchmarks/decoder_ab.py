"""The decoder of this checkout against the decoder of an earlier commit, side by side in one process: the same
`generate()` (this checkout's preparation and draft policy), with `decode_batch` from `refusion_decoder.py` and
`draft_policy.py` as they were at `--baseline` (read with `git show`, imported as a package of their own) or as
they are now; every batch decoded `--repeats` times per decoder, interleaved (which goes first alternates), its
fastest run timed; tokens checked identical. Reports, per batch size, the baseline's wall time over this
checkout's (above 1: this checkout is faster). Embedded model, its decoding defaults, synthetic test prompts.

    .venv/bin/python benchmarks/decoder_ab.py --baseline f3909cd --out benchmarks/results/decoder_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from decoder_profile import embedded_prompts, left_pad
from results_file import write_results

from refusion_hf.command_inputs import positive_int
from refusion_hf.generation import refusion_decoder, refusion_generate
from refusion_hf.modeling.loading import default_model_path, load_model_and_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ("refusion_decoder.py", "draft_policy.py")  # the decoder and its one sibling import


def baseline_decoder(commit: str, folder: Path):
    """`refusion_decoder` as it was at `commit`, imported from `folder` as the package `baseline_decoder`."""
    package = folder / "baseline_decoder"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in BUNDLE:
        shown = subprocess.run(
            ["git", "show", f"{commit}:src/refusion_hf/generation/{name}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode != 0:
            reason = (shown.stderr.strip().splitlines() or ["git show failed"])[0]
            raise SystemExit(f"--baseline {commit}: git cannot show its {name}: {reason}")
        (package / name).write_text(shown.stdout)
    sys.path.insert(0, str(folder))
    return importlib.import_module("baseline_decoder.refusion_decoder")


def batch_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1."""
    return [positive_int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a commit (or anything `git show` takes)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 4, 16])
    parser.add_argument("--prompts", type=positive_int, default=32)
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decoder_ab.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        decoders = {"baseline": baseline_decoder(args.baseline, Path(folder)), "current": refusion_decoder}
        model, tokenizer = load_model_and_tokenizer(str(default_model_path()), dtype=args.dtype)
        prompts = embedded_prompts(tokenizer, args.prompts, seed=0)
        pad = model.generation_config.pad_token_id or 0
        rows = []
        try:
            for batch_size in args.batch_sizes:
                batches = [left_pad(prompts[i : i + batch_size], pad) for i in range(0, len(prompts), batch_size)]
                seconds = dict.fromkeys(decoders, 0.0)
                for index, (ids, mask) in enumerate(batches):
                    order = list(decoders) if index % 2 == 0 else list(decoders)[::-1]
                    best, outputs = {}, {}
                    for _ in range(args.repeats):
                        for name in order:
                            refusion_generate.decode_batch = decoders[name].decode_batch
                            start = time.perf_counter()
                            outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens)
                            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
                    if not torch.equal(outputs["baseline"], outputs["current"]):
                        raise SystemExit(f"batch {index} at batch size {batch_size}: the decoders' tokens differ")
                    for name in decoders:
                        seconds[name] += best[name]
                rows.append(
                    {
                        "batch_size": batch_size,
                        "seconds": seconds,
                        "baseline_over_current_wall_time": seconds["baseline"] / seconds["current"],
                    }
                )
        finally:
            refusion_generate.decode_batch = refusion_decoder.decode_batch
    results = {
        "baseline": args.baseline,
        "current": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "dtype": args.dtype,
        "torch_threads": args.threads,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_results(results, args.out)


if __name__ == "__main__":
    main()
