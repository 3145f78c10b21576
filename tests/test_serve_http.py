"""HTTP contract of `sparserl serve` over real loopback sockets (uvicorn in a thread).

The engine behind the server here is `HFReferenceEngine`: plain HF transformers decoding, written
independently of the embedded engine, so these tests check the HTTP layer (shapes, errors, auth,
weight routes, cancellation) against known-good generations. The embedded engine behind the real
`sparserl serve` subprocess is covered in test_serve_embedded.py.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
import torch
from hf_reference import hf_greedy
from waiting import event_after_call, wait_until

from sparserl_mcore.ckpt.tiny import TinyModelConfig, build_tokenizer, make_tiny
from sparserl_mcore.rollout.client import RemoteEngine, RemoteEngineError, RemoteValueError
from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, bind_socket, create_app
from sparserl_mcore.rollout.protocol import GenerateRequest, KVStats, Sample, SamplingParams
from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.diff import make_patch

TOKEN = "test-token-0123456789"
PROMPT = [5, 17, 33, 40, 41, 42]


class HFReferenceEngine:
    """RolloutEngine over an HF transformers model: no KV cache, one request at a time."""

    def __init__(self, hf_dir: str) -> None:
        import transformers
        from safetensors.torch import load_file

        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        weights = {}
        for f in sorted(pathlib.Path(hf_dir).glob("*.safetensors")):
            weights.update(load_file(f))
        self.receiver = HFReceiver(weights, version=0)
        self.version = 0
        self.aborted: set[str] = set()
        self.decoding: set[str] = set()  # rids that reached the decode loop
        self.flushes = 0
        self.pauses: list[str] = []
        self._running = threading.Event()
        self._running.set()
        self._step = threading.Lock()  # held while a token is computed: pause() waits for it
        self._inflight: set[str] = set()
        self._epoch = 0  # bumped by a "retract" pause: requests restart from their prompts

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        return [self._one(r) for r in requests]

    @torch.no_grad()
    def _one(self, req: GenerateRequest) -> Sample:
        sp, ids, logps = req.sampling, list(req.input_ids), []
        gen = torch.Generator().manual_seed(sp.seed or 0)
        reason, epoch = "length", self._epoch
        self._inflight.add(req.rid)
        while len(ids) - len(req.input_ids) < sp.max_new_tokens:
            self.decoding.add(req.rid)
            self._running.wait()
            with self._step:
                if epoch != self._epoch:  # retracted: start over
                    ids, logps, epoch = list(req.input_ids), [], self._epoch
                    gen.manual_seed(sp.seed or 0)
                if req.rid in self.aborted:
                    reason = "abort"
                    break
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                logp = torch.log_softmax(logits / (sp.temperature or 1.0), dim=-1)
                if sp.greedy:
                    tok = int(logp.argmax())
                else:
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(tok)
                logps.append(float(logp[tok]))
                if tok in sp.stop_token_ids:
                    reason = "stop"
                    break
        self._inflight.discard(req.rid)
        n = len(req.input_ids)
        return Sample(
            rid=req.rid,
            prompt_ids=req.input_ids,
            output_ids=tuple(ids[n:]),
            output_logprobs=tuple(logps),
            finish_reason=reason,
            kv_stats=KVStats(peak_retained_tokens=len(ids)),
            weight_version=self.version,
        )

    def _load(self) -> None:
        self.model.load_state_dict({k: v.float() for k, v in self.receiver.state.items()}, strict=True)

    def update_weights(self, state_dict, version: int) -> None:
        for name, tensor in state_dict.items():
            self.receiver.state[name].copy_(tensor)
        self.receiver = HFReceiver(self.receiver.state, version=version)
        self.version = version
        self._load()

    def apply_patch(self, patch_bytes: bytes) -> int:
        self.version = self.receiver.apply(patch_bytes).version
        self._load()
        return self.version

    def flush_cache(self) -> None:
        self.flushes += 1

    def pause(self, mode: str = "in_place") -> None:
        self.pauses.append(mode)
        self._running.clear()
        with self._step:  # no token is being computed once this returns
            if mode == "abort":
                self.aborted |= self._inflight
            elif mode == "retract":
                self._epoch += 1

    def resume(self) -> None:
        self._running.set()

    def abort(self, rid: str) -> None:
        self.aborted.add(rid)

    def model_info(self) -> dict:
        return {"model_path": "tiny", "weight_version": self.version, "kv_compression": "none"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(make_tiny(TinyModelConfig(dtype="bfloat16", seed=3), tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def served(hf_dir) -> Iterator[tuple[str, HFReferenceEngine]]:
    torch.set_num_threads(1)
    engine = HFReferenceEngine(hf_dir)
    tok = build_tokenizer()
    app = create_app(
        engine,
        ServerConfig(token=TOKEN),
        encode=lambda text: tok(text)["input_ids"],
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    with BackgroundServer(app) as server:
        yield server.url, engine


def _greedy(n: int, **kw) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw}


def _hf_greedy(hf_dir: str, prompt: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf_greedy(model, prompt, n)


def test_generate_with_logprobs_has_sglang_shapes(served, hf_dir):
    url, _ = served
    body = {"input_ids": PROMPT, "sampling_params": _greedy(6), "return_logprob": True}
    r = httpx.post(f"{url}/generate", json={**body, "return_text_in_logprobs": True}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert out["output_ids"] == _hf_greedy(hf_dir, PROMPT, 6)
    assert isinstance(out["text"], str)
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [item[1] for item in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(
        isinstance(lp, float) and lp <= 0 and isinstance(txt, str)
        for lp, _, txt in meta["output_token_logprobs"]
    )
    assert meta["kv_stats"]["peak_retained_tokens"] == len(PROMPT) + 6
    plain = httpx.post(
        f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": _greedy(6)}, timeout=60
    )
    assert "output_token_logprobs" not in plain.json()["meta_info"]


def test_batch_and_text_prompts(served):
    url, _ = served
    r = httpx.post(
        f"{url}/generate",
        json={"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": _greedy(3), "rid": ["a", "b"]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["id"] for o in r.json()] == ["a", "b"]
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [6, 3]
    r = httpx.post(
        f"{url}/generate", json={"text": ["1+1=", "hi"], "sampling_params": _greedy(2)}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [4, 2]
    stop = httpx.post(
        f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": _greedy(6)}, timeout=60
    )
    first = stop.json()["output_ids"][1]
    r = httpx.post(
        f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": _greedy(6, stop_token_ids=[first])}
    )
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {}}, "exactly one of input_ids or text"),
        ({"input_ids": PROMPT, "text": "x"}, "exactly one of input_ids or text"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, -2]}, "non-negative"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature=-1"),
        ({"input_ids": PROMPT, "sampling_params": {"temprature": 1}}, "unknown sampling params"),
        ({"input_ids": PROMPT, "stream": True}, "stream=true is not supported"),
        ({"input_ids": PROMPT, "lora_path": "x"}, "unknown fields ['lora_path']"),
        ({"input_ids": PROMPT, "return_hidden_states": True}, "return_hidden_states=True is not supported"),
        ({"input_ids": PROMPT, "sampling_params": {"seed": 1, "sampling_seed": 1}}, "not both"),
        ({"input_ids": [PROMPT, PROMPT], "rid": ["x", "x"]}, "unique"),
        ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
        ([1, 2], "JSON object"),
    ],
)
def test_malformed_generate_is_400_with_message(served, body, message):
    url, _ = served
    r = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_invalid_json_and_wrong_content_type(served):
    url, _ = served
    r = httpx.post(f"{url}/generate", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{url}/update_weights_from_patch", content=b"x", headers=auth, timeout=30)
    assert r.status_code == 415
    r = httpx.post(
        f"{url}/update_weights_from_safetensors",
        content=b"garbage",
        params={"weight_version": 1},
        headers={**auth, "Content-Type": "application/octet-stream"},
        timeout=30,
    )
    assert r.status_code == 400 and "safetensors" in r.json()["error"]


@pytest.mark.parametrize(
    "route",
    [
        "/update_weights_from_patch",
        "/update_weights_from_disk",
        "/flush_cache",
        "/pause_generation",
        "/abort_request",
    ],
)
def test_state_routes_require_token(served, route):
    url, engine = served
    for headers in ({}, {"Authorization": "Bearer wrong-token-xyz"}, {"Authorization": TOKEN}):
        r = httpx.post(f"{url}{route}", content=b"x", headers=headers, timeout=30)
        assert r.status_code == 401 and "Bearer" in r.json()["detail"], (headers, r.text)
    assert not engine.receiver.version and engine._running.is_set()
    assert httpx.get(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["weight_version"] == 0 and info["is_generation"] and info["paused"] is False


def test_public_host_needs_token():
    with pytest.raises(ValueError, match="no token is set"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", token=TOKEN).host == "0.0.0.0"
    assert ServerConfig(host="::1").token is None


def test_sparse_patch_and_full_update_through_routes(served, hf_dir):
    url, engine = served
    req = [GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(**_greedy(8)), rid="p")]
    with RemoteEngine(url, token=TOKEN, bucket_bytes=64 * 1024) as client:  # several full-update buckets
        before = client.generate(req)[0]
        old = {k: v.clone() for k, v in engine.receiver.state.items()}
        new = {k: v.clone() for k, v in old.items()}
        new["lm_head.weight"][before.output_ids[0]] -= 4.0  # the first greedy token becomes unlikely
        patch = encode_patch(make_patch(old, new, version=1, base_version=0, anchor_version=0))
        with pytest.raises(ValueError, match="HTTP 400") as rejected:  # what the trainer's fallback catches
            client.apply_patch(patch[:-7])  # truncated: rejected, nothing applied
        assert isinstance(rejected.value, RemoteValueError)
        assert client.generate(req)[0].output_ids == before.output_ids
        assert client.apply_patch(patch) == 1
        after = client.generate(req)[0]
        assert after.weight_version == 1 and after.output_ids[0] != before.output_ids[0]
        client.update_weights(old, version=2)  # full update back to the original weights
        restored = client.generate(req)[0]
        assert restored.weight_version == 2 and restored.output_ids == before.output_ids
        assert restored.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)
        client.flush_cache()
        assert engine.flushes >= 1 and client.model_info()["weight_version"] == 2


def test_disk_update_route(served, hf_dir):
    url, engine = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": hf_dir, "weight_version": 3}, headers=auth
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 3, r.text
    r = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": "/nonexistent", "weight_version": 4},
        headers=auth,
    )
    assert r.status_code == 400 and "no such file" in r.json()["error"]
    assert engine.version == 3


def test_client_disconnect_does_not_hurt_other_requests(served):
    url, engine = served
    slow = {"input_ids": PROMPT, "sampling_params": _greedy(4000), "rid": "slow"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=slow, timeout=0.5)
    t0 = time.monotonic()
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": _greedy(4)}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    assert "slow" in engine.aborted
    assert time.monotonic() - t0 < 30, "the aborted request should not have run to 4000 tokens"


def test_remote_abort_finishes_a_running_request(served):
    url, engine = served
    req = GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(**_greedy(4000)), rid="remote-abort")
    with RemoteEngine(url, token=TOKEN) as client:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(s=client.generate([req])[0]))
        thread.start()
        wait_until(lambda: "remote-abort" in engine.decoding, timeout=30, what="the request decoding")
        client.abort("remote-abort")
        thread.join(30)
        assert not thread.is_alive(), "the aborted request should not have run to 4000 tokens"
    assert result["s"].finish_reason == "abort" and len(result["s"].output_ids) < 4000


def test_pause_holds_generation_until_continue(hf_dir, monkeypatch):
    app = create_app(HFReferenceEngine(hf_dir), ServerConfig(token=TOKEN))
    queued = event_after_call(monkeypatch, app.state.worker, "submit_generate")
    with BackgroundServer(app) as server:
        _pause_holds_generation_until_continue(server.url, queued)


def _pause_holds_generation_until_continue(url: str, queued: threading.Event) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/pause_generation", headers=auth).status_code == 200
    result: dict = {}
    body = {"input_ids": PROMPT, "sampling_params": _greedy(3)}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/generate", json=body, timeout=60)))
    t.start()
    assert queued.wait(30), "the request never reached the worker"
    assert "r" not in result and httpx.get(f"{url}/get_model_info").json()["paused"] is True
    assert httpx.post(f"{url}/flush_cache", headers=auth).status_code == 200  # control ops run while paused
    assert httpx.post(f"{url}/continue_generation", headers=auth).status_code == 200
    t.join(60)
    assert result["r"].status_code == 200


def test_remote_engine_unreachable_is_a_clear_error():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    client = RemoteEngine(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01, connect_timeout=1)
    with pytest.raises(RemoteEngineError, match="failed after 2 attempts.*ConnectError"):
        client.flush_cache()
    assert client.health() is False
