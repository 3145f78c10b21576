"""The run configuration: one typed schema, YAML files plus dotted command-line overrides.

`RunConfig` nests one small frozen dataclass per concern. Sections owned by other components are
their own config classes, reused here rather than redefined (one owner per concept):
`parallel` is the runtime's `ParallelConfig` (expert parallelism and the MoE token dispatcher
included), `model.moe` the model provider's `MoEConfig`, `rollout.kv` the serve engineer's
`KVCompressionConfig`, `rollout.sampling` the engine's `SamplingParams`, `loss.correction`,
`loss.policy` and `dgg` the loss engineer's `CorrectionConfig`, `PolicyLossConfig` and
`DGGConfig`, `sync.codec` the sync engineer's `CodecConfig`, `diloco` the islands' `DiLoCoConfig`
(used when `parallel.islands > 1`).

Everything is validated while the config is built, before any process group or model exists:
an unknown key names itself and lists the allowed keys; a bad value names the key and the allowed
values or type; a component's own `__post_init__` ValueError is re-raised prefixed with the dotted
key of its section (the conversion from plain data is `config_io`'s; this module is the schema).

    cfg = load_config("examples/demo.yaml", ["train.steps=20", "rollout.kv.budget=48"])
    text = to_yaml(cfg)                      # round-trips: load_config_text(text) == cfg
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from model_providers.moe_config import MoEConfig  # component configs owned elsewhere, as sections
from sparserl_mcore.agent.env import EnvConfig
from sparserl_mcore.config_io import ConfigError, apply_overrides, from_dict, to_dict, yaml_problem
from sparserl_mcore.diloco.config import DiLoCoConfig
from sparserl_mcore.loss.correction import CorrectionConfig
from sparserl_mcore.loss.dgg import DGGConfig
from sparserl_mcore.loss.policy import PolicyLossConfig
from sparserl_mcore.parallel.config import ParallelConfig
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
from sparserl_mcore.rollout.protocol import SamplingParams, check_temperature
from sparserl_mcore.sync.codec import CodecConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "apply_overrides",
    "config_from_dict",
    "from_dict",
    "load_config",
    "to_dict",
]


# ---------------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------------


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            raise ValueError(f"{name}={value!r}: must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy: an HF checkpoint directory (weights + tokenizer), loaded into megatron-core.

    ref_path: frozen reference policy for the KL term (defaults to hf_path when KL is on).
    moe: how a mixture-of-experts policy's routers train (`model_providers.moe_config.MoEConfig`;
    ignored for dense models).
    """

    hf_path: str
    ref_path: str | None = None
    params_dtype: Literal["fp32", "bf16"] = "bf16"
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if not self.hf_path:
            raise ValueError("hf_path is empty: point it at an HF checkpoint directory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Who generates and how: G samples per prompt with (optionally) compressed KV.

    engine: "embedded" runs the engine in the trainer process; "remote" talks to servers at `urls`
    over HTTP. server: what those servers are, since the two speak different weight-update routes:
    "sparserl" (`sparserl serve`: /update_weights_from_patch) or "sglang" (`sparserl sglang-serve`:
    SGLang's /update_weights_from_tensor with our loader, bracketed by pause / begin / end / flush /
    continue; `sparserl slurm` sets it for the servers it starts). token_env names an environment
    variable holding the servers' bearer token (the token itself never sits in a config file).
    request_timeout_s / max_retries bound how long a dead or hung engine can stall a step: a failed
    request (chunk) is retried up to max_retries times, after retry_backoff_s (doubling), on another
    engine when one is live; a removed engine is asked for health every probe_interval_s and comes
    back after a full weight sync (docs/rollout.md, "Faults").
    server_concurrency: requests each server is given at once (whole GRPO groups: at least one),
    so it can batch them; as slime's --sglang-server-concurrency. One group at a time would leave a
    server decoding batches of group_size.
    prefix_cache_across_versions: the embedded engine keeps its prefix cache over weight updates,
    so requests may reuse prompt KV an older version computed (servers: `sparserl serve
    --prefix-cache-across-versions`); off, no request reuses KV of an older version.
    tensor_parallel_size: GPUs per rollout server (SGLang's --tp-size) where servers are started
    for the run (`sparserl slurm`); the embedded engine runs on one device.
    router_url: an sglang-router in front of the SGLang servers at `urls` (server=sglang only):
    generation goes through it, weights and pauses still go to each of `urls` (the router does not
    proxy those routes). `sparserl slurm` starts one and sets it for SGLang rollout nodes.
    env: multi-turn episodes with an environment (`sparserl_mcore.agent.EnvConfig`, docs/agents.md)
    instead of one completion per sample; null: single-turn.
    manager: where the host rank's rollout client runs: "thread" in the learner's process (its
    HTTP, JSON and rewards on worker threads there), "process" in a rollout manager process of its
    own that the host feeds through a pipe (`trainer/rollout_manager.py`; `sparserl serve` servers
    and single-turn rollouts only; docs/async.md, "Rollout manager").
    """

    engine: Literal["embedded", "remote"] = "embedded"
    server: Literal["sparserl", "sglang"] = "sparserl"
    urls: tuple[str, ...] = ()
    router_url: str | None = None
    token_env: str | None = None
    tensor_parallel_size: int = 1
    group_size: int = 8
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    kv: KVCompressionConfig = dataclasses.field(default_factory=KVCompressionConfig)
    request_timeout_s: float = 600.0
    max_retries: int = 2
    retry_backoff_s: float = 0.5
    probe_interval_s: float = 10.0
    server_concurrency: int = 512
    prefix_cache_across_versions: bool = False
    env: EnvConfig | None = None
    manager: Literal["thread", "process"] = "thread"

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: GRPO needs >= 2 samples per prompt")
        if self.engine == "remote" and not self.urls:
            raise ValueError("engine='remote' needs urls: list the servers, e.g. urls=[http://host:30000]")
        if self.engine == "embedded" and self.urls:
            raise ValueError(
                f"urls={list(self.urls)} given but engine='embedded'; set engine=remote or drop urls"
            )
        if any(not u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"urls={list(self.urls)}: each must start with http:// or https://")
        twice = sorted({u for u in self.urls if [v.rstrip("/") for v in self.urls].count(u.rstrip("/")) > 1})
        if twice:
            raise ValueError(f"urls lists {', '.join(twice)} more than once: list each server once")
        if self.server == "sglang" and self.engine != "remote":
            raise ValueError("server='sglang' names remote servers: set engine=remote and urls, or drop it")
        if self.router_url is not None:
            if self.engine != "remote" or self.server != "sglang":
                raise ValueError(
                    "router_url fronts SGLang servers: set engine=remote, server=sglang and urls "
                    "(the workers), or drop it"
                )
            if not self.router_url.startswith(("http://", "https://")) or self.router_url in self.urls:
                raise ValueError(
                    f"router_url={self.router_url!r}: must be an http(s):// URL other than the worker urls"
                )
        _positive(self, "request_timeout_s", "tensor_parallel_size", "server_concurrency")
        if self.request_timeout_s > threading.TIMEOUT_MAX:  # its consumers wait on threading primitives
            raise ValueError(
                f"request_timeout_s={self.request_timeout_s:g}: must be <= {threading.TIMEOUT_MAX:g}"
            )
        if self.prefix_cache_across_versions and self.engine != "embedded":
            raise ValueError(
                "prefix_cache_across_versions configures the embedded engine; remote servers take "
                "`sparserl serve --prefix-cache-across-versions`: drop it here"
            )
        if self.max_retries < 0:
            raise ValueError(
                f"max_retries={self.max_retries}: must be >= 0 (0: a failed request is not retried)"
            )
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s={self.retry_backoff_s:g}: must be >= 0 seconds")
        if self.probe_interval_s < 0:
            raise ValueError(
                f"probe_interval_s={self.probe_interval_s:g}: must be >= 0 seconds (0: never probe)"
            )
        if self.manager == "process" and (
            self.engine != "remote" or self.server != "sparserl" or self.env is not None
        ):
            raise ValueError(
                "manager='process' runs the client of `sparserl serve` servers for single-turn "
                f"rollouts (got engine={self.engine!r}, server={self.server!r}, "
                f"env={'set' if self.env else None}): set manager=thread"
            )

    @property
    def groups_in_flight(self) -> int:
        """GRPO groups (the pool's chunks) each server is given at once."""
        return max(1, self.server_concurrency // self.group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Which verifier scores a completion: a key of `sparserl_mcore.rewards.REWARDS` or a
    `package.module:function` import path; kwargs are passed to it by name. null: "math_boxed",
    or with `rollout.env` none (the environment's Replies are the reward).

    timeout_s: the longest one call may take; the verifier runs in a process of its own
    (`rewards.runner`), killed past it, and the run stops naming the reward and the sample.
    skip_nonfinite: a NaN or infinite reward stops the run naming the sample (default); true drops
    that sample's whole group from the step instead, counted (`reward/nonfinite_skipped`) and logged.
    """

    name: str | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float = 60.0
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.name is not None and not self.name:
            raise ValueError("name is empty: use a registered reward or module:function")
        _positive(self, "timeout_s")
        if self.timeout_s > threading.TIMEOUT_MAX:
            raise ValueError(f"timeout_s={self.timeout_s:g}: must be <= {threading.TIMEOUT_MAX:g}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt datasets: local JSONL or Parquet files with a prompt column and an answer column.

    eval_path: held-out split; without it, `eval_fraction` of the train file is held out
    (deterministically, by the data seed) and never trained on.
    skip_bad_rows: a row whose prompt is empty, or too long to leave room for
    rollout.sampling.max_new_tokens in the model's context, is refused before launch naming its
    file and line (default); true drops such rows from either split, counted.
    """

    train_path: str
    eval_path: str | None = None
    eval_fraction: float = 0.0
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle: bool = True
    skip_bad_rows: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction}: must be in [0, 1)")
        if self.eval_path and self.eval_fraction:
            raise ValueError("eval_path and eval_fraction are both set; hold out by one of them only")
        for name in ("train_path", "prompt_key", "answer_key"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Periodic pass@1 on the held-out split, under dense and under compressed KV inference.

    every: steps between evaluations (0 = only at start and end); num_prompts: cap on evaluated
    prompts (None = all); temperature 0 = greedy decoding.
    """

    every: int = 0
    num_prompts: int | None = None
    temperature: float = 0.0
    dense: bool = True
    compressed: bool = True
    at_start: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every}: must be >= 0 (0 = start and end only)")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts}: must be >= 1 or null (all)")
        check_temperature(self.temperature)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Megatron dist checkpoints (model, optimizer, RNG, data position, DGG, sync version).

    every: steps between saves (0 = only at the end, if dir is set); resume: continue from the
    latest complete checkpoint in dir when one exists; save_hf: export final HF safetensors here.
    """

    dir: str | None = None
    every: int = 0
    keep_last: int = 2
    resume: bool = True
    save_hf: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every}: must be >= 0")
        if self.every and not self.dir:
            raise ValueError(f"every={self.every} but dir is not set; set checkpoint.dir")
        if self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last}: must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    """Metrics sinks. JSONL is always written (dir/metrics.jsonl); the others when enabled.

    wandb_project: log to Weights & Biases (imported only then); plot: PNG summary at the end.
    """

    dir: str = "runs/default"
    tensorboard: bool = False
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    progress: bool = True
    gpu_stats: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("dir is empty: metrics.jsonl and the plot are written there")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam(W) for the learner (megatron-core optimizer). Defaults: Sparse-RL's setup.

    distributed: megatron's distributed optimizer (fp32 master weights and Adam state sharded over
    the data-parallel ranks; with bf16 params, megatron's standard mixed precision). It runs on CPU
    too (parallel/cpu_mode.py); false: megatron's replicated optimizer.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    distributed: bool = True

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas}: each must be in [0, 1)")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.lr_warmup_steps < 0:
            raise ValueError("weight_decay, clip_grad and lr_warmup_steps must be >= 0 (clip_grad 0 = off)")


MAX_SEED = 2**31  # train.seed: numpy's legacy seeding takes [0, 2**32), minus stage and step offsets


ASYNC_MODES = ("off", "one_step", "in_flight")
# train.async.max_staleness at most: the loss and the metrics hold one histogram bin per lag, and a
# batch generated further ahead trains on a policy this many updates old (docs/async.md).
MAX_STALENESS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous RL (`train.async`): rollouts for the next steps are generated while the learner
    updates. One loop either way: the rollout phase is a producer the update consumes, and "off" is
    the case where it runs 0 batches ahead (docs/async.md).

    mode: "off" -- synchronous (generate, update, sync), today's loop exactly; "one_step" --
    verl's one-step-off-policy: batch s+1 is generated under the weights of step s-1 while step s
    trains, and the sync waits for that generation to end (every sample has one version, lag 1);
    "in_flight" -- PipelineRL-style: generation never waits for the learner, each sync lands
    between two decode steps of the running requests, which keep their KV (a sample may span
    versions; every token carries the version that sampled it).
    max_staleness: eta, in policy versions. A batch starts generating only when the lag of its
    first token at train time cannot exceed eta (in_flight runs up to eta batches ahead;
    one_step exactly 1); a token older than eta when its batch trains leaves the loss, counted
    (`staleness/masked_tokens`).
    """

    mode: Literal["off", "one_step", "in_flight"] = "off"
    max_staleness: int = 1

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(
                f"max_staleness={self.max_staleness}: must be >= 1 (staleness 0 is mode=off, the "
                "synchronous loop)"
            )
        if self.max_staleness > MAX_STALENESS:
            raise ValueError(
                f"max_staleness={self.max_staleness}: must be <= {MAX_STALENESS} (each lag is one bin of "
                "the loss's staleness histogram, and tokens that old carry little signal)"
            )
        if self.mode == "one_step" and self.max_staleness != 1:
            raise ValueError(
                f"max_staleness={self.max_staleness} with mode=one_step, which runs exactly one batch "
                "ahead: set max_staleness=1, or mode=in_flight to run further ahead"
            )

    @property
    def ahead(self) -> int:
        """Batches generated beyond the one being trained (0: synchronous)."""
        return 0 if self.mode == "off" else self.max_staleness


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop's size. A step samples prompts_per_step * rollout.group_size sequences, then
    updates on them in optimizer steps of global_batch_size sequences, micro_batch_size sequences
    per forward/backward on each data-parallel rank, for reuse_epochs passes over the batch
    (K, batch reuse: 1 = single-use GRPO; with `dgg.enabled` DGG may end the reuse early).

    max_empty_steps: the run stops (exit code 5, naming the cause) after this many consecutive
    steps that trained nothing: no tokens generated, no reward variance, or every update skipped as
    non-finite (0 = never stop).
    """

    steps: int = 100
    seed: int = 1234
    prompts_per_step: int = 32
    global_batch_size: int = 256
    micro_batch_size: int = 4
    reuse_epochs: int = 1
    filter_zero_variance_groups: bool = True
    max_empty_steps: int = 3
    async_: AsyncConfig = dataclasses.field(default_factory=AsyncConfig, metadata={"key": "async"})

    def __post_init__(self) -> None:
        _positive(self, "steps", "prompts_per_step", "global_batch_size", "micro_batch_size", "reuse_epochs")
        if self.max_empty_steps < 0:
            raise ValueError(f"max_empty_steps={self.max_empty_steps}: must be >= 0 (0 = never stop)")
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(
                f"seed={self.seed}: must be in [0, {MAX_SEED - 1}] (numpy seeds take 32 bits, and "
                "megatron adds 100 per pipeline stage)"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The RL objective: the loss engineer's Sparse-RL correction and policy-loss configs, plus the
    GRPO advantage normalisation (divide by the group std, or only centre)."""

    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
    policy: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    advantage_std_normalize: bool = True
    # learner log-probs through the LM head fused with the log-prob, response rows only
    # (docs/loss.md); false: megatron's output layer + vocab_parallel_logprobs (bit-identical to
    # the loop before the fused head)
    fused_logprob: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class BroadcastConfig:
    """Full syncs (start, resume, fallback) into SGLang workers as bucketed broadcasts from learner
    rank 0 over SGLang's weight-update group (NCCL on GPUs, gloo on CPU) instead of HTTP fragments.

    master_address: learner rank 0's host as the SGLang workers reach it (null: the address rank 0
    reaches the first worker from, which is right unless a NAT sits between them); master_port: a
    free port there for the group's TCP store; bucket_mb: MiB per broadcast (rank 0 and each worker
    hold one bucket at a time besides the model).
    """

    master_address: str | None = None
    master_port: int = 29700
    bucket_mb: int = 512

    def __post_init__(self) -> None:
        if self.master_address == "":
            raise ValueError("master_address is empty: name learner rank 0's host, or null to find it")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port}: must be a TCP port (1..65535)")
        _positive(self, "bucket_mb")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Sparse BF16 weight sync from the learner to every rollout engine.

    codec: the sync engineer's patch encoding (value encoding, zstd level); every: steps between
    syncs. How patches travel follows rollout.engine: in process to the embedded engine, over the
    weight route to remote servers. broadcast: how full syncs reach SGLang workers (null: as
    fragments over HTTP, like the sparse ones).
    """

    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
    every: int = 1
    broadcast: BroadcastConfig | None = None

    def __post_init__(self) -> None:
        _positive(self, "every")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs; built by `load_config`, never by reading globals."""

    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    dgg: DGGConfig = dataclasses.field(default_factory=DGGConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = dataclasses.field(default_factory=TelemetryConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    diloco: DiLoCoConfig = dataclasses.field(default_factory=DiLoCoConfig)

    def __post_init__(self) -> None:
        self._check_reward()
        rollout_seqs = self.train.prompts_per_step * self.rollout.group_size
        if rollout_seqs % self.train.global_batch_size:
            raise ValueError(
                f"train.prompts_per_step * rollout.group_size = {self.train.prompts_per_step} * "
                f"{self.rollout.group_size} = {rollout_seqs} sequences per step is not a multiple of "
                f"train.global_batch_size={self.train.global_batch_size}"
            )
        if self.sync.broadcast is not None and self.rollout.server != "sglang":
            raise ValueError(
                "sync.broadcast sends full syncs over SGLang's weight-update group: it needs "
                f"rollout.server=sglang (got {self.rollout.server!r}); drop it"
            )
        if self.train.async_.mode != "off":
            self._check_async()
        if self.model.moe.routing_replay and self.rollout.server == "sglang" and self.rollout.kv.enabled:
            raise ValueError(
                f"model.moe.routing_replay=true with rollout.server=sglang and rollout.kv.method="
                f"{self.rollout.kv.method}: SGLang reads routed experts back by KV slot, and the KV "
                "plugin moves kept entries to other slots, so the ids would belong to other tokens; set "
                "rollout.kv.method=none (or use rollout.server=sparserl, whose engine records them as fed)"
            )
        if self.model.moe.routing_replay and self.rollout.router_url is not None:
            raise ValueError(
                "model.moe.routing_replay=true with rollout.router_url: sglang-router 0.3.2 drops "
                "return_routed_experts from the requests it forwards, so no sample would come back "
                "with its routing; send to the workers directly (drop rollout.router_url)"
            )
        if self.rollout.sampling.seed is not None:
            raise ValueError(
                f"rollout.sampling.seed={self.rollout.sampling.seed}: training seeds every request "
                "from train.seed (so a resumed run draws the same samples); leave it null"
            )

    def _check_reward(self) -> None:
        """reward.name defaults to math_boxed; with an environment the Replies are the reward, and a
        verifier of completions has nothing to score."""
        if self.rollout.env is None:
            if self.reward.name is None:
                object.__setattr__(self, "reward", dataclasses.replace(self.reward, name="math_boxed"))
        elif self.reward.name is not None or self.reward.kwargs:
            raise ValueError(
                f"reward.name={self.reward.name} with rollout.env.name={self.rollout.env.name}: an "
                "environment's Replies are the episode's reward, a completion verifier cannot apply; "
                "drop the reward section (reward: {})"
            )

    def _check_async(self) -> None:
        mode = self.train.async_.mode
        if self.sync.every != 1:
            raise ValueError(
                f"train.async.mode={mode} with sync.every={self.sync.every}: asynchronous rollouts need "
                "every step's weights at the engines (staleness counts versions); set sync.every=1"
            )
        if self.loss.correction.mode == "off":
            raise ValueError(
                f"train.async.mode={mode} with loss.correction.mode=off: stale samples need the behavior "
                "correction (pi_old / pi_sampler per token); set loss.correction.mode to tis or sparse_rl"
            )


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> RunConfig:
    """Validate plain data (+ dotted overrides) into a `RunConfig`; raises ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a run config is a mapping of sections, got {type(data).__name__}")
    return from_dict(RunConfig, apply_overrides(data, overrides))


def load_config_text(text: str, overrides: Sequence[str] = ()) -> RunConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {yaml_problem(exc)}") from None
    return config_from_dict(data or {}, overrides)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML run config and apply `key.sub=value` overrides; errors name the file and key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        return load_config_text(text, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def to_yaml(cfg: RunConfig) -> str:
    """The complete config (defaults included) as YAML that `load_config_text` reads back equal."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
