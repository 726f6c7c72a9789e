"""`refusion serve [MODEL]`: an OpenAI-compatible HTTP server (`/v1/chat/completions`, `/v1/completions`) with
ReFusion decoding (`app.py`: the routes; `handler.py`: a request's path; `decoding.py`: the decoding worker).
uvicorn runs the app until SIGINT / SIGTERM (`DrainingServer`: the waiting requests are answered 503 at once, the
ones decoding get `--shutdown-timeout` seconds). The flags follow vLLM's (`docs/serving.md`). `--engine sglang` runs
SGLang's server instead, with ReFusion decoding (`sglang_launch.py`)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal

from ..command_inputs import CommandError, non_negative_float, positive_int, require_extra
from ..errors import first_line
from ..generation.refusion_generate import DEFAULT_BATCH_ROWS
from ..modeling.checkpoint_checks import check_checkpoint_folder, check_tokenizer_files
from ..modeling.loading import DTYPES, default_model_path
from .prompts import TEMPLATE_MEMORY_BYTES, TEMPLATE_SECONDS  # standard library and jinja2 only
from .sglang_launch import add_engine_arguments, refuse_engine_flags

SHUTDOWN_SECONDS = 10.0  # --shutdown-timeout's default
KEEP_ALIVE_SECONDS = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port (0 lets the system pick a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {value}")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only `localhost` is known to stay on this machine
        return False


def warn_if_open(host: str, api_key: str | None) -> None:
    """A warning when the server listens beyond this machine with no API key."""
    if api_key is None and not is_loopback(host):
        logging.getLogger("refusion_hf.serving").warning(
            "refusion serve listens on %s without an API key: anyone who can reach it can use it; pass --api-key "
            "(or set REFUSION_API_KEY).",
            host,
        )


def check_api_key(key: str | None) -> None:
    """A key every client can send in `Authorization: Bearer <key>`: printable ASCII (HTTP header values are), not
    empty, no surrounding spaces (clients and proxies strip them); else one line saying what is wrong."""
    if key is None:
        return
    if not key.strip():
        raise CommandError("--api-key (or REFUSION_API_KEY) is empty: give a key, or leave both unset.")
    if key != key.strip():
        raise CommandError(
            "--api-key (or REFUSION_API_KEY) begins or ends with white space, which HTTP clients strip from the "
            "Authorization header: no client could send it; remove the spaces."
        )
    unsendable = sorted({c for c in key if not (" " <= c <= "~")})
    if unsendable:
        raise CommandError(
            f"--api-key (or REFUSION_API_KEY) holds {', '.join(repr(c) for c in unsendable)}: an HTTP header carries "
            "printable ASCII only, so no client could send it; use letters, digits and punctuation."
        )


def draining_server(config, decoder):
    """A uvicorn server that, when told to stop (SIGTERM / SIGINT), first answers every request still waiting for
    its decoding with 503 (the decoder takes no new one), then stops as uvicorn does: the requests decoding get
    `timeout_graceful_shutdown` seconds, then their tasks are cancelled (their decoding stops before its next
    forward)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            decoder.waiting.stop_waiting()
            await super().shutdown(sockets)

    return DrainingServer(config)


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument("model", nargs="?", default=None, help="local folder or Hub id (default: the embedded model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="default: the checkpoint's own (the embedded model: bfloat16)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="`device_map` for from_pretrained: auto (every visible GPU, else the CPU), cpu, cuda:0, ...",
    )
    parser.add_argument("--attn-implementation", default=None, help="e.g. sdpa, eager, flash_attention_2")
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="decode the requests waiting at each moment together, through the model's generate_batch "
        "(default: one request at a time)",
    )
    parser.add_argument(
        "--max-requests-per-batch",
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help=f"requests decoded at once, the rest wait in the queue (default: {DEFAULT_BATCH_ROWS} with "
        "--continuous-batching, else 1, the only value it takes without)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the name(s) requests may give as `model` (default: MODEL as given); another name is a 404",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="most tokens per request, prompt + max_tokens (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template sent in a request (chat_template_kwargs.chat_template); default: refused",
    )
    parser.add_argument(
        "--request-chat-template-seconds",
        type=positive_float,
        default=None,
        help="with --trust-request-chat-template: how long a request's template may render, in a process of its own "
        f"with {TEMPLATE_MEMORY_BYTES // 2**20} MiB of memory, before the request is refused "
        f"(default {TEMPLATE_SECONDS:g})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("REFUSION_API_KEY"),
        help="require `Authorization: Bearer <key>` on every route but /health, /metrics (default: $REFUSION_API_KEY)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=None,
        help="most requests waiting for their decoding; one more is HTTP 503 with Retry-After (default: no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=None,
        help="on SIGTERM / SIGINT: seconds the requests in flight get to finish before they are ended (default 10)",
    )
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = args.max_requests_per_batch
    if rows is not None and rows > 1 and not args.continuous_batching:
        raise CommandError(
            f"--max-num-seqs (--max-requests-per-batch) {rows}: without --continuous-batching requests decode one at "
            f"a time (--max-num-seqs 1); pass --continuous-batching to decode {rows} at once."
        )
    check_api_key(args.api_key)
    if args.engine == "sglang":
        from . import sglang_launch

        model = args.model if args.model is not None else str(default_model_path())
        check_checkpoint_folder(model, "MODEL")
        check_tokenizer_files(model, "MODEL")  # SGLang's server tokenizes and renders chat templates itself
        warn_if_open(args.host, args.api_key)
        return sglang_launch.run(args, model)
    refuse_engine_flags(args)
    require_extra("serving", "fastapi", "uvicorn", "openai", "prometheus_client")
    warn_if_open(args.host, args.api_key)
    import uvicorn

    from .app import ServeOptionError, build_app
    from .connections import HeadDeadlineProtocol
    from .malloc_arenas import use_one_malloc_arena

    model = args.model if args.model is not None else str(default_model_path())
    check_checkpoint_folder(model, "MODEL")
    check_tokenizer_files(model, "MODEL")
    use_one_malloc_arena()  # before build_app starts the decoding worker's thread
    try:
        app, decoder = build_app(
            model,
            dtype=args.dtype,
            device=args.device,
            attn_implementation=args.attn_implementation,
            continuous_batching=args.continuous_batching,
            max_requests_per_batch=args.max_requests_per_batch,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            trust_request_chat_template=args.trust_request_chat_template,
            api_key=args.api_key,
            max_queued_requests=args.max_queued_requests,
            request_chat_template_seconds=args.request_chat_template_seconds or TEMPLATE_SECONDS,
        )
    except ServeOptionError as error:
        raise CommandError(str(error)) from None
    except (OSError, ValueError) as error:
        raise CommandError(f"MODEL {model}: the checkpoint does not load ({first_line(error)}).") from None
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=SHUTDOWN_SECONDS if args.shutdown_timeout is None else args.shutdown_timeout,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        http=HeadDeadlineProtocol,
    )
    server = draining_server(config, decoder)
    # uvicorn stops accepting on SIGINT / SIGTERM, gives the requests in flight --shutdown-timeout seconds (then
    # cancels them: their decoding stops before its next forward), and re-raises the signal once it has stopped:
    # both then end here as KeyboardInterrupt, and the command exits 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        decoder.shutdown()
    return 0
