"""Build the parts a `loop.Trainer` drives from a `RunConfig`: the learner on every rank, engines
on the host rank.

Config translation lives here (the run schema -> each component's own small config), so the
components never see the run schema.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.agent import resolve_env
from sparserl_mcore.agent.render import build_renderer
from sparserl_mcore.agent.runner import EpisodeRunner
from sparserl_mcore.ckpt.convert import save_hf
from sparserl_mcore.ckpt.hf_io import load_hf_weights
from sparserl_mcore.ckpt.layout import layout_for
from sparserl_mcore.config import RunConfig, to_dict
from sparserl_mcore.diloco.agreed import AgreedWeights
from sparserl_mcore.diloco.optimizer import with_islands
from sparserl_mcore.loss import megatron_step
from sparserl_mcore.loss.dgg import DynamicGradientGate
from sparserl_mcore.rewards.runner import RewardRunner
from sparserl_mcore.rollout.protocol import SamplingParams
from sparserl_mcore.sglang.dense_sync import DenseSyncConfig, address_towards
from sparserl_mcore.telemetry import MetricsLogger
from sparserl_mcore.trainer import learner as learner_lib
from sparserl_mcore.trainer.engine_pool import EnginePool, EventSink, Fleet, PoolConfig
from sparserl_mcore.trainer.evaluate import Evaluator
from sparserl_mcore.trainer.learner import unwrap_model
from sparserl_mcore.trainer.prompts import PromptData, decode_ids, load_tokenizer
from sparserl_mcore.trainer.rollout_manager import RolloutManager, Scoring
from sparserl_mcore.trainer.rollouts import HOST_RANK, Prompt, RewardFn, request_seed
from sparserl_mcore.trainer.run_record import latest_checkpoint, read_saved_run
from sparserl_mcore.trainer.weight_sync import WeightSyncer


def update_config(cfg: RunConfig, vocab_size: int) -> megatron_step.UpdateConfig:
    return megatron_step.UpdateConfig(
        micro_batch_size=cfg.train.micro_batch_size,
        epochs=cfg.train.reuse_epochs,
        temperature=cfg.rollout.sampling.temperature or 1.0,
        vocab_size=vocab_size,
        correction=cfg.loss.correction,
        policy=cfg.loss.policy,
        max_staleness=cfg.train.async_.max_staleness if cfg.train.async_.mode != "off" else None,
        fused_logprob=cfg.loss.fused_logprob,
        max_turns=cfg.rollout.env.max_turns if cfg.rollout.env is not None else None,
    )


@dataclasses.dataclass
class Learner:
    """The policy being trained and what checkpoints/sync/update need of it."""

    model: Any
    optimizer: Any
    scheduler: Any
    spec: Any
    layout: Any
    gate: DynamicGradientGate
    update_cfg: megatron_step.UpdateConfig
    outer: Any = None  # diloco.outer.OuterStep with parallel.islands > 1 (its optimizer drives it)

    def dgg_state(self) -> dict:
        return self.gate.state_dict()

    def load_dgg_state(self, state: dict) -> None:
        if state:
            self.gate.load_state_dict(state)

    def export_hf(self, out: str, *, runtime: Any, source_dir: str) -> Path:
        """Collective: the policy as HF safetensors in its params dtype (+ config/tokenizer of
        `source_dir`), replacing `out` atomically (`ckpt.convert.save_hf`)."""
        return save_hf(unwrap_model(self.model), self.spec, runtime, out, hf_config_dir=source_dir)


def build_learner(cfg: RunConfig, runtime: Any, *, padded_vocab_size: int | None = None) -> Learner:
    """The policy loaded from the HF checkpoint; `padded_vocab_size`: a checkpoint's, when resuming."""
    spec, model = learner_lib.build_model(
        cfg.model.hf_path,
        cfg.model.params_dtype,
        runtime,
        padded_vocab_size=padded_vocab_size,
        moe=cfg.model.moe,
    )
    layout = layout_for(spec)
    load_hf_weights(
        model,
        layout,
        cfg.model.hf_path,
        tp_rank=runtime.tp_rank,
        pp_rank=runtime.pp_rank,
        ep_rank=runtime.ep_rank,
    )
    ddp = learner_lib.wrap_ddp(model, spec, runtime, distributed_optimizer=cfg.optimizer.distributed)
    optimizer, scheduler = learner_lib.build_optimizer(ddp, cfg.optimizer, spec, runtime)
    outer = None
    if runtime.islands > 1:  # the outer step rides on the optimizer step the update already makes
        optimizer = with_islands(optimizer, ddp, cfg.diloco, runtime)
        outer = optimizer.outer
    return Learner(
        model=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        spec=spec,
        layout=layout,
        gate=DynamicGradientGate(cfg.dgg),
        update_cfg=update_config(cfg, spec.vocab_size),
        outer=outer,
    )


def build_reference(cfg: RunConfig, runtime: Any) -> torch.nn.Module | None:
    """Frozen pi_ref for the KL term (only when loss.policy.kl_coef > 0)."""
    if cfg.loss.policy.kl_coef == 0:
        return None
    path = cfg.model.ref_path or cfg.model.hf_path
    spec, model = learner_lib.build_model(path, cfg.model.params_dtype, runtime, moe=cfg.model.moe)
    load_hf_weights(
        model,
        layout_for(spec),
        path,
        tp_rank=runtime.tp_rank,
        pp_rank=runtime.pp_rank,
        ep_rank=runtime.ep_rank,
    )
    model.eval().requires_grad_(False)
    return model


def build_engines(cfg: RunConfig, *, compressed: bool, device: Any) -> dict[str, Any]:
    """Host rank only: the rollout engines (compressed KV as configured) or a dense eval engine;
    an embedded engine lives on `device`, the host rank's own (its learner's GPU on a GPU node)."""
    rc = cfg.rollout
    if rc.engine == "remote" and compressed:
        from sparserl_mcore.rollout.client import RemoteEngine
        from sparserl_mcore.sglang.client import SGLangRouter, SGLangWorker

        token = os.environ.get(rc.token_env) if rc.token_env else None
        shape = None  # rollout routing replay: the (layers, top_k) routed experts are read back in
        if cfg.model.moe.routing_replay:
            from sparserl_mcore.trainer.routing_replay import RoutingShape

            routing = RoutingShape.of_checkpoint(cfg.model.hf_path)
            shape = None if routing is None else (routing.layers, routing.top_k)
        if rc.router_url is not None:  # generation only: weights go to the workers (WeightSyncer)
            router = SGLangRouter(
                rc.router_url,
                concurrency=len(rc.urls) * rc.groups_in_flight,
                chunk_size=rc.group_size,
                timeout=rc.request_timeout_s,
                retries=rc.max_retries,  # per request: the router sends each retry to a live worker
                backoff_s=rc.retry_backoff_s,
                workers=[SGLangWorker(u, token, timeout=rc.request_timeout_s, retries=0) for u in rc.urls],
            )
            return {rc.router_url: router}
        # retries=0: the pool retries a failed chunk itself, on another server when one is live
        client = SGLangWorker if rc.server == "sglang" else RemoteEngine
        return {
            url: client(
                url,
                token,
                timeout=rc.request_timeout_s,
                retries=0,
                concurrency=rc.groups_in_flight,
                routed_experts_shape=shape,
            )
            for url in rc.urls
        }
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig

    kv = rc.kv if compressed else KVCompressionConfig(method="none")
    name = "embedded" if compressed else "embedded-dense"
    engine_cfg = EngineConfig(
        device=str(device),
        kv_compression=kv,
        seed=cfg.train.seed,
        prefix_cache_across_versions=rc.prefix_cache_across_versions,
    )
    return {name: EmbeddedEngine(cfg.model.hf_path, engine_cfg)}


@dataclasses.dataclass
class Parts:
    """What the loop drives. pool / dense_pool exist on the host rank only (None elsewhere)."""

    learner: Learner
    ref: torch.nn.Module | None
    pool: Fleet | None
    dense_pool: EnginePool | None
    data: PromptData
    reward_fn: Any
    reward: (
        RewardRunner | None
    )  # the reward's process (host rank, started at its first call); None: rollout.env
    episodes: EpisodeRunner | None  # rollout.env on the host rank: runs the step's episodes
    syncer: WeightSyncer
    evaluator: Evaluator
    telemetry: MetricsLogger
    kv_bytes_per_token: int


def pool_config(cfg: RunConfig) -> PoolConfig:
    """The engine pool's settings from `rollout` (in the learner's process or the rollout manager's)."""
    return PoolConfig(
        chunk_size=cfg.rollout.group_size,
        chunk_timeout_s=cfg.rollout.request_timeout_s,
        max_attempts=cfg.rollout.max_retries + 1,
        retry_backoff_s=cfg.rollout.retry_backoff_s,
        probe_interval_s=cfg.rollout.probe_interval_s,
    )


def rollout_manager(cfg: RunConfig, on_event: EventSink) -> RolloutManager:
    """`rollout.manager: process`: the host's engine pool and rewards in a process of their own
    (the factories are pickled to it; `sparserl serve` clients only, so no device)."""
    return RolloutManager(
        partial(build_engines, cfg, compressed=True, device="cpu"),
        pool_config(cfg),
        scoring(cfg),
        partial(manager_reward, cfg),
        on_event,
    )


def scoring(cfg: RunConfig) -> Scoring:
    return Scoring(
        group_size=cfg.rollout.group_size,
        sampling=cfg.rollout.sampling,
        run_seed=cfg.train.seed,
        return_routed_experts=cfg.model.moe.routing_replay,
    )


def build_reward(
    cfg: RunConfig, decode: Callable[[tuple[int, ...]], str]
) -> tuple[RewardRunner | None, RewardFn]:
    """The verifier's process (started at its first call) and the reward of one sample: the
    verifier on its decoded completion, or with rollout.env the episode's own (its Replies)."""
    rc = cfg.reward
    reward = (
        RewardRunner(rc.name, rc.kwargs, timeout_s=rc.timeout_s, skip_nonfinite=rc.skip_nonfinite)
        if rc.name is not None
        else None
    )

    def reward_fn(sample: Any, prompt: Prompt) -> float:
        if reward is None:
            return float(sample.reward)
        return reward(decode(sample.output_ids), prompt.answer, sample=sample.rid)

    return reward, reward_fn


def manager_reward(cfg: RunConfig) -> tuple[RewardFn, Callable[[], None]]:
    """The rollout manager's rewards (`rollout.manager: process`): its own tokenizer and verifier
    process, scoring as the learner's would; and what closes them."""
    tokenizer = load_tokenizer(cfg.model.hf_path)
    reward, reward_fn = build_reward(cfg, partial(decode_ids, tokenizer))
    return reward_fn, (reward.close if reward is not None else lambda: None)


def kv_bytes_per_token(spec: Any, runtime: Any) -> int:
    """K+V bytes one token takes over all layers in the embedded engine (fp32 on CPU, bf16 on GPU)."""
    element = 4 if runtime.cpu else 2
    return 2 * spec.hf.num_layers * spec.hf.num_kv_heads * spec.hf.head_dim * element


def broadcast_config(cfg: RunConfig, runtime: Any) -> DenseSyncConfig | None:
    """`sync.broadcast` for this rank: NCCL from its GPU, or gloo on a CPU learner."""
    bc = cfg.sync.broadcast
    if bc is None:
        return None
    return DenseSyncConfig(
        master_address=bc.master_address or address_towards(cfg.rollout.urls[0]),
        master_port=bc.master_port,
        backend="gloo" if runtime.cpu else "nccl",
        device=str(runtime.device),
        bucket_bytes=bc.bucket_mb * 2**20,
        timeout_s=cfg.rollout.request_timeout_s,
    )


def build_parts(cfg: RunConfig, runtime: Any, *, resume_from: Path | None = None) -> Parts:
    """Every part of a run on this rank; `resume_from`: the checkpoint it continues (its padded
    vocabulary is kept)."""
    host = runtime.rank == HOST_RANK
    log = MetricsLogger(
        cfg.telemetry,
        enabled=host,
        run_config=to_dict(cfg),
        device_index=runtime.local_rank,
        resume_step=read_saved_run(resume_from).step if resume_from else None,
        async_mode=cfg.train.async_.mode,
    )
    pool_cfg = pool_config(cfg)
    engines = partial(build_engines, cfg, device=runtime.device)
    pool: Fleet | None = None
    if host and cfg.rollout.manager == "process":  # started first: it starts while the learner builds
        pool = rollout_manager(cfg, log.event)
    elif host:
        pool = EnginePool(engines(compressed=True), pool_cfg, log.event)
    dense_pool = None
    if host and cfg.eval.dense:
        dense_pool = EnginePool(engines(compressed=False), pool_cfg, log.event)
    data = PromptData(
        cfg.data,
        cfg.model.hf_path,
        seed=cfg.train.seed,
        max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        context=parse_hf_config(cfg.model.hf_path).max_position_embeddings,
    )
    reward, reward_fn = build_reward(cfg, data.decode)
    saved = read_saved_run(resume_from).layout if resume_from else None
    learner = build_learner(cfg, runtime, padded_vocab_size=saved.padded_vocab_size if saved else None)
    remote = cfg.rollout.engine == "remote"
    syncer = WeightSyncer(
        learner.model,
        learner.layout,
        runtime,
        cfg.sync.codec,
        log.event,
        remote_urls=cfg.rollout.urls if remote else (),  # every learner rank sends its own fragment
        remote_server=cfg.rollout.server,
        router_url=cfg.rollout.router_url,
        token=os.environ.get(cfg.rollout.token_env) if remote and cfg.rollout.token_env else None,
        timeout_s=cfg.rollout.request_timeout_s,
        broadcast=broadcast_config(cfg, runtime) if remote else None,
        in_flight=cfg.train.async_.mode == "in_flight",
        # islands: engines only ever get the agreed weights (island 0's ranks send them)
        agreed=AgreedWeights(learner.outer, sender=runtime.island == 0) if learner.outer else None,
    )
    runner = partial(episode_runner, cfg, data) if cfg.rollout.env is not None else None
    evaluator = Evaluator(
        cfg.eval,
        data.eval_prompts(cfg.eval.num_prompts),
        reward_fn,
        cfg.rollout,
        seed=cfg.train.seed,
        group=runtime.learner_group,
        episodes=runner,
    )
    return Parts(
        learner=learner,
        ref=build_reference(cfg, runtime),
        pool=pool,
        dense_pool=dense_pool,
        data=data,
        reward_fn=reward_fn,
        reward=reward,
        episodes=runner(pool, cfg.rollout.sampling)
        if runner is not None and isinstance(pool, EnginePool)
        else None,
        syncer=syncer,
        evaluator=evaluator,
        telemetry=log,
        kv_bytes_per_token=kv_bytes_per_token(learner.spec, runtime),
    )


def episode_runner(
    cfg: RunConfig, data: PromptData, pool: EnginePool, sampling: SamplingParams
) -> EpisodeRunner:
    """rollout.env's episodes over `pool`, sampled with `sampling` (train or eval), seeded from
    train.seed; the context is the policy's max_position_embeddings."""
    from transformers import AutoConfig

    env = cfg.rollout.env
    assert env is not None
    hf = AutoConfig.from_pretrained(cfg.model.hf_path)
    eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
    eos = [t for t in (*eos, data.tokenizer.eos_token_id) if t is not None]
    return EpisodeRunner(
        pool,
        resolve_env(env.name),
        env,
        build_renderer(env.renderer, data.tokenizer, tool_role=env.tool_role),
        lambda ids: data.decode(tuple(ids)),
        sampling=sampling,
        context_length=hf.max_position_embeddings,
        eos_token_ids=eos,
        seed_of=partial(request_seed, cfg.train.seed),
    )


def resume_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint this run continues from, if any (checkpoint.dir with resume on)."""
    ckpt = cfg.checkpoint
    return latest_checkpoint(ckpt.dir) if ckpt.dir and ckpt.resume else None
