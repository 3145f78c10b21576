"""The RL loop. `train(cfg)` runs on every learner rank; one step is the list in `Trainer.step`:

    admit prompts -> take the step's rollouts (host rank, one engine interface) with rewards
    -> GRPO advantages -> dense pi_old (+ pi_ref) recompute -> up to K update epochs with DGG
    -> sparse weight sync -> periodic eval (dense and compressed KV) -> metrics -> checkpoint

The rollout phase is a producer the update consumes (trainer/producer.py). Admission: batch b is
submitted at the start of step b - ahead (ahead = 0 synchronous, `train.async.max_staleness`
asynchronous), when the engines hold the learner's current version, so no token of it can be more
than `ahead` versions old when step b trains on it. `train.async.mode=off` is ahead 0: the batch is
generated when taken, exactly the synchronous loop.

Before each step the ranks agree whether a stop signal (SIGUSR1 ahead of a Slurm time limit,
SIGTERM, SIGINT) arrived anywhere; if so they checkpoint and end cleanly (trainer/preemption.py).

Collective discipline: every rank walks the same steps in the same order; whatever only the host
rank knows (samples, rewards, engine failures, eval scores) reaches the others by broadcast.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from sparserl_mcore import parallel
from sparserl_mcore.agent.metrics import episode_metrics
from sparserl_mcore.agent.trajectory import Episode
from sparserl_mcore.config import RunConfig, to_dict
from sparserl_mcore.loss import megatron_step
from sparserl_mcore.rewards.runner import RewardError
from sparserl_mcore.rollout.protocol import Sample
from sparserl_mcore.telemetry import RunProgress
from sparserl_mcore.trainer import checkpoint, moe_routing, routing_replay, run_layout
from sparserl_mcore.trainer.batch import RolloutBatch, build_batch, informative_rows
from sparserl_mcore.trainer.empty_steps import (
    EmptySteps,
    NothingTrainedError,
    drop_nonfinite_groups,
    empty_cause,
    trained_signal,
)
from sparserl_mcore.trainer.engine_pool import NoEngineLeftError
from sparserl_mcore.trainer.preemption import StopRequest
from sparserl_mcore.trainer.producer import Produced, RolloutProducer
from sparserl_mcore.trainer.rollout_manager import RolloutManager
from sparserl_mcore.trainer.rollouts import HOST_RANK, Prompt, run_episodes_on_host, score_on_host
from sparserl_mcore.trainer.run_layout import RunLayout
from sparserl_mcore.trainer.run_record import read_saved_run
from sparserl_mcore.trainer.run_summary import (
    EXIT_NO_ENGINE,
    EXIT_NOTHING_TRAINED,
    EXIT_OK,
    EXIT_REWARD,
    RunSummary,
    step_info,
)
from sparserl_mcore.trainer.setup import Parts, build_parts, resume_checkpoint
from sparserl_mcore.trainer.step_metrics import StepTimer, rollout_metrics
from sparserl_mcore.trainer.versions import PolicyVersions


@dataclasses.dataclass
class LoopState:
    """What a checkpoint must carry besides model/optimizer/scheduler/RNG to resume exactly."""

    step: int = 0  # completed RL steps
    sync_version: int = 0  # weight version the rollout engines hold
    rollouts: int = 0  # sequences sampled so far (x-axis of sample efficiency)
    skipped_updates: int = 0  # non-finite loss/gradient updates dropped
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    dgg: dict[str, Any] = dataclasses.field(default_factory=dict)
    versions: list[int] = dataclasses.field(default_factory=list)  # published, see trainer/versions.py
    diloco: dict[str, Any] = dataclasses.field(default_factory=dict)  # outer-step counters (islands)
    synced_inner: float = 0.0  # islands: inner steps taken when the engines' anchor was made


def train(cfg: RunConfig) -> RunSummary:
    """Initialise this rank, run the loop, tear down (also on error): engines closed, process
    groups destroyed, so nothing the run started outlives it."""
    runtime = parallel.initialize(cfg.parallel, seed=cfg.train.seed)
    try:
        if cfg.checkpoint.dir:
            checkpoint.start_checkpoint_writer()
        resume_from = resume_checkpoint(cfg)
        parts = build_parts(cfg, runtime, resume_from=resume_from)
        layout = run_layout.requested_layout(cfg, runtime.world_size, parts.learner.spec.padded_vocab_size)
        trainer = Trainer(cfg, runtime, parts, layout=layout, resume_from=resume_from)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    finally:
        parallel.shutdown()


class Trainer:
    """Holds the parts built by `setup.build_parts`; `fit` drives them step by step."""

    def __init__(
        self, cfg: RunConfig, runtime: Any, parts: Parts, *, layout: RunLayout, resume_from: Path | None
    ):
        self.cfg, self.runtime, self.parts = cfg, runtime, parts
        self._routing = (
            routing_replay.RoutingShape.of_checkpoint(cfg.model.hf_path)
            if cfg.model.moe.routing_replay
            else None
        )
        self.layout, self.resume_from = layout, resume_from  # this run's layout; checkpoint or None
        self.state = LoopState()
        self._weights_changed = False  # an update was applied since the last sync
        self._started = time.monotonic()
        self._first_step = 0
        self._rewards: list[float] = []  # mean reward of this run's first and latest step
        self._saved_step = -1  # step of the last checkpoint this process wrote
        self.versions = PolicyVersions()
        self.producer = RolloutProducer(
            self._score,
            ahead=cfg.train.async_.ahead,
            host=runtime.rank == HOST_RANK,
            group=runtime.learner_group,
            abort=self._abort_generation,
        )
        self._submitted_through = 0  # the last step whose batch was submitted
        self._updates_applied = 0  # optimizer updates this process applied (the summary reports it)
        self.empty_steps = EmptySteps(cfg.train.max_empty_steps)

    # -- the run -------------------------------------------------------------------------------
    def fit(self) -> RunSummary:
        p = self.parts
        show = p.telemetry.enabled and self.cfg.telemetry.progress
        with RunProgress(
            self.cfg.train.steps, enabled=show, console=getattr(p.telemetry, "console", None)
        ) as bars:
            self.progress = bars
            if p.pool is not None:
                p.pool.on_chunk_done = bars.advance_rollouts
            with StopRequest(ignore_after=True) as stop:
                return self._fit(stop)

    def _fit(self, stop: StopRequest) -> RunSummary:
        self._log_islands()
        self.resume()
        self._first_step = self.state.step
        self.progress.step_done(self.state.step)
        p = self.parts
        if self.cfg.eval.at_start and self.state.step == 0:
            self._log_eval()
        try:
            while self.state.step < self.cfg.train.steps:
                signum = stop.agreed(self.runtime.device)  # collective, at every step boundary
                if signum is not None:
                    return self._stopped(signum.name)
                self.step()
                if self._checkpoint_due():
                    self.save()
        except NoEngineLeftError as exc:
            ckpt = self.save(sync_engines=False) if self.cfg.checkpoint.dir else None
            p.telemetry.event("stopped", {"reason": str(exc), "checkpoint": str(ckpt)})
            return self._summary(EXIT_NO_ENGINE, ckpt, message=f"no rollout engine left: {exc}")
        except (RewardError, NothingTrainedError) as exc:  # nothing worth a checkpoint was made
            p.telemetry.event("stopped", {"reason": str(exc), "step": self.state.step}, show=False)
            code = EXIT_REWARD if isinstance(exc, RewardError) else EXIT_NOTHING_TRAINED
            return self._summary(code, None, message=str(exc))
        if self.cfg.eval.every == 0 or self.state.step % self.cfg.eval.every:
            self._log_eval()
        ckpt = self.save() if self.cfg.checkpoint.dir else None
        hf = None
        if self.cfg.checkpoint.save_hf:
            hf = p.learner.export_hf(
                self.cfg.checkpoint.save_hf, runtime=self.runtime, source_dir=self.cfg.model.hf_path
            )
        return self._summary(EXIT_OK, ckpt, hf=hf)

    def step(self) -> None:
        """One RL step, as a list of named steps."""
        cfg, p, step = self.cfg, self.parts, self.state.step + 1
        timer, started = StepTimer(), time.perf_counter()
        self._readmit()
        self._admit(step)
        if self.producer.ahead:
            self.progress.phase("rollouts (generated ahead)")
        else:
            self.progress.rollouts(cfg.train.prompts_per_step * cfg.rollout.group_size)
        lag = self._policy_lag()
        with timer("rollout"):  # asynchronous: how long the learner waited for the batch
            produced = self.producer.take(step)
        samples, rewards, metrics = self._finite_groups(produced, step)
        batch, informative, updates_per_epoch = self._train_batch(step, samples, rewards, metrics)
        if self.producer.ahead:
            metrics["rollout/generate_s"] = produced.generate_s
        metrics.update(lag)
        if p.pool is not None:  # host: the fleet's state (docs/rollout.md, "Faults")
            metrics["engines/live"] = float(len(p.pool))
            if (workers := p.pool.workers_live()) is not None:  # behind rollout.router_url
                metrics["engines/workers_live"] = float(workers)
            metrics["rollout/requests_retried"] = float(p.pool.take_requests_retried())
        if batch is not None and batch.size:
            with timer("update"):
                metrics.update(self.update(batch, updates_per_epoch))
            self._weights_changed |= metrics["train/updates"] > 0 and p.learner.outer is None
        self._updates_applied += int(metrics.get("train/updates", 0))
        cause = empty_cause(
            samples,
            rewards,
            metrics,
            informative=informative,
            trained_signal=batch is not None and trained_signal(batch),
            skipped_groups=len(produced.samples) // cfg.rollout.group_size,
        )
        if p.learner.outer is not None:
            metrics.update(self._outer_steps(closing=step == cfg.train.steps))
        if step % cfg.sync.every == 0 and self._weights_changed:  # skipped/gated-only: version kept
            self.progress.phase("sync")
            with timer("sync"):
                metrics.update(self.sync_weights(step))
        if cfg.eval.every and step % cfg.eval.every == 0:
            with timer("eval"):
                metrics.update(self.evaluate())
        self.state.step, self.state.rollouts = step, self.state.rollouts + len(produced.samples)
        metrics.update(timer.metrics(), **{"train/rollouts": self.state.rollouts})
        metrics["time/step_s"] = time.perf_counter() - started
        p.telemetry.log(metrics, step=step)
        if "rollout/reward_mean" in metrics:
            self._rewards[1:] = [metrics["rollout/reward_mean"]]
        self.progress.step_done(step, info=step_info(metrics))
        self.empty_steps.observe(cause)

    def close(self) -> None:
        """Stop generating ahead, release the engines (HTTP clients); the telemetry closes with the
        run's summary."""
        self.producer.close()
        for pool in (self.parts.pool, self.parts.dense_pool):
            if pool is not None:
                pool.close()
        if self.parts.reward is not None:
            self.parts.reward.close()

    # -- pieces ---------------------------------------------------------------------------------
    def _finite_groups(self, produced: Produced, step: int) -> tuple[list[Sample], list[float], dict]:
        """The step's samples and rewards without the groups holding a non-finite reward (NaN:
        reward.skip_nonfinite kept it), those counted and logged; the step's first metrics."""
        samples, rewards, skipped = drop_nonfinite_groups(
            produced.samples, produced.rewards, self.cfg.rollout.group_size
        )
        if not skipped:
            return samples, rewards, {}
        self.parts.telemetry.event("nonfinite_reward_skipped", {"step": step, "samples": skipped})
        return samples, rewards, {"reward/nonfinite_skipped": float(len(skipped))}

    def _train_batch(
        self, step: int, samples: Sequence[Sample], rewards: Sequence[float], metrics: dict[str, float]
    ) -> tuple[RolloutBatch | None, int, int]:
        """The batch to train on (None: no sample left), the sequences with reward variance in it
        before the trim, and its optimizer updates per epoch; adds the rollout metrics."""
        cfg = self.cfg
        if not samples:
            metrics["train/sequences"] = 0.0
            return None, 0, 1
        batch = build_batch(
            samples,
            rewards,
            group_size=cfg.rollout.group_size,
            normalize_std=cfg.loss.advantage_std_normalize,
        )
        metrics.update(rollout_metrics(samples, batch, self.parts.kv_bytes_per_token))
        if cfg.rollout.env is not None:
            metrics.update(episode_metrics(cast(list[Episode], samples)))
        if self._routing is not None:  # rollout routing replay: the engines' ids beside the tokens
            batch, replay_metrics, refused = routing_replay.attach(batch, samples, self._routing)
            metrics.update(replay_metrics)
            if refused:
                self.parts.telemetry.event("routed_experts_refused", {"step": step, "samples": refused})
        informative = informative_rows(batch.rewards_B, cfg.rollout.group_size)
        if cfg.train.filter_zero_variance_groups:
            batch = batch.select(informative)
        batch, updates_per_epoch = self._trim(batch)
        metrics["train/sequences"] = float(batch.size)
        return batch, len(informative), updates_per_epoch

    def _admit(self, step: int) -> None:
        """Submit every batch up to step + ahead (within the run), prompts drawn in step order on
        every rank; see the module docstring for why this bounds the staleness."""
        cfg, p = self.cfg, self.parts
        last = min(step + self.producer.ahead, cfg.train.steps)
        for b in range(max(self._submitted_through + 1, step), last + 1):
            before = p.data.state_dict()
            self.producer.submit(b, p.data.next_prompts(cfg.train.prompts_per_step), before)
            self._submitted_through = b

    def _readmit(self) -> None:
        """Collective: engines the host's pool found healthy again (removed ones, or ones down at
        start) get a full weight sync to the version the others hold, then rejoin the pool; one
        that fails it stays out and is probed again. Between two syncs, on the main thread: a
        re-admitted engine never serves a request at an older version than the rest."""
        pool = self.parts.pool
        box: list[Any] = [pool.recovered() if pool is not None else []]
        dist.broadcast_object_list(box, src=HOST_RANK)
        if not box[0]:
            return
        synced = self.parts.syncer.readmit([pool, self.parts.dense_pool], set(box[0]))
        if pool is not None:
            for name in box[0]:
                if name in synced:
                    pool.admit(name)
                else:
                    pool.not_recovered(name)

    def _score(self, step: int, prompts: Sequence[Prompt]) -> tuple[list[Any], list[float]]:
        """Host: batch `step` from the engines, scored (the producer's worker when running ahead):
        samples, or with rollout.env episodes."""
        cfg = self.cfg
        if cfg.rollout.env is not None:
            return run_episodes_on_host(
                self.parts.episodes, prompts, tag=f"step{step}", group_size=cfg.rollout.group_size
            )
        if isinstance(self.parts.pool, RolloutManager):  # generated and scored in its process
            return self.parts.pool.score(f"step{step}", prompts)
        return score_on_host(
            self.parts.pool,
            prompts,
            tag=f"step{step}",
            group_size=cfg.rollout.group_size,
            sampling=cfg.rollout.sampling,
            run_seed=cfg.train.seed,
            reward_fn=self.parts.reward_fn,
            return_routed_experts=cfg.model.moe.routing_replay,
        )

    def _abort_generation(self) -> None:
        """Host, stopping mid-run: the pool starts no more chunks (the embedded engine runs one at
        a time: the batch's others would follow the aborted one), and every request the engines
        run finishes as "abort"."""
        pool = self.parts.pool
        if pool is not None:
            pool.stop()
        for name, engine in list(pool.live.items()) if pool is not None else []:
            try:
                engine.pause("abort")
                engine.resume()
            except Exception as exc:  # noqa: BLE001 - stopping anyway; the engine's answer is late
                self.parts.telemetry.event("abort_failed", {"engine": name, "reason": str(exc)})

    def _log_islands(self) -> None:
        """Islands: which nodes each island runs on (Slurm's node name, else the host name)."""
        rt = self.runtime
        if rt.islands == 1:
            return
        here = (rt.island, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        everyone: list[Any] = [None] * rt.world_size
        dist.all_gather_object(everyone, here, group=rt.learner_group)
        nodes = {i: sorted({node for island, node in everyone if island == i}) for i in range(rt.islands)}
        size = rt.world_size // rt.islands
        self.parts.telemetry.event(
            "islands",
            {
                f"island {i}": f"ranks {i * size}-{(i + 1) * size - 1} on {', '.join(n)}"
                for i, n in nodes.items()
            },
        )

    def _policy_lag(self) -> dict[str, float]:
        """Islands: applied inner steps since the anchor the engines hold (what the rollout's tokens
        lag the islands' local weights by); nothing without islands (the engines are current)."""
        outer = self.parts.learner.outer
        if outer is None:
            return {}
        return {"rollout/policy_lag_updates": outer.totals["inner_steps"] - self.state.synced_inner}

    def _outer_steps(self, *, closing: bool) -> dict[str, float]:
        """Islands: the outer steps this RL step made (one more, closing the last round, at the
        run's last step, so the final weights are agreed ones); each logged as an event."""
        outer = self.parts.learner.outer
        if closing and outer.inner:
            outer.step()
        records = outer.pop_records()
        for record in records:
            self.parts.telemetry.event(
                "diloco_outer_step", {"step": self.state.step + 1, **record}, show=False
            )
        self._weights_changed |= bool(records)
        return outer.summary(records)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Collective: publish the learner's weights as `version`. one_step mode first waits for the
        batch being generated (its samples keep one version); in_flight lands between decode steps."""
        p = self.parts
        metrics: dict[str, float] = {}
        if self.cfg.train.async_.mode == "one_step" and self.runtime.rank == HOST_RANK:
            waited = time.perf_counter()
            self.producer.wait_generated()
            metrics["time/wait_generation_s"] = time.perf_counter() - waited
        metrics.update(p.syncer.sync([p.pool, p.dense_pool], version=version))
        self.state.sync_version, self._weights_changed = version, False
        if p.pool is not None:  # host: every engine left in the pool holds it now
            p.pool.version = version
        self.versions.publish(version)
        self.state.versions = self.versions.state_dict()
        self._engines_hold_anchor()
        return metrics

    def _engines_hold_anchor(self) -> None:
        """Islands: the engines now hold the latest anchor; remember how many inner steps made it."""
        outer = self.parts.learner.outer
        if outer is not None:
            self.state.synced_inner = outer.totals["inner_steps"] - outer.inner

    def _log_eval(self) -> None:
        """An eval row at the current step, if an eval is configured (no empty rows)."""
        metrics = self.evaluate()
        if metrics:
            self.parts.telemetry.log(metrics, step=self.state.step)

    def evaluate(self) -> dict[str, float]:
        self.progress.phase("eval")
        return self.parts.evaluator.run(self.parts.pool, self.parts.dense_pool)

    def _trim(self, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
        """Drop trailing rows so the batch splits into whole micro-batches on every DP rank and into
        optimizer updates of about train.global_batch_size sequences (zero-variance filtering makes
        the size vary). Returns the batch and its optimizer updates per epoch."""
        step = self.cfg.train.micro_batch_size * self.runtime.replicas
        updates = max(1, round(batch.size / self.cfg.train.global_batch_size))
        keep = batch.size // (step * updates) * step * updates
        if keep == 0:
            updates, keep = 1, batch.size // step * step
        return batch.select(slice(0, keep)), updates

    def update(self, batch: RolloutBatch, updates_per_epoch: int) -> dict[str, float]:
        """pi_ref recompute (KL on), then up to K epochs with DGG (pi_old is recomputed inside)."""
        p, rt = self.parts, self.runtime
        learner = p.learner
        rows = torch.arange(batch.size).tensor_split(rt.replicas)[rt.replica_rank]
        local = batch.select(rows)
        asynchronous = learner.update_cfg.max_staleness is not None
        logp_ref = None
        if p.ref is not None:
            logp_ref = megatron_step.compute_logprobs(
                p.ref,
                local.tokens_BT,
                micro_batch_size=learner.update_cfg.micro_batch_size,
                temperature=learner.update_cfg.temperature,
                vocab_size=learner.update_cfg.vocab_size,
                runtime=rt,
                fused=learner.update_cfg.fused_logprob,
                mask_BT=local.mask_BT,
            )
        update_batch = megatron_step.UpdateBatch(
            tokens_BT=local.tokens_BT,
            mask_BT=local.mask_BT,
            advantages_B=local.advantages_B,
            logp_sparse_BT=local.logp_sparse_BT,
            logp_ref_BT=logp_ref,
            lag_BT=self.versions.lag(local.versions_BT) if asynchronous else None,
            lengths_B=local.lengths_B,
            routed_BTLK=local.routed_BTLK,
            turn_BT=local.turn_BT,
        )
        cfg = dataclasses.replace(learner.update_cfg, minibatches_per_epoch=updates_per_epoch)
        self.progress.phase(f"update (<= {updates_per_epoch * cfg.epochs} optimizer steps)")
        result = megatron_step.train_on_batch(
            learner.model,
            learner.optimizer,
            update_batch,
            cfg=cfg,
            gate=learner.gate,
            runtime=rt,
            scheduler=learner.scheduler,
        )
        routing = moe_routing.collect(learner.model, rt)  # None for a dense policy
        if routing is not None and rt.rank == 0:
            moe_routing.append_table(self.cfg.telemetry.dir, self.state.step + 1, routing)
        p.telemetry.log_updates(result.updates, step=self.state.step + 1)  # DWD/DGG per update
        skipped = sum(u.get("train/found_inf", 0.0) > 0 for u in result.updates)
        if skipped:
            self.state.skipped_updates += skipped
            p.telemetry.event("nonfinite_update_skipped", {"step": self.state.step + 1, "updates": skipped})
        return {
            **result.metrics,
            **(routing.metrics() if routing is not None else {}),
            "dgg/gates": float(sum(d.gate for d in result.decisions)),
            "train/skipped_nonfinite": float(skipped),
        }

    def _stopped(self, reason: str) -> RunSummary:
        """A stop signal was agreed: checkpoint this step (unless just saved) and end cleanly."""
        step, ckpt_dir = self.state.step, self.cfg.checkpoint.dir
        ckpt = None
        if ckpt_dir:
            ckpt = self.save() if self._saved_step != step else checkpoint.latest_checkpoint(ckpt_dir)
        self.parts.telemetry.event("stopped", {"reason": reason, "step": step, "checkpoint": str(ckpt)})
        return self._summary(EXIT_OK, ckpt, stopped_by=reason)

    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and self.state.step % every == 0 and self.state.step < self.cfg.train.steps

    def save(self, *, sync_engines: bool = True) -> Path:
        """Collective. Engines first receive any unsynced update, so the checkpoint's weights and the
        engines' agree, and a resumed run's full sync reproduces exactly what the engines held."""
        p = self.parts
        if sync_engines and self._weights_changed:
            self.sync_weights(self.state.step)
        # batches generated ahead are regenerated on resume: record the position before them
        self.state.data = self.producer.resume_data_state() or p.data.state_dict()
        self.state.dgg = p.learner.dgg_state()
        self.state.diloco = p.learner.outer.state_dict() if p.learner.outer is not None else {}
        record = {
            "config": to_dict(self.cfg),
            "world_size": self.runtime.world_size,
            "data": self.state.data,
            "layout": self.layout,
        }
        if self.cfg.checkpoint.dir is None:
            raise ValueError("checkpoint.dir is not set: there is nowhere to save the run")
        self._saved_step = self.state.step
        return checkpoint.save_checkpoint(
            self.cfg.checkpoint.dir,
            self.state.step,
            model=p.learner.model,
            optimizer=p.learner.optimizer,
            scheduler=p.learner.scheduler,
            loop_state=dataclasses.asdict(self.state),
            record=record,
            keep=self.cfg.checkpoint.keep_last,
            islands=self._island_state(),
        )

    def _island_state(self) -> checkpoint.IslandState | None:
        """What the checkpoint saves per island (islands only)."""
        rt, outer = self.runtime, self.parts.learner.outer
        if outer is None:
            return None
        position = rt.rank % (rt.world_size // rt.islands)
        return checkpoint.IslandState(
            island=rt.island, position=position, dp_cp_group=rt.groups.dp_cp, outer=outer
        )

    def resume(self) -> None:
        """Continue from the latest checkpoint (if any), then bring every engine to these weights."""
        p, path = self.parts, self.resume_from
        if path is not None:
            loop, same_layout = checkpoint.load_checkpoint(
                path,
                model=p.learner.model,
                optimizer=p.learner.optimizer,
                scheduler=p.learner.scheduler,
                layout=self.layout,
                seed=self.cfg.train.seed,
                pp_rank=self.runtime.pp_rank,
                islands=self._island_state(),
            )
            self.state = LoopState(**loop)
            self.versions = PolicyVersions(self.state.versions or [self.state.sync_version])
            if p.learner.outer is not None:
                p.learner.outer.load_state_dict(self.state.diloco)
            p.data.load_state_dict(self.state.data)
            p.learner.load_dgg_state(self.state.dgg)
            saved = read_saved_run(path).layout
            p.telemetry.event(
                "resumed",
                {
                    "checkpoint": str(path),
                    "step": self.state.step,
                    "saved_layout": saved.describe() if saved else "unrecorded",
                    "layout": self.layout.describe(),
                    "rng": "restored" if same_layout else "re-seeded (new layout)",
                },
            )
        p.syncer.full_sync([p.pool, p.dense_pool], version=self.state.sync_version)
        if p.pool is not None:
            p.pool.version = self.state.sync_version
        self._engines_hold_anchor()

    def _summary(
        self,
        code: int,
        ckpt: Path | None,
        *,
        hf: Path | None = None,
        message: str = "",
        stopped_by: str | None = None,
    ) -> RunSummary:
        paths = self.parts.telemetry.close()
        return RunSummary(
            exit_code=code,
            steps=self.state.step,
            metrics_path=paths.get("metrics"),
            plot_path=paths.get("plot"),
            checkpoint_path=ckpt,
            hf_path=hf,
            message=message,
            first_step=self._first_step,
            seconds=time.monotonic() - self._started,
            rewards=(self._rewards[0], self._rewards[-1]) if self._rewards else None,
            stopped_by=stopped_by,
            updates=self._updates_applied,
        )
