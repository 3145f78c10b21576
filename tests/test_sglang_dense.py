"""Dense sync into SGLang 0.5.23's REAL weight-update path on CPU: one TP=1 and one TP=2 worker.

Processes (tests/sglang_dense_world.py): three SGLang TP ranks (SGLang's `Qwen2ForCausalLM` on
checkpoint A, its `WeightUpdater`, its `SchedulerWeightUpdaterManager`) behind our stand-in for
SGLang's HTTP routes (SGLang's http_server does not import on CPU), and the sender, which imports
no SGLang. The sender runs `dense_sync` over BOTH workers in one gloo group (world 1 + 1 + 2, rank
offsets 1 and 2) with 48 KiB buckets: SGLang's real `init_weights_update_group` (its
`init_custom_process_group`) meets our `open_update_group`, and SGLang's real
`receive_weights_from_distributed("flattened_bucket")` + `load_weights` meet our broadcasts.
Then a sparse patch through our loader, then a second dense sync on the same master port (the
fallback). After each step every SGLang parameter is compared bit for bit with SGLang loading the
same full state through its own `load_weights`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from e2e_support import free_port
from safetensors.torch import load_file, save_file
from sglang_cpu import require_sglang

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.client import RemoteEngine

HERE = Path(__file__).parent


def _states(hf_dir: Path, out: Path) -> None:
    """B: every weight changed; C: B with 2% of elements one ulp up (a sparse step); D: dense again."""
    a = {k: v.to(torch.bfloat16) for k, v in load_file(hf_dir / "model.safetensors").items()}
    gen = torch.Generator().manual_seed(3)
    b = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16) for k, v in a.items()}
    c = {}
    for k, v in b.items():
        bits = v.clone().view(torch.int16).reshape(-1)
        idx = torch.randperm(bits.numel(), generator=gen)[: max(1, bits.numel() // 50)]
        bits[idx] += 1
        c[k] = bits.view(torch.bfloat16).reshape(v.shape)
    d = {k: (v.float() * 0.5 - 0.003).to(torch.bfloat16) for k, v in a.items()}
    for name, state in (("B", b), ("C", c), ("D", d)):
        save_file({k: t.contiguous() for k, t in state.items()}, str(out / f"{name}.safetensors"))


def _wait_ready(proc: subprocess.Popen, url_file: Path, deadline: float) -> str:
    """The worker's URL once it answers /health; fails at once if the process died."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = proc.communicate()[0].decode(errors="replace")
            raise AssertionError(f"worker exited {proc.returncode}:\n{log[-3000:]}")
        if url_file.exists():
            url = url_file.read_text()
            with RemoteEngine(url, retries=0) as probe:
                if probe.health():
                    return url
        time.sleep(0.2)  # polling a file another process writes; no event to wait on across processes
    raise AssertionError(f"no worker at {url_file} in time")


@contextmanager
def sglang_workers(
    root: Path, hf_dir: Path, env: dict[str, str]
) -> Iterator[tuple[list[subprocess.Popen], list[str]]]:
    """A TP=1 and a TP=2 SGLang worker (sglang_dense_world.py) serving `hf_dir`: (their processes,
    their URLs once healthy); whatever is still running on exit is killed."""
    world = [sys.executable, str(HERE / "sglang_dense_world.py")]
    procs: list[subprocess.Popen] = []
    fronts = []
    try:
        for tp in (1, 2):
            tp_port, url_file = free_port(), root / f"tp{tp}.url"
            for rank in range(tp):
                args = [str(a) for a in (rank, tp, tp_port, hf_dir, root, url_file)]
                procs.append(
                    subprocess.Popen(
                        [*world, "worker", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                    )
                )
            fronts.append((procs[-tp], url_file))
        deadline = time.monotonic() + 300
        yield procs, [_wait_ready(p, f, deadline) for p, f in fronts]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_sglang()
    root = tmp_path_factory.mktemp("sglang-dense")
    hf_dir = make_tiny(TinyModelConfig(arch="qwen2", vocab=130), root / "tiny")
    _states(hf_dir, root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    world = [sys.executable, str(HERE / "sglang_dense_world.py")]
    with sglang_workers(root, hf_dir, env) as (procs, served):
        out = root / "sender.json"
        sender = subprocess.run(
            [*world, "sender", str(free_port()), str(hf_dir), str(root), str(out), *served],
            env=env, capture_output=True, timeout=300,
        )  # fmt: skip
        assert sender.returncode == 0, sender.stderr.decode()[-4000:]
        for p in procs:
            log = p.communicate(timeout=60)[0].decode(errors="replace")
            assert p.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


def _ranks(found: dict, tag: str) -> list[dict]:
    return [rank for worker in found[tag] for rank in worker]


def test_dense_sync_is_bit_identical_to_sglang_loading_the_state(found):
    ranks = _ranks(found, "after_v1")
    assert len(ranks) == 3  # TP=1 worker + both ranks of the TP=2 worker
    for rank in ranks:
        assert rank["params"] == 17 and rank["mismatched"] == []
        assert rank["receiver_version"] == 1 and rank["broken"] is None  # the sparse base is v1
        assert rank["weight_versions"][-1] == "1"  # SGLang's own weight_version moved with it


def test_buckets_are_bounded_and_carry_the_whole_state(found):
    buckets, sent, workers = found["stats_v1"]
    assert workers == 2 and sent == found["state_bytes"]
    assert buckets >= found["state_bytes"] // (48 * 1024)  # many buckets, none over the bound


def test_the_session_brackets_every_dense_sync(found):
    routes = _ranks(found, "after_v1")[0]["routes"]
    dense = [r for r in routes if r not in ("/health", "/server_info")]
    n = found["stats_v1"][0]
    assert dense == [
        "/pause_generation",
        "/begin_weight_update",
        "/init_weights_update_group",
        *["/update_weights_from_distributed"] * n,
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",  # the version marker, through our loader
        "/end_weight_update",
        "/flush_cache",
        "/continue_generation",
        "/check",
    ]


def test_a_sparse_patch_applies_on_top_of_the_dense_sync(found):
    for rank in _ranks(found, "after_v2"):
        assert rank["mismatched"] == [] and rank["receiver_version"] == 2 and rank["broken"] is None


def test_a_second_dense_sync_on_the_same_port_replaces_everything(found):
    for rank in _ranks(found, "after_v3"):
        assert rank["mismatched"] == [] and rank["receiver_version"] == 3
        assert rank["weight_versions"][-1] == "3"


def test_a_failed_bucket_fails_the_group_at_once_and_a_dense_sync_recovers(found):
    failed = found["failed"]
    assert len(failed["workers"]) == 2 and "Failed to update parameter online" in failed["message"]
    assert failed["seconds"] < 60  # answered by the workers, not by the 120 s collective timeout
    for rank in _ranks(found, "after_failure"):
        # SGLang loaded the buckets before the bad one: mixed weights, which is why the whole
        # group is reported failed; the session was still ended, the cache flushed (its KV
        # came from other weights) and generation continued
        assert rank["mismatched"] != []
        assert rank["routes"][-4:] == ["/end_weight_update", "/flush_cache", "/continue_generation", "/check"]
    for rank in _ranks(found, "after_v5"):
        assert rank["mismatched"] == [] and rank["receiver_version"] == 5


def test_buckets_keep_order_respect_the_bound_and_refuse_what_sglang_would():
    from sparserl_mcore.sglang.dense_sync import byte_offsets, plan_buckets

    bf16 = torch.bfloat16
    specs = [("a", bf16, (4,)), ("b", bf16, (2, 2)), ("c", bf16, (20,))]
    plan = plan_buckets(specs, bucket_bytes=16)
    assert [[n for n, _, _ in b] for b in plan] == [["a", "b"], ["c"]]  # c (40 bytes) goes alone
    assert byte_offsets(plan[0]) == [0, 8, 16] and byte_offsets(plan[1]) == [0, 40]
    with pytest.raises(ValueError, match="unaligned"):  # FlattenedTensorBucket.empty refuses this
        plan_buckets([("x", bf16, (1,)), ("y", torch.float32, (1,))], bucket_bytes=64)
    with pytest.raises(ValueError, match="no tensors"):
        plan_buckets([], bucket_bytes=64)


def test_the_master_address_is_found_from_the_route_to_a_worker():
    from sparserl_mcore.sglang.dense_sync import address_towards

    assert address_towards("http://127.0.0.1:30000") == "127.0.0.1"
    assert address_towards("http://localhost:30000/") in ("127.0.0.1", "::1")
    with pytest.raises(ValueError, match="no host"):
        address_towards("http:///generate")


class _InProcessWorker:
    """The collective side of one SGLang TP=1 worker, in this process: SGLang's own
    `init_custom_process_group` (what `WeightUpdater.init_weights_update_group` calls) and a
    broadcast receive per bucket; `refuse` makes its init call fail at once, as an HTTP 400 /
    401 or an unreachable worker would, before it ever joins the group."""

    def __init__(self, url: str, *, refuse: bool = False) -> None:
        self.url, self.refuse, self.group, self.received = url, refuse, None, []

    def tp_size(self) -> int:
        return 1

    def open_update_session(self) -> None: ...
    def close_update_session(self) -> None: ...
    def declare_version(self, version: int, tp_size: int) -> None: ...

    def destroy_weights_update_group(self, group_name: str) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def init_weights_update_group(
        self, *, master_address, master_port, rank_offset, world_size, group_name, backend
    ):
        import datetime

        from sglang.srt.utils.common import init_custom_process_group  # imported by the test first

        if self.refuse:
            raise RuntimeError("HTTP 400: Failed to initialize custom process group (refused)")
        self.group = init_custom_process_group(
            backend=backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
            rank=rank_offset, group_name=group_name, timeout=datetime.timedelta(seconds=10),
        )  # fmt: skip

    def update_weights_from_distributed(self, tensors, *, group_name, version) -> None:
        import torch.distributed as dist

        from sparserl_mcore.sglang.dense_sync import byte_offsets

        flat = torch.empty(byte_offsets(tensors)[-1], dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=self.group)
        self.received.append(flat)


def test_a_worker_that_fails_before_joining_fails_the_sync_at_once_and_frees_the_port():
    """The sender watches the workers' calls while its side of the group set-up runs: a worker
    that cannot join fails the sync within moments, not after the set-up timeout, and closing the
    store the sender hosted frees the port: the next dense sync on it lands whole."""
    require_sglang()
    import sglang.srt.utils.common  # noqa: F401 - the workers' join; imported now, not while timed

    from sparserl_mcore.sglang.dense_sync import DenseSyncConfig, DenseSyncError, dense_sync, plan_buckets

    cfg = DenseSyncConfig(
        master_address="127.0.0.1", master_port=free_port(), backend="gloo", device="cpu", bucket_bytes=64,
        timeout_s=60, connect_timeout_s=60,
    )  # fmt: skip
    plan = plan_buckets([("a", torch.bfloat16, (40,)), ("b", torch.bfloat16, (10,))], cfg.bucket_bytes)
    gen = torch.Generator().manual_seed(0)
    buckets = [
        torch.randint(0, 256, (sum(2 * s[0] for _, _, s in b),), dtype=torch.uint8, generator=gen)
        for b in plan
    ]
    fill = iter(buckets)
    good, refusing = _InProcessWorker("http://good"), _InProcessWorker("http://refusing", refuse=True)
    start = time.monotonic()
    with pytest.raises(DenseSyncError, match="refused") as failure:
        dense_sync([good, refusing], plan, lambda _: next(fill), version=1, cfg=cfg)
    assert time.monotonic() - start < 15  # answered by the refusal, not by the 60 s set-up timeout
    assert failure.value.workers == [good.url, refusing.url] and good.received == []
    again, fill = _InProcessWorker("http://again"), iter(buckets)
    stats = dense_sync([again], plan, lambda _: next(fill), version=2, cfg=cfg)
    assert stats.buckets == len(plan) and all(
        torch.equal(a, b) for a, b in zip(again.received, buckets, strict=True)
    )
