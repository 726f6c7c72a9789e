"""`refusion generate`: decode one prompt with ReFusion, streaming the answer, then the same prompt decoded
autoregressively with the same weights, with forward passes, tokens per forward and tokens/s for both."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from ..command_inputs import (
    CommandError,
    add_decoding_arguments,
    add_dtype_argument,
    non_negative_float,
    positive_int,
    require_extra,
    seed,
)
from ..modeling.loading import load_model_and_tokenizer, prompt_ids
from ..outputs import check_output_file, staged_output
from .refusion_generate import answer_lengths, eos_token_ids, merge_generation_config
from .refusion_generation_config import DECODING_KNOBS, sampling_arguments
from .trace_view import DecodeTrace, ansi_by_step, order_summary, write_trace


def encode_prompt(tokenizer, prompt: str) -> torch.LongTensor:
    """`prompt_ids` as a [1, n] tensor."""
    return torch.tensor([prompt_ids(tokenizer, prompt)])


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="decode a prompt with ReFusion and compare with AR decoding")
    parser.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    parser.add_argument("--model", default=None, help="local folder or Hub id (default: the embedded model)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None)
    add_decoding_arguments(parser)
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="sample at this temperature (do_sample=True); 0 is greedy",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed for sampling at temperature > 0")
    add_dtype_argument(parser)
    parser.add_argument("--no-compare", action="store_true", help="skip the autoregressive comparison")
    parser.add_argument("--show-order", action="store_true",
                        help="colour the answer by the step that wrote it (underlined: revised)")  # fmt: skip
    parser.add_argument("--trace-out", default=None, help="draw the canvas per step into FILE (.png or .html)")
    parser.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict:
    names = ("max_new_tokens", *DECODING_KNOBS)
    overrides = {name: getattr(args, name, None) for name in names if getattr(args, name, None) is not None}
    return {**overrides, **sampling_arguments(args.temperature)}


def _timed_generate(model, input_ids, **kwargs):
    start = time.perf_counter()
    try:
        output = model.generate(input_ids, return_dict_in_generate=True, **kwargs)
    except ValueError as error:  # a flag value generate() refuses, named
        raise CommandError(str(error)) from None
    return output, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    if args.trace_out is not None:
        if Path(args.trace_out).suffix not in (".html", ".png"):
            raise CommandError(f"--trace-out must end in .html or .png, got {Path(args.trace_out).name!r}.")
        check_output_file(args.trace_out, "--trace-out")
        if Path(args.trace_out).suffix == ".png":
            require_extra("viz", "matplotlib")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    input_ids = encode_prompt(tokenizer, args.prompt)
    overrides = _overrides(args)
    eos_ids = set(eos_token_ids(model.generation_config))

    if input_ids.shape[1] == 0:
        raise CommandError("the prompt encodes to no tokens; give a non-empty prompt.")
    # Warm both decoders up (first calls pay one-off costs) so the tokens/s below compare like with like.
    _timed_generate(model, input_ids, max_new_tokens=4, slot_size=2)
    _timed_generate(model, input_ids, max_new_tokens=4, decoding="autoregressive")

    print("ReFusion:")
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    output, seconds = _timed_generate(model, input_ids, streamer=streamer, **overrides)
    new_tokens = output.sequences[0, input_ids.shape[1] :]
    [length] = answer_lengths(new_tokens[None], eos_ids)
    print(
        f"[refusion] {length} tokens, {output.num_forward_passes} forward passes, "
        f"{float(output.tokens_per_forward[0]):.2f} tokens/forward, {length / seconds:.1f} tokens/s"
    )
    if args.show_order or args.trace_out:
        slot_size = merge_generation_config(model, None, overrides)[0].slot_size  # the one the decoding used
        trace = DecodeTrace.from_output(output, 0, input_ids.shape[1], tokenizer, slot_size)
        if args.show_order:
            print(ansi_by_step(trace))
            print(f"[refusion] {order_summary(trace)}")
        if args.trace_out:
            with staged_output(args.trace_out, "--trace-out") as staged:  # no half-written file on a full disk
                write_trace(trace, staged)
            print(f"[refusion] decoding trace written to {args.trace_out}")
    if args.no_compare:
        return 0
    print("\nAutoregressive (same weights):")
    torch.manual_seed(args.seed)
    ar_overrides = {k: v for k, v in overrides.items() if k in ("max_new_tokens", "do_sample", "temperature")}
    ar_streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    ar_sequences = model.generate(
        input_ids,
        decoding="autoregressive",
        streamer=ar_streamer,
        max_new_tokens=overrides.get("max_new_tokens", new_tokens.shape[0]),
        **{k: v for k, v in ar_overrides.items() if k != "max_new_tokens"},
    )
    ar_seconds = time.perf_counter() - start
    [ar_length] = answer_lengths(ar_sequences[:, input_ids.shape[1] :], eos_ids)
    print(
        f"[autoregressive] {ar_length} tokens, {ar_length} forward passes, 1.00 tokens/forward, "
        f"{ar_length / ar_seconds:.1f} tokens/s"
    )
    return 0
