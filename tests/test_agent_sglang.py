"""Multi-turn episodes through LIVE SGLang 0.5.23 servers behind a real sglang-router.

Two dense CPU servers (`sparserl sglang-serve --device cpu`, tests/sglang_live.py: radix cache on,
BF16) serve a tiny Llama warm-started on lookup_chain demonstrations (so its episodes call the
tool); sglang-router 0.3.2 in front of them runs the `manual` policy, which keeps the requests of
one `x-smg-routing-key` on one worker. One module-scoped server set (start-up costs minutes on a
2-core box), two tests:
- one episode group (G=4) through the trainer's own runner (`setup.episode_runner` over
  `build_engines`' router engine): every turn's request is the whole trajectory so far, `input_ids`
  in and ids out (append-only, observations encoded on their own), the loss mask 1 exactly on the
  sampled ids, SGLang's log-probs and weight versions at their positions and nothing elsewhere,
  every request of the group on one worker (its access log) and later turns served from that
  worker's radix cache;
- `sparserl train` for one step of one lookup_chain group through the router: the weights synced
  to both workers, the episodes multi-turn, every /generate of the group on one worker.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest
import yaml
from e2e_support import PY, free_port, metrics, subprocess_env, write_config
from sglang_live import TOKEN, LiveServer, post, start
from waiting import wait_until

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None
    or importlib.util.find_spec("uvloop") is None
    or importlib.util.find_spec("sglang_router") is None,
    reason="live SGLang servers and sglang-router need `make setup` (sglang 0.5.23, sglang-router 0.3.2)",
)

TOKEN_ENV = "SPARSERL_LIVE_SGLANG_TOKEN"
GROUP = 4
ENV = {"name": "lookup_chain", "max_turns": 5, "max_tokens_per_turn": 8, "max_episode_tokens": 80}
OBSERVATION = re.compile(r"=\d r\d\n")


class Live:
    def __init__(self, root, hf, servers: list[LiveServer], router_url: str) -> None:
        self.root, self.hf, self.servers, self.router_url = root, hf, servers, router_url
        self.urls = [s.url for s in servers]

    def generates(self) -> list[int]:
        """/generate calls each worker has answered so far (its uvicorn access log)."""
        return [sum(1 for path, _ in s.routes() if path == "/generate") for s in self.servers]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from sparserl_mcore.agent.envs.lookup_chain import warm_start_rows, write_splits
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
    from sparserl_mcore.sglang.client import router_workers
    from sparserl_mcore.sglang.launch import LaunchConfig, ServerProcess, router_argv
    from sparserl_mcore.trainer.warmstart import WarmStartConfig, warm_start

    root = tmp_path_factory.mktemp("agent-sglang")
    tiny = make_tiny(
        TinyModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seed=1),
        root / "tiny",
    )
    # the servers start on the random weights while the warm start runs (the tests give them the
    # warm-started ones: from disk, or by the trainer's sync)
    servers = [start(tiny, root / f"worker{i}.log", {"method": "none"}) for i in range(2)]
    router = None
    try:
        cfg = WarmStartConfig(steps=120, batch_size=32, lr=1e-2, warmup_steps=10)
        hf = warm_start(tiny, warm_start_rows(2000, early=0.5, seed=0), root / "warm", cfg).out_dir
        write_splits(root / "data", n_train=64, n_eval=8, seed=1)
        for server in servers:
            server.wait_ready()
        urls = [s.url for s in servers]
        launch = LaunchConfig(model_path="unused", port=free_port(), startup_timeout_s=120, grace_s=10)
        # manual: a routing key's requests stay on one worker
        argv = router_argv(urls, host=launch.host, port=launch.port, policy="manual")
        router = ServerProcess(launch, argv=argv).__enter__()
        router.wait_healthy()
        wait_until(
            lambda: sorted(router_workers(launch.url)) == sorted(urls), timeout=60, what="router lists both"
        )
        yield Live(root, hf, servers, launch.url)
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()


def _config(live, name: str):
    """A one-step lookup_chain run of one group through the router (reward: the env's Replies)."""
    path = write_config(
        live.root,
        live.hf,
        name,
        model={"hf_path": str(live.hf), "params_dtype": "bf16"},
        data={"train_path": str(live.root / "data" / "train.jsonl"), "eval_fraction": 0.0},
        parallel={"tensor_model_parallel_size": 1},
        rollout={
            "engine": "remote",
            "server": "sglang",
            "urls": live.urls,
            "router_url": live.router_url,
            "token_env": TOKEN_ENV,
            "group_size": GROUP,
            "sampling": {"temperature": 1.0, "max_new_tokens": 8},
            "kv": {"method": "none"},
            "env": ENV,
        },
        train={"steps": 1, "prompts_per_step": 1, "global_batch_size": GROUP, "micro_batch_size": GROUP},
        eval={"every": 0, "at_start": False, "dense": False, "compressed": False},
        checkpoint={"every": 0, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    raw = yaml.safe_load(path.read_text())
    raw["reward"] = {}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_episode_group_through_the_router_keeps_the_token_rules_and_one_worker(live):
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.prompts import PromptData
    from sparserl_mcore.trainer.rollouts import run_episodes_on_host
    from sparserl_mcore.trainer.setup import build_engines, episode_runner

    version = 3  # the workers' weights, labelled as a trainer's sync labels them
    for url in live.urls:
        post(url, "/update_weights_from_disk", {"model_path": str(live.hf), "weight_version": str(version)})
    cfg = config_from_dict(yaml.safe_load(_config(live, "episodes").read_text()))
    engines = build_engines(cfg, compressed=True, device="cpu")
    assert list(engines) == [live.router_url]
    pool = EnginePool(engines, PoolConfig(chunk_size=GROUP, chunk_timeout_s=300))
    data = PromptData(cfg.data, str(live.hf), seed=0, max_new_tokens=8, context=512)
    runner = episode_runner(cfg, data, pool, cfg.rollout.sampling)
    tok = data.tokenizer
    before = live.generates()
    episodes, _ = run_episodes_on_host(runner, data.next_prompts(1), tag="live", group_size=GROUP)
    served = [after - b for after, b in zip(live.generates(), before, strict=True)]
    turns = sum(len(e.turns) for e in episodes)
    assert sorted(served) == [0, turns], (served, turns)  # the whole group on one worker
    assert max(len(e.turns) for e in episodes) >= 2, [e.end_reason for e in episodes]  # multi-turn

    for ep in episodes:
        at = 0  # where the current turn's request ends in the episode's tokens
        for k, sample in enumerate(ep.turns):
            # append-only: the request is the trajectory so far (prompt, earlier turns' sampled
            # ids as sampled, the observations in between)
            assert ep.tokens[: len(sample.prompt_ids)] == tuple(sample.prompt_ids)
            if k:
                gap = ep.tokens[at : len(sample.prompt_ids)]
                text = tok.decode(list(gap))
                assert OBSERVATION.fullmatch(text) and list(gap) == tok.encode(text, add_special_tokens=False)
                # the same worker served the previous turn: its finished sequence is in the radix cache
                assert sample.cached_prompt_tokens >= at - 1, (k, sample.cached_prompt_tokens, at)
            start_, end = len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.output_ids)
            assert ep.tokens[start_:end] == tuple(sample.output_ids)
            assert ep.turn_of[start_:end] == (k,) * len(sample.output_ids)
            assert ep.logprobs[start_:end] == tuple(sample.output_logprobs)  # SGLang's, where sampled
            assert all(lp < 0 for lp in sample.output_logprobs)
            assert ep.versions[start_:end] == (version,) * len(sample.output_ids)
            at = end
        sampled = [t >= 0 for t in ep.turn_of]
        assert [bool(m) for m in ep.loss_mask] == sampled  # 1 exactly on sampled ids
        assert all(
            lp == 0 and v == 0 for lp, v, s in zip(ep.logprobs, ep.versions, sampled, strict=True) if not s
        )
    pool.close()


def test_train_one_step_of_an_episode_group_through_the_router(live):
    cfg = _config(live, "train")
    before = live.generates()
    env = {**subprocess_env(), TOKEN_ENV: TOKEN}
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    records = metrics(live.root, "train")
    (step,) = [r for r in records if "rollout/reward_mean" in r]
    assert not [r for r in records if r.get("event", "").startswith("sync_")], records  # no sync failed
    assert step["agent/turns_mean"] > 1, step
    served = [after - b for after, b in zip(live.generates(), before, strict=True)]
    assert sorted(served) == [0, round(step["agent/turns_mean"] * GROUP)], (served, step)
    for server in live.servers:  # both workers got the learner's weights before any generation
        paths = [p for p, _ in server.routes()]
        assert "/update_weights_from_tensor" in paths, paths[-20:]
