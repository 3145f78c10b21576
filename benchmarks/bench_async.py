"""Asynchronous RL: the synchronous loop vs one-step-off vs in-flight updates, side by side in one run.

    python -m benchmarks bench_async                              # 3 modes x seeds 0 1 2, demo task
    python -m benchmarks.bench_async --seeds 0 --steps 8 --section loop    # a short check
    python -m benchmarks.bench_async --section pause              # only the in-flight pause vs patch size
    python -m benchmarks.bench_async --section sglang_pause       # the same into a live SGLang server
    python -m benchmarks.bench_async --section client             # the learner host's CPU per step

Section "loop": the demo task (examples/demo.yaml, from `sparserl demo --seed S`'s warm start) on
this box as a disaggregated job in miniature: one learner rank pinned to core 0, one `sparserl
serve` rollout server pinned to core 1 (`taskset`), one torch thread each, the demo's KV
compression in the server. Per seed, the same server serves one `sparserl train` run per mode (each
run begins with a full weight sync, which resets the server to that run's weights), modes
interleaved so drift on a shared box hits them alike. Per mode: whole-loop rollout tokens per second
(every mode samples the same rollouts per step, so the ratio is the wall-time ratio), seconds to a
target reward (5-step mean), reward per step (mean over seeds, for the equal-curve check), pause ms
per update (p50/p99, the server's own clock) with the patch bytes, and the staleness histogram.

Section "pause": the embedded engine decoding a full batch on one thread while sparse patches of
0.1 % .. 100 % of the BF16 weights land between its decode steps: ms the engine stood still per
update (p50/p99) against the patch bytes.

Section "sglang_pause": the same model and patches into a live SGLang 0.5.23 server on CPU
(`sparserl sglang-serve --device cpu`) decoding 16 streamed requests, through the trainer's
in-flight bracket (`SGLangDelivery(in_flight=True)`: pause in place, begin, the patch through our
loader, end, continue): ms from the pause to the continue's answer, on the host's clock.

Section "client": the CPU the learner's host process spends taking one demo-sized step (128
requests) from `sparserl serve` on the other core, as 16 calls of a GRPO group, as one call, through
the trainer's `EnginePool`, and through the rollout manager (`rollout.manager: process`, the pool in
a process of its own on the same core; its CPU reported beside): in the asynchronous modes the
host's share runs on the learner's core beside the update.

Mode "in_flight_process" (not run by default): in_flight at eta 1 with `rollout.manager=process`,
to set beside "in_flight" (`--modes in_flight in_flight_process`).

Writes OUT/results.json; results and the command in docs/benchmarks.md ("Asynchronous RL").
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from benchmarks.sglang_cpu import cpu_server

MODES = {
    "off": ["train.async.mode=off"],
    "one_step": ["train.async.mode=one_step"],
    "in_flight": ["train.async.mode=in_flight", "train.async.max_staleness=1"],
    "in_flight_2": ["train.async.mode=in_flight", "train.async.max_staleness=2"],  # not by default
    # in_flight with the rollout client in a process of its own (not by default)
    "in_flight_process": [
        "train.async.mode=in_flight",
        "train.async.max_staleness=1",
        "rollout.manager=process",
    ],
}
DEFAULT_MODES = ["off", "one_step", "in_flight"]
RUN = [
    "parallel.tensor_model_parallel_size=1",
    "rollout.engine=remote",
    "eval.at_start=false",
    "eval.dense=false",
    "eval.compressed=false",
    "checkpoint.dir=null",
    "checkpoint.every=0",
    "checkpoint.save_hf=null",
    "telemetry.plot=false",
    "telemetry.progress=false",
]
LEARNER_CORE, SERVER_CORE = "0", "1"
# the pause sections' model (4.9 M parameters, bf16 checkpoint)
PAUSE_MODEL = dict(layers=4, hidden=256, heads=8, kv_heads=2, ffn=1024, vocab=2048, dtype="bfloat16")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_async", description=__doc__.splitlines()[0])
    p.add_argument("--section", choices=["all", "loop", "pause", "sglang_pause", "client"], default="all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--target", type=float, default=0.3, help="5-step mean reward for 'seconds to target'")
    p.add_argument("--out", default="runs/async", help="work directory (warm starts, runs, results)")
    p.add_argument(
        "--report", action="store_true", help="loop: summarize the runs already in OUT, train nothing"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run-config overrides for every run")
    return p.parse_args(argv)


# ---- loop section ------------------------------------------------------------------------------
def _serve_flags(kv: dict) -> list[str]:
    """The server's compression flags from the run config's rollout.kv (the server owns its KV)."""
    flags = []
    for key, value in kv.items():
        if value is not None:
            flags += [f"--kv-{key.replace('_', '-')}", str(value)]
    return flags


@contextmanager
def _server(model_dir: Path, kv: dict) -> Iterator[str]:
    """`sparserl serve` on SERVER_CORE, one torch thread; yields its URL."""
    cmd = ["taskset", "-c", SERVER_CORE, sys.executable, "-m", "sparserl_mcore", "serve",
           "--hf-dir", str(model_dir), "--port", "0", "--device", "cpu", "--log-level", "warning",
           *_serve_flags(kv)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True).start()
    try:
        yield lines.get(timeout=300).rsplit(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(60)


def run_mode(out: Path, seed: int, mode: str, url: str, steps: int, extra: list[str]) -> list[dict]:
    """One `sparserl train` run of `mode` on LEARNER_CORE against the server; its metrics records."""
    from sparserl_mcore.demo import demo_config

    run_dir = out / f"seed{seed}" / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [*RUN, *MODES[mode], f'rollout.urls=["{url}"]', f"telemetry.dir={run_dir}", *extra]
    config = demo_config(out / f"seed{seed}", steps, 1, overrides, seed=seed)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = ["taskset", "-c", LEARNER_CORE, sys.executable, "-m", "sparserl_mcore", "train",
           "--config", str(run_dir / "config.yaml"), "--nproc", "1"]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed ({done.returncode}): {done.stdout[-2000:]}")
    return _records(run_dir)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def summarize(rows: list[dict], target: float) -> dict:
    """One run's numbers (see the module docstring)."""
    rewards = [r["rollout/reward_mean"] for r in rows]
    wall = [r["time/step_s"] for r in rows]
    elapsed = [sum(wall[: i + 1]) for i in range(len(wall))]
    means = [statistics.fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    reached = next((t for t, m in zip(elapsed, means, strict=True) if m >= target), None)
    tokens = sum(r["rollout/response_len_mean"] * (r["train/rollouts"] - p) for r, p in _rollouts(rows))
    pauses = [r["time/sync_pause_ms"] for r in rows if r.get("time/sync_pause_ms") is not None]
    lag_keys = sorted({k for r in rows for k in r if k.startswith("staleness/tokens_lag")})
    lags = {k.removeprefix("staleness/tokens_lag"): sum(r.get(k, 0.0) for r in rows) for k in lag_keys}
    return {
        "rewards": rewards,
        "wall_s": elapsed[-1],
        "tokens_per_s": tokens / elapsed[-1],
        "seconds_to_target": reached,
        "pause_ms_p50": _percentile(pauses, 0.5),
        "pause_ms_p99": _percentile(pauses, 0.99),
        "patch_bytes": statistics.fmean(r["sync/patch_bytes"] for r in rows if "sync/patch_bytes" in r),
        "lag_tokens": lags,
        "masked_tokens": sum(r.get("staleness/masked_tokens", 0.0) for r in rows),
        "mixed_sequences": sum(r.get("staleness/mixed_sequences", 0.0) for r in rows),
        "phase_s": {
            p: statistics.fmean(r.get(f"time/{p}_s", 0.0) for r in rows)
            for p in ("rollout", "update", "sync", "wait_generation")
        },  # fmt: skip
        "generate_s": statistics.fmean(r.get("rollout/generate_s", r["time/rollout_s"]) for r in rows),
    }


def _rollouts(rows: list[dict]) -> Iterator[tuple[dict, float]]:
    previous = 0.0
    for r in rows:
        yield r, previous
        previous = r["train/rollouts"]


def loop_section(a: argparse.Namespace, out: Path) -> dict:
    from sparserl_mcore.config import load_config
    from sparserl_mcore.demo import DEMO_YAML
    from sparserl_mcore.trainer.warmstart import prepare_policy

    demo = load_config(DEMO_YAML)
    kv = {k: v for k, v in demo.rollout.kv.__dict__.items()}
    results: dict = {mode: {} for mode in a.modes}
    for seed in a.seeds:
        if a.report:
            for mode in a.modes:
                results[mode][str(seed)] = summarize(_records(out / f"seed{seed}" / mode), a.target)
            continue
        policy = prepare_policy(out / f"seed{seed}", n_eval=64, seed=seed)
        with _server(policy.model_dir, kv) as url:
            for mode in a.modes:
                print(f"=== seed {seed}, mode {mode}", flush=True)
                rows = run_mode(out, seed, mode, url, a.steps, a.overrides)
                results[mode][str(seed)] = summarize(rows, a.target)
                (out / "results.json").write_text(json.dumps({"loop": results}, indent=1))
    print_loop(results, a)
    return results


def _records(run_dir: Path) -> list[dict]:
    """A run's step records (those with a reward) from its metrics.jsonl."""
    from sparserl_mcore.telemetry import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"bench_async: no run at {run_dir} (--report reads the --seeds and --modes given)")
    return [r for r in read_metrics(path) if r.get("rollout/reward_mean") is not None]


def _mean_min_max(values: list[float], fmt: str) -> str:
    if not values:
        return "never"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def print_loop(results: dict, a: argparse.Namespace) -> None:
    base = [r["tokens_per_s"] for r in results.get("off", {}).values()]
    print(f"\nloop: {len(a.seeds)} seed(s) x {a.steps} steps; learner on core {LEARNER_CORE}, "
          f"server on core {SERVER_CORE}, 1 torch thread each")  # fmt: skip
    print("| mode | rollout tokens/s | vs off | s to target | pause ms p50/p99 | patch KB | lag tokens |")
    print("|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        rows = list(runs.values())
        tps = [r["tokens_per_s"] for r in rows]
        ratio = statistics.fmean(tps) / statistics.fmean(base) if base else float("nan")
        reached = [r["seconds_to_target"] for r in rows if r["seconds_to_target"] is not None]
        target = f"{_mean_min_max(reached, '{:.0f}')} [{len(reached)}/{len(rows)}]"
        pause = f"{statistics.fmean(r['pause_ms_p50'] for r in rows):.1f} / " + (
            f"{max(r['pause_ms_p99'] for r in rows):.1f}"
        )
        lags = {k: sum(r["lag_tokens"].get(k, 0.0) for r in rows) for k in rows[0]["lag_tokens"]}
        lag = ", ".join(f"{k}: {v:.0f}" for k, v in lags.items()) or "-"
        patch = statistics.fmean(r["patch_bytes"] for r in rows) / 1024
        if mode != "off":
            masked, mixed = (sum(r.get(k, 0.0) for r in rows) for k in ("masked_tokens", "mixed_sequences"))
            lag += f" (masked {masked:.0f}; sequences spanning versions {mixed:.0f})"
        print(f"| {mode} | {_mean_min_max(tps, '{:.0f}')} | {ratio:.2f}x | {target} | {pause} | "
              f"{patch:.1f} | {lag} |")  # fmt: skip
    print("\nmean reward per step over seeds (blocks of 5 steps):")
    print("| mode | " + " | ".join(f"{i + 1}-{min(i + 5, a.steps)}" for i in range(0, a.steps, 5)) + " |")
    print("|---|" + "---|" * len(range(0, a.steps, 5)))
    for mode, runs in results.items():
        curves = [r["rewards"] for r in runs.values()]
        blocks = [statistics.fmean(c[i] for c in curves for i in range(b, min(b + 5, len(c))))
                  for b in range(0, a.steps, 5)]  # fmt: skip
        print(f"| {mode} | " + " | ".join(f"{v:.3f}" for v in blocks) + " |")
    print("\nmean phase seconds per step (rollout = the learner's wait for its batch):")
    for mode, runs in results.items():
        phases = {p: statistics.fmean(r["phase_s"][p] for r in runs.values()) for p in rows[0]["phase_s"]}
        gen = statistics.fmean(r["generate_s"] for r in runs.values())
        print(f"  {mode}: generate {gen:.2f}, " + ", ".join(f"{p} {v:.2f}" for p, v in phases.items()))


# ---- pause section -----------------------------------------------------------------------------
def _step_changes(state: dict, changed: float, rng) -> list:
    """The trainer's changes of the next version (`sync.per_rank` Change tuples): `changed` of
    every tensor's elements moved by 1-4 BF16 ulps either way (an update's size); `state` (the
    learner's BF16 weights) moves with it."""
    import numpy as np

    from sparserl_mcore.sync.hashing import bits_view

    changes = []
    for name, tensor in state.items():
        flat = bits_view(tensor)
        idx = np.flatnonzero(rng.random(flat.size) < changed).astype(np.int64)
        old = flat[idx].copy()
        step = rng.integers(1, 5, size=idx.size) * rng.choice(np.array([-1, 1]), size=idx.size)
        flat[idx] = (old.astype(np.int32) + step).astype(np.uint16)
        changes.append((name, idx, old, flat[idx].copy()))
    return changes


def _fragment(state: dict, changed: float, version: int, rng, meta) -> bytes:
    """One learner rank's fragment of the next version (`_step_changes`)."""
    from sparserl_mcore.sync.per_rank import encode_fragment

    changes = _step_changes(state, changed, rng)
    return encode_fragment(changes, meta, version=version, base_version=version - 1, fragment=(0, 1))


def _pauses(hf_dir: Path, dtype: str, repeats: int) -> dict[float, dict]:
    """Per share of weights changed: patch bytes, pause ms p50/p99 of one engine decoding 16 requests."""
    import numpy as np
    import torch

    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.sync.hashing import dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta

    engine = EmbeddedEngine(hf_dir, EngineConfig(device="cpu", dtype=dtype))
    state = {n: t.to(torch.bfloat16, copy=True).contiguous() for n, t in engine.model.params.items()}
    meta = ModelMeta(dtype_name(torch.bfloat16), {n: tuple(t.shape) for n, t in state.items()})
    params = SamplingParams(temperature=1.0, max_new_tokens=2000, ignore_eos=True)
    requests = [GenerateRequest(input_ids=(5 + i, 6, 7), sampling=params) for i in range(16)]
    decoding = threading.Thread(target=engine.generate, args=(requests,), daemon=True)
    decoding.start()
    rng, version, out = np.random.default_rng(0), 0, {}
    for changed in (0.001, 0.01, 0.1, 1.0):
        pauses, sizes = [], []
        for _ in range(repeats):
            version += 1
            patch = _fragment(state, changed, version, rng, meta)
            engine.apply_patch(patch)
            pauses.append(engine.last_pause_ms or 0.0)
            sizes.append(len(patch))
        running = len(engine.scheduler.running)
        p50, p99 = _percentile(pauses, 0.5), _percentile(pauses, 0.99)
        out[changed] = {"bytes": statistics.fmean(sizes), "p50": p50, "p99": p99, "running": running}
    engine.pause("abort")
    engine.resume()
    decoding.join(60)
    return out


def pause_section(repeats: int = 11) -> dict:
    """ms an embedded engine stands still per in-flight patch (the trainer's per-rank fragment
    format), by the share of the weights changed; 16-bit parameters are patched in place (what a
    GPU engine does), fp32 ones (CPU) get the touched tensors copied from a BF16 wire state."""
    import tempfile

    import torch

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny(TinyModelConfig(**PAUSE_MODEL), Path(tmp) / "model")
        results = {dtype: _pauses(hf_dir, dtype, repeats) for dtype in ("bfloat16", "float32")}
    print(f"\npause: embedded engine on CPU, 1 thread, 4-layer hidden-256 model; {repeats} patches per row,")
    print("each landing while it decodes (running: requests decoding at the last patch of the row)")
    print("| engine dtype | weights changed | patch KB | pause ms p50 | p99 | running |")
    print("|---|---|---|---|---|---|")
    for dtype, rows in results.items():
        for changed, r in rows.items():
            print(f"| {dtype} | {changed:.1%} | {r['bytes'] / 1024:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | "
                  f"{r['running']} |")  # fmt: skip
    return {d: {str(k): v for k, v in rows.items()} for d, rows in results.items()}


# ---- client section ----------------------------------------------------------------------------
def client_section(steps: int = 40) -> dict:
    """CPU the learner's host process spends per step taking a demo-sized step from a server: 16
    prompts x G=8 (26 tokens each) from `sparserl serve` on SERVER_CORE, this process pinned to
    LEARNER_CORE. In the asynchronous modes that work shares the learner's core with the update, so
    every millisecond of it is one the update loses. Rows: the step as calls of 8 requests (a GRPO
    group, all 16 at once, what the pool did before 7998362), as one call, and through the
    trainer's `EnginePool` (its default server concurrency)."""
    import tempfile

    import torch

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    os.sched_setaffinity(0, {int(LEARNER_CORE)})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        with _server(make_tiny(TinyModelConfig(), Path(tmp) / "model"), {}) as url:
            hows = ("8 per call", "1 call", "EnginePool", "manager process")
            results = {how: _client_cost(url, how, steps) for how in hows}
    print("\nclient: the host process's CPU per step (128 requests x 26 tokens), median over steps 4..")
    print("| how | client CPU ms per step | manager process CPU ms per step | step wall ms |")
    print("|---|---|---|---|")
    for how, r in results.items():
        child = f"{r['manager_cpu_ms']:.1f}" if "manager_cpu_ms" in r else "-"
        print(f"| {how} | {r['cpu_ms']:.1f} | {child} | {r['wall_ms']:.0f} |")
    return results


def _bench_engines(url: str) -> dict:
    """The client section's one server (a picklable factory: the rollout manager's child calls it)."""
    from sparserl_mcore.rollout.client import RemoteEngine

    return {"server": RemoteEngine(url, concurrency=512 // 8)}


def _no_reward() -> tuple:
    return (lambda sample, prompt: 0.0), (lambda: None)


def _client_cost(url: str, how: str, steps: int) -> dict[str, float]:
    import time
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    import psutil
    import torch

    from sparserl_mcore.rollout.client import RemoteEngine
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.rollout_manager import RolloutManager, Scoring

    g = torch.Generator().manual_seed(0)
    remote = RemoteEngine(url, concurrency=512 // 8)
    pool = EnginePool({"server": remote}, PoolConfig(chunk_size=8))
    calls = ThreadPoolExecutor(16)
    manager = None
    if how == "manager process":  # the pool in a process of its own: this process pickles and unpickles
        manager = RolloutManager(
            partial(_bench_engines, url),
            PoolConfig(chunk_size=8),
            Scoring(group_size=8, sampling=SamplingParams(), run_seed=0),
            _no_reward,
            lambda kind, fields: None,
        )
        child = psutil.Process(manager.pid)
    cpu, wall, child_cpu = [], [], []
    for step in range(steps):
        requests = [
            GenerateRequest(
                input_ids=tuple(torch.randint(0, 100, (10,), generator=g).tolist()),
                sampling=SamplingParams(max_new_tokens=26, ignore_eos=True, seed=step * 128 + i),
                rid=f"{how}-{step}-{i}",
            )
            for i in range(128)
        ]
        c0, w0 = time.process_time(), time.perf_counter()
        m0 = sum(child.cpu_times()[:2]) if manager else 0.0
        if manager is not None:
            manager.generate(requests)
            child_cpu.append(sum(child.cpu_times()[:2]) - m0)
        elif how == "EnginePool":
            pool.generate(requests)
        elif how == "1 call":
            remote.generate(requests)
        else:
            list(calls.map(remote.generate, [requests[k : k + 8] for k in range(0, 128, 8)]))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    calls.shutdown()
    pool.close()
    found = {"cpu_ms": 1e3 * statistics.median(cpu[3:]), "wall_ms": 1e3 * statistics.median(wall[3:])}
    if manager is not None:
        manager.close()
        found["manager_cpu_ms"] = 1e3 * statistics.median(child_cpu[3:])
    return found


# ---- sglang_pause section ----------------------------------------------------------------------
SGLANG_TOKEN = "bench-async-sglang-token"
# the overlap scheduler off, as in-flight updates need it (preflight refuses it otherwise)
SGLANG_FLAGS = (
    "--max-total-tokens", "34000", "--mem-fraction-static", "0.8", "--skip-server-warmup",
    "--disable-overlap-schedule",
)  # fmt: skip


class _Decoding:
    """`count` streamed requests decoding on the server, one thread each; `start` returns once each
    has produced a token; `running`: those not ended."""

    def __init__(self, url: str, count: int, max_new: int) -> None:
        self._started = threading.Barrier(count + 1)
        self._threads = [
            threading.Thread(target=self._run, args=(url, [5 + i, 6, 7], max_new), daemon=True)
            for i in range(count)
        ]

    def _run(self, url: str, prompt: list[int], max_new: int) -> None:
        import httpx

        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True},
            "stream": True,
        }
        first = True
        with httpx.stream("POST", url + "/generate", json=body, timeout=None) as answer:
            for line in answer.iter_lines():
                if first and line.startswith("data:"):
                    first = False
                    if "output_ids" not in json.loads(line[5:]):  # SGLang's refusal, e.g. too long
                        self._started.abort()
                        raise RuntimeError(f"{url}/generate: {line[5:200]}")
                    self._started.wait()

    def start(self) -> None:
        for t in self._threads:
            t.start()
        self._started.wait(600)

    def running(self) -> int:
        return sum(t.is_alive() for t in self._threads)


def _sglang_pauses(url: str, hf_dir: Path, repeats: int) -> dict[float, dict]:
    """Per share of weights changed: patch bytes and pause ms p50/p99 of the trainer's in-flight
    bracket (`SGLangDelivery(in_flight=True)`, the host's clock) with 16 requests decoding."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.sglang.trainer_sync import SGLangDelivery
    from sparserl_mcore.sync.hashing import bits_view, dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment

    state = {n: t.to(torch.bfloat16).contiguous() for n, t in load_file(hf_dir / "model.safetensors").items()}
    meta = ModelMeta(dtype_name(torch.bfloat16), {n: tuple(t.shape) for n, t in state.items()})
    hf = parse_hf_config(hf_dir)
    sizes: list[int] = []

    def encoder(version: int, base: int | None):
        def encode(changes, fragment) -> bytes:
            blob = encode_fragment(changes, meta, version=version, base_version=base, fragment=fragment)
            sizes.append(len(blob))
            return blob

        return encode

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        full = [(n, np.arange(t.numel()), None, bits_view(t).copy()) for n, t in state.items()]
        failed = SGLangDelivery([url], hf, host_rank=0, token=SGLANG_TOKEN).deliver(
            full, encoder(0, None), version=0, only=None
        )  # the server now holds exactly `state` as version 0
        assert not failed, failed
        decoding = _Decoding(url, 16, max_new=2000)  # the model's context: 2048
        decoding.start()
        delivery = SGLangDelivery([url], hf, host_rank=0, token=SGLANG_TOKEN, in_flight=True)
        rng, version, out = np.random.default_rng(0), 0, {}
        for changed in (0.001, 0.01, 0.1, 1.0):
            pauses, sizes[:] = [], []
            for _ in range(repeats):
                version += 1
                changes = _step_changes(state, changed, rng)
                failed = delivery.deliver(changes, encoder(version, version - 1), version=version, only=None)
                assert not failed, failed
                pauses.append(delivery.pause_ms[url])
            p50, p99 = _percentile(pauses, 0.5), _percentile(pauses, 0.99)
            running = decoding.running()
            out[changed] = {"bytes": statistics.fmean(sizes), "p50": p50, "p99": p99, "running": running}
        with SGLangWorker(url, SGLANG_TOKEN) as worker:  # the requests end here
            worker.pause("abort")
            worker.resume()
    finally:
        dist.destroy_process_group()
    return out


def sglang_pause_section(out: Path, repeats: int = 11) -> dict:
    """ms a live SGLang 0.5.23 server (CPU, `sparserl sglang-serve`) stands still per in-flight
    patch, the same model and patches as the pause section; the host's clock from the pause to the
    continue's answer (4-5 HTTP calls included)."""
    import importlib.util
    import tempfile

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
    from sparserl_mcore.sglang.client import overlap_scheduled

    if importlib.util.find_spec("sglang") is None:
        print("\nsglang_pause: skipped (SGLang is not installed: `make setup`)")
        return {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_tiny(TinyModelConfig(**PAUSE_MODEL), Path(tmp) / "model")
        server_log = out / "sglang-pause-server.log"
        with cpu_server(
            hf_dir, server_log, serve_args=("--token", SGLANG_TOKEN), sglang_args=SGLANG_FLAGS
        ) as url:
            assert not overlap_scheduled(url, SGLANG_TOKEN), "the server runs SGLang's overlap scheduler"
            rows = _sglang_pauses(url, hf_dir, repeats)
    print(f"\nsglang_pause: live SGLang 0.5.23 on CPU (sparserl sglang-serve --device cpu, bf16, overlap "
          f"scheduler off), the 4-layer hidden-256 model; {repeats} patches per row, 16 requests decoding; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| weights changed | patch KB | pause ms p50 | p99 | running |")
    print("|---|---|---|---|---|")
    for changed, r in rows.items():
        kb = r["bytes"] / 1024
        print(f"| {changed:.1%} | {kb:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['running']} |")
    return {str(k): v for k, v in rows.items()}


def main(argv: list[str]) -> int:
    from sparserl_mcore.telemetry.console import quiet_library_output

    a = _args(argv)
    quiet_library_output()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    found: dict = {}
    if a.section in ("all", "pause") and not a.report:
        found["pause"] = pause_section()
    if a.section in ("all", "client") and not a.report:
        found["client"] = client_section()
    if a.section in ("all", "sglang_pause") and not a.report:
        found["sglang_pause"] = sglang_pause_section(out)
    if a.section in ("all", "loop"):
        if shutil.which("taskset") is None and not a.report:
            raise SystemExit("bench_async: the loop section pins processes with `taskset` (util-linux)")
        found["loop"] = loop_section(a, out)
    (out / "results.json").write_text(json.dumps(found, indent=1))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
