"""Learner half of tests/test_inflight_sync.py: the trainer's own learner (one rank, gloo) and
`WeightSyncer(in_flight=True)` against

- a real `sparserl serve` app (in this process, real HTTP on loopback, the embedded engine); a
  delivery it cannot take is made to fail by refusing patches (`Refusing`) or, the server's own
  refusal, by moving it to another version first (`/update_weights_from_disk`);
- a stand-in SGLang worker (stdlib HTTP, SGLang 0.5.23's route shapes) that logs every route and,
  when asked to continue generation, has the host's pool engine (`SGLangWorker`) send a /generate
  at that moment, as the producer thread does when generation resumes: its `extra_key` is the
  prefix-cache key such a request carries.

    torchrun --nproc_per_node 1 tests/inflight_sync_worker.py CONFIG.yaml OUT_DIR

Results: OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandInSGLang(ThreadingHTTPServer):
    """Answers the routes the trainer's SGLang bracket and generation use. `refuse`: how many of the
    next /update_weights_from_tensor calls answer 400 (SGLang's rejection). `on_continue`: called
    before /continue_generation is answered."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.log: list[list[Any]] = []  # [route, detail]
        self.refuse = 0
        self.version = "default"
        self.on_continue = lambda: None
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: StandInSGLang

    def log_message(self, *args: Any) -> None:
        del args

    def _answer(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200, {"tp_size": 1} if self.path == "/server_info" else {})

    def do_POST(self) -> None:
        server, route = self.server, self.path
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if route == "/generate":
            server.log.append([route, body.get("extra_key")])
            rids = body["rid"]
            answer = [
                {
                    "output_ids": [7],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": {"type": "length"},
                        "weight_version": server.version,
                        "output_token_logprobs": [[-1.0, 7, None]],
                    },
                }
                for rid in rids
            ]
            return self._answer(200, answer)
        with server.lock:
            refused = route == "/update_weights_from_tensor" and server.refuse > 0
            server.refuse -= refused
        server.log.append([route, body.get("mode") if route == "/pause_generation" else refused or None])
        if refused:
            return self._answer(400, {"success": False, "message": "refused by the stand-in"})
        if route == "/update_weights_from_tensor":
            server.version = str(body["weight_version"])
        if route == "/continue_generation":
            server.on_continue()
        self._answer(200, {"success": True, "message": ""})


class Refusing:
    """The embedded engine behind the `sparserl serve` app; patches fail while `refuse` is set."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.refuse = engine, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def apply_patch(self, patch: bytes) -> int:
        if self.refuse:
            raise ValueError("patch refused by the test")
        return int(self.engine.apply_patch(patch))


def main() -> int:
    from learner_support import rl_update
    from waiting import wait_until

    from sparserl_mcore.config import load_config
    from sparserl_mcore.parallel import initialize, shutdown
    from sparserl_mcore.rollout.client import RemoteEngine
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.sglang import wire
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.setup import build_learner
    from sparserl_mcore.trainer.weight_sync import WeightSyncer

    cfg = load_config(sys.argv[1], [])
    out = pathlib.Path(sys.argv[2])
    rt = initialize(cfg.parallel, seed=cfg.train.seed)
    found: dict[str, Any] = {}
    try:
        learner = build_learner(cfg, rt)
        engine = Refusing(EmbeddedEngine(cfg.model.hf_path, EngineConfig(device="cpu")))
        standin = StandInSGLang()
        threading.Thread(target=standin.serve_forever, daemon=True).start()
        with BackgroundServer(create_app(engine, ServerConfig())) as served:  # type: ignore[arg-type]
            serve = RemoteEngine(served.url, timeout=60, retries=0)
            events: list[list[Any]] = []

            def sink(kind: str, data: dict[str, Any]) -> None:
                paused = serve.model_info()["paused"] if kind == "sync_fallback_full" else None
                events.append([kind, data.get("what"), paused])

            to_serve = WeightSyncer(
                learner.model, learner.layout, rt, cfg.sync.codec, sink,
                remote_urls=[served.url], in_flight=True, timeout_s=60,
            )  # fmt: skip
            to_sglang = WeightSyncer(
                learner.model, learner.layout, rt, cfg.sync.codec, lambda k, d: None,
                remote_urls=[standin.url], remote_server="sglang", in_flight=True, timeout_s=60,
            )  # fmt: skip
            client = SGLangWorker(standin.url, timeout=60, retries=0)  # the host pool's engine
            pool = EnginePool({standin.url: client}, PoolConfig(chunk_size=1))
            request = GenerateRequest(input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=1), rid="r")
            standin.on_continue = lambda: client.generate([request])
            for syncer, pools in ((to_serve, [None]), (to_sglang, [pool])):
                syncer.full_sync(pools, version=0)

            # v1: `sparserl serve` holds another version (its own refusal), SGLang takes it
            moved = {"model_path": cfg.model.hf_path, "weight_version": 99}
            serve._call("POST", "/update_weights_from_disk", json=moved)
            rl_update(learner, rt, seed=1)
            to_serve.sync([None], version=1)
            to_sglang.sync([pool], version=1)
            found["v1"] = {"events": events[:], "info": serve.model_info()}

            # v2: both refuse the sparse patch and take the full fallback
            events.clear()
            engine.refuse, standin.refuse = True, 1
            rl_update(learner, rt, seed=2)

            def refuse_once(kind: str, data: dict[str, Any]) -> None:
                if kind == "sync_fallback_full":
                    engine.refuse = False
                sink(kind, data)

            to_serve._on_event = refuse_once
            to_serve.sync([None], version=2)
            to_sglang.sync([pool], version=2)
            found["v2"] = {"events": events[:], "info": serve.model_info()}

            # v3: both refuse the fallback too and are dropped, with a request decoding on the server
            events.clear()
            to_serve._on_event = sink
            engine.refuse, standin.refuse = True, 2
            rl_update(learner, rt, seed=3)
            long = SamplingParams(temperature=1.0, max_new_tokens=1500, ignore_eos=True, seed=1)
            answers: list[Any] = []
            slow = GenerateRequest(input_ids=(5, 6), sampling=long)
            decoding = threading.Thread(target=lambda: answers.append(serve.generate([slow])))
            decoding.start()
            tokens = lambda: engine.engine.stats()["generated_tokens"] >= 4  # noqa: E731
            wait_until(tokens, timeout=120, what="the long request decoding")
            to_serve.sync([None], version=3)
            to_sglang.sync([pool], version=3)
            decoding.join(120)
            found["v3"] = {
                "events": events[:],
                "info": serve.model_info(),
                "answer": [[s.finish_reason, len(s.output_ids)] for s in answers[0]] if answers else None,
            }
            found["sglang_log"] = standin.log
            found["keys"] = {v: wire.prefix_key(to_sglang._run_key, v) for v in range(4)}
            standin.shutdown()
        (out / "result.json").write_text(json.dumps(found))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
