"""A run that survives its SGLang fleet failing (issue 35), against LIVE CPU SGLang 0.5.23 workers
(`sparserl sglang-serve --device cpu`, tests/sglang_live.py) behind the real sglang-router 0.3.2:
tests/test_e2e_fleet.py's faults, with SGLang workers in place of `sparserl serve`.

One `sparserl train` run, asynchronous (in flight, two batches ahead), through the router (round
robin) over two workers, each behind a fault-injecting proxy (tests/fault_proxy.py), which is the
URL the router, the pool and the weight sync know it by:
- worker A's proxy answers every 10th /generate 502 or 503 in turn and holds its 5th past the
  request timeout (the router retries the 5xx on the other worker; the trainer retries the hung one);
- worker B's SGLang processes are SIGKILLed while it runs a step's requests, so the router has a
  dead worker. It comes back at the same URL as a fresh server holding the checkpoint's weights
  (B's proxy is pointed at a spare server started with the others: a CPU SGLang server takes
  minutes to start, longer than this run lasts).
The run must finish every step with every sample trained once, take B out of the router, probe
it, and put it back only after a full weight sync: B then serves requests again, none before its
sync, and ends at the learner's final weight version, like A.

Three servers start at once for the module (minutes on a 2-core box).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from e2e_support import PY, free_port, metrics, subprocess_env, write_config
from fault_proxy import FaultProxy
from sglang_live import TOKEN, LiveServer, start
from waiting import wait_until

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None
    or importlib.util.find_spec("uvloop") is None
    or importlib.util.find_spec("sglang_router") is None,
    reason="live SGLang workers behind sglang-router need `make setup` (sglang 0.5.23, sglang-router 0.3.2)",
)

# KV compression turns SGLang's overlap scheduler off, which an in-flight run needs
KV = {"method": "snapkv", "budget": 16, "interval": 4, "window": 4, "kernel_size": 3}
TOKEN_ENV = "SPARSERL_LIVE_SGLANG_TOKEN"
TIMEOUT_S = 15.0  # rollout.request_timeout_s: the hung request is abandoned after it
STEPS = 8  # enough after B's return for it to take requests of later batches


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(root, hf, {"a", "b", "spare"}: live servers), all started at once."""
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    root = tmp_path_factory.mktemp("sglang-fleet")
    hf = make_tiny(
        TinyModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seed=1), root / "hf"
    )
    rows = [{"prompt": f"say {i}:", "answer": "a"} for i in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    live = {name: start(hf, root / f"{name}.log", KV) for name in ("a", "b", "spare")}
    try:
        for server in live.values():
            server.wait_ready()
        yield root, hf, live
    finally:
        for server in live.values():
            server.terminate()
        for server in live.values():
            server.stop()


def _kill(server: LiveServer) -> None:
    """SIGKILL the SGLang processes behind `sparserl sglang-serve` (their own process group), then
    the launcher: a worker gone without a word."""
    import psutil

    for child in psutil.Process(server.proc.pid).children():
        os.killpg(child.pid, signal.SIGKILL)
    server.proc.kill()
    server.proc.wait()


def _tail(root) -> str:
    return (root / "trainer.log").read_text(errors="replace")[-3000:]


def _event(root, kind: str, engine: str, trainer: subprocess.Popen) -> bool:
    assert trainer.poll() is None, f"trainer ended before {kind} of {engine}: {_tail(root)}"
    try:
        return any(r.get("event") == kind and r.get("engine") == engine for r in metrics(root, "fleet"))
    except FileNotFoundError:
        return False


def _stepped(root, trainer: subprocess.Popen) -> bool:
    assert trainer.poll() is None, f"trainer ended early: {_tail(root)}"
    try:
        return any("train/rollouts" in r for r in metrics(root, "fleet"))
    except FileNotFoundError:
        return False


def _router(urls: list[str]):
    from sparserl_mcore.sglang.client import router_workers
    from sparserl_mcore.sglang.launch import LaunchConfig, ServerProcess, router_argv

    cfg = LaunchConfig(model_path="unused", port=free_port(), startup_timeout_s=120, grace_s=10)
    argv = [*router_argv(urls, host=cfg.host, port=cfg.port), "--policy", "round_robin"]
    router = ServerProcess(cfg, argv=argv).__enter__()
    router.wait_healthy()
    wait_until(lambda: sorted(router_workers(cfg.url)) == sorted(urls), timeout=60, what="router lists both")
    return router, cfg.url


def test_a_run_through_the_router_survives_failing_hung_and_killed_workers(servers):
    root, hf, live = servers
    flaky = FaultProxy(live["a"].url, fail_every=10, hang_at=5, hang_s=TIMEOUT_S + 2)
    returning = FaultProxy(live["b"].url)
    router, trainer = None, None
    try:
        router, router_url = _router([flaky.url, returning.url])
        rollout = {
            "engine": "remote",
            "server": "sglang",
            "urls": [flaky.url, returning.url],
            "router_url": router_url,
            "token_env": TOKEN_ENV,
            "group_size": 4,
            "kv": KV,
            "request_timeout_s": TIMEOUT_S,
            "max_retries": 4,
            "retry_backoff_s": 0.1,
            "probe_interval_s": 0.5,
        }
        cfg = write_config(
            root,
            hf,
            "fleet",
            model={"hf_path": str(hf), "params_dtype": "bf16"},
            parallel={"tensor_model_parallel_size": 1},
            rollout=rollout,
            eval={"every": 0, "at_start": False, "dense": False, "compressed": False},
            checkpoint={"dir": None, "every": 0, "save_hf": None},
            loss={"correction": {"mode": "sparse_rl"}},
            train={
                "steps": STEPS,
                "prompts_per_step": 4,
                "global_batch_size": 16,
                "micro_batch_size": 8,
                "async": {"mode": "in_flight", "max_staleness": 2},
            },
        )
        env = {**subprocess_env(), TOKEN_ENV: TOKEN}
        cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)]
        with (root / "trainer.log").open("w") as out:
            trainer = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: _stepped(root, trainer), timeout=600, what="step 1 in metrics.jsonl")
        served = len(returning.served)  # mid-step: B is answering requests of the batches ahead
        wait_until(lambda: len(returning.served) > served, timeout=120, what="B serving the next batch")
        _kill(live["b"])
        wait_until(
            lambda: _event(root, "engine_removed", returning.url, trainer), timeout=120, what="B taken out"
        )
        marks = len(live["spare"].routes())
        returning.retarget(live["spare"].url)  # B answers again, with the checkpoint's weights
        wait_until(
            lambda: _event(root, "engine_readmitted", returning.url, trainer),
            timeout=120,
            what="B re-admitted",
        )
        back = time.monotonic()
        trainer.wait(timeout=600)
        versions = [httpx.get(f"{s.url}/model_info", timeout=30).json()["weight_version"] for s in
                    (live["a"], live["spare"])]  # fmt: skip
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if router is not None:
            router.stop()
        flaky.close()
        returning.close()
    assert trainer.returncode == 0, _tail(root)
    records = metrics(root, "fleet")
    steps = [r for r in records if "train/rollouts" in r]
    # every step ran and got all its samples (4 prompts x 4) exactly once, retries included
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["train/rollouts"] for r in steps] == [16.0 * (i + 1) for i in range(STEPS)]
    assert {502, 503, 0} <= set(flaky.injected)  # both statuses and the hang were injected
    assert sum(r["rollout/requests_retried"] for r in steps) >= 1  # at least the hung one, by us
    removed = [r["engine"] for r in records if r.get("event") == "engine_removed"]
    assert removed == [returning.url]  # A failed requests, never its worker; the router stayed
    assert min(r["engines/workers_live"] for r in steps) == 1 and steps[-1]["engines/workers_live"] == 2
    # no token older than the admission bound: B never served an older version
    assert all(r["staleness/masked_tokens"] == 0 and r["staleness/lag_max"] <= 2 for r in steps)
    # B's new server took its full sync before any request, served requests after its return, and
    # ends at the learner's final version, like A
    paths = [p for p, code in live["spare"].routes()[marks:] if code == 200]
    assert "/generate" in paths and paths.index("/update_weights_from_tensor") < paths.index("/generate")
    assert any(t > back for t in returning.served)
    final = max(r["step"] for r in steps if "sync/patch_bytes" in r)
    assert versions == [str(final), str(final)]
