"""What `sparserl train`, `serve`, `model make-tiny` refuse before anything starts: one line, exit
code 2, no traceback; and how a run that would resume is planned from a checkpoint's run.json.

Real files throughout (tiny HF checkpoints, JSONL data, run records); no rank is started.
"""

from __future__ import annotations

import http.server
import json
import pathlib
import re
import subprocess
import sys
import threading

import pytest
import yaml
from e2e_support import make_assets, subprocess_env, write_config

from sparserl_mcore.cli import main
from sparserl_mcore.config import load_config, to_dict
from sparserl_mcore.trainer.preflight import PreflightError, check_run
from sparserl_mcore.trainer.run_layout import requested_layout
from sparserl_mcore.trainer.run_record import LATEST, rng_file, write_record


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("assets")
    return root, make_assets(root)


def _config(root: pathlib.Path, hf: pathlib.Path, name: str, **sections) -> pathlib.Path:
    return write_config(root, hf, name, **sections)


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    return out.err


def _train(cfg: pathlib.Path, *overrides: str, nproc: str = "2") -> list[str]:
    return ["train", "--config", str(cfg), "--nproc", nproc, *overrides]


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        ((), "3", "world size 3 is not divisible by TP\\*PP\\*CP = 2\\*1\\*1 = 2"),
        (("model.hf_path=/nonexistent/model",), "2", "model.hf_path /nonexistent/model: no such directory"),
        (("parallel.tensor_model_parallel_size=3",), "3", "tensor_model_parallel_size=3 does not divide"),
        (("reward.name=no_such_pkg.mod:fn",), "2", "cannot import module 'no_such_pkg.mod'"),
        (("reward.name=nope",), "2", "unknown reward 'nope'"),
        (("data.answer_key=solution",), "2", "train.jsonl:1: missing key 'solution'"),
        (
            ("data.train_path=/nonexistent/train.jsonl",),
            "2",
            "dataset /nonexistent/train.jsonl does not exist",
        ),
        (("train.prompts_per_step=1", "train.global_batch_size=8"), "4", "cannot fill one micro-batch"),
        (("parallel.islands=3",), "4", "islands=3 does not divide the 2 data-parallel replicas"),
        (
            ("parallel.islands=2", "optimizer.distributed=false"),
            "8",
            "islands=2 with optimizer.distributed=false and 2 data-parallel replicas per island",
        ),
    ],
)
def test_train_refuses_before_any_rank_starts(assets, capsys, overrides, nproc, message):
    root, hf = assets
    cfg = _config(root, hf, "refused")
    tp1 = (
        ("parallel.tensor_model_parallel_size=1",) if overrides and overrides[0].startswith("train.") else ()
    )
    err = _refused(capsys, *_train(cfg, *tp1, *overrides, nproc=nproc))
    assert err.startswith("sparserl train: ")
    assert re.search(message, err), err
    assert not (root / "refused" / "metrics").exists()  # nothing written


def test_train_refuses_bad_data_and_outputs(assets, tmp_path, capsys):
    root, hf = assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": 1\n')
    cfg = _config(root, hf, "bad_data")
    assert "bad.jsonl:2: invalid JSON" in _refused(capsys, *_train(cfg, f"data.train_path={bad}"))
    (tmp_path / "file").write_text("x")
    err = _refused(capsys, *_train(cfg, f"telemetry.dir={tmp_path / 'file'}"))
    assert "telemetry.dir" in err and "is not a directory" in err


def test_a_malformed_model_directory_is_one_line(assets, tmp_path, capsys):
    root, hf = assets
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[:-100])
    cfg = _config(root, hf, "broken")
    err = _refused(capsys, *_train(cfg, f"model.hf_path={broken}"))
    assert "model.safetensors is not a readable safetensors file" in err
    config = json.loads((hf / "config.json").read_text())
    del config["hidden_size"]
    (broken / "model.safetensors").write_bytes(weights)
    (broken / "config.json").write_text(json.dumps(config))
    assert "lacks the required field 'hidden_size'" in _refused(
        capsys, *_train(cfg, f"model.hf_path={broken}")
    )
    assert "lacks the required field 'hidden_size'" in _refused(capsys, "serve", "--hf-dir", str(broken))


def test_make_tiny_refuses_bad_arch_and_a_non_empty_folder(tmp_path, capsys):
    assert "arch='gpt9' is not supported" in _refused(
        capsys, "model", "make-tiny", "--arch", "gpt9", "--out", str(tmp_path / "x")
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    err = _refused(capsys, "model", "make-tiny", "--arch", "qwen2", "--out", str(tmp_path / "full"))
    assert "not empty; pass --overwrite" in err and (tmp_path / "full" / "keep").read_text() == "x"


def test_serve_refuses_a_port_in_use(assets, capsys):
    import socket

    _, hf = assets
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert "cannot listen on 127.0.0.1:" in _refused(capsys, "serve", "--hf-dir", str(hf), "--port", port)


def test_refusal_as_a_subprocess_has_no_traceback(assets):
    root, hf = assets
    cfg = _config(root, hf, "sub")
    cmd = [sys.executable, "-m", "sparserl_mcore", *_train(cfg, nproc="3")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.startswith("sparserl train: parallel: world size 3")
        and len(proc.stderr.splitlines()) == 1
    )


# -- resume planning from run.json ---------------------------------------------------------------


def _saved(root: pathlib.Path, hf: pathlib.Path, name: str, step: int, **changes) -> pathlib.Path:
    """A config whose checkpoint.dir holds a (fake-weights) checkpoint at `step` with a real record
    of that config; `changes` override sections afterwards (the 'new' run)."""
    cfg_path = _config(root, hf, name)
    cfg = load_config(cfg_path)
    step_dir = pathlib.Path(cfg.checkpoint.dir) / f"step_{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))  # megatron's
    data = {"n": 56, "seed": cfg.train.seed, "shuffle": True, "epoch": 0, "offset": 8}
    layout = requested_layout(cfg, 2, padded_vocab_size=256)
    write_record(step_dir, step=step, config=to_dict(cfg), world_size=2, data=data, layout=layout)
    for rank in range(2):
        rng_file(step_dir, rank).write_bytes(b"")
    (step_dir.parent / LATEST).write_text(step_dir.name + "\n")
    raw = yaml.safe_load(cfg_path.read_text())
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values}
    cfg_path.write_text(yaml.safe_dump(raw))
    return cfg_path


def test_a_resumed_run_names_its_step_and_every_changed_setting(assets):
    root, hf = assets
    path = _saved(root, hf, "resume", 2, train={"steps": 6}, optimizer={"lr": 1e-3})
    plan = check_run(load_config(path), world_size=2)
    assert not plan.complete
    assert plan.notes[0] == f"resuming from {root / 'resume' / 'ckpt' / 'step_00000002'} at step 2 of 6"
    assert plan.notes[1] == "changed since that run: optimizer.lr 0.003 -> 0.001, train.steps 4 -> 6"
    assert len(plan.notes) == 2


def test_a_changed_layout_is_fine_but_said(assets):
    root, hf = assets
    path = _saved(root, hf, "layout", 2, parallel={"tensor_model_parallel_size": 1})
    notes = check_run(load_config(path), world_size=1).notes
    assert notes[1].startswith(
        "parallel layout changed (tensor_model_parallel_size 2 -> 1, world size 2 -> 1)"
    )
    assert "RNG streams restart" in notes[1]


def test_a_complete_run_does_nothing_and_another_dataset_is_refused(assets, tmp_path):
    root, hf = assets
    done = check_run(load_config(_saved(root, hf, "done", 4)), world_size=2)
    assert done.complete and done.notes[0].startswith("already complete:")
    assert "is at step 4 and train.steps=4" in done.notes[0]
    rows = [{"prompt": f"p{i}", "answer": "a"} for i in range(80)]
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = _saved(
        root, hf, "other_data", 2, data={"train_path": str(tmp_path / "more.jsonl")}, train={"steps": 6}
    )
    with pytest.raises(PreflightError, match="cannot resume .*step_00000002: its prompt sampler ran over"):
        check_run(load_config(path), world_size=2)


def test_a_layout_that_cannot_load_is_refused_naming_both_layouts(assets):
    root, hf = assets
    path = _saved(root, hf, "optim", 2, optimizer={"distributed": False}, train={"steps": 6})
    with pytest.raises(PreflightError) as refused:
        check_run(load_config(path), world_size=2)
    line = str(refused.value)
    assert "step_00000002: cannot resume: saved at TP=2 PP=1 CP=1 DP=1" in line
    assert "distributed optimizer, requested TP=2" in line and "optimizer.distributed=true" in line


def test_a_checkpoint_cut_short_or_missing_a_file_is_refused(assets):
    """run.json records every file's size when the checkpoint is complete; a shard cut short (a
    full disk, a copy) or gone is refused before any rank loads it (tests/test_e2e_kill.py does
    the same on a real checkpoint)."""
    root, hf = assets
    path = _saved(root, hf, "cut", 2, train={"steps": 6})
    step_dir = root / "cut" / "ckpt" / "step_00000002"
    shard = step_dir / "__0_0.distcp"
    shard.write_bytes(b"x" * 1000)
    record = json.loads((step_dir / "run.json").read_text())  # re-recorded with the shard in it
    record["files"]["__0_0.distcp"] = 1000
    (step_dir / "run.json").write_text(json.dumps(record))
    assert check_run(load_config(path), world_size=2).notes[0].startswith("resuming from")
    shard.write_bytes(b"x" * 900)
    with pytest.raises(PreflightError) as refused:
        check_run(load_config(path), world_size=2)
    line = str(refused.value)
    assert re.search(
        r"cannot resume step_00000002: .*__0_0\.distcp has 900 bytes where the checkpoint wrote 1000", line
    )
    assert "set checkpoint.resume=false to start over" in line
    shard.unlink()
    with pytest.raises(PreflightError, match=r"__0_0\.distcp is missing"):
        check_run(load_config(path), world_size=2)
    shard.write_bytes(b"x" * 1000)
    meta = step_dir / "metadata.json"  # same size, not JSON: the size check alone would pass it
    meta.write_text("#" * len(meta.read_text()))
    with pytest.raises(PreflightError, match=r"metadata\.json is not readable megatron checkpoint metadata"):
        check_run(load_config(path), world_size=2)


def test_a_run_that_starts_over_says_it_replaces_the_old_metrics(assets):
    root, hf = assets
    path = _config(root, hf, "again")
    cfg = load_config(path)
    assert check_run(cfg, world_size=2).notes == ()
    metrics = pathlib.Path(cfg.telemetry.dir) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"step": 1}\n')
    assert check_run(cfg, world_size=2).notes == (
        f"{metrics} holds an earlier run's metrics: this run starts it over",
    )


class _Front(http.server.BaseHTTPRequestHandler):
    """GET /server_info as SGLang answers it (a JSON object of its settings, tp_size among them)
    on the "sglang" servers (its overlap scheduler on, SGLang's default, or off; routed experts
    returned on "sglang_routed" only), 404 (no such route, as `sparserl serve`) on the other."""

    def do_GET(self) -> None:
        kind = self.server.kind  # type: ignore[attr-defined]
        sglang = kind.startswith("sglang")
        info = {
            "tp_size": 2,
            "version": "0.5.23",
            "disable_overlap_schedule": kind == "sglang_no_overlap",
            "enable_return_routed_experts": kind == "sglang_routed",
        }
        body = json.dumps(info).encode() if sglang else b"{}"
        self.send_response(200 if sglang and self.path == "/server_info" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fronts():
    urls = {}
    servers = []
    for kind in ("sglang", "sglang_no_overlap", "sglang_routed", "sparserl"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Front)
        server.kind = kind  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls[kind] = f"http://127.0.0.1:{server.server_address[1]}"
    yield urls
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("said", "started", "message"),
    [
        (
            "sparserl",
            "sglang",
            "answers as an SGLang server, but rollout.server=sparserl; set rollout.server=sglang",
        ),
        (
            "sglang",
            "sparserl",
            "answers as `sparserl serve` .*, but rollout.server=sglang; set rollout.server=sparserl",
        ),
    ],
)
def test_remote_servers_of_the_other_kind_are_refused(assets, capsys, fronts, said, started, message):
    root, hf = assets
    cfg = _config(root, hf, "kinds")
    remote = ("rollout.engine=remote", f"rollout.urls=[{fronts[started]}]", f"rollout.server={said}")
    err = _refused(capsys, *_train(cfg, *remote))
    assert re.search(message, err), err
    # the right kind (and an unreachable server, left to the run) passes
    ok = load_config(
        cfg,
        [
            "rollout.engine=remote",
            f"rollout.urls=[{fronts[said]},http://127.0.0.1:9]",
            f"rollout.server={said}",
        ],
    )
    check_run(ok, world_size=2)


def test_in_flight_refuses_sglang_workers_that_run_the_overlap_scheduler(assets, capsys, fronts):
    root, hf = assets
    cfg = _config(root, hf, "overlap")
    remote = ["rollout.engine=remote", "rollout.server=sglang", "loss.correction.mode=sparse_rl"]
    both = f"rollout.urls=[{fronts['sglang_no_overlap']},{fronts['sglang']}]"
    err = _refused(capsys, *_train(cfg, *remote, both, "train.async.mode=in_flight"))
    assert re.search(rf"{fronts['sglang']} runs SGLang's overlap scheduler.*--disable-overlap-schedule", err)
    # without it, or with one version per sample (one_step), the run goes ahead
    quiet = f"rollout.urls=[{fronts['sglang_no_overlap']}]"
    check_run(load_config(cfg, [*remote, quiet, "train.async.mode=in_flight"]), world_size=2)
    check_run(load_config(cfg, [*remote, both, "train.async.mode=one_step"]), world_size=2)


def test_replay_refuses_sglang_workers_started_without_routed_experts(assets, fronts):
    """`model.moe.routing_replay` needs workers started with --enable-return-routed-experts (SGLang
    answers without ids otherwise, and every sample would be refused)."""
    from sparserl_mcore.trainer.preflight import _check_servers

    root, hf = assets
    path = _config(root, hf, "replay")

    def cfg(*urls: str):
        remote = ["rollout.engine=remote", "rollout.server=sglang", f"rollout.urls=[{','.join(urls)}]"]
        return load_config(path, [*remote, "model.moe.routing_replay=true", "rollout.kv.method=none"])

    with pytest.raises(PreflightError, match=rf"{fronts['sglang']} is an SGLang server started without "):
        _check_servers(cfg(fronts["sglang_routed"], fronts["sglang"]))
    _check_servers(cfg(fronts["sglang_routed"], "http://127.0.0.1:9"))  # unreachable: left to the run
