"""The command that starts one rollout server of a Slurm job, per server kind, from the run config.

One function answers "how is a rollout server started": `server_command`. The SGLang branch of
it targets `sparserl sglang-serve` (our launcher around `python -m sglang.launch_server` with the
sparse weight loader and the KV-compression plugin), the embedded branch `sparserl serve`.
Both bind every interface (the learners are on other nodes) and read the weight-route token from
$SPARSERL_SERVE_TOKEN, which the job script generates.
"""

from __future__ import annotations

import sys
from typing import Literal

from sparserl_mcore.config import RunConfig
from sparserl_mcore.rollout.http.cli import KV_FLAGS
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig

ServerKind = Literal["sglang", "embedded"]


def kv_flags(kv: KVCompressionConfig) -> list[str]:
    """The run's KV compression as the servers' `--kv-*` flags (same names for both kinds)."""
    flags: list[str] = []
    for flag, (field, _, _) in KV_FLAGS.items():
        flags += [f"--kv-{flag}", str(getattr(kv, field))]
    return flags


def server_command(kind: ServerKind, cfg: RunConfig, *, port: int, first_gpu: int | None) -> list[str]:
    """argv of one server listening on `port`; `first_gpu`: its first GPU index on the node (None:
    CPU). An SGLang server spans rollout.tensor_parallel_size GPUs from there; the embedded
    engine runs on that one GPU."""
    base = [sys.executable, "-m", "sparserl_mcore"]
    bind = ["--host", "0.0.0.0", "--port", str(port)]
    if kind == "sglang":
        if first_gpu is None:
            raise ValueError("SGLang rollout servers need GPUs")
        tp = ["--tp-size", str(cfg.rollout.tensor_parallel_size)]
        routed = ["--return-routed-experts"] if cfg.model.moe.routing_replay else []
        own = ["--model-path", cfg.model.hf_path, *bind, *tp, *kv_flags(cfg.rollout.kv), *routed]
        return [*base, "sglang-serve", *own, "--", "--base-gpu-id", str(first_gpu)]  # SGLang's own flag
    device = "cpu" if first_gpu is None else f"cuda:{first_gpu}"
    own = ["--hf-dir", cfg.model.hf_path, *bind, "--device", device, "--log-level", "warning"]
    return [*base, "serve", *own, *kv_flags(cfg.rollout.kv)]


def task_server(
    kind: ServerKind, cfg: RunConfig, *, local_task: int, base_port: int, gpus: bool
) -> list[str]:
    """The server of srun task `local_task` of a node: port base + i, GPUs from i * (its TP)."""
    width = cfg.rollout.tensor_parallel_size if kind == "sglang" else 1
    first_gpu = local_task * width if gpus else None
    return server_command(kind, cfg, port=base_port + local_task, first_gpu=first_gpu)
