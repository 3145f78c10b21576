"""Rendered jobs through a real Slurm (slurmctld + two slurmd on this host, CPU nodes): `make slurm-test`.

1. the colocated job (one node, TP=2 over two gloo ranks) trains 2 steps to completion via sbatch;
2. the disaggregated job: learner on node n1, two embedded rollout servers on node n2, 2 steps;
3. preemption: USR1 sent to the batch shell (what `--signal=B:USR1@S` does before the time limit)
   makes the trainer checkpoint at its next step boundary and the job requeue itself; the
   requeued job resumes from that step and completes.

Slow (a few minutes on 2 cores) and needs root plus slurm-wlm and munge, so it runs only with
SPARSERL_SLURM_TEST=1, as `make slurm-test` sets (and CI runs separately).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2e_support import free_port, make_assets, metrics, subprocess_env, write_config
from slurm_cluster import LocalSlurm, missing_tools

from sparserl_mcore.config import load_config

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("SPARSERL_SLURM_TEST") != "1",
        reason="starts a local Slurm: run `make slurm-test` (root, installs slurm-wlm and munge)",
    ),
    pytest.mark.timeout(900),
]
NO_EVAL = {"every": 0, "at_start": False, "dense": False, "compressed": False}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"the Slurm job tests need root and {', '.join(missing_tools()) or 'nothing more'}")
    slurm = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2, cpus_per_node=2)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    return root, make_assets(root)


def _submit(cluster: LocalSlurm, root: Path, cfg: Path, *layout: str) -> tuple[str, Path]:
    """`sparserl slurm` (not a dry run) with the venv on PATH and the tests' reward importable."""
    bin_dir = Path(sys.executable).parent  # this environment's sparserl, torchrun, python
    env = {**subprocess_env(), **cluster.env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = ["sparserl", "slurm", "--config", str(cfg), "--gpus-per-node", "0", "--ranks-per-node", "2"]
    out = _check_output([*cmd, "--time", "20:00", "--stop-before", "120", *layout], env, root)
    job_id = out.split("submitted job ")[1].split(";")[0]
    run_dir = Path(load_config(cfg).telemetry.dir)
    return job_id, run_dir


def _check_output(cmd: list[str], env: dict, cwd: Path) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _wait_job(cluster: LocalSlurm, job_id: str, states: tuple[str, ...], timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = cluster.job(job_id)
        if info["JobState"] in states:
            return info
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {cluster.job(job_id)}")


def _wait_step(root: Path, name: str, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(r.get("step") == step and "rollout/reward_mean" in r for r in metrics(root, name)):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"step {step} of {name} not logged after {timeout} s")


def _steps(root: Path, name: str) -> list[int]:
    return [r["step"] for r in metrics(root, name) if "rollout/reward_mean" in r]


def _diagnose(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").glob("*"))
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in logs)


def test_colocated_job_trains_two_steps(cluster, tiny):
    root, hf = tiny
    cfg = write_config(root, hf, "colocated", train={"steps": 2}, eval=NO_EVAL)
    started = time.monotonic()
    job_id, run_dir = _submit(cluster, root, cfg, "--learner-nodes", "1")
    info = _wait_job(cluster, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    print(f"colocated job: {time.monotonic() - started:.0f} s from submission to completion")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _diagnose(run_dir)
    assert _steps(root, "colocated") == [1, 2]
    assert (root / "colocated" / "hf" / "model.safetensors.index.json").is_file()
    assert [p.name for p in (run_dir / "logs").glob("learner-*.log")]  # one per learner node


def test_disaggregated_job_trains_on_its_rollout_node(cluster, tiny):
    root, hf = tiny
    cfg = write_config(root, hf, "disagg", train={"steps": 2}, eval=NO_EVAL)
    port = free_port()
    started = time.monotonic()
    job_id, run_dir = _submit(
        cluster, root, cfg, "--learner-nodes", "1", "--rollout-nodes", "1", "--rollout-port", str(port)
    )
    _wait_step(root, "disagg", 1)
    # the job's servers (node n2) hold the weights the learner synced after step 1
    kv = load_config(cfg).rollout.kv
    for url in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"):
        info = httpx.get(f"{url}/get_model_info", timeout=10).json()
        assert info["weight_version"] >= 1 and info["kv_compression"]["budget"] == kv.budget
    info = _wait_job(cluster, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    print(f"disaggregated job: {time.monotonic() - started:.0f} s from submission to completion")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _diagnose(run_dir)
    assert info["NodeList"] == "n[1-2]"
    out = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "2 embedded rollout servers on n2" in out and "learners on n1" in out
    assert _steps(root, "disagg") == [1, 2]
    assert len(list((run_dir / "logs").glob("rollout-*.log"))) == 2  # one per server


def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(cluster, tiny):
    root, hf = tiny
    cfg = write_config(root, hf, "preempt", train={"steps": 5}, checkpoint={"every": 0}, eval=NO_EVAL)
    started = time.monotonic()
    job_id, run_dir = _submit(cluster, root, cfg, "--learner-nodes", "1")
    _wait_step(root, "preempt", 1)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)  # as --signal=B:USR1@S does
    info = _wait_job(cluster, job_id, ("PENDING", "COMPLETED", "FAILED", "CANCELLED"))
    assert (info["JobState"], info["Restarts"]) == ("PENDING", "1"), _diagnose(run_dir)
    stopped = [r for r in metrics(root, "preempt") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "SIGUSR1"
    saved = stopped[0]["step"]
    assert 1 <= saved < 5 and (root / "preempt" / "ckpt" / f"step_{saved:08d}").is_dir()
    # Slurm holds a requeued job back for a while (BeginTime); release it sooner, but not at once:
    # slurmd refuses a batch launch within about a second of revoking the job's previous
    # credential ("Job credential revoked", seen once in CI), so leave it a few seconds
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+10")
    info = _wait_job(cluster, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    print(f"preempted job: {time.monotonic() - started:.0f} s from submission to completion")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _diagnose(run_dir)
    resumed = [r["step"] for r in metrics(root, "preempt") if r.get("event") == "resumed"]
    assert resumed == [saved]
    assert _steps(root, "preempt") == [1, 2, 3, 4, 5]  # each step once: none lost, none repeated
    assert "requeueing job" in (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def test_islands_job_puts_each_island_on_its_own_node(cluster, tiny):
    """parallel.islands=2 over 2 learner nodes x 2 ranks: the static rendezvous makes node n1
    island 0 (ranks 0-1) and n2 island 1 (ranks 2-3); the job trains with outer steps."""
    root, hf = tiny
    islands = {"tensor_model_parallel_size": 1, "islands": 2}
    cfg = write_config(
        root,
        hf,
        "islands",
        train={"steps": 2, "global_batch_size": 32},
        eval=NO_EVAL,
        parallel=islands,
        diloco={"inner_steps": 2},
    )
    job_id, run_dir = _submit(cluster, root, cfg, "--learner-nodes", "2")
    info = _wait_job(cluster, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _diagnose(run_dir)
    rows = metrics(root, "islands")
    placed = [r for r in rows if r.get("event") == "islands"]
    assert (
        placed and placed[0]["island 0"] == "ranks 0-1 on n1" and placed[0]["island 1"] == "ranks 2-3 on n2"
    )
    assert _steps(root, "islands") == [1, 2]
    assert [r["diloco/outer_step"] for r in rows if r.get("event") == "diloco_outer_step"] == [1, 2]
