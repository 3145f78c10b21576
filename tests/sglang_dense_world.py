"""Processes of tests/test_sglang_dense.py: SGLang workers on CPU and the trainer-side sender.

    python tests/sglang_dense_world.py worker RANK TP TP_PORT HF_DIR STATES_DIR URL_FILE
    python tests/sglang_dense_world.py sender MASTER_PORT HF_DIR STATES_DIR OUT_JSON URL...

A worker is one SGLang server's TP ranks, each a process: SGLang 0.5.23's real `Qwen2ForCausalLM`
(SGLang's parallel state over gloo, loaded with checkpoint A), its real `WeightUpdater` and its
real scheduler-side `SchedulerWeightUpdaterManager` (session checks, receive + load, weight
version). Its HTTP server and scheduler are not used here (they run live, with TP=1 only, in
tests/test_sglang_live.py), so TP rank 0 answers the same routes with a stdlib HTTP server: it
parses each body into SGLang's own request struct (`managers/io_struct.py`; an unknown or missing
field fails), hands (route, body) to every TP rank over the TP CPU group as SGLang's scheduler
does, and every rank calls the manager. `tp_worker.TpModelWorker` is not built either: `_TpWorker`
holds the four members the manager uses, each the body it has in 0.5.23.

The sender imports no SGLang: it is what the trainer runs (`sparserl_mcore.sglang.dense_sync`,
`client.SGLangWorker`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

STATES = ("B", "C", "D")  # dense v1, sparse v2 on top, dense v3 (the fallback) on top


class _TpWorker:
    """`managers/tp_worker.py: TpModelWorker`'s members the weight manager calls (0.5.23 bodies)."""

    def __init__(self, runner: Any) -> None:
        self.model_runner = runner

    def weight_update_runners(self) -> list[tuple[str, Any]]:
        return [("target", self.model_runner)]

    def init_weights_update_group(self, r: Any) -> tuple[bool, str]:
        return self.model_runner.weight_updater.init_weights_update_group(
            r.master_address, r.master_port, r.rank_offset, r.world_size, r.group_name, r.backend
        )

    def destroy_weights_update_group(self, r: Any) -> tuple[bool, str]:
        return self.model_runner.weight_updater.destroy_weights_update_group(r.group_name)

    def deserialize_own_rank(self, serialized: list) -> Any:
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.utils.common import MultiprocessingSerializer

        return MultiprocessingSerializer.deserialize(serialized[get_parallel().tp_rank])


class Worker:
    """One TP rank: the model, SGLang's weight managers, and what the routes do on this rank."""

    def __init__(self, rank: int, tp: int, hf_dir: Path, states: Path) -> None:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_parallel
        from sglang_tp_worker import sglang_model

        from sparserl_mcore.sglang.loader import LOADER_PATH

        self.rank, self.tp, self.hf_dir, self.states = rank, tp, hf_dir, states
        self.model = sglang_model(hf_dir, load_file(hf_dir / "model.safetensors"))
        updater = WeightUpdater(
            tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[LOADER_PATH],
            get_model=lambda: self.model, update_model_fields=None, recapture_cuda_graph=None,
            get_model_runner=None,
        )  # fmt: skip
        self.versions: list[str | None] = []
        scheduler = SimpleNamespace(
            record_weight_version_change=lambda new_version: self.versions.append(new_version)
        )
        self.routes: list[str] = []
        self.paused = False
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=_TpWorker(SimpleNamespace(weight_updater=updater)), draft_worker=None,
            memory_saver_adapter=None, flush_cache=lambda **_: True, is_fully_idle=lambda **_: True,
            scheduler=scheduler,
        )  # fmt: skip
        self.group = get_parallel().tp_group.cpu_group

    def handle(self, route: str, body: dict) -> tuple[bool, Any]:
        """What SGLang's scheduler does for `route` on this TP rank: (success, message or data)."""
        from sglang.srt.managers import io_struct as io

        self.routes.append(route)
        m = self.manager
        calls = {
            "/begin_weight_update": lambda: m.begin_weight_update(io.BeginWeightUpdateReqInput(**body)),
            "/end_weight_update": lambda: m.end_weight_update(io.EndWeightUpdateReqInput(**body)),
            "/init_weights_update_group": lambda: m.init_weights_update_group(
                io.InitWeightsUpdateGroupReqInput(**body)
            ),
            "/destroy_weights_update_group": lambda: m.destroy_weights_update_group(
                io.DestroyWeightsUpdateGroupReqInput(**body)
            ),
            "/update_weights_from_distributed": lambda: m.update_weights_from_distributed(
                io.UpdateWeightsFromDistributedReqInput(**body)
            ),
            "/update_weights_from_tensor": lambda: m.update_weights_from_tensor(
                io.UpdateWeightsFromTensorReqInput(**body)
            ),
        }
        if route in calls:
            out = calls[route]()
            return bool(out.success), out.message
        if route == "/pause_generation":
            io.PauseGenerationReqInput(**body)
            self.paused = True
        elif route == "/continue_generation":
            self.paused = False
        elif route == "/flush_cache":  # SGLang flushes while paused (`is_fully_idle(ignore_waiting=...)`)
            return self.paused, "flushed" if self.paused else "requests running: not flushed"
        elif route == "/server_info":
            return True, {"tp_size": self.tp}
        elif route == "/check":
            return True, self.check(body["state"])
        return True, "ok"

    def check(self, state: str) -> dict:
        """This rank's parameters against SGLang loading `state` itself through `load_weights`."""
        from sglang_tp_worker import sglang_model

        ref = sglang_model(self.hf_dir, load_file(self.states / f"{state}.safetensors"))
        mine, theirs = dict(self.model.named_parameters()), dict(ref.named_parameters())
        mismatched = [
            n for n, p in theirs.items() if not torch.equal(mine[n].view(torch.int16), p.view(torch.int16))
        ]
        receiver = getattr(self.model, "_sparserl_receiver", None)
        return {
            "rank": self.rank,
            "params": len(theirs),
            "mismatched": mismatched,
            "receiver_version": None if receiver is None else receiver.version,
            "broken": None if receiver is None else receiver.ledger.broken,
            "weight_versions": list(self.versions),
            "routes": list(self.routes),
        }

    def step(self, command: tuple[str, dict] | None = None) -> tuple[str, dict, bool, list]:
        """One route on every TP rank: rank 0 passes (route, body) on; all answer; rank 0 gathers."""
        box: list[Any] = [command]
        dist.broadcast_object_list(box, src=0, group=self.group)
        route, body = box[0]
        try:
            ok, detail = self.handle(route, body)
        except Exception as exc:  # noqa: BLE001 - SGLang answers 400 with the message
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        answers: list[Any] = [None] * self.tp
        dist.all_gather_object(answers, (ok, detail), group=self.group)
        return route, body, all(a[0] for a in answers), answers


def serve(worker: Worker, url_file: Path) -> None:
    """TP rank 0: the HTTP front; one request at a time, as SGLang's scheduler takes them."""
    done = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            route, _, ok, answers = worker.step((self.path, body))
            if route == "/shutdown":
                done.append(True)
            detail = answers[0][1] if route != "/check" else [a[1] for a in answers]
            data = json.dumps({"success": ok, "message": detail} if route != "/server_info" else detail)
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            self._answer(json.loads(self.rfile.read(length) or b"{}"))

        def do_GET(self) -> None:
            self._answer({})

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    tmp = url_file.with_suffix(".tmp")
    tmp.write_text(f"http://127.0.0.1:{server.server_address[1]}")
    tmp.rename(url_file)  # the test waits for this file, then for /health
    while not done:
        server.handle_request()


def worker_main(argv: list[str]) -> None:
    rank, tp, tp_port = int(argv[0]), int(argv[1]), int(argv[2])
    hf_dir, states, url_file = Path(argv[3]), Path(argv[4]), Path(argv[5])
    from sglang_cpu import require_sglang
    from sglang_tp_worker import init_sglang_parallel, sglang_route, shutdown_sglang_parallel

    require_sglang()
    init_sglang_parallel(rank, tp, tp_port)
    worker = Worker(rank, tp, hf_dir, states)
    sglang_route(worker.model, rank)  # loads our plugin through SGLang's load_plugins (rejections -> 400)
    if rank == 0:
        serve(worker, url_file)
    else:
        while worker.step()[0] != "/shutdown":
            pass
    shutdown_sglang_parallel()


def sparse_patch(worker: Any, hf_dir: Path, old: dict, new: dict, *, version: int, base: int) -> None:
    """The sparse path on top of the dense sync: per-rank fragments for this worker's TP size."""
    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.sglang.layout import SGLangLayout
    from sparserl_mcore.sync.hashing import bits_view, dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment, split_by_receiver

    changes = []
    for name in sorted(new):
        a, b = bits_view(old[name]), bits_view(new[name])
        idx = (a != b).nonzero()[0]
        changes.append((name, idx, a[idx].copy(), b[idx].copy()))
    layout = SGLangLayout(parse_hf_config(hf_dir), tp_size=worker.tp_size())
    meta = ModelMeta(dtype_name(torch.bfloat16), layout.hf_shapes)
    frags = [
        encode_fragment(c, meta, version=version, base_version=base, fragment=(0, 1))
        for c in split_by_receiver(changes, layout)
    ]
    worker.pause("retract")
    worker.begin_weight_update()
    worker.send_fragments(frags, version)
    worker.end_weight_update()
    worker.flush_cache()
    worker.resume()


def sender_main(argv: list[str]) -> None:
    """The trainer's side: dense B (v1), sparse B -> C (v2), dense D (v3, as after a rejected patch),
    a dense sync that fails on every worker (v4), then dense D again (v5)."""
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.sglang.dense_sync import (
        DenseSyncConfig,
        DenseSyncError,
        DenseSyncStats,
        Spec,
        dense_sync,
        plan_buckets,
    )

    master_port, hf_dir, states, out = int(argv[0]), Path(argv[1]), Path(argv[2]), Path(argv[3])
    workers = [SGLangWorker(u, retries=0, timeout=120) for u in argv[4:]]
    state = {s: load_file(states / f"{s}.safetensors") for s in STATES}
    cfg = DenseSyncConfig(
        master_address="127.0.0.1", master_port=master_port, backend="gloo", device="cpu",
        bucket_bytes=48 * 1024, timeout_s=120,
    )  # fmt: skip
    found: dict[str, Any] = {}

    def check(tag: str, s: str) -> None:
        found[tag] = [w._call("POST", "/check", json={"state": s}).json()["message"] for w in workers]

    def send(named: dict[str, torch.Tensor], version: int) -> DenseSyncStats:
        """`named` in name order from memory (the trainer fills buckets from its shards)."""
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in sorted(named.items())]
        plan = plan_buckets(specs, cfg.bucket_bytes)

        def fill(bucket: Sequence[Spec]) -> torch.Tensor:
            return torch.cat([named[n].contiguous().reshape(-1).view(torch.uint8) for n, _, _ in bucket])

        return dense_sync(workers, plan, fill, version=version, cfg=cfg)

    stats = send(state["B"], 1)
    found["stats_v1"] = [stats.buckets, stats.bytes, stats.workers]
    check("after_v1", "B")
    for w in workers:
        sparse_patch(w, hf_dir, state["B"], state["C"], version=2, base=1)
    check("after_v2", "C")
    stats = send(state["D"], 3)  # same port again
    found["stats_v3"] = [stats.buckets, stats.bytes, stats.workers]
    check("after_v3", "D")
    # a bucket SGLang's load_weights refuses (wrong shape): every worker of the group fails, at once
    bad = dict(state["B"], **{"model.norm.weight": torch.zeros(7, dtype=torch.bfloat16)})
    start = time.monotonic()
    try:
        send(bad, 4)
    except DenseSyncError as exc:
        found["failed"] = {"workers": exc.workers, "message": str(exc), "seconds": time.monotonic() - start}
    check("after_failure", "D")
    send(state["D"], 5)  # and a dense sync recovers
    check("after_v5", "D")
    found["state_bytes"] = sum(t.numel() * t.element_size() for t in state["D"].values())
    out.write_text(json.dumps(found))
    for w in workers:
        w._call("POST", "/shutdown", json={})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    role, rest = sys.argv[1], sys.argv[2:]
    worker_main(rest) if role == "worker" else sender_main(rest)
