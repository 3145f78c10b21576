"""`sparserl sglang-serve`: one SGLang server with our sparse-sync loader and KV plugin (launch.py).

Stable command line (the Slurm scripts call it on rollout nodes):

    sparserl sglang-serve --model-path DIR [--host H] [--port P] [--tp-size N] [--token T]
        [--device cuda|cpu] [--kv-method M --kv-budget B ...] [--max-running-requests R]
        [--return-routed-experts] [--startup-timeout S]
        [-- <extra sglang.launch_server args>]

The token comes from --token or SPARSERL_SERVE_TOKEN and becomes SGLang's --admin-api-key (an
empty one is refused). The checkpoint is checked before SGLang starts (`launch.check_model`). The
KV flags are those of `sparserl serve` (same KVCompressionConfig). `--device cpu` runs SGLang's
CPU engine with our stand-ins for its CUDA-only packages (docs/sglang.md). `--return-routed-experts`
starts SGLang with `--enable-return-routed-experts`, which `model.moe.routing_replay` needs
(docs/moe.md, R3). Prints
`sparserl sglang-serve: ready <url>` once GET /health answers 200; exits 0 on SIGTERM/SIGINT
after stopping SGLang's whole process group, or with SGLang's exit code if it dies.
"""

from __future__ import annotations

import argparse
import os
import sys

from sparserl_mcore.cli_args import port, positive_float, positive_int
from sparserl_mcore.rollout.http.cli import KV_FLAGS, TOKEN_ENV, _given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="HF checkpoint directory SGLang loads")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; non-loopback needs a token")
    parser.add_argument("--port", type=port, default=30000, help="TCP port of the SGLang HTTP server")
    parser.add_argument("--tp-size", type=positive_int, default=1, help="tensor-parallel GPUs of this server")
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token for weight routes (or ${TOKEN_ENV})"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: SGLang's CPU engine (tests, small models)",
    )
    parser.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        help="requests decoded at once (SGLang's flag; default: SGLang's, or 256 with --kv-method "
        "snapkv / rkv, whose query ring is sized from it)",
    )
    parser.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="answer the experts each token was routed to (SGLang's --enable-return-routed-experts; "
        "model.moe.routing_replay needs it)",
    )
    parser.add_argument(
        "--startup-timeout", type=positive_float, default=1800.0, help="seconds to wait for /health"
    )
    kv = parser.add_argument_group("KV compression (omitted: KVCompressionConfig defaults)")
    for flag, (_, kind, text) in KV_FLAGS.items():
        kv.add_argument(f"--kv-{flag}", type=kind, default=None, help=text)
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after --: passed to SGLang as is")


def config_from_args(args: argparse.Namespace):  # -> LaunchConfig
    from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
    from sparserl_mcore.sglang.launch import LaunchConfig

    if args.token == "":  # LaunchConfig refuses it too; here the message can name both sources
        raise ValueError(
            f"--token (or ${TOKEN_ENV}) is empty; give a long random string, or none on loopback"
        )
    extra = list(args.sglang_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return LaunchConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        token=args.token,
        device=args.device,
        kv=KVCompressionConfig(**_given(args, KV_FLAGS, "kv_")),
        max_running_requests=args.max_running_requests,
        return_routed_experts=args.return_routed_experts,
        extra_args=tuple(extra),
        startup_timeout_s=args.startup_timeout,
    )


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.sglang.launch import check_model, check_startable, serve

    try:
        cfg = config_from_args(args)
        check_model(cfg)  # the user's input first, then what this machine lacks
        check_startable(cfg)
    except ValueError as exc:
        print(f"sparserl sglang-serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(cfg)
    except (RuntimeError, TimeoutError) as exc:
        print(f"sparserl sglang-serve: error: {exc}", file=sys.stderr)
        return 1
