"""Live SGLang 0.5.23 servers on loopback for tests/test_sglang_live.py, started the way a user
starts one: `sparserl sglang-serve --device cpu` (our launcher, our weight loader and KV plugin,
BF16 weights, radix cache on, SGLang's CPU engine with our CUDA-package stand-ins).

Also: reading a server's parameters back through SGLang's own `/get_weights_by_name`, the routes a
server answered (its uvicorn access log), and a loopback proxy that corrupts one weight patch in
flight.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import json
import pickle
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from e2e_support import PY, free_port, subprocess_env
from waiting import wait_until

TOKEN = "live-sglang-test-token"
STARTUP_S = 900.0  # minutes on a loaded 2-core box: the spawned processes each import SGLang
# SGLang's CPU engine on a small shared box: a 4096-token KV pool (else sized from free RAM),
# no warm-up request.
SGLANG_FLAGS = ("--max-total-tokens", "4096", "--mem-fraction-static", "0.8", "--skip-server-warmup")


@dataclasses.dataclass
class LiveServer:
    """One `sparserl sglang-serve` process (SGLang's whole process group behind it)."""

    proc: subprocess.Popen
    url: str
    log: Path

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url}: exited with {self.proc.returncode}:\n{self.tail()}")
            return "sparserl sglang-serve: ready" in self.log.read_text(errors="replace")

        wait_until(ready, timeout=timeout, what=f"sparserl sglang-serve at {self.url}", interval=0.5)

    def terminate(self) -> None:
        """Ask it to stop (the launcher stops SGLang's process group); `stop` waits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def routes(self) -> list[tuple[str, int]]:
        """(path, status) of every request the server answered, in order (uvicorn's access log)."""
        found = re.findall(r'"(?:GET|POST|DELETE) (/[^ ?"]*)\S* HTTP/1\.1" (\d{3})', self.log.read_text())
        return [(path, int(code)) for path, code in found]


def start(hf: Path, log: Path, kv: dict[str, object], serve_args: Sequence[str] = ()) -> LiveServer:
    """`sparserl sglang-serve` with these KV settings (method "none": no compression) and further
    flags of ours (`serve_args`); not waited for."""
    port = free_port()
    cmd = [PY, "-m", "sparserl_mcore", "sglang-serve", "--model-path", str(hf), "--port", str(port)]
    cmd += ["--device", "cpu", "--token", TOKEN, "--startup-timeout", str(STARTUP_S)]
    for key, value in kv.items():
        cmd += [f"--kv-{key.replace('_', '-')}", str(value)]
    cmd += [*serve_args, "--", *SGLANG_FLAGS]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    out.close()
    return LiveServer(proc, f"http://127.0.0.1:{port}", log)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def post(url: str, path: str, body: dict, *, timeout: float = 300.0) -> Any:
    """One authorised POST that must answer 200; its JSON body (None for a text answer, e.g.
    /flush_cache's)."""
    answer = httpx.post(url + path, json=body, headers=auth(), timeout=timeout)
    assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text[:500]}"
    return answer.json() if answer.headers.get("content-type", "").startswith("application/json") else None


def read_weights(
    url: str, names: Sequence[str], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Each HF tensor as the server holds it, through SGLang's `/get_weights_by_name` (its model's
    own `get_weights_by_name`: fused q/k/v and gate/up rows cut back by SGLang's stacked-parameter
    map), as bf16. The route returns float32 lists; every bf16 value is exact in them."""
    out = {}
    for name in names:
        rows = shapes[name][0]
        values = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
        assert values is not None, f"{url} could not read {name}"
        tensor = torch.tensor(values, dtype=torch.float32)
        out[name] = tensor[:rows].to(torch.bfloat16)  # embeddings: SGLang's vocab padding rows cut
    return out


class _Fragments(pickle.Unpickler):
    """Reads the trainer's `serialized_named_tensors` entries (plain pickles of CPU tensors, made by
    `sglang.client.patch_payloads`): only the two callables SGLang's SafeUnpickler admits."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes")}

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle protocol
        if (module, name) in self.ALLOWED or (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor payload")


def _corrupt(payload: str) -> str:
    """One sparse patch fragment with one byte of its values flipped (its digest no longer holds)."""
    from sparserl_mcore.sglang.client import patch_payloads

    named = _Fragments(io.BytesIO(base64.b64decode(payload))).load()
    ((name, tensor),) = named
    assert name == "sparserl.patch", name
    data = bytearray(tensor.numpy().tobytes())
    data[len(data) // 2] ^= 0xFF
    return patch_payloads([bytes(data)])[0]


class CorruptingProxy:
    """A loopback HTTP proxy in front of one server that forwards everything as it is, except the
    first `/update_weights_from_tensor` carrying patch fragments once it has forwarded a request to
    `arm_on`: one byte of that fragment is flipped in flight. `routes` lists (path, status) of what
    it forwarded."""

    def __init__(self, target: str, *, arm_on: str) -> None:
        self.target, self.routes, self._armed = target, [], threading.Event()
        self._arm_on, self._spent = arm_on, False
        self.corrupted_answer: int | None = None  # the server's status for the corrupted request
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                corrupted = False
                if self.path == "/update_weights_from_tensor" and proxy._armed.is_set():
                    body, corrupted = proxy._maybe_corrupt(body)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")
                }
                answer = httpx.request(
                    self.command, proxy.target + self.path, content=body, headers=headers, timeout=600
                )
                proxy.routes.append((self.path, answer.status_code))
                if corrupted:
                    proxy.corrupted_answer = answer.status_code
                if self.path == proxy._arm_on and not proxy._spent:
                    proxy._spent = True
                    proxy._armed.set()
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _maybe_corrupt(self, body: bytes) -> tuple[bytes, bool]:
        obj = json.loads(body)
        named = _Fragments(io.BytesIO(base64.b64decode(obj["serialized_named_tensors"][0]))).load()
        if named[0][0] != "sparserl.patch":  # a version marker: not a patch
            return body, False
        self._armed.clear()
        obj["serialized_named_tensors"] = [_corrupt(p) for p in obj["serialized_named_tensors"]]
        return json.dumps(obj).encode(), True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
