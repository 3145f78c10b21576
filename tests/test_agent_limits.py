"""Every limit of an episode is a tested path: per-turn, episode and context caps, an observation
that would overflow (nothing appended), max_turns, a tool that raises or hangs (that episode ends
with its reason, counted; the others complete), and masking of truncated episodes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from agent_support import engine, runner, specs, tiny_checkpoint, tokenizer

from sparserl_mcore.agent import Env, Reply, Turn
from sparserl_mcore.agent.metrics import episode_metrics
from sparserl_mcore.rollout.protocol import SamplingParams

FIXED = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)  # turns end by their cap


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    hf = tiny_checkpoint(tmp_path_factory.mktemp("agent_limits") / "hf")
    return engine(hf), tokenizer(hf)


class Talker(Env):
    """Observes `obs` after every turn and never ends the episode itself."""

    obs = "=123456789\n"
    finishes: list[str] = []

    def reset(self, row):
        return row["prompt"]

    def step(self, turn: Turn) -> Reply:
        Talker.finishes.append(turn.finish_reason)
        return Reply(observation=self.obs, reward=0.5)


def _run(parts, env_cls, n=2, **kw):
    eng, tok = parts
    kw.setdefault("sampling", FIXED)
    return runner({"e0": eng}, env_cls, tok, **kw).run(
        specs([{"prompt": "hop 1 from 3\n"}] * n, group_size=1)
    )


def test_turn_cap_and_max_turns(parts):
    Talker.finishes.clear()
    episodes = _run(parts, Talker, max_turns=3, max_tokens_per_turn=5)
    for ep in episodes:
        assert ep.end_reason == "max_turns" and ep.truncated and len(ep.turns) == 3
        assert [len(t.output_ids) for t in ep.turns] == [5, 5, 5]
        assert ep.reward == 1.5  # every Reply counts, the last one's too
        assert ep.tokens[-5:] == ep.turns[-1].output_ids  # the last observation is not appended
    assert set(Talker.finishes) == {"length"}


def test_episode_budget_counts_sampled_and_environment_tokens(parts):
    (ep,) = _run(parts, Talker, n=1, max_turns=10, max_tokens_per_turn=8, max_episode_tokens=30)
    # 8 sampled + 11 observed = 19; then 8 more = 27 and the next observation would make 38 > 30
    assert [len(t.output_ids) for t in ep.turns] == [8, 8]
    assert ep.end_reason == "episode_tokens" and len(ep.tokens) - ep.prompt_len == 27
    (ep,) = _run(parts, Talker, n=1, max_turns=10, max_tokens_per_turn=8, max_episode_tokens=21)
    assert [len(t.output_ids) for t in ep.turns] == [8, 2]  # the second turn is clamped to the budget


def test_observation_that_would_overflow_the_context_is_not_appended(parts):
    prompt = 13  # "hop 1 from 3\n"
    (ep,) = _run(
        parts, Talker, n=1, max_turns=10, max_tokens_per_turn=8, context_length=prompt + 8 + 11 + 8 + 5
    )
    assert ep.end_reason == "context" and len(ep.turns) == 2
    assert ep.tokens[-8:] == ep.turns[-1].output_ids and len(ep.tokens) == prompt + 27
    (ep,) = _run(parts, Talker, n=1, max_turns=10, max_tokens_per_turn=8, context_length=prompt + 8 + 11 + 3)
    assert [len(t.output_ids) for t in ep.turns] == [8, 3]  # the turn is clamped to the context left


class FlakyTool(Env):
    """Episode 0's tool raises, episode 1's hangs past the timeout, episode 2 completes."""

    release = threading.Event()

    def reset(self, row):
        self.kind = row["kind"]
        return row["prompt"]

    async def step(self, turn: Turn) -> Reply:
        if self.kind == "raise":
            raise ZeroDivisionError("division by zero in the tool")
        if self.kind == "hang":
            await asyncio.sleep(60)
        return Reply(done=True, reward=1.0)


class BlockingTool(Env):
    def reset(self, row):
        return row["prompt"]

    def step(self, turn: Turn) -> Reply:  # a plain def that never returns in time
        FlakyTool.release.wait(60)
        return Reply(done=True)


def test_a_failing_tool_ends_its_episode_and_the_others_complete(parts):
    eng, tok = parts
    rows = [{"prompt": "hop 1 from 3\n", "kind": k} for k in ("raise", "hang", "ok")]
    run = runner(
        {"e0": eng}, FlakyTool, tok, sampling=FIXED, max_turns=2, max_tokens_per_turn=4, tool_timeout_s=1.0
    )
    started = time.monotonic()
    episodes = run.run(specs(rows, group_size=1))
    assert [e.end_reason for e in episodes] == ["tool_error", "tool_timeout", "done"]
    assert episodes[2].reward == 1.0 and time.monotonic() - started < 30
    metrics = episode_metrics(episodes)
    assert metrics["agent/end_tool_error"] == 1 and metrics["agent/end_tool_timeout"] == 1
    run = runner(
        {"e0": eng}, BlockingTool, tok, sampling=FIXED, max_turns=2, max_tokens_per_turn=4, tool_timeout_s=1.0
    )
    try:
        (ep,) = run.run(specs(rows[:1], group_size=1))  # returns although the thread still blocks
        assert ep.end_reason == "tool_timeout"
    finally:
        FlakyTool.release.set()


def test_truncated_episodes_can_be_masked(parts):
    kept = _run(parts, Talker, n=1, max_turns=2, max_tokens_per_turn=4)[0]
    masked = _run(parts, Talker, n=1, max_turns=2, max_tokens_per_turn=4, on_truncation="mask")[0]
    assert kept.tokens == masked.tokens and sum(kept.loss_mask) == 8  # same seeds, same episode
    assert not any(masked.loss_mask) and not any(masked.logprobs) and not any(masked.versions)


class Barrier(Env):
    """Every episode's first step waits until all of them are inside a step at once: episodes that
    ran one after another would wait forever (tool_timeout)."""

    n = 6
    inside = 0
    all_in = asyncio.Event()

    def reset(self, row):
        return row["prompt"]

    async def step(self, turn: Turn) -> Reply:
        if turn.index == 0:
            Barrier.inside += 1
            if Barrier.inside == Barrier.n:
                Barrier.all_in.set()
            await Barrier.all_in.wait()
            return Reply(observation="=1 r0\n")
        return Reply(done=True, reward=1.0)


def test_episodes_run_concurrently_so_tool_waits_overlap(parts):
    episodes = _run(parts, Barrier, n=Barrier.n, max_turns=2, max_tokens_per_turn=4, tool_timeout_s=60.0)
    assert [e.end_reason for e in episodes] == ["done"] * Barrier.n
