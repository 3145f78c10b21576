"""`sparserl serve`: the embedded engine behind the SGLang-style HTTP API (docs/rollout.md).

Engine and compression options left out keep `EngineConfig` / `KVCompressionConfig` defaults, so
those defaults live in one place. The token comes from --token or SPARSERL_SERVE_TOKEN (an
environment variable keeps it out of `ps` listings and shell history).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from sparserl_mcore.cli_args import non_negative_float, positive_float, positive_int

TOKEN_ENV = "SPARSERL_SERVE_TOKEN"

# flag suffix -> (EngineConfig field, type, help)
ENGINE_FLAGS: dict[str, tuple[str, type, str]] = {
    "device": ("device", str, "auto | cpu | cuda | cuda:N (auto: CUDA when available)"),
    "dtype": ("dtype", str, "auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)"),
    "page-size": ("page_size", int, "KV entries per pool page"),
    "capacity-pages": ("capacity_pages", int, "KV pool size in pages"),
    "capacity-bytes": ("capacity_bytes", int, "KV pool size in bytes (K+V, all layers; default 256 MiB)"),
    "max-running-requests": ("max_running_requests", int, "continuous-batch size cap"),
    "max-prefill-tokens": ("max_prefill_tokens", int, "prompt tokens admitted per step"),
    "seed": ("seed", int, "generator of requests that bring no seed"),
}
# flag -> (ServerConfig field, type, help)
LIMIT_FLAGS: dict[str, tuple[str, Any, str]] = {
    "max-new-tokens": ("max_new_tokens", int, "cap on a request's max_new_tokens (none: the context length)"),
    "max-pending-requests": ("max_pending_requests", int, "accepted, unanswered requests; more: 503 (4096)"),
    "max-body-bytes": (
        "max_body_bytes",
        positive_int,
        "largest request body but a weight update's; a larger one gets 413 unread (8388608 = 8 MiB)",
    ),
    "request-timeout": (
        "request_timeout_s",
        non_negative_float,
        "seconds: a request not started by then gets 503, a running one is aborted (3600; 0: none)",
    ),
    "client-timeout": (
        "client_timeout_s",
        positive_float,
        "seconds a client may leave a request head or body unfinished before it is disconnected (60)",
    ),
    "keep-alive-timeout": (
        "keep_alive_s",
        positive_float,
        "seconds an idle connection is kept between requests (5)",
    ),
}
# flag suffix (after --kv-) -> (KVCompressionConfig field, type, help)
KV_FLAGS: dict[str, tuple[str, type, str]] = {
    "method": ("method", str, "none | snapkv | rkv | streamingllm | h2o"),
    "budget": ("budget", int, "hard cap on retained positions per layer and KV head (512)"),
    "interval": ("interval", int, "decode steps between compressions; keeps budget - interval (128)"),
    "window": ("window", int, "recent positions always kept / observation window (8)"),
    "kernel-size": ("kernel_size", int, "odd max-pool width over importance scores (7)"),
    "rkv-lambda": ("rkv_lambda", float, "R-KV importance weight (0.1)"),
    "similarity-threshold": ("similarity_threshold", float, "R-KV cosine threshold (0.5)"),
    "sink-tokens": ("sink_tokens", int, "StreamingLLM attention sinks (4)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory (safetensors, config)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; non-loopback needs a token")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one)")
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token for state routes (or ${TOKEN_ENV})"
    )
    parser.add_argument("--max-batch-requests", type=int, default=256, help="requests per engine.generate")
    parser.add_argument(
        "--max-concurrent-batches", type=int, default=8, help="engine.generate calls joining one batch"
    )
    limits = parser.add_argument_group("limits (omitted: ServerConfig defaults)")
    for flag, (_, kind, text) in LIMIT_FLAGS.items():
        limits.add_argument(f"--{flag}", type=kind, default=None, help=text)
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    engine = parser.add_argument_group("engine (omitted: EngineConfig defaults)")
    for flag, (_, kind, text) in ENGINE_FLAGS.items():
        engine.add_argument(f"--{flag}", type=kind, default=None, help=text)
    engine.add_argument("--no-radix-cache", action="store_true", help="disable prompt-prefix KV sharing")
    engine.add_argument(
        "--prefix-cache-across-versions",
        action="store_true",
        help="keep the prefix cache over weight updates (new requests may reuse older versions' KV)",
    )
    kv = parser.add_argument_group("KV compression (omitted: KVCompressionConfig defaults)")
    for flag, (_, kind, text) in KV_FLAGS.items():
        kv.add_argument(f"--kv-{flag}", type=kind, default=None, help=text)


def _given(args: argparse.Namespace, flags: dict[str, tuple[str, Any, str]], prefix: str) -> dict[str, Any]:
    values = {}
    for flag, (field, _, _) in flags.items():
        value = getattr(args, (prefix + flag).replace("-", "_"))
        if value is not None:
            values[field] = value
    return values


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    given = _given(args, LIMIT_FLAGS, "")
    if given.get("request_timeout_s") == 0:
        given["request_timeout_s"] = None  # 0: no deadline
    return given


def run(args: argparse.Namespace) -> int:
    """Exit 2 when the server cannot start (bad flags, an unreadable checkpoint, a port in use)."""
    from sparserl_mcore.ckpt.preflight import check_hf_checkpoint
    from sparserl_mcore.rollout.http.server import ServerConfig

    try:
        check_hf_checkpoint(args.hf_dir, label="--hf-dir")
        server_cfg = ServerConfig(
            host=args.host,
            port=args.port,
            token=args.token or None,
            max_batch_requests=args.max_batch_requests,
            max_concurrent_batches=args.max_concurrent_batches,
            **_limits(args),
        )
        engine_cfg = _engine_config(args)
        engine_cfg.resolved_device()  # a CUDA device that is not there, before loading anything
    except ValueError as exc:
        print(f"sparserl serve: error: {exc}", file=sys.stderr)
        return 2
    return _serve(args.hf_dir, server_cfg, engine_cfg, args.log_level)


def _engine_config(args: argparse.Namespace) -> Any:
    from sparserl_mcore.rollout.engine import EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

    kv = KVCompressionConfig(**_given(args, KV_FLAGS, "kv_"))
    return EngineConfig(
        **_given(args, ENGINE_FLAGS, ""),
        radix_cache=not args.no_radix_cache,
        prefix_cache_across_versions=args.prefix_cache_across_versions,
        kv_compression=kv,
    )


def _serve(hf_dir: str, server_cfg: Any, engine_cfg: Any, log_level: str) -> int:
    from sparserl_mcore.rollout.engine import EmbeddedEngine
    from sparserl_mcore.rollout.http.server import bind_socket, create_app, make_uvicorn

    try:
        sock = bind_socket(server_cfg.host, server_cfg.port)
    except OSError as exc:
        where = f"{server_cfg.host}:{server_cfg.port}"
        print(f"sparserl serve: error: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        engine = EmbeddedEngine(hf_dir, engine_cfg)
    except (OSError, ValueError) as exc:
        sock.close()
        print(f"sparserl serve: error: cannot load {hf_dir}: {exc}", file=sys.stderr)
        return 2
    _log_to_console(log_level)
    tok = engine.tokenizer
    app = create_app(
        engine,
        server_cfg,
        encode=(lambda text: tok(text)["input_ids"]) if tok is not None else None,
        decode=(lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"sparserl serve: listening on http://{shown}:{port}", flush=True)
    make_uvicorn(app, log_level=log_level).run(sockets=[sock])
    return 0


def _log_to_console(level: str) -> None:
    """Our loggers (refused requests, engine failures) next to uvicorn's, at the same level."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))  # uvicorn's look
    root = logging.getLogger("sparserl_mcore")
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
