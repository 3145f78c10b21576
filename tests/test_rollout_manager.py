"""`rollout.manager: process` (issue 35 point 4): the host's rollout client (its generation calls,
retries, health and rewards) in a process of its own, against a real `sparserl serve` behind a
fault-injecting proxy (tests/fault_proxy.py) on loopback.

The learner's process must parse no rollout JSON: here the test's own process stands for it (its
`json.loads` counted while the manager scores, and counted again while the in-process pool scores
the same batches, which must parse), and in a `sparserl train` run the /generate requests the proxy
saw must come from the manager's process, none from the learner's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import psutil
import pytest
from e2e_support import PY, make_assets, metrics, subprocess_env, write_config
from fault_proxy import FaultProxy
from test_e2e_faults import _serve, _url, _wait_healthy, _wait_step
from waiting import wait_until

from sparserl_mcore.config import ConfigError, config_from_dict, load_config, to_dict
from sparserl_mcore.trainer import setup
from sparserl_mcore.trainer.engine_pool import EnginePool, GenerationStopped, NoEngineLeftError
from sparserl_mcore.trainer.prompts import decode_ids, load_tokenizer
from sparserl_mcore.trainer.rollouts import Prompt, make_requests, score_on_host

ROLLOUT = {"engine": "remote", "manager": "process", "max_retries": 4, "retry_backoff_s": 0.05}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `sparserl serve` of the tiny checkpoint: (its checkpoint dir, its URL)."""
    root = tmp_path_factory.mktemp("manager")
    hf = make_assets(root)
    proc = _serve(hf, subprocess_env())
    try:
        url = _url(proc)
        _wait_healthy(url, proc)
        yield root, hf, url
    finally:
        proc.kill()
        proc.wait()


class _JsonCount:
    """`json.loads` calls in this process (httpx parses every answer with it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self._lock = threading.Lock()
        real = json.loads

        def counted(*args, **kwargs):
            with self._lock:
                self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(json, "loads", counted)


def test_the_manager_scores_in_its_own_process_what_the_in_process_pool_scores(server, monkeypatch):
    root, hf, url = server
    proxy = FaultProxy(url, fail_every=2)  # every 2nd /generate answered 502 or 503: retried in the child
    try:
        cfg = load_config(
            write_config(
                root,
                hf,
                "direct",
                parallel={"tensor_model_parallel_size": 1},
                rollout={**ROLLOUT, "urls": [proxy.url]},
            )
        )
        tokenizer = load_tokenizer(str(hf))
        texts = ["abc", "hello there", "x y z", "rollout"]
        prompts = [Prompt(tuple(tokenizer(t).input_ids), answer="", text=t) for t in texts]
        events: list[tuple[str, dict]] = []
        manager = setup.rollout_manager(cfg, lambda kind, fields: events.append((kind, fields)))
        parsed = _JsonCount(monkeypatch)
        try:
            assert set(manager.live) == {proxy.url}
            batches = [manager.score(f"step{s}", prompts) for s in (1, 2)]
            evals = make_requests(
                prompts, tag="eval", group_size=1, sampling=cfg.rollout.sampling, run_seed=0
            )
            eval_samples, eval_rewards = manager.score_requests(evals, prompts)  # the evaluator's call
            retried = manager.take_requests_retried()
            in_learner = parsed.calls
            manager.version = 1
            manager.stop()  # the run is stopping: a batch is refused, in the caller's process
            with pytest.raises(GenerationStopped):
                manager.score("step3", prompts)
            os.kill(manager.pid, signal.SIGKILL)  # a dead manager stops the run as an empty fleet does
            with pytest.raises(NoEngineLeftError, match="rollout manager process exited"):
                wait_until(lambda: not manager.live, timeout=60, what="the dead manager noticed")
        finally:
            manager.close()
        # the same batches through the in-process pool: this process parses their answers
        _, reward_fn = setup.build_reward(cfg, lambda ids: decode_ids(tokenizer, ids))
        pool = EnginePool(setup.build_engines(cfg, compressed=True, device="cpu"), setup.pool_config(cfg))
        before = parsed.calls
        expected = [
            score_on_host(
                pool,
                prompts,
                tag=f"step{s}",
                group_size=8,
                sampling=cfg.rollout.sampling,
                run_seed=cfg.train.seed,
                reward_fn=reward_fn,
            )  # fmt: skip
            for s in (1, 2)
        ]
        ref_eval = pool.generate(evals)
        pool.close()
    finally:
        proxy.close()
    assert in_learner == 0, f"the learner's process parsed {in_learner} JSON documents"
    assert parsed.calls - before >= 2 * len(prompts)  # the in-process pool parsed at least one per call
    for (samples, rewards), (ref_samples, ref_rewards) in zip(batches, expected, strict=True):
        assert [s.rid for s in samples] == [r.rid for r in ref_samples]  # each request once, in order
        assert [s.output_ids for s in samples] == [r.output_ids for r in ref_samples]
        assert [s.output_versions for s in samples] == [r.output_versions for r in ref_samples]
        assert rewards == pytest.approx(ref_rewards)
    assert [s.output_ids for s in eval_samples] == [r.output_ids for r in ref_eval]
    assert eval_rewards == pytest.approx([reward_fn(r, p) for r, p in zip(ref_eval, prompts, strict=True)])
    assert retried > 0 and any(kind == "rollout_retry" for kind, _ in events)  # forwarded to the host


def test_a_run_with_the_manager_process_trains_every_sample_once_and_sends_no_generate_itself(server):
    root, hf, url = server
    proxy = FaultProxy(url, fail_every=4)
    steps = 4
    cfg = write_config(
        root,
        hf,
        "managed",
        parallel={"tensor_model_parallel_size": 1},
        rollout={**ROLLOUT, "urls": [proxy.url]},
        eval={"dense": False, "compressed": True, "at_start": False},  # at the end, scored in the manager
        checkpoint={"dir": None, "every": 0, "save_hf": None},
        train={"steps": steps, "reuse_epochs": 1, "async": {"mode": "in_flight", "max_staleness": 1}},
    )
    trainer = subprocess.Popen(
        [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_step(root, "managed", 2, trainer)
        # who holds the sockets /generate came from (the clients keep their connections open)
        owners = {
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.raddr and c.laddr and (c.laddr.ip, c.laddr.port) in set(proxy.clients) and c.pid is not None
        }
        children = {p.pid for p in psutil.Process(trainer.pid).children()}
        _, err = trainer.communicate(timeout=400)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        proxy.close()
    assert trainer.returncode == 0, err[-3000:]
    assert owners and trainer.pid not in owners and owners <= children  # the manager sent them
    records = metrics(root, "managed")
    assert [r["step"] for r in records if "eval/pass1_compressed" in r] == [steps]
    steps_run = [r for r in records if "train/rollouts" in r]
    assert [r["step"] for r in steps_run] == list(range(1, steps + 1))
    assert [r["train/rollouts"] for r in steps_run] == [32.0 * (i + 1) for i in range(steps)]
    assert sum(r["rollout/requests_retried"] for r in steps_run) >= 8 * len(proxy.injected) > 0
    assert all(r["engines/live"] == 1 and r["staleness/masked_tokens"] == 0 for r in steps_run)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.manager=fork"], ["rollout.manager", "'fork'", "thread, process"]),
        (["rollout.manager=process"], ["manager='process'", "engine='embedded'", "set manager=thread"]),
    ],
)
def test_a_bad_manager_setting_is_one_line(overrides, words):
    base = to_dict(config_from_dict({"model": {"hf_path": "/m"}, "data": {"train_path": "/d.jsonl"}}))
    with pytest.raises((ConfigError, ValueError)) as info:
        config_from_dict(base, overrides)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
