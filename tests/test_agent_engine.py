"""The engine side of episodes: a finished uncompressed turn is in the radix cache, so the next turn
prefills only its new tokens (with the same log-probs as without a cache); compressed turns
recompress the whole history from the dense prompt prefix; a group sticks to one engine, and a turn
whose engine fails moves to another and stays correct."""

from __future__ import annotations

import pytest
from agent_support import engine, runner, specs, tiny_checkpoint, tokenizer

from sparserl_mcore.agent import Env, Reply, Turn
from sparserl_mcore.agent.metrics import episode_metrics
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
from sparserl_mcore.rollout.protocol import SamplingParams

FIXED = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)
PS = 4  # page size of the test engines
ROWS = [{"prompt": "hop 2 from 7\n"}, {"prompt": "hop 3 from 1\n"}]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("agent_engine") / "hf")


class FourTurns(Env):
    def reset(self, row):
        return row["prompt"]

    def step(self, turn: Turn) -> Reply:
        return Reply(observation=f"={turn.index} r{3 - turn.index}\n") if turn.index < 3 else Reply(done=True)


def _episodes(hf, engines=None, **engine_kw):
    tok = tokenizer(hf)
    engines = engines or {"e0": engine(hf, check_invariants=True, **engine_kw)}
    run = runner(engines, FourTurns, tok, sampling=FIXED, max_turns=4, max_tokens_per_turn=9)
    return run.run(specs(ROWS, group_size=2)), engines


def test_next_turn_prefills_only_its_new_tokens(hf):
    episodes, engines = _episodes(hf)
    for ep in episodes:
        for before, turn in zip(ep.turns, ep.turns[1:], strict=False):
            fed = len(before.prompt_ids) + len(before.output_ids) - 1  # the last sampled id was never fed
            aligned = min(fed, len(turn.prompt_ids) - 1) // PS * PS
            assert turn.cached_prompt_tokens >= aligned
            assert len(turn.prompt_ids) - turn.cached_prompt_tokens <= len(turn.prompt_ids) - fed + PS
    metrics = episode_metrics(episodes)
    assert metrics["agent/prefill_tokens_turn3"] < 20 < metrics["agent/cached_tokens_turn3"]
    uncached, _ = _episodes(hf, radix_cache=False)
    for a, b in zip(episodes, uncached, strict=True):  # reused KV is the same KV
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    (eng,) = engines.values()
    assert not eng.scheduler.resource_problems()


def test_compressed_turns_recompress_from_the_dense_prompt_prefix(hf):
    kv = KVCompressionConfig(method="streamingllm", budget=16, window=4, sink_tokens=4, interval=4)
    episodes, engines = _episodes(hf, kv_compression=kv)
    for ep in episodes:
        assert ep.turns[-1].kv_stats.compressions > 0
        for t in ep.turns:  # the prefill holds the history once, decode stays near the budget
            assert t.kv_stats.peak_retained_tokens <= max(len(t.prompt_ids), 16 + 4)
        for before, turn in zip(ep.turns, ep.turns[1:], strict=False):
            # the previous turn's prompt was cached dense after its prefill; its decode was compressed
            assert turn.cached_prompt_tokens >= len(before.prompt_ids) // PS * PS
            assert turn.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    (eng,) = engines.values()
    assert not eng.scheduler.resource_problems()


class Counting:
    """A real engine that records the requests it served, and can be made to fail."""

    def __init__(self, inner, fail_after: int | None = None):
        self.inner, self.fail_after, self.rids = inner, fail_after, []

    def generate(self, requests):
        if self.fail_after is not None and len(self.rids) >= self.fail_after:
            raise RuntimeError("engine died")
        self.rids += [r.rid for r in requests]
        return self.inner.generate(requests)


def test_a_group_sticks_to_one_engine_and_a_failed_turn_moves(hf):
    reference, _ = _episodes(hf)
    engines = {f"e{i}": Counting(engine(hf)) for i in range(3)}
    episodes, _ = _episodes(hf, engines)
    for p in range(len(ROWS)):
        served = {name for name, e in engines.items() if any(r.startswith(f"s1-p{p}-") for r in e.rids)}
        assert len(served) == 1  # all 8 turns of the group's 2 episodes on one engine
    doomed = max(engines, key=lambda n: len(engines[n].rids))
    engines = {n: Counting(engine(hf), fail_after=3 if n == doomed else None) for n in engines}
    episodes, _ = _episodes(hf, engines)
    for a, b in zip(episodes, reference, strict=True):  # ids travel: the moved turns are the same
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_a_weight_update_during_a_tool_wait_versions_the_next_turn(hf):
    """An update that lands while the environment works: the next turn's tokens carry the new
    version, the earlier ones keep theirs, and no KV of the old weights is reused."""
    from safetensors.torch import load_file

    eng = engine(hf, check_invariants=True)
    weights = load_file(str(hf / "model.safetensors"))
    updated = {"lm_head.weight": weights["lm_head.weight"] * 1.5}

    class UpdateInTool(FourTurns):
        def step(self, turn: Turn) -> Reply:
            if turn.index == 1:
                eng.update_weights(updated, version=7)
            return super().step(turn)

    run = runner({"e0": eng}, UpdateInTool, tokenizer(hf), sampling=FIXED, max_turns=4, max_tokens_per_turn=9)
    (ep,) = run.run(specs(ROWS[:1], group_size=1))
    assert [set(t.token_versions()) for t in ep.turns] == [{0}, {0}, {7}, {7}]
    sampled = [v for v, m in zip(ep.versions, ep.loss_mask, strict=True) if m]
    assert sampled == sorted(sampled)  # non-decreasing along the episode
    assert ep.turns[2].cached_prompt_tokens == 0 < ep.turns[3].cached_prompt_tokens


def test_an_in_flight_update_mid_turn_versions_its_tokens_and_the_learners_lag(hf):
    """train.async.mode=in_flight: an update that lands while a turn decodes splits that turn's
    tokens between the two versions, later turns carry the new one, and the learner's lag per token
    (build_batch -> PolicyVersions.lag -> staleness pieces) follows them turn by turn."""
    import threading

    import torch
    from safetensors.torch import load_file
    from waiting import wait_until

    from sparserl_mcore.loss import staleness
    from sparserl_mcore.trainer.batch import build_batch
    from sparserl_mcore.trainer.versions import PolicyVersions

    eng = engine(hf)
    weights = load_file(str(hf / "model.safetensors"))
    updated = {"lm_head.weight": weights["lm_head.weight"] * 1.5}
    long = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)
    run = runner({"e0": eng}, FourTurns, tokenizer(hf), sampling=long, max_turns=3, max_tokens_per_turn=200)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(eps=run.run(specs(ROWS[:1], 1))), daemon=True)
    thread.start()
    wait_until(lambda: eng.stats()["generated_tokens"] >= 260, timeout=120, what="turn 1 decoding")
    eng.update_weights(updated, version=7)
    thread.join(120)
    (ep,) = out["eps"]
    per_turn = [list(t.token_versions()) for t in ep.turns]
    assert len(per_turn) == 3 and all(len(v) == 200 for v in per_turn)
    mixed = [k for k, v in enumerate(per_turn) if set(v) == {0, 7}]
    assert len(mixed) == 1 and mixed[0] >= 1, [sorted(set(v)) for v in per_turn]
    j = mixed[0]
    assert per_turn[j] == sorted(per_turn[j])  # old, then new: the switch at a step boundary
    assert all(set(v) == {0} for v in per_turn[:j]) and all(set(v) == {7} for v in per_turn[j + 1 :])
    if j + 1 < len(ep.turns):  # no prefix KV of the old weights serves the next turn
        assert ep.turns[j + 1].cached_prompt_tokens == 0
    # the learner's side: each sampled token's lag behind version 7, per turn
    batch = build_batch([ep, ep], [0.0, 1.0], group_size=2, normalize_std=False).select(slice(0, 1))
    assert batch.turn_BT is not None
    lag = PolicyVersions([0, 7]).lag(batch.versions_BT)
    sampled = batch.mask_BT.bool()
    for k, versions in enumerate(per_turn):
        at = sampled & (batch.turn_BT == k)
        assert lag[at].tolist() == [int(v == 0) for v in versions]
    pieces = staleness.lag_pieces(batch.logp_sparse_BT, batch.logp_sparse_BT, batch.mask_BT, lag, 1)
    assert pieces["staleness/mixed_sequences"].item() == 1
    old = sum(v.count(0) for v in per_turn)
    assert (
        pieces["staleness/tokens_lag1"].item() == old and pieces["staleness/tokens_lag0"].item() == 600 - old
    )
    assert torch.equal(staleness.drop_stale(batch.mask_BT, lag, 0).bool(), sampled & (lag == 0))
