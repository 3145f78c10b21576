"""Host time of one embedded-engine decode step, split: prepare, forward, sampling, bookkeeping.

Why: on an H200 the static decode step replays as a CUDA graph in ~1 ms, yet a step took ~7 ms
(docs/benchmarks.md, "Issue 34's device run"): the rest is host work. On the CPU the static step
(`EngineConfig(cuda_graph=True)`) runs eagerly, so everything but "forward" below is the host time
a GPU step pays too. The model is 1 layer of tiny widths (the forward is small, not the subject),
`--batch` requests decode together at steady state (admitted, prefilled, no request finishing).

Columns (CPU microseconds of the process per step, one torch thread; median over `--repeats`
rounds of `--steps` steps each, the parts alternating within a round):
- host: `Scheduler.step` with the static step's forward stubbed by its logits (a graph replay
  costs the host next to nothing), i.e. what a CUDA-graph step pays on the host;
- prepare: `DecodeGraphs.prepare` (inputs of the static step: ids, positions, slots, page tables);
- sampling: `sampler.sample` on the step's logits (on a GPU partly device work);
- bookkeeping: host minus the two above: page reservation, counters, tokens appended, stop checks;
- forward: the static step run eagerly on the CPU (`decode_step`), for scale only.
Sampling modes: greedy, T=1 unseeded (the engine's shared generator, as RL rollouts run) and
T=1 seeded (one generator per request).

`python -m benchmarks bench_engine_host` (defaults: batch 64, 1 layer); results in docs/rollout.md
("Host time of a decode step").
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.engine.sampler import sample
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

MODES = ("greedy", "t1", "t1_seeded")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_engine_host", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-context", type=int, default=4096, help="EngineConfig.cuda_graph_max_context")
    return p.parse_args(argv)


def _per_step_us(fn: Callable[[], object], n: int) -> float:
    """CPU microseconds of the process per call (one torch thread: stable on a shared box)."""
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def _row(a, path, mode: str) -> dict[str, float]:
    cfg = EngineConfig(
        device="cpu",
        cuda_graph=True,
        max_running_requests=a.batch,
        cuda_graph_max_bs=a.batch,
        cuda_graph_max_context=a.max_context,
    )
    engine = EmbeddedEngine(path, cfg)
    sched, graphs = engine.scheduler, engine.scheduler._forward.graphs
    assert graphs is not None
    g = torch.Generator().manual_seed(0)
    gen = a.prompt_len + (a.steps + 2) * (a.repeats + 2) * 2  # nobody finishes while timed
    temperature = 0.0 if mode == "greedy" else 1.0
    states = [
        engine._new_state(
            GenerateRequest(
                input_ids=torch.randint(0, a.vocab, (a.prompt_len,), generator=g).tolist(),
                sampling=SamplingParams(
                    temperature=temperature,
                    max_new_tokens=gen,
                    ignore_eos=True,
                    seed=i if mode == "t1_seeded" else None,
                ),
            )
        )
        for i in range(a.batch)
    ]
    sched.waiting.extend(states)
    while sched.waiting or sched._forward.static_steps < 2:
        sched.step()
    assert len(sched.running) == a.batch
    decodes = list(sched.running)
    key = graphs.prepare(decodes)
    params, gens = [r.req.sampling for r in decodes], [r.generator for r in decodes]
    logits = graphs.decode_step(*key)[: len(decodes)]
    # The host step: Scheduler.step with the static step's forward stubbed by its logits, as a
    # graph replay costs the host ~nothing; the forward is timed on its own.
    replay = graphs.decode_step(*key)
    host_graphs = copy.copy(graphs)
    host_graphs.decode_step = lambda rows, width: replay  # type: ignore[method-assign]
    parts: dict[str, list[float]] = {"host": [], "prepare": [], "forward": [], "sampling": []}
    for _ in range(a.repeats):  # the parts alternate, so the neighbours' load hits them alike
        sched._forward.graphs = host_graphs
        parts["host"].append(_per_step_us(sched.step, a.steps))
        sched._forward.graphs = graphs
        parts["prepare"].append(_per_step_us(partial(graphs.prepare, list(sched.running)), a.steps))
        parts["forward"].append(_per_step_us(lambda: graphs.decode_step(*key), a.steps))
        parts["sampling"].append(_per_step_us(lambda: sample(logits, params, gens), a.steps))
    host, prepare, forward, sampling = (statistics.median(parts[k]) for k in parts)
    return {
        "prepare": prepare,
        "sampling": sampling,
        "bookkeeping": host - prepare - sampling,
        "host": host,
        "forward": forward,
    }


def main(argv: list[str]) -> int:
    a = _args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        tiny = TinyModelConfig(layers=a.layers, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=a.vocab)
        path = make_tiny(tiny, f"{tmp}/model")
        rows = {mode: _row(a, path, mode) for mode in MODES}
    cols = ("prepare", "sampling", "bookkeeping", "host", "forward")
    print(f"decode step at batch {a.batch}, {a.layers} layer(s), vocab {a.vocab}: us per step (median)")
    print(f"| mode | {' | '.join(cols)} |")
    print(f"|---|{'---:|' * len(cols)}")
    for mode, r in rows.items():
        print(f"| {mode} | {' | '.join(f'{r[c]:.0f}' for c in cols)} |")
    print("host: Scheduler.step with the forward stubbed (what a CUDA-graph step pays besides the replay)")
    print("forward: the static step run eagerly on the CPU (a graph replay on CUDA), for scale")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
