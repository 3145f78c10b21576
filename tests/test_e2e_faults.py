"""Rollout engines dying mid-run, with real `sparserl serve` subprocesses on loopback.

Two servers; the first is SIGKILLed once step 1 is logged (its next requests fail mid-batch and
are retried on the other), the second once step 2 is logged: the run then checkpoints and stops
with a clear error and exit code 3. No sample is lost or duplicated on the way, and the
checkpoint's data position is that of the trained batches (the failed one is drawn again on
resume).
"""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
from e2e_support import PY, make_assets, metrics, subprocess_env, write_config
from waiting import wait_until


def _serve(hf, env: dict, port: int = 0) -> subprocess.Popen:
    """`sparserl serve` on `port` (0: the OS picks one); `_url` reads it from its first line."""
    cmd = [PY, "-m", "sparserl_mcore", "serve", "--hf-dir", str(hf), "--port", str(port)]
    cmd += ["--log-level", "warning"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()  # "sparserl serve: listening on http://127.0.0.1:PORT"
    assert "listening on http://" in line, f"server exited with {proc.poll()}: {line!r}"
    return line.rsplit(" ", 1)[1].strip()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    def healthy() -> bool:
        assert proc.poll() is None, f"server {url} exited with {proc.returncode}"
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=timeout, what=f"{url}/health", interval=0.3)


def _wait_step(root, name: str, step: int, trainer: subprocess.Popen, timeout: float = 240) -> None:
    def logged() -> bool:
        assert trainer.poll() is None, "trainer ended early"
        try:
            return any(r.get("step") == step and "rollout/reward_mean" in r for r in metrics(root, name))
        except FileNotFoundError:
            return False

    wait_until(logged, timeout=timeout, what=f"step {step} in metrics.jsonl")


def test_dead_engines_fail_over_then_checkpoint_and_stop(tmp_path):
    hf = make_assets(tmp_path)
    env = subprocess_env()
    servers = [_serve(hf, env) for _ in range(2)]
    trainer = None
    try:
        urls = [_url(proc) for proc in servers]
        for url, proc in zip(urls, servers, strict=True):
            _wait_healthy(url, proc)
        cfg = write_config(
            tmp_path,
            hf,
            "faults",
            parallel={"tensor_model_parallel_size": 1},
            rollout={"engine": "remote", "urls": urls, "request_timeout_s": 60.0, "max_retries": 2},
            eval={"dense": False, "compressed": False, "at_start": False},
            train={"steps": 6},
        )
        cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)]
        trainer = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_step(tmp_path, "faults", 1, trainer)
        servers[0].send_signal(signal.SIGKILL)
        _wait_step(tmp_path, "faults", 2, trainer)
        servers[1].send_signal(signal.SIGKILL)
        _, err = trainer.communicate(timeout=240)
    finally:
        for proc in [*servers, trainer]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert trainer.returncode == 3, err[-2000:]
    assert "no rollout engine left" in err
    records = metrics(tmp_path, "faults")
    events = [r["event"] for r in records if "event" in r]
    assert events.count("engine_removed") == 2 and "stopped" in events
    steps = [r for r in records if "train/rollouts" in r]
    # every step that completed got all its samples (4 prompts x 8) once, failover included
    assert [r["train/rollouts"] for r in steps] == [32.0 * (i + 1) for i in range(len(steps))]
    assert len(steps) >= 2
    latest = tmp_path / "faults" / "ckpt" / "latest"
    assert latest.is_file() and latest.read_text().strip() == f"step_{len(steps):08d}"
    # the batch that failed was drawn but never trained: the checkpoint resumes before its prompts
    data = json.loads((latest.parent / latest.read_text().strip() / "run.json").read_text())["data"]
    drawn = 4 * len(steps)
    assert (data["epoch"], data["offset"]) == (drawn // data["n"], drawn % data["n"]), data
