"""Episodes: the loop that alternates engine turns and environment steps, token-in/token-out.

Every episode is one asyncio task; a turn's `generate` and a plain (non-async) `Env.step` each run
on a daemon thread, so one episode's tool wait overlaps the others' decoding (the embedded engine
merges concurrent calls into one continuous batch; remote engines serve them concurrently). An
episode group (the G episodes of a prompt) sticks to one engine of the pool (`EnginePool.sticky`),
so each turn's request finds the previous turns in that engine's prefix cache; an engine that
fails or does not answer leaves the pool and the turn goes to the group's next engine, which is
still correct because the request carries every id (only the cache is lost). Behind one
sglang-router (a pool of one engine) the group's key travels with each request (`routing_key`),
and the router's `manual` policy keeps the group on one worker instead.

Limits, each an end reason of the episode (agent/trajectory.py END_REASONS):
- a turn's max_new_tokens is min(max_tokens_per_turn, the episode budget left, the context left);
  no room left ends the episode (episode_tokens, context);
- an observation that would not leave room for one more sampled token in the context, or would
  overrun the episode budget, ends the episode before it is appended (context, episode_tokens);
- max_turns turns without `done` (max_turns); an engine abort (abort);
- an `Env.step` that raises or takes longer than tool_timeout_s (tool_error, tool_timeout): that
  episode ends, the others and the run go on.
Seeds: turn k of episode `rid` is sampled with `seed_of(f"{rid}-t{k}")`, so a resumed run replays it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sparserl_mcore.agent.env import Env, EnvConfig, Reply, Turn, TurnFinish
from sparserl_mcore.agent.render import Renderer
from sparserl_mcore.agent.trajectory import Episode, Trajectory
from sparserl_mcore.rollout.protocol import GenerateRequest, Sample, SamplingParams
from sparserl_mcore.trainer.engine_pool import NoEngineLeftError

if TYPE_CHECKING:
    from sparserl_mcore.trainer.engine_pool import EnginePool

log = logging.getLogger(__name__)
R = TypeVar("R")


async def on_daemon_thread(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` on a daemon thread: a call abandoned after a timeout never blocks the loop's
    shutdown or the process's exit (asyncio's default executor would join it)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if not future.done():
            (future.set_exception if failed else future.set_result)(outcome)

    def target() -> None:
        try:
            result: Any = fn(*args)
            loop.call_soon_threadsafe(settle, result, False)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, exc, True)

    threading.Thread(target=target, daemon=True, name="sparserl-episode-call").start()
    return await future


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: its id, its data row, the group it sticks with."""

    rid: str
    row: dict[str, Any]
    group: str


class EpisodeRunner:
    """Runs episodes of one environment class over an engine pool (see the module docstring)."""

    def __init__(
        self,
        pool: EnginePool,
        env_cls: type[Env],
        cfg: EnvConfig,
        renderer: Renderer,
        decode: Callable[[Sequence[int]], str],
        *,
        sampling: SamplingParams,
        context_length: int,
        eos_token_ids: Sequence[int],
        seed_of: Callable[[str], int],
    ) -> None:
        self.pool, self.env_cls, self.cfg = pool, env_cls, cfg
        self.renderer, self.decode, self.sampling = renderer, decode, sampling
        self.context_length, self.seed_of = context_length, seed_of
        self.end_tokens = (
            frozenset(eos_token_ids) | set(renderer.stop_token_ids) | set(sampling.stop_token_ids)
        )

    def run(self, specs: Sequence[EpisodeSpec]) -> list[Episode]:
        """Every episode, concurrently; results in the order of `specs`."""
        return asyncio.run(self._run_all(specs))

    async def _run_all(self, specs: Sequence[EpisodeSpec]) -> list[Episode]:
        return list(await asyncio.gather(*(self.episode(spec) for spec in specs)))

    async def episode(self, spec: EpisodeSpec) -> Episode:
        cfg = self.cfg
        env = self.env_cls()
        traj = Trajectory(self.renderer.prompt(env.reset(spec.row)))
        reward, end = 0.0, "max_turns"
        for k in range(cfg.max_turns):
            budget_left = cfg.max_episode_tokens - traj.added
            room = min(cfg.max_tokens_per_turn, budget_left, self.context_length - len(traj))
            if room < 1:
                end = "episode_tokens" if budget_left < 1 else "context"
                break
            sample = await self._generate(spec, k, traj, room, env.stop)
            traj.append_sampled(sample, k)
            if sample.finish_reason == "abort":
                end = "abort"
                break
            try:
                reply = await self._step(env, Turn(self.decode(sample.output_ids), k, self._finish(sample)))
            except TimeoutError:
                end = "tool_timeout"
                log.warning("episode %s: Env.step of turn %d took over %g s", spec.rid, k, cfg.tool_timeout_s)
                break
            except Exception as exc:  # user code: anything
                end = "tool_error"
                log.warning(
                    "episode %s: Env.step of turn %d raised %s: %s", spec.rid, k, type(exc).__name__, exc
                )
                break
            reward += reply.reward
            if reply.done:
                end = "done"
                break
            if k == cfg.max_turns - 1:
                break
            obs = self.renderer.observation(reply.observation, sample.output_ids)
            if len(traj) + len(obs) >= self.context_length:
                end = "context"
                break
            if traj.added + len(obs) > cfg.max_episode_tokens:
                end = "episode_tokens"
                break
            traj.append_env(obs)
        return traj.finish(spec.rid, end, reward, mask_truncated=cfg.on_truncation == "mask")

    def _finish(self, sample: Sample) -> TurnFinish:
        if sample.finish_reason == "length":
            return "length"
        return "eos" if sample.output_ids and sample.output_ids[-1] in self.end_tokens else "stop"

    async def _step(self, env: Env, turn: Turn) -> Reply:
        if inspect.iscoroutinefunction(env.step):
            reply = await asyncio.wait_for(env.step(turn), self.cfg.tool_timeout_s)
        else:
            reply = await asyncio.wait_for(on_daemon_thread(env.step, turn), self.cfg.tool_timeout_s)
        if not isinstance(reply, Reply):
            raise TypeError(f"Env.step returned {type(reply).__name__}, not a Reply")
        return reply

    async def _generate(
        self, spec: EpisodeSpec, k: int, traj: Trajectory, room: int, stop: tuple[str, ...]
    ) -> Sample:
        """Turn k on the group's engine; a failing engine leaves the pool and the turn moves on."""
        rid = f"{spec.rid}-t{k}"
        params = dataclasses.replace(
            self.sampling,
            max_new_tokens=room,
            stop=(*self.sampling.stop, *stop),
            stop_token_ids=(*self.sampling.stop_token_ids, *self.renderer.stop_token_ids),
            seed=self.seed_of(rid),
        )
        req = GenerateRequest(input_ids=tuple(traj.tokens), sampling=params, rid=rid, routing_key=spec.group)
        timeout = self.pool.cfg.chunk_timeout_s
        why = "no attempt"
        for _ in range(self.pool.cfg.max_attempts):
            name = self.pool.sticky(spec.group)
            engine = self.pool.live.get(name)
            if engine is None:  # left the pool meanwhile
                continue
            try:
                (sample,) = await asyncio.wait_for(on_daemon_thread(engine.generate, [req]), timeout)
                return sample
            except TimeoutError:
                why = f"no answer within {timeout:g} s"
            except Exception as exc:  # the engine's failure: it leaves the pool, the turn moves on
                why = f"generate failed: {type(exc).__name__}: {exc}"
            self.pool.remove(name, why)
        raise NoEngineLeftError(f"turn {rid} failed {self.pool.cfg.max_attempts} times (last: {why})")
