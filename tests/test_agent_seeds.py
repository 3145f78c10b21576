"""A resumed run replays its episodes: turn k of an episode is seeded from (run seed, step, prompt
slot, group member, turn) alone, so the same step's episodes sample the same tokens on a fresh
engine, whatever else runs beside them, and another step, run seed or turn samples differently."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
from agent_support import engine, tiny_checkpoint, tokenizer

from sparserl_mcore.agent import Env, Reply, Turn


class ThreeTurns(Env):
    def reset(self, row):
        return row["prompt"]

    def step(self, turn: Turn) -> Reply:
        return Reply(observation=f"={turn.index} r1\n") if turn.index < 2 else Reply(done=True)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("agent_seeds") / "hf")


def _run(hf, texts, *, step: int, run_seed: int = 7):
    """One step's episodes as the trainer draws them (`run_episodes_on_host`), on a fresh engine."""
    from sparserl_mcore.agent import EnvConfig
    from sparserl_mcore.agent.render import PlainRenderer
    from sparserl_mcore.agent.runner import EpisodeRunner
    from sparserl_mcore.rollout.protocol import SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.rollouts import Prompt, request_seed, run_episodes_on_host

    tok = tokenizer(hf)
    run = EpisodeRunner(
        EnginePool({"e0": engine(hf)}, PoolConfig(chunk_size=4, chunk_timeout_s=120.0)),
        ThreeTurns,
        EnvConfig(name="test", max_turns=3, max_tokens_per_turn=6),
        PlainRenderer(tok),
        lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True),
        context_length=512,
        eos_token_ids=(tok.eos_token_id,),
        seed_of=partial(request_seed, run_seed),  # as trainer/setup.py builds it
    )
    prompts = [Prompt(input_ids=(), answer="", text=t) for t in texts]
    episodes, _ = run_episodes_on_host(run, prompts, tag=f"step{step}", group_size=2)
    return {e.rid: e for e in episodes}


def _same(a, b) -> None:
    """The same tokens; log-probs to fp32 rounding (CPU kernels do not promise bit-equal sums
    across batch compositions)."""
    assert a.tokens == b.tokens and a.loss_mask == b.loss_mask
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_episodes_replay_from_the_run_seed_step_and_prompt(hf):
    texts = ["hop 2 from 7\n", "hop 3 from 1\n"]
    first = _run(hf, texts, step=3)
    again = _run(hf, texts, step=3)  # a resumed run: fresh engine, same step
    assert first.keys() == again.keys() == {"step3-p0-g0", "step3-p0-g1", "step3-p1-g0", "step3-p1-g1"}
    for rid, ep in first.items():
        assert len(ep.turns) == 3
        _same(ep, again[rid])
    # beside other episodes (a third prompt, one more turn of batching): the same tokens
    crowded = _run(hf, [*texts, "hop 1 from 4\n"], step=3)
    for rid, ep in first.items():
        _same(ep, crowded[rid])
    # each part of the seed matters: the group member, the turn, the step and the run seed
    assert first["step3-p0-g0"].turns[0].output_ids != first["step3-p0-g1"].turns[0].output_ids
    ep = first["step3-p0-g0"]
    assert len({s.output_ids for s in ep.turns}) == 3
    other_step, other_seed = _run(hf, texts, step=4), _run(hf, texts, step=3, run_seed=8)
    assert ep.turns[0].output_ids != other_step["step4-p0-g0"].turns[0].output_ids
    assert ep.turns[0].output_ids != other_seed["step3-p0-g0"].turns[0].output_ids


def _train(root, hf, name: str, steps: int, turns_file):
    """`sparserl train` (one rank, embedded engine) of `steps` steps of RecordedTurns episodes,
    checkpointing every step into its own dir (resumed from there when it holds one)."""
    import subprocess

    import yaml
    from agent_support import RECORD_ENV
    from e2e_support import PY, subprocess_env, write_config

    cfg = write_config(
        root,
        hf,
        name,
        data={"eval_fraction": 0.0},
        parallel={"tensor_model_parallel_size": 1},
        rollout={
            "group_size": 4,
            "sampling": {"temperature": 1.0, "max_new_tokens": 6},
            "kv": {"method": "none"},
            "env": {"name": "agent_support:RecordedTurns", "max_turns": 3, "max_tokens_per_turn": 6},
        },
        optimizer={"lr": 1e-2, "weight_decay": 0.0},
        train={
            "steps": steps,
            "prompts_per_step": 2,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "reuse_epochs": 1,
            "filter_zero_variance_groups": False,
        },
        eval={"every": 0, "at_start": False, "dense": False, "compressed": False},
        checkpoint={"every": 1, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    run = yaml.safe_load(cfg.read_text())
    run["reward"] = {}
    cfg.write_text(yaml.safe_dump(run))
    env = {**subprocess_env(), RECORD_ENV: str(turns_file)}
    proc = subprocess.run(
        [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _turns(path) -> Counter:
    import json

    return Counter(tuple(sorted(json.loads(line).items())) for line in path.read_text().splitlines())


@pytest.mark.timeout(600)
def test_a_resumed_run_replays_the_episodes_an_uninterrupted_run_draws(tmp_path):
    """Through a real checkpoint: a 2-step run checkpoints after step 1; a run whose checkpoint dir
    holds only that checkpoint (what a run stopped after step 1 leaves) resumes from it. Its step 2
    samples exactly the turns the uninterrupted run sampled at step 2 (the same episodes, the same
    texts: with the character tokenizer, the sampled ids but EOS), which differ from step 1's."""
    import shutil

    from e2e_support import make_assets

    from sparserl_mcore.trainer.run_record import LATEST

    hf = make_assets(tmp_path)
    whole, rest = tmp_path / "whole.jsonl", tmp_path / "rest.jsonl"
    _train(tmp_path, hf, "whole", 2, whole)
    stopped = tmp_path / "stopped" / "ckpt"
    shutil.copytree(tmp_path / "whole" / "ckpt" / "step_00000001", stopped / "step_00000001")
    (stopped / LATEST).write_text("step_00000001\n")
    _train(tmp_path, hf, "stopped", 2, rest)  # resumes after step 1
    everything, after = _turns(whole), _turns(rest)
    assert sum(after.values()) == 2 * 4 * 3  # step 2's prompts x episodes x turns
    assert sum(everything.values()) == 2 * sum(after.values())
    assert after <= everything  # step 2 of the uninterrupted run, turn for turn
    assert not (everything - after) & after  # and step 1 sampled other turns
