"""Which nodes do what in one Slurm job, and whether a run config can work on them.

A job has `learner_nodes` nodes running the megatron learner (one torchrun per node, one rank per
GPU) and `rollout_nodes` nodes running rollout servers (none: the learner's host rank runs the
embedded engine, "colocated"). `check_layout` refuses, in one line each, every combination that
would only fail (or silently train something else) once the job has started; nothing here
imports torch, so `sparserl slurm` answers in a fraction of a second on a login node.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

from sparserl_mcore.config import RunConfig

RolloutServer = Literal["auto", "sglang", "embedded"]
MAX_SIGNAL_LEAD_S = 65535  # Slurm's limit for --signal=...@sig_time
_NAME = re.compile(r"^[A-Za-z0-9_.,-]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class LayoutError(ValueError):
    """A job layout that cannot work with the run config; the message is one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmLayout:
    """The job's shape. gpus_per_node=0 means CPU nodes: then ranks_per_node says how many learner
    ranks (gloo) and embedded rollout servers run per node; on GPUs it equals gpus_per_node.

    stop_before_s: seconds before the time limit at which Slurm signals the job (USR1) so the
    trainer finishes its step, checkpoints and the job requeues itself.
    """

    learner_nodes: int
    rollout_nodes: int
    gpus_per_node: int
    ranks_per_node: int
    partition: str | None
    time: str
    stop_before_s: int
    job_name: str
    rollout_server: RolloutServer
    rollout_port: int
    server_start_timeout_s: int = 1800

    @property
    def nodes(self) -> int:
        return self.learner_nodes + self.rollout_nodes

    @property
    def learner_ranks(self) -> int:
        return self.learner_nodes * self.ranks_per_node

    @property
    def cpu(self) -> bool:
        return self.gpus_per_node == 0


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm --time value: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    match = _TIME.match(text.strip())
    if not match:
        raise LayoutError(f"--time {text!r}: use a Slurm time such as 90, 4:00:00 or 1-12:00:00")
    days, a, b, c = match.groups()
    if days is None:
        h, m, s = (int(a), int(b), int(c)) if c is not None else (0, int(a), int(b or 0))
    else:
        h, m, s = int(a), int(b or 0), int(c or 0)
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def check_layout(cfg: RunConfig, layout: SlurmLayout, hf_config: Path | None = None) -> None:
    """Raise LayoutError naming the first thing that cannot work. `hf_config`: the model's
    config.json when readable here (shared filesystem), for the head/layer divisibility checks."""
    check_job(layout)
    _check_learners(cfg, layout)
    _check_rollouts(cfg, layout)
    _check_resumable(cfg)
    if hf_config is not None:
        _check_model(cfg, layout, hf_config)


def check_job(layout: SlurmLayout) -> None:
    """The job's own settings (what needs no run config); LayoutError naming the flag and value."""
    if layout.learner_nodes < 1:
        raise LayoutError(f"--learner-nodes {layout.learner_nodes}: a job needs at least one learner node")
    if layout.rollout_nodes < 0:
        raise LayoutError(f"--rollout-nodes {layout.rollout_nodes}: must be >= 0 (0 = colocated)")
    if layout.gpus_per_node < 0 or layout.ranks_per_node < 1:
        raise LayoutError("--gpus-per-node must be >= 0 (0 = CPU nodes) and --ranks-per-node >= 1")
    if not layout.cpu and layout.ranks_per_node != layout.gpus_per_node:
        raise LayoutError(
            f"--ranks-per-node {layout.ranks_per_node} with --gpus-per-node {layout.gpus_per_node}: "
            "on GPU nodes every GPU runs one learner rank (set --ranks-per-node only for CPU nodes)"
        )
    for flag, value in (("--partition", layout.partition), ("--job-name", layout.job_name)):
        if value is not None and not _NAME.match(value):
            raise LayoutError(f"{flag} {value!r}: use letters, digits and . _ , - only")
    low, high = layout.rollout_port - 2, layout.rollout_port + layout.ranks_per_node - 1
    if low < 1 or high > 65535:
        raise LayoutError(
            f"--rollout-port {layout.rollout_port}: the job uses ports {low}..{high} on a rollout node "
            "(the router two below, one per server from it); choose a port in "
            f"[3, {65536 - layout.ranks_per_node}]"
        )
    limit = time_limit_seconds(layout.time)
    if not 0 < layout.stop_before_s < min(limit, MAX_SIGNAL_LEAD_S + 1):
        raise LayoutError(
            f"--stop-before {layout.stop_before_s} s must be > 0 and shorter than --time {layout.time} "
            f"({limit} s) and at most {MAX_SIGNAL_LEAD_S} s"
        )


def _check_learners(cfg: RunConfig, layout: SlurmLayout) -> None:
    par, n = cfg.parallel, layout.ranks_per_node
    tp, world = par.tensor_model_parallel_size, layout.learner_ranks
    unit = "CPU ranks" if layout.cpu else "GPUs"
    if n % tp:
        raise LayoutError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the {n} {unit} of a node: "
            "tensor parallelism must stay inside a node"
        )
    try:
        par.validate_world(world)
    except ValueError as exc:
        raise LayoutError(f"{layout.learner_nodes} learner nodes x {n} {unit}: {exc}") from None
    _check_islands(par.islands, layout)
    dp = world // par.model_parallel_size
    per_update = cfg.train.micro_batch_size * dp
    if cfg.train.global_batch_size % per_update:
        raise LayoutError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x DP = {cfg.train.micro_batch_size} x {dp} = {per_update}"
        )


def island_nodes(islands: int, layout: SlurmLayout) -> int:
    """Learner nodes per island (0: several islands share each node)."""
    per_island = layout.learner_ranks // islands
    return per_island // layout.ranks_per_node if per_island >= layout.ranks_per_node else 0


def _check_islands(islands: int, layout: SlurmLayout) -> None:
    """DiLoCo islands are blocks of consecutive ranks: each must be whole nodes (the slow links run
    between node groups), or lie inside one node."""
    if islands == 1:
        return
    per_island, n = layout.learner_ranks // islands, layout.ranks_per_node
    if per_island % n and n % per_island:
        raise LayoutError(
            f"parallel.islands={islands} over {layout.learner_nodes} learner nodes x {n} ranks: an "
            f"island of {per_island} ranks would straddle nodes; make the learner nodes a multiple "
            f"of the islands (whole nodes per island)"
        )


def _check_rollouts(cfg: RunConfig, layout: SlurmLayout) -> None:
    rtp = cfg.rollout.tensor_parallel_size
    if layout.rollout_nodes == 0:
        if cfg.rollout.engine == "remote":
            raise LayoutError(
                "rollout.engine=remote but --rollout-nodes 0 starts no servers: add rollout nodes "
                "or set rollout.engine=embedded for a colocated job"
            )
        if rtp > 1:
            raise LayoutError(
                f"rollout.tensor_parallel_size={rtp} needs rollout nodes running SGLang; the "
                "colocated embedded engine runs on one device"
            )
        return
    if layout.cpu and layout.rollout_server == "sglang":
        raise LayoutError("--rollout-server sglang needs GPU nodes (--gpus-per-node >= 1)")
    slots = layout.ranks_per_node
    if not layout.cpu and slots % rtp:
        raise LayoutError(
            f"rollout.tensor_parallel_size={rtp} does not divide the {slots} GPUs of a rollout node"
        )


def _check_resumable(cfg: RunConfig) -> None:
    if not cfg.checkpoint.dir:
        raise LayoutError(
            "checkpoint.dir is not set: a job stopped at its time limit or preempted could not "
            "resume; set it to a directory on the shared filesystem"
        )
    if not cfg.checkpoint.resume:
        raise LayoutError("checkpoint.resume=false: a requeued job would start over; set it to true")


def _check_model(cfg: RunConfig, layout: SlurmLayout, hf_config: Path) -> None:
    from model_providers.hf_config import parse_hf_config

    try:
        hf = parse_hf_config(hf_config)
    except (OSError, ValueError, KeyError) as exc:
        raise LayoutError(f"cannot read {hf_config}: {exc}") from None
    from model_providers.moe_config import check_moe_config

    try:
        cfg.parallel.validate_model(**hf.layout_shape())
        check_moe_config(hf, cfg.model.moe)
    except ValueError as exc:
        raise LayoutError(f"{cfg.model.hf_path}: {exc}") from None
    rtp = cfg.rollout.tensor_parallel_size
    if layout.rollout_nodes and hf.num_heads % rtp:
        raise LayoutError(
            f"rollout.tensor_parallel_size={rtp} does not divide num_attention_heads={hf.num_heads} "
            f"of {cfg.model.hf_path}"
        )
