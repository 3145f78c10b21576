"""A run that survives its rollout fleet failing the way clusters fail (issue 35), with real
`sparserl serve` subprocesses behind fault-injecting proxies (tests/fault_proxy.py) on loopback.

The run is asynchronous (in flight, two batches ahead), so batches share the servers. Server A's
proxy answers every 5th /generate with 502 or 503 in turn and holds its 3rd past the
request timeout; server B is SIGKILLed after step 1 and started again on the same port. The run
must finish every step with every sample trained once, retrying the failed requests (A stays in
the pool), dropping B, probing it, and re-admitting it after a full weight sync: B then serves
requests again and ends at the learner's final weight version, like A.
"""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
from e2e_support import PY, free_port, make_assets, metrics, subprocess_env, write_config
from fault_proxy import FaultProxy
from test_e2e_faults import _serve, _url, _wait_healthy, _wait_step
from waiting import wait_until

TIMEOUT_S = 6.0  # rollout.request_timeout_s: the hung request is abandoned after it
STEPS = 10  # enough after the restart for the returned server to take requests of later batches


def _event(root, name: str, kind: str, engine: str, trainer: subprocess.Popen) -> bool:
    assert trainer.poll() is None, f"trainer ended before {kind} of {engine}"
    try:
        return any(r.get("event") == kind and r.get("engine") == engine for r in metrics(root, name))
    except FileNotFoundError:
        return False


def test_failed_requests_are_retried_and_a_killed_server_comes_back_at_the_current_version(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    port_b = free_port()
    servers = [_serve(hf, env), _serve(hf, env, port_b)]
    proxies: list[FaultProxy] = []
    trainer = None
    try:
        url_a, url_b = (_url(proc) for proc in servers)
        for url, proc in zip((url_a, url_b), servers, strict=True):
            _wait_healthy(url, proc)
        proxies = [FaultProxy(url_a, fail_every=5, hang_at=3, hang_s=TIMEOUT_S + 2), FaultProxy(url_b)]
        flaky, restarted = proxies
        rollout = {
            "engine": "remote",
            "urls": [flaky.url, restarted.url],
            "request_timeout_s": TIMEOUT_S,
            "max_retries": 4,
            "retry_backoff_s": 0.1,
            "probe_interval_s": 0.3,
            "server_concurrency": 8,  # one group at a time per server: the step spreads over both
        }
        cfg = write_config(
            tmp_path,
            hf,
            "fleet",
            parallel={"tensor_model_parallel_size": 1},
            rollout=rollout,
            eval={"dense": False, "compressed": False, "at_start": False},
            # in flight, two batches ahead: a step's requests share the servers with the next ones'
            train={"steps": STEPS, "async": {"mode": "in_flight", "max_staleness": 2}},
        )
        cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)]
        trainer = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_step(tmp_path, "fleet", 1, trainer)
        servers[1].send_signal(signal.SIGKILL)
        servers[1].wait()
        wait_until(
            lambda: _event(tmp_path, "fleet", "engine_removed", restarted.url, trainer),
            timeout=240,
            what="the killed server removed",
        )
        servers[1] = _serve(hf, env, port_b)
        assert _url(servers[1]) == url_b
        back = time.monotonic()
        wait_until(
            lambda: _event(tmp_path, "fleet", "engine_readmitted", restarted.url, trainer),
            timeout=240,
            what="the restarted server re-admitted",
        )
        _, err = trainer.communicate(timeout=400)
        versions = [
            httpx.get(f"{u}/get_model_info", timeout=30).json()["weight_version"] for u in (url_a, url_b)
        ]
    finally:
        for proc in [*servers, trainer]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for proxy in proxies:
            proxy.close()
    assert trainer.returncode == 0, err[-3000:]
    records = metrics(tmp_path, "fleet")
    steps = [r for r in records if "train/rollouts" in r]
    # every step ran and got all its samples (4 prompts x 8) exactly once, retries included
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["train/rollouts"] for r in steps] == [32.0 * (i + 1) for i in range(STEPS)]
    removed = [r for r in records if r.get("event") == "engine_removed"]
    assert [r["engine"] for r in removed] == [restarted.url]  # A failed requests, never its engine
    assert {502, 503, 0} <= set(flaky.injected)  # both statuses and the hang were injected
    assert sum(r["rollout/requests_retried"] for r in steps) >= 8 * len(flaky.injected)
    assert steps[-1]["engines/live"] == 2
    # no token older than the admission bound: the returned server never served an older version
    assert all(r["staleness/masked_tokens"] == 0 and r["staleness/lag_max"] <= 2 for r in steps)
    # the restarted server served requests after its return, at the learner's final version
    assert any(t > back for t in restarted.served)
    final = max(r["step"] for r in steps if "sync/patch_bytes" in r)
    assert versions == [final, final]
