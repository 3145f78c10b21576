"""`sparserl serve` with the real EmbeddedEngine: the CLI as a subprocess over loopback, and the
in-process app where the test needs to look inside the engine (aborts free their pages, pause ->
weight update -> continue). References: HF transformers greedy decoding on the same weights."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import transformers
from hf_reference import hf_greedy
from safetensors.torch import load_file
from waiting import event_after_call, wait_until

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.cli import main
from sparserl_mcore.rollout.client import RemoteEngine, RemoteEngineError
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
from sparserl_mcore.rollout.http.worker import EngineWorker
from sparserl_mcore.rollout.protocol import GenerateRequest, RolloutEngine, SamplingParams
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.diff import make_patch
from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig

TOKEN = "serve-test-token-42"
PROMPT = (7, 19, 33, 40, 41, 42)
BUDGET = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    path = make_tiny(TinyModelConfig(dtype="bfloat16", seed=5), tmp_path_factory.mktemp("m") / "tiny")
    config = json.loads((path / "config.json").read_text())  # room for the 20000-token requests below
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    return path


def _weights(hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _hf_greedy(hf_dir: pathlib.Path, weights: dict[str, torch.Tensor], prompt, n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return hf_greedy(model, prompt, n)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _lowered_first_token(weights: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    new = {k: v.clone() for k, v in weights.items()}
    new["lm_head.weight"][token] -= 4.0  # greedy can no longer pick it first
    return new


@pytest.fixture(scope="module")
def cli_server(hf_dir) -> Iterator[tuple[str, subprocess.Popen]]:
    env = {k: v for k, v in os.environ.items() if k != "SPARSERL_SERVE_TOKEN"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "sparserl_mcore", "serve", "--hf-dir", str(hf_dir), "--port", "0",
           "--token", TOKEN, "--device", "cpu", "--capacity-pages", "256", "--page-size", "8",
           "--kv-method", "snapkv", "--kv-budget", str(BUDGET), "--kv-interval", "8", "--kv-window", "4",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=120)
        assert "listening on http://127.0.0.1:" in line, line
        yield line.rsplit(" ", 1)[1].strip(), proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cli_generate_compresses_and_matches_hf(cli_server, hf_dir):
    url, _ = cli_server
    with RemoteEngine(url, token=TOKEN) as engine:
        assert engine.health() and engine.model_info()["kv_compression"]["budget"] == BUDGET
        short, long = engine.generate(
            [
                GenerateRequest(input_ids=PROMPT, sampling=_greedy(8), rid="short"),
                GenerateRequest(
                    input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=60, seed=3, ignore_eos=True)
                ),
            ]
        )
    # Below the budget nothing is compressed: greedy equals HF transformers.
    assert list(short.output_ids) == _hf_greedy(hf_dir, _weights(hf_dir), PROMPT, 8)
    assert short.rid == "short" and short.kv_stats.compressions == 0 and short.finish_reason == "length"
    assert len(long.output_ids) == len(long.output_logprobs) == 60
    assert long.kv_stats.compressions > 0 and long.kv_stats.peak_retained_tokens <= BUDGET
    assert all(lp <= 0 for lp in long.output_logprobs)


def test_cli_text_prompt_and_token_routes(cli_server):
    url, _ = cli_server
    sampling = {"max_new_tokens": 3, "ignore_eos": True}
    body = {
        "text": "2+2=",
        "sampling_params": sampling,
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["prompt_tokens"] == 4
    assert "".join(item[2] for item in out["meta_info"]["output_token_logprobs"]) == out["text"]
    assert httpx.post(f"{url}/flush_cache").status_code == 401
    with RemoteEngine(url) as anonymous, pytest.raises(RemoteEngineError, match="HTTP 401") as err:
        anonymous.apply_patch(b"\x00" * 16)
    assert err.value.status_code == 401


def test_cli_sparse_patch_changes_outputs_like_hf(cli_server, hf_dir):
    url, _ = cli_server
    old = _weights(hf_dir)
    req = [GenerateRequest(input_ids=PROMPT, sampling=_greedy(6))]
    with RemoteEngine(url, token=TOKEN) as engine:
        before = engine.generate(req)[0]
        new = _lowered_first_token(old, before.output_ids[0])
        patch = make_patch(old, new, version=1, base_version=0, anchor_version=0)
        assert engine.apply_patch(encode_patch(patch)) == 1
        after = engine.generate(req)[0]
    assert after.weight_version == 1 and after.output_ids[0] != before.output_ids[0]
    assert list(after.output_ids) == _hf_greedy(hf_dir, new, PROMPT, 6)


def test_cli_refuses_public_host_without_token(hf_dir, capsys, monkeypatch):
    monkeypatch.delenv("SPARSERL_SERVE_TOKEN", raising=False)
    assert main(["serve", "--hf-dir", str(hf_dir), "--host", "0.0.0.0"]) == 2
    assert "no token is set" in capsys.readouterr().err
    assert main(["serve", "--hf-dir", str(hf_dir), "--kv-method", "rkv", "--kv-budget", "64"]) == 2
    assert "budget=64 <= interval=128" in capsys.readouterr().err


@pytest.fixture()
def embedded(hf_dir) -> Iterator[tuple[str, EmbeddedEngine]]:
    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", page_size=8, capacity_pages=4096))
    app = create_app(engine, ServerConfig(token=TOKEN, max_concurrent_batches=4))
    with BackgroundServer(app) as server:
        yield server.url, engine


def test_disconnect_aborts_in_engine_and_frees_pages(embedded):
    url, engine = embedded
    total = engine.stats()["pool_pages"]
    endless = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    fast: dict = {}

    def other_client():
        wait_until(lambda: engine.scheduler.running, timeout=20, what="the endless request decoding")
        fast["info"] = httpx.get(f"{url}/get_model_info", timeout=5)
        fast["r"] = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                               {"max_new_tokens": 5, "ignore_eos": True}}, timeout=60)  # fmt: skip

    t = threading.Thread(target=other_client)
    t.start()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=endless, timeout=1.5)
    t.join(60)
    assert fast["info"].status_code == 200  # read-only routes answer while a batch decodes
    assert fast["r"].status_code == 200 and fast["r"].json()["meta_info"]["completion_tokens"] == 5
    # 20000 tokens would take far longer: it was aborted
    wait_until(lambda: engine.scheduler.idle, timeout=20, what="the disconnected request aborted")
    engine.flush_cache()
    assert engine.stats()["pool_free_pages"] == total
    assert httpx.get(f"{url}/health").text == "ok"


def test_pause_update_continue(hf_dir, monkeypatch):
    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", page_size=8, capacity_pages=4096))
    app = create_app(engine, ServerConfig(token=TOKEN, max_concurrent_batches=4))
    queued = event_after_call(monkeypatch, app.state.worker, "submit_generate")
    with BackgroundServer(app) as server:
        _pause_update_continue(server.url, engine, hf_dir, queued)


def _pause_update_continue(url: str, engine: EmbeddedEngine, hf_dir, queued: threading.Event) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    old = _weights(hf_dir)
    first = engine.generate([GenerateRequest(input_ids=PROMPT, sampling=_greedy(4))])[0].output_ids[0]
    new = _lowered_first_token(old, first)
    patch = encode_patch(make_patch(old, new, version=7, base_version=0, anchor_version=0))
    assert httpx.post(f"{url}/pause_generation", headers=auth).status_code == 200
    result: dict = {}
    body = {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": 4,
            "ignore_eos": True}}  # fmt: skip
    t = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/generate", json=body, timeout=60)))
    t.start()
    assert queued.wait(30), "the request never reached the worker"
    assert "r" not in result  # held while paused
    r = httpx.post(f"{url}/update_weights_from_patch", content=patch, headers={**auth,
                   "Content-Type": "application/octet-stream"}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["weight_version"] == 7, r.text
    assert httpx.post(f"{url}/continue_generation", headers=auth).status_code == 200
    t.join(60)
    out = result["r"].json()
    assert out["meta_info"]["weight_version"] == 7
    assert out["output_ids"] == _hf_greedy(hf_dir, new, PROMPT, 4)


def test_bad_request_in_a_shared_batch_fails_alone(hf_dir):
    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", page_size=8, capacity_pages=256))
    worker = EngineWorker(engine)
    worker.start()
    try:
        worker.pause()  # both jobs queue up and then start as ONE engine.generate batch
        good = worker.submit_generate([GenerateRequest(input_ids=PROMPT, sampling=_greedy(3))])
        bad = worker.submit_generate([GenerateRequest(input_ids=(1, 10_000), sampling=_greedy(3))])
        worker.resume()
        assert len(good.future.result(60)[0].output_ids) == 3
        with pytest.raises(ValueError, match="vocab_size"):
            bad.future.result(60)
    finally:
        worker.stop()


def test_remote_engine_is_a_rollout_engine(embedded):
    url, _ = embedded
    with RemoteEngine(url, token=TOKEN) as remote:
        assert isinstance(remote, RolloutEngine)
        r = httpx.post(f"{url}/generate", json={"input_ids": [1, 10_000]}, timeout=30)
        assert r.status_code == 400 and "vocab_size" in r.json()["error"]


def test_shutdown_aborts_a_running_generation(hf_dir):
    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", page_size=8, capacity_pages=4096))
    endless = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
    outcome: dict = {}

    def client(url: str) -> None:
        try:
            outcome["r"] = httpx.post(f"{url}/generate", json=endless, timeout=60)
        except httpx.HTTPError as exc:
            outcome["r"] = exc

    with BackgroundServer(create_app(engine, ServerConfig(max_concurrent_batches=2))) as server:
        t = threading.Thread(target=client, args=(server.url,))
        t.start()
        wait_until(lambda: engine.scheduler.running, timeout=20, what="the generation running")
        start = time.monotonic()
    assert time.monotonic() - start < 20, "shutdown waited for the generation"
    t.join(30)
    assert "r" in outcome
    # the abort lands at the engine's next step
    wait_until(lambda: engine.scheduler.idle, timeout=20, what="the generation aborted")


def test_the_pool_gives_a_server_several_groups_at_once_and_it_batches_them(embedded):
    """`rollout.server_concurrency`: a server given one GRPO group at a time decodes batches of
    group_size; given four groups at once, it batches across them."""
    url, engine = embedded
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    requests = [
        GenerateRequest(input_ids=(*PROMPT, g), sampling=sampling, rid=f"g{g}-{i}")
        for g in range(4)
        for i in range(4)
    ]
    batch = {}
    for concurrency in (1, 4):
        before = engine.stats()
        with RemoteEngine(url, token=TOKEN, concurrency=concurrency) as remote:
            samples = EnginePool({url: remote}, PoolConfig(chunk_size=4)).generate(requests)
        assert [s.rid for s in samples] == [r.rid for r in requests]
        after = engine.stats()
        batch[concurrency] = (after["batched_requests"] - before["batched_requests"]) / (
            after["steps"] - before["steps"]
        )
    assert batch[1] <= 4 < batch[4], batch
