"""A `sparserl train --nproc 2` launcher killed outright costs at most the current step (issue 27).

Real processes throughout: the tiny model, TP=2 over two gloo ranks under torchrun, a checkpoint
directory but no periodic checkpoints (`checkpoint.every=0`), so the only checkpoint there can be
is the stop checkpoint (megatron's checkpoint writer, a process of its own, is started with the
run all the same). The launcher is SIGKILLed mid-run and its console (the pipes this test reads)
goes with it. torchrun then signals its ranks' whole process groups; the ranks finish their step,
write a complete stop checkpoint holding every step they finished, and are gone within 10 s; no
`.step_N.tmp` and no `torchelastic_*` folder is left.
That checkpoint, cut short by hand, is refused before any rank starts; intact, the rerun resumes
from it, and its metrics.jsonl holds every step once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from e2e_support import make_assets, metrics, subprocess_env, write_config
from waiting import wait_until

from sparserl_mcore.config import load_config
from sparserl_mcore.trainer.preflight import PreflightError, check_run
from sparserl_mcore.trainer.run_record import latest_checkpoint, read_saved_run

RANKS_GONE_WITHIN_S = 10.0
STEPS = 4


def _train(cfg, env, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2"]
    return subprocess.Popen(cmd, env=env, text=True, **kw)


def _rank_pids(log_dir) -> list[int]:
    """The ranks' pids: each is the leader of its own process group (`rank<R>.pgid`)."""
    return [int(p.read_text()) for p in sorted(log_dir.glob("rank*.pgid"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone as far as the run is concerned
        return stat.read().split(")")[-1].split()[0] != "Z"


def _step_rows(root, name) -> list[int]:
    return [r["step"] for r in metrics(root, name) if "rollout/reward_mean" in r]


@pytest.mark.timeout(900)
def test_sigkill_of_the_launcher_leaves_a_complete_stop_checkpoint_and_a_clean_resume(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(tmp_path, hf, "kill", train={"steps": STEPS}, checkpoint={"every": 0, "save_hf": None})
    (tmp_path / "tmp").mkdir()
    env = {**subprocess_env(), "TMPDIR": str(tmp_path / "tmp")}  # where torchelastic_* would pile up
    launcher = _train(cfg, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    logs = tmp_path / "kill" / "metrics" / "logs"
    try:

        def two_steps() -> bool:
            assert launcher.poll() is None, launcher.communicate()
            try:
                return len(_step_rows(tmp_path, "kill")) >= 2
            except FileNotFoundError:
                return False

        wait_until(two_steps, timeout=400, what="step 2 in metrics.jsonl")
        ranks = _rank_pids(logs)
        assert len(ranks) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.stdout.close()  # the console goes with the launcher
        launcher.stderr.close()
        wait_until(lambda: not any(map(_alive, ranks)), timeout=RANKS_GONE_WITHIN_S, what="ranks gone")
    finally:
        launcher.kill()
        launcher.wait()

    records = [json.loads(p.read_text()) for p in sorted(logs.glob("rank*.exit.json"))]
    assert [r["exit_code"] for r in records] == [0, 0], records  # no BrokenPipeError, no crash
    root = tmp_path / "kill" / "ckpt"
    saved = read_saved_run(latest_checkpoint(root))
    assert saved.step >= 2 and saved.files and len(saved.files) >= 5, saved
    assert saved.step == max(_step_rows(tmp_path, "kill"))  # every finished step is in it, no more
    assert [p.name for p in root.iterdir() if p.name.startswith("step_")] == [saved.path.name]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no partial .step_N.tmp
    assert list((tmp_path / "tmp").glob("torchelastic_*")) == []  # torchrun's files: in the log dir
    events = [r for r in metrics(tmp_path, "kill") if r.get("event") == "stopped"]
    assert [(e["reason"], e["step"]) for e in events] == [("SIGTERM", saved.step)]

    # the same checkpoint with one shard cut short is refused before any rank starts
    cut = tmp_path / "cut"
    shutil.copytree(root, cut)
    shard = next((cut / saved.path.name).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    cut_cfg = load_config(cfg, [f"checkpoint.dir={cut}"])
    with pytest.raises(PreflightError, match=r"\.distcp has \d+ bytes where the checkpoint wrote \d+"):
        check_run(cut_cfg, world_size=2)

    # the rerun resumes from the stop checkpoint: every step once in metrics.jsonl
    done = _train(cfg, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = done.communicate(timeout=600)
    assert done.returncode == 0, out[-3000:]
    assert f"resuming from {saved.path} at step {saved.step}" in out
    assert _step_rows(tmp_path, "kill") == list(range(1, STEPS + 1))
    assert list((tmp_path / "tmp").glob("torchelastic_*")) == []
    assert not (logs / "torchelastic").exists()  # the killed launch's, removed by the next one
