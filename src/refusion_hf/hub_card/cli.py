"""`refusion publish`: write a complete Hub folder (weights, config with auto_map, remote code, generation config
with the ReFusion defaults, tokenizer, model card) and optionally push it."""

from __future__ import annotations

import argparse
import sys

from ..command_inputs import add_decoding_arguments, positive_int
from .card import DEFAULT_EXAMPLE_PROMPT, DEFAULT_LICENSE
from .errors import PublishError

DESCRIPTION = """\
Write a complete Hugging Face Hub folder for a ReFusion checkpoint (ours or the official qwen3 format) or a LoRA
adapter: safetensors weights, config.json with auto_map, the flat remote code, generation_config.json with the
ReFusion decoding defaults, the tokenizer, and README.md (a model card with metadata, usage, decoding settings,
evaluation results from `refusion eval --json` files, training details from trainer_state.json, limitations and
citation). With --push, create the repository and upload the folder (needs `hf auth login` or HF_TOKEN)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "publish",
        help="write a complete Hub folder with a model card, and optionally push it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="checkpoint or LoRA adapter folder (or a Hub id)")
    parser.add_argument("--out", required=True, help="folder to write (new or empty, see --overwrite)")
    parser.add_argument(
        "--eval", action="append", default=[], metavar="RESULTS_JSON", help="`refusion eval --json` output (repeat)"
    )
    parser.add_argument("--trainer-state", default=None, help="trainer_state.json (default: the one in --model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one in --model)")
    parser.add_argument("--repo-id", default=None, help="NAMESPACE/NAME on the Hub (used in the card; --push target)")
    parser.add_argument("--push", action="store_true", help="create --repo-id if needed and upload the folder")
    parser.add_argument("--private", action="store_true", help="with --push: create the repository as private")
    parser.add_argument("--license", default=DEFAULT_LICENSE, help=f"Hub license id (default: {DEFAULT_LICENSE})")
    parser.add_argument("--base-model", default=None, help="Hub id of the model this one derives from")
    parser.add_argument("--dataset", action="append", default=[], help="Hub id of a training dataset (repeat)")
    parser.add_argument("--example-prompt", default=DEFAULT_EXAMPLE_PROMPT, help="prompt of the card's usage example")
    add_decoding_arguments(parser, "decoding defaults written to generation_config.json (models only)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, help="default answer length to write")
    parser.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    parser.add_argument(
        "--allow-eval-mismatch",
        action="store_true",
        help="put --eval reports on the card even when they do not record these weights (settings.model_sha256)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .publish import DECODING_OVERRIDES, publish

    try:
        result = publish(
            args.model,
            args.out,
            eval_paths=args.eval,
            trainer_state=args.trainer_state,
            tokenizer=args.tokenizer,
            repo_id=args.repo_id,
            push=args.push,
            private=args.private,
            license=args.license,
            base_model=args.base_model,
            datasets=args.dataset,
            example_prompt=args.example_prompt,
            decoding_defaults={key: getattr(args, key) for key in DECODING_OVERRIDES},
            overwrite=args.overwrite,
            allow_eval_mismatch=args.allow_eval_mismatch,
        )
    except PublishError as error:
        print(f"refusion publish: error: {error}", file=sys.stderr)
        return 2  # the user-error status of every refusion command
    print(f"Wrote the {result.kind} folder {result.folder} ({len(result.files)} files):")
    for name in result.files:
        print(f"  {name}")
    for note in result.notes:
        print(f"Note: {note}")
    if result.commit_url:
        print(f"Pushed to {args.repo_id}: {result.commit_url}")
    elif args.repo_id is None:
        print("Pass --repo-id NAMESPACE/NAME so the card's usage example names the repository.")
    return 0
