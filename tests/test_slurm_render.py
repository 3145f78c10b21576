"""`sparserl slurm`: the rendered sbatch scripts (shellcheck, bash -n, the checked-in examples), the
layouts it refuses (one line, exit 2), what it writes, and the rollout server commands.

A real Slurm runs these scripts in tests/test_slurm_cluster.py (`make slurm-test`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from e2e_support import PY, REPO, make_assets, write_config

from sparserl_mcore.cli import main
from sparserl_mcore.config import load_config
from sparserl_mcore.rollout.http import cli as serve_cli
from sparserl_mcore.sglang import cli as sglang_cli
from sparserl_mcore.slurm import cli as slurm_cli
from sparserl_mcore.slurm.layout import LayoutError, time_limit_seconds
from sparserl_mcore.slurm.servers import task_server

# The checked-in examples and the commands that render them (run from the repository root).
EXAMPLES = {
    "slurm/colocated.sbatch": "--config examples/qwen2.5-1.5b-math.yaml --learner-nodes 1 "
    "rollout.engine=embedded 'rollout.urls=[]'",
    "slurm/disaggregated.sbatch": "--config examples/qwen2.5-7b-math.yaml --learner-nodes 2 "
    "--rollout-nodes 2",
    "slurm/qwen3-30b-a3b.sbatch": "--config examples/qwen3-30b-a3b-math.yaml --learner-nodes 2 "
    "--rollout-nodes 2 --rollout-server sglang",
    "slurm/islands.sbatch": "--config examples/qwen2.5-7b-math.yaml --learner-nodes 4 --rollout-nodes 2 "
    "parallel.islands=2 diloco.inner_steps=8",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    slurm_cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_checked_in_examples_are_the_renderer_output(path, monkeypatch):
    monkeypatch.chdir(REPO)
    job = slurm_cli.build_job(_args(shlex.split(EXAMPLES[path])))
    regenerate = f"sparserl slurm {EXAMPLES[path]} --dry-run --out {path}"
    assert job.script == (REPO / path).read_text(), f"{path} is stale; regenerate with: {regenerate}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    return root, make_assets(root)


def _config(root: Path, hf: Path, name: str = "job", **sections) -> Path:
    """write_config's tiny run, with optimizer steps of 32 sequences (DP 1, 2 or 4 at micro-batch 8)."""
    return write_config(root, hf, name, **{"train": {"global_batch_size": 32}, **sections})


LAYOUTS = {
    "colocated-gpu": "--learner-nodes 1",
    "disaggregated-gpu-rollout-tp2": "--learner-nodes 1 --rollout-nodes 3 rollout.tensor_parallel_size=2",
    "colocated-cpu": "--learner-nodes 1 --gpus-per-node 0 --ranks-per-node 2",
    "disaggregated-cpu": "--learner-nodes 1 --rollout-nodes 1 --gpus-per-node 0 --ranks-per-node 2",
    "partition-time-sglang": "--learner-nodes 1 --rollout-nodes 1 --gpus-per-node 4 --partition h100 "
    "--time 2-00:00:00 --stop-before 1800 --rollout-server sglang rollout.kv.method=none",
    "islands-cpu": "--learner-nodes 2 --gpus-per-node 0 --ranks-per-node 2 parallel.islands=2",
}


def _render(root: Path, hf: Path, argv: str) -> str:
    cfg = _config(root, hf)
    return slurm_cli.build_job(_args(["--config", str(cfg), *shlex.split(argv)])).script


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_rendered_scripts_parse_with_bash_n(tiny, name):
    script = _render(*tiny, LAYOUTS[name])
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_rendered_scripts_pass_shellcheck(tiny, name):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; `make slurm-test` does)")
    script = _render(*tiny, LAYOUTS[name])
    proc = subprocess.run(["shellcheck", "-"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stdout


def test_shellcheck_finds_a_planted_bug(tiny):
    """The check above can fail: an unquoted array expansion in a rendered script is reported."""
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    script = _render(*tiny, LAYOUTS["colocated-gpu"]).replace('"${TOPOLOGY[@]}"', "${TOPOLOGY[@]}")
    proc = subprocess.run(["shellcheck", "-"], input=script, text=True, capture_output=True)
    assert proc.returncode != 0 and "SC2068" in proc.stdout


REFUSED = {
    "tp-spans-nodes": (
        "--learner-nodes 2 --gpus-per-node 2 parallel.tensor_model_parallel_size=4",
        "tensor_model_parallel_size=4 does not divide the 2 GPUs of a node",
    ),
    "world": (
        "--learner-nodes 1 --gpus-per-node 6 parallel.pipeline_model_parallel_size=2",
        "world size 6 is not divisible by TP*PP*CP",
    ),
    "gbs-vs-dp": (
        "--learner-nodes 3 --gpus-per-node 2",
        "train.global_batch_size=32 is not a multiple of train.micro_batch_size x DP = 8 x 3 = 24",
    ),
    "rollout-tp": (
        "--learner-nodes 1 --rollout-nodes 1 rollout.tensor_parallel_size=3",
        "rollout.tensor_parallel_size=3 does not divide the 8 GPUs",
    ),
    "remote-no-servers": (
        "--learner-nodes 1 rollout.engine=remote rollout.urls=[http://x:1]",
        "--rollout-nodes 0 starts no servers",
    ),
    "colocated-rollout-tp": (
        "--learner-nodes 1 rollout.tensor_parallel_size=2",
        "needs rollout nodes running SGLang",
    ),
    "no-checkpoint-dir": (
        "--learner-nodes 1 checkpoint.dir=null checkpoint.every=0",
        "checkpoint.dir is not set",
    ),
    "no-resume": ("--learner-nodes 1 checkpoint.resume=false", "a requeued job would start over"),
    "bad-time": ("--learner-nodes 1 --time tomorrow", "--time 'tomorrow'"),
    "stop-after-limit": (
        "--learner-nodes 1 --time 10:00 --stop-before 900",
        "--stop-before 900 s must be > 0 and shorter than --time 10:00 (600 s)",
    ),
    "gpu-ranks": ("--learner-nodes 1 --ranks-per-node 4", "every GPU runs one learner rank"),
    "sglang-cpu": (
        "--learner-nodes 1 --rollout-nodes 1 --gpus-per-node 0 --ranks-per-node 2 --rollout-server sglang "
        "rollout.kv.method=none",
        "--rollout-server sglang needs GPU nodes",
    ),
    "sglang-h2o": (
        "--learner-nodes 1 --rollout-nodes 1 --rollout-server sglang rollout.kv.method=h2o",
        "rollout.kv.method=h2o: this method does not work inside SGLang",
    ),
    "partition": ("--learner-nodes 1 --partition 'gpu;rm'", "--partition 'gpu;rm'"),
    "kv-heads": (
        "--learner-nodes 1 --gpus-per-node 4 parallel.tensor_model_parallel_size=4",
        "does not divide num_key_value_heads=2",
    ),
    "config": ("--learner-nodes 1 train.stepz=3", "unknown key train.stepz"),
    "experts-dense": ("--learner-nodes 1 parallel.expert_model_parallel_size=2", "the model has no experts"),
    "experts-world": (
        "--learner-nodes 1 --gpus-per-node 4 parallel.expert_model_parallel_size=8",
        "world size 4 is not divisible by ETP*EP*PP = 2*8*1 = 16",
    ),
    "islands-dp": (
        "--learner-nodes 1 --gpus-per-node 4 parallel.islands=3",
        "islands=3 does not divide the 2 data-parallel replicas",
    ),
    "island-across-nodes": (
        "--learner-nodes 3 --gpus-per-node 2 parallel.islands=2 parallel.tensor_model_parallel_size=1",
        "an island of 3 ranks would straddle nodes",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_layouts_that_cannot_work_are_refused_in_one_line(tiny, name, capsys):
    root, hf = tiny
    argv, message = REFUSED[name]
    cfg = _config(root, hf, "refused")
    assert main(["slurm", "--config", str(cfg), "--dry-run", *shlex.split(argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sparserl slurm: "), err
    assert message in err, err
    assert not (root / "refused" / "metrics").exists()  # nothing written


def _wrapper(script: str) -> str:
    """The inner `bash -c '...'` every learner node runs torchrun through."""
    line = next(ln for ln in script.splitlines() if "bash -c '" in ln)
    return line.split("bash -c '", 1)[1].rsplit("'", 1)[0]


@pytest.mark.parametrize(
    ("name", "backend", "node_rank"), [("islands-cpu", "static", "1"), ("colocated-cpu", "c10d", "")]
)
def test_islands_take_their_node_rank_from_the_learner_node_list(tiny, name, backend, node_rank):
    """DiLoCo islands are blocks of consecutive ranks, so node ranks must follow the node list
    (static rendezvous, --node-rank from SLURM_NODEID); other jobs keep c10d."""
    script = _render(*tiny, LAYOUTS[name])
    assert f"RDZV_BACKEND={backend}" in script
    assert ("# Islands: 2, learner nodes [0], [1]; DiLoCo outer sync between them only." in script) == (
        backend == "static"
    )
    env = {"PATH": "/usr/bin:/bin", "RDZV_BACKEND": backend, "SLURM_NODEID": "1"}
    proc = subprocess.run(
        ["bash", "-c", _wrapper(script), "torchrun-agent", "bash", "-c", 'echo "${PET_NODE_RANK-}"'],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert proc.stdout.strip() == node_rank


def test_dry_run_writes_the_script_and_the_config_snapshot_atomically(tiny, capsys):
    root, hf = tiny
    cfg = _config(root, hf, "written")
    argv = ["slurm", "--config", str(cfg), "--learner-nodes", "1", "--gpus-per-node", "0"]
    assert main([*argv, "--ranks-per-node", "2", "--dry-run", "train.steps=2"]) == 0
    run_dir = root / "written" / "metrics"  # write_config's telemetry.dir
    script, snapshot = run_dir / "job.sbatch", run_dir / "job-config.yaml"
    assert script.stat().st_mode & 0o111 and (run_dir / "logs").is_dir()
    assert f"CONFIG={snapshot}" in script.read_text()
    assert load_config(snapshot) == load_config(cfg, ["train.steps=2"])
    assert sorted(p.name for p in run_dir.iterdir()) == ["job-config.yaml", "job.sbatch", "logs"]
    assert f"wrote {script}" in capsys.readouterr().out


def test_submitting_without_sbatch_is_refused_in_one_line(tiny, capsys, monkeypatch, tmp_path):
    root, hf = tiny
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    cfg = _config(root, hf, "nosbatch")
    assert main(["slurm", "--config", str(cfg), "--learner-nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "sparserl slurm: sbatch not found: run on a Slurm login node, or pass --dry-run\n"


def test_time_limits_in_every_slurm_format():
    cases = {
        "90": 5400,
        "90:30": 5430,
        "4:00:00": 14400,
        "1-12": 129600,
        "1-0:30": 88200,
        "2-00:00:05": 172805,
    }
    assert {t: time_limit_seconds(t) for t in cases} == cases
    with pytest.raises(LayoutError):
        time_limit_seconds("1:2:3:4")


def _sglang_launch(cmd: list[str]):
    assert cmd[1:4] == ["-m", "sparserl_mcore", "sglang-serve"]
    parser = argparse.ArgumentParser()
    sglang_cli.add_arguments(parser)
    args = parser.parse_args(cmd[4:])
    args.token = "job-token"  # the job script's $SPARSERL_SERVE_TOKEN
    return sglang_cli.config_from_args(args)


def _serve_args(cmd: list[str]) -> argparse.Namespace:
    assert cmd[1:4] == ["-m", "sparserl_mcore", "serve"]
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(cmd[4:])


def test_rollout_tasks_get_their_own_port_and_gpus(tiny):
    root, hf = tiny
    path = _config(
        root,
        hf,
        "tasks",
        rollout={"tensor_parallel_size": 2, "kv": {"method": "rkv", "budget": 64, "interval": 16}},
    )
    cfg = load_config(path)
    # each server's flags are read back by its own command's parser (`sparserl sglang-serve` / `serve`)
    sglang = _sglang_launch(task_server("sglang", cfg, local_task=3, base_port=30000, gpus=True))
    assert (sglang.model_path, sglang.port, sglang.tp_size, sglang.host) == (str(hf), 30003, 2, "0.0.0.0")
    assert sglang.extra_args == ("--base-gpu-id", "6") and sglang.kv == cfg.rollout.kv
    assert not sglang.return_routed_experts
    replay = load_config(
        path, ["model.moe.routing_replay=true", "rollout.kv.method=none"]
    )  # routed experts back
    assert _sglang_launch(
        task_server("sglang", replay, local_task=0, base_port=30000, gpus=True)
    ).return_routed_experts
    embedded = _serve_args(task_server("embedded", cfg, local_task=3, base_port=30000, gpus=True))
    assert (embedded.port, embedded.device, embedded.host) == (30003, "cuda:3", "0.0.0.0")
    assert serve_cli._engine_config(embedded).kv_compression == cfg.rollout.kv
    assert (
        _serve_args(task_server("embedded", cfg, local_task=0, base_port=30000, gpus=False)).device == "cpu"
    )


def test_the_rollout_entry_refuses_a_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"hf_path": "x"}}))
    proc = subprocess.run(
        [PY, "-m", "sparserl_mcore.launch.rollout", "--config", str(bad), "--server", "embedded",
         "--device", "cpu", "--port", "1"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "missing required key data" in proc.stderr


def _learner_overrides(script: str) -> list[str]:
    """The overrides the rendered script passes to the learners (`TOPOLOGY`), for one server URL:
    its value lines, the server-kind block and the TOPOLOGY line, run by bash."""
    lines = script.splitlines()
    values = [ln for ln in lines if ln.startswith(("ROLLOUT_SERVER=", "RANKS_PER_NODE=", "ROLLOUT_TP="))]
    start = lines.index("SERVERS_PER_NODE=$RANKS_PER_NODE  # the embedded engine: one per GPU")
    block = lines[start : lines.index("fi", start) + 1]
    topology = [ln for ln in lines if ln.startswith("TOPOLOGY=(rollout")]
    program = "\n".join(
        [*values, 'join() { local IFS=,; echo "$*"; }', "URLS=(http://a:1)", "MASTER_PORT=29500", *block,
         *topology, 'printf "%s\\n" "${TOPOLOGY[@]}"']
    )  # fmt: skip
    proc = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


@pytest.mark.parametrize(
    ("name", "server"), [("partition-time-sglang", "sglang"), ("disaggregated-cpu", "sparserl")]
)
def test_the_learners_are_told_which_servers_the_job_started(tiny, name, server):
    root, hf = tiny
    overrides = _learner_overrides(_render(root, hf, LAYOUTS[name]))
    assert f"rollout.server={server}" in overrides, overrides
    cfg = load_config(_config(root, hf), overrides)
    assert (cfg.rollout.engine, cfg.rollout.server, cfg.rollout.urls) == ("remote", server, ("http://a:1",))
    # SGLang servers get full syncs by broadcast from learner rank 0, on the port after the rendezvous
    port = 29500 + 1
    assert (cfg.sync.broadcast and cfg.sync.broadcast.master_port) == (port if server == "sglang" else None)


@pytest.mark.parametrize(
    ("overrides", "policy"),
    [("", "cache_aware"), (" rollout.env.name=lookup_chain reward.name=null", "manual")],
    ids=["single-turn", "episodes"],
)
def test_the_router_keeps_an_episode_group_on_one_worker(tiny, overrides, policy):
    """Multi-turn runs key each episode group (`x-smg-routing-key`); only sglang-router's manual
    policy honours the key, so their router runs it. The value is one the router's parser takes."""
    pytest.importorskip("sglang_router", reason="sglang-router (the sglang extra) parses the policy")
    from sglang_router.launch_router import parse_router_args

    root, hf = tiny
    script = _render(root, hf, LAYOUTS["partition-time-sglang"] + overrides)
    assert f"ROUTER_POLICY={policy}" in script.splitlines() and '--policy "$ROUTER_POLICY"' in script
    assert parse_router_args(["--policy", policy, "--worker-urls", "http://a:1"]).policy == policy


def test_auto_leaves_the_server_kind_to_the_job():
    """Under --rollout-server auto only the script knows (sglang importable on the node or not)."""
    from sparserl_mcore.slurm.layout import SlurmLayout
    from sparserl_mcore.slurm.render import topology_overrides

    def layout(server: str, gpus: int) -> SlurmLayout:
        return SlurmLayout(
            learner_nodes=1, rollout_nodes=1, gpus_per_node=gpus, ranks_per_node=max(gpus, 2), partition=None,
            time="1:00:00", stop_before_s=300, job_name="j", rollout_server=server, rollout_port=30000,
        )  # fmt: skip

    def kinds(server: str, gpus: int) -> list[str]:
        return [o for o in topology_overrides(layout(server, gpus), ["http://a:1"]) if "server" in o]

    assert kinds("auto", 8) == []
    assert kinds("sglang", 8) == ["rollout.server=sglang"]
    routers = [o for o in topology_overrides(layout("sglang", 8), ["http://a:1"]) if "router" in o]
    assert routers == ["rollout.router_url=http://rollout-0:29998"]  # generation through sglang-router
    assert not [o for o in topology_overrides(layout("embedded", 8), ["http://a:1"]) if "router" in o]
    assert kinds("embedded", 8) == kinds("auto", 0) == ["rollout.server=sparserl"]
