"""Embedded rollout engine: throughput vs HF transformers, KV memory under compression, radix sharing.

Same random-weight model (sparserl_mcore.ckpt.tiny) and prompts for every row. Each system is built
and warmed up once, then the systems compared in a table run in turn, `--repeats` rounds, so
neighbours' load hits them alike. Speed is tokens per CPU second of the process (one torch thread by
default), which stays meaningful on a shared machine where wall time depends on the neighbours'
load; a ratio is the median over rounds of the same-round ratio, with its min-max over rounds.
1. tokens/s of `EmbeddedEngine` vs HF `generate` (batched, left-padded, KV cache on), greedy with
   equal response lengths and with RL-like varied ones, and an RL-shaped batch (P prompts x G
   samples at temperature 1, varied lengths) where the engine's radix cache shares each prompt's
   prefill among its G samples; the engine's prefix cache is flushed before every timed run, so
   repeating the same prompts round after round does not skip prefill work HF has to do;
2. each compression policy at budgets of 25% and 50% of the generated length: mean per-request
   peak KV bytes relative to `none` (goal: <= budget share + one page) and tokens/s relative to
   `none` (goal: >= 0.9);
3. fixed KV memory: every policy gets the same pool (pages for `--pool-requests` dense requests at
   full length) and an RL-shaped batch (P prompts x G samples, temperature 1): mean and peak
   requests decoded per step (the engine admits while pages last and retracts the youngest
   request when they run out), retractions, and tokens/s relative to `none`;
4. radix sharing: pool pages holding the prompts of G samples per prompt, radix on vs off (goal:
   <= 1/G + one page per sample);
5. the matmul layout behind the engine's fp32 CPU weights: F.linear (HF layout) vs input-major;
6. decode attention alone at this model's shape: the native kernel (rollout/engine/native.py, pages read in
   place) vs the torch path (page gather + SDPA), with each one's max error vs a float64 reference.

`python -m benchmarks bench_rollout` (defaults); results are recorded in docs/benchmarks.md ("## Rollout
engine"). On a GPU, CPU seconds are the wrong unit: `python -m benchmarks.gpu.engine` measures wall
tokens/s there.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig, native
from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention
from sparserl_mcore.rollout.kvcompress import METHODS, KVCompressionConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

TABLES = ("throughput", "compression", "fixed_pool", "radix", "gemm", "decode_attention")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_rollout", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, same for both systems (1: stable on a shared box)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="prompts per run")
    p.add_argument("--prompt-len", type=int, default=32, help="mean; lengths vary +-50%% as in real batches")
    p.add_argument("--gen", type=int, default=128, help="generated tokens per request")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (RL-shaped and radix rows)")
    p.add_argument("--rl-prompt-len", type=int, default=128, help="prompt tokens in the RL-shaped row")
    p.add_argument("--radix-prompt-len", type=int, default=200)
    p.add_argument("--pool-prompts", type=int, default=8, help="P of the fixed-pool row (x --group samples)")
    p.add_argument("--pool-gen", type=int, default=256, help="generated tokens per request, fixed-pool row")
    p.add_argument("--pool-requests", type=int, default=8, help="dense full-length requests the pool holds")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per table (systems alternate)")
    p.add_argument(
        "--tables",
        default=",".join(TABLES),
        help=f"comma-separated subset of {','.join(TABLES)} (default: all)",
    )
    a = p.parse_args(argv)
    if a.device != "cpu":
        p.error("--device: this counts tokens per CPU second; on a GPU: python -m benchmarks.gpu.engine")
    unknown = set(a.tables.split(",")) - set(TABLES)
    if unknown:
        p.error(f"--tables: unknown {sorted(unknown)}; known: {', '.join(TABLES)}")
    return a


def _requests(
    prompts: list[list[int]], gens: int | list[int], temperature: float = 0.0
) -> list[GenerateRequest]:
    """Greedy (temperature 0), or pure sampling (no top-k / top-p, unseeded as RL rollouts usually
    are: HF draws from its one global generator) at `temperature`."""
    gens = gens if isinstance(gens, list) else [gens] * len(prompts)
    return [
        GenerateRequest(
            input_ids=p, sampling=SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True)
        )
        for p, n in zip(prompts, gens, strict=True)
    ]


@dataclass(frozen=True)
class Rate:
    tokens: int
    wall_s: float
    cpu_s: float

    @property
    def per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


class _Clock:
    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


# A system under test: one call = one timed run, returning its rate and (engines) its samples.
Runner = Callable[[], tuple[Rate, list]]


def _engine_runner(
    path, cfg: EngineConfig, prompts, gens: int | list[int], temperature: float = 0.0
) -> Runner:
    engine = EmbeddedEngine(path, cfg)
    engine.generate(_requests(prompts[:2], 8, temperature))  # warm-up

    def run() -> tuple[Rate, list]:
        engine.flush_cache()  # no KV left from the previous round: each round prefills like HF
        with _Clock(cfg.device) as clock:
            samples = engine.generate(_requests(prompts, gens, temperature))
        return Rate(sum(len(s.output_ids) for s in samples), clock.wall, clock.cpu), samples

    return run


def _hf_runner(path, device: str, prompts, gens: list[int], temperature: float = 0.0) -> Runner:
    """HF `generate` on the left-padded batch. A batch runs until its longest request is done (rows
    stop only at EOS, and stay in the batch); only each request's own tokens count. temperature > 0:
    pure sampling (top_k=0 and top_p=1 turn HF's default filters off, as in `_requests`)."""
    import transformers

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(use_cache=True, eos_token_id=None, pad_token_id=0)
    if temperature:
        kw |= dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw |= dict(do_sample=False)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, **kw)  # warm-up

    def run() -> tuple[Rate, list]:
        with torch.no_grad(), _Clock(device) as clock:
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(gens), min_new_tokens=max(gens), **kw
            )
        assert out.shape[1] - width == max(gens)
        return Rate(sum(gens), clock.wall, clock.cpu), []

    return run


def _alternate(runners: dict[str, Runner], repeats: int) -> tuple[dict[str, list[Rate]], dict[str, list]]:
    """`repeats` rounds, each running every system once in turn; rates per system, last samples."""
    rates: dict[str, list[Rate]] = {k: [] for k in runners}
    samples: dict[str, list] = {}
    for _ in range(repeats):
        for key, run in runners.items():
            rate, samples[key] = run()
            rates[key].append(rate)
    return rates, samples


def _rate_cell(rates: list[Rate]) -> str:
    cpu = [r.per_cpu_s for r in rates]
    return f"{statistics.median(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f})"


def _ratio_cell(num: list[Rate], den: list[Rate]) -> str:
    """Median and min-max over rounds of the same-round ratio of CPU-time rates."""
    ratios = [a.per_cpu_s / b.per_cpu_s for a, b in zip(num, den, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _mean_peak_bytes(samples) -> float:
    return sum(s.kv_stats.peak_kv_bytes for s in samples) / len(samples)


def main(argv: list[str]) -> int:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.prompt_len // 2, a.prompt_len * 3 // 2 + 1, (a.batch,), generator=g).tolist()
    prompts = [torch.randint(100, a.vocab, (n,), generator=g).tolist() for n in lengths]
    # 256 MiB pools (thousands of pages, far more than any row needs): the compression table holds
    # nine engines at once, and every pool is zero-filled memory.
    base = dict(
        device=a.device, page_size=a.page_size, capacity_bytes=256 * 2**20, max_running_requests=a.batch
    )
    with tempfile.TemporaryDirectory() as tmp:
        tiny = TinyModelConfig(
            arch="qwen2", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
            ffn=int(a.hidden * 2.75), vocab=a.vocab,
        )  # fmt: skip
        path = make_tiny(tiny, f"{tmp}/model")
        print(
            f"model: qwen2 {a.layers}L h{a.hidden} {a.heads}/{a.kv_heads} heads vocab {a.vocab}, {a.device}, "
            f"torch threads {torch.get_num_threads()}; {a.batch} prompts of {min(lengths)}-{max(lengths)} "
            f"tokens, up to {a.gen} generated, page {a.page_size}"
        )
        tables = a.tables.split(",")
        if "throughput" in tables:
            _throughput_table(a, path, prompts, base, g)
        if "compression" in tables:
            _compression_table(a, path, prompts, base)
        if "fixed_pool" in tables:
            _fixed_pool_table(a, path, g)
        if "radix" in tables:
            _radix_table(a, path, base)
        if "gemm" in tables:
            _gemm_table(a)
        if "decode_attention" in tables:
            _decode_attention_table(a)
    return 0


def _throughput_table(a, path, prompts, base, g: torch.Generator) -> None:
    """The engine vs HF generate on the same batches, alternating in the same rounds."""
    # Equal lengths (no early exits), then RL-like response lengths (uniform gen/4 .. gen).
    equal, varied = (
        [a.gen] * a.batch,
        torch.randint(a.gen // 4, a.gen + 1, (a.batch,), generator=g).tolist(),
    )
    # RL-shaped: batch // group prompts, each sampled `group` times at temperature 1.
    rl_prompts = [
        torch.randint(100, a.vocab, (a.rl_prompt_len,), generator=g).tolist()
        for _ in range(max(1, a.batch // a.group))
    ]
    rl_batch = [p for p in rl_prompts for _ in range(a.group)]
    rl_gens = torch.randint(a.gen // 4, a.gen + 1, (len(rl_batch),), generator=g).tolist()
    rl_base = {**base, "max_running_requests": len(rl_batch)}
    runners = {
        "hf_equal": _hf_runner(path, a.device, prompts, equal),
        "ours_equal": _engine_runner(path, EngineConfig(**base), prompts, equal),
        "hf_varied": _hf_runner(path, a.device, prompts, varied),
        "ours_varied": _engine_runner(path, EngineConfig(**base), prompts, varied),
        "hf_rl": _hf_runner(path, a.device, rl_batch, rl_gens, temperature=1.0),
        "ours_rl": _engine_runner(path, EngineConfig(**rl_base), rl_batch, rl_gens, temperature=1.0),
    }
    rates, _ = _alternate(runners, a.repeats)
    print(
        f"\n{a.repeats} alternating rounds; tokens per CPU second, median (min-max)\n"
        "| batch | response lengths | HF generate tok/s | EmbeddedEngine tok/s | ratio |\n"
        "|---|---|---|---|---|"
    )
    rows = (
        (f"{a.batch} prompts, greedy", f"{a.gen} each", "equal"),
        (f"{a.batch} prompts, greedy", f"{min(varied)}-{a.gen}", "varied"),
        (
            f"{len(rl_prompts)} prompts of {a.rl_prompt_len} x G={a.group}, temperature 1",
            f"{min(rl_gens)}-{max(rl_gens)}",
            "rl",
        ),
    )
    for batch, lengths, key in rows:
        hf, ours = rates[f"hf_{key}"], rates[f"ours_{key}"]
        print(f"| {batch} | {lengths} | {_rate_cell(hf)} | {_rate_cell(ours)} | {_ratio_cell(ours, hf)} |")


def _compression_table(a, path, prompts, base) -> None:
    """Every policy at both budgets alternating with `none` in the same rounds."""
    configs = {("none", 0): KVCompressionConfig()}
    for share in (0.25, 0.5):
        budget = int(a.gen * share)
        for method in [m for m in METHODS if m != "none"]:
            configs[(method, budget)] = KVCompressionConfig(
                method=method, budget=budget, interval=max(1, budget // 4), window=8
            )
    runners = {
        key: _engine_runner(path, EngineConfig(**base, kv_compression=kv), prompts, a.gen)
        for key, kv in configs.items()
    }
    rates, samples = _alternate(runners, a.repeats)
    none_rates, none_bytes = rates[("none", 0)], _mean_peak_bytes(samples[("none", 0)])
    total = sum(len(p) for p in prompts) / len(prompts) + a.gen
    print(
        f"\n{a.repeats} alternating rounds with `none` ({_rate_cell(none_rates)} tok/s); tokens per CPU "
        "second, median (min-max)\n| policy | budget | peak KV bytes / none | goal (budget share + 1 page) "
        "| tok/s | vs none |\n|---|---|---|---|---|---|"
    )
    for (method, budget), kv_rates in rates.items():
        if method == "none":
            continue
        ratio = _mean_peak_bytes(samples[(method, budget)]) / none_bytes
        goal = (budget + a.page_size) / total
        print(
            f"| {method} | {budget} ({budget / a.gen:.0%} of gen) | {ratio:.3f} | {goal:.3f} "
            f"| {_rate_cell(kv_rates)} | {_ratio_cell(kv_rates, none_rates)} |"
        )


def _pool_runner(path, cfg: EngineConfig, prompts, gen: int) -> Runner:
    """Like `_engine_runner` at temperature 1; its samples slot carries the run's scheduler counters."""
    engine = EmbeddedEngine(path, cfg)
    engine.generate(_requests(prompts[:2], 8, 1.0))  # warm-up

    def run() -> tuple[Rate, list]:
        engine.flush_cache()
        before = engine.stats()
        with _Clock(cfg.device) as clock:
            samples = engine.generate(_requests(prompts, gen, 1.0))
        after = engine.stats()
        counts = {k: after[k] - before[k] for k in ("steps", "batched_requests", "retractions")}
        rate = Rate(sum(len(s.output_ids) for s in samples), clock.wall, clock.cpu)
        return rate, [counts | {"peak_running": after["peak_running"]}]

    return run


def _fixed_pool_table(a, path, g: torch.Generator) -> None:
    """Every policy at a budget of 25% of the generation, `none` included, on one pool size."""
    prompts = [
        torch.randint(100, a.vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.pool_prompts)
    ]
    batch = [p for p in prompts for _ in range(a.group)]
    pages = a.pool_requests * math.ceil((a.prompt_len + a.pool_gen) / a.page_size)
    base = dict(device=a.device, page_size=a.page_size, capacity_pages=pages, max_running_requests=len(batch))
    budget = a.pool_gen // 4
    configs = {"none": KVCompressionConfig()} | {
        m: KVCompressionConfig(method=m, budget=budget, interval=budget // 4, window=8)
        for m in METHODS
        if m != "none"
    }
    runners = {
        m: _pool_runner(path, EngineConfig(**base, kv_compression=kv), batch, a.pool_gen)
        for m, kv in configs.items()
    }
    rates, counts = _alternate(runners, a.repeats)
    print(
        f"\nfixed pool: {pages} pages of {a.page_size} tokens ({a.pool_requests} dense requests at "
        f"full length); {a.pool_prompts} prompts of {a.prompt_len} tokens x G={a.group}, {a.pool_gen} "
        f"tokens each, temperature 1; budget {budget}; {a.repeats} alternating rounds, tokens per CPU "
        "second, median (min-max); requests per step and retractions from the last round\n"
        "| policy | requests decoded per step, mean / peak | retractions | tok/s | vs none |\n"
        "|---|---|---|---|---|"
    )
    for method, kv_rates in rates.items():
        c = counts[method][0]
        print(
            f"| {method} | {c['batched_requests'] / c['steps']:.1f} / {c['peak_running']} "
            f"| {c['retractions']} | {_rate_cell(kv_rates)} | {_ratio_cell(kv_rates, rates['none'])} |"
        )


def _gemm_table(a) -> None:
    """Why the engine stores fp32 CPU weights input-major: F.linear(x, W) (HF layout, W [out, in])
    vs x @ W_t (W_t [in, out] contiguous), same values, at decode (M = 16, 64) and other row counts."""
    shapes = {  # (in, out): this model's gate_up and lm_head, and Qwen2.5-0.5B-like gate_up
        "gate_up": (a.hidden, 2 * int(a.hidden * 2.75)),
        "lm_head": (a.hidden, a.vocab),
        "0.5B gate_up": (896, 9728),
    }
    print("\n| matmul (in x out) | dtype | rows M | F.linear us | x @ W_t us | speed-up |")
    print("|---|---|---|---|---|---|")
    for (name, (k, n)), dtype, m in itertools.product(
        shapes.items(), (torch.float32, torch.bfloat16), (1, 16, 64, 512)
    ):
        w = torch.randn(n, k, dtype=dtype, device=a.device)
        x = torch.randn(m, k, dtype=dtype, device=a.device)
        calls = {"linear": partial(F.linear, x, w), "input-major": partial(torch.mm, x, w.t().contiguous())}
        us = _median_call_us(calls, max(3, int(3e8 / (m * n * k))), a.repeats, a.device)
        print(
            f"| {name} ({k} x {n}) | {str(dtype).removeprefix('torch.')} | {m} | {us['linear']:.0f} | "
            f"{us['input-major']:.0f} | {us['linear'] / us['input-major']:.2f}x |"
        )


def _decode_attention_table(a, pool_pages: int = 512) -> None:
    """One layer's decode attention for `--batch` requests of about N cached entries each, their pages
    scattered at random over a pool of `pool_pages` (as after many requests came and went)."""
    kernel = native.paged_decode()
    if kernel is None:
        print("\ndecode_attention: native kernel unavailable (no C compiler or SPARSERL_NATIVE=0)")
        return
    d, ps, g = a.hidden // a.heads, a.page_size, torch.Generator().manual_seed(2)
    k_rows, v_rows = (torch.randn(pool_pages, ps * a.kv_heads * d, generator=g) for _ in range(2))
    print("\n| entries N | torch (gather + SDPA) us | native us | speed-up | max err torch / native |")
    print("|---|---|---|---|---|")
    for n_max in (16, 64, 128, a.gen + 48):
        lengths = torch.randint(max(1, n_max - 2), n_max + 1, (a.batch,), generator=g).tolist()
        perm, tables = torch.randperm(pool_pages, generator=g).tolist(), []
        for n in lengths:
            tables.append(perm[: -(-n // ps)])
            perm = perm[len(tables[-1]) :]
        q = torch.randn(a.batch, a.heads, d, generator=g)
        layout = DecodeLayout.build(tables, lengths, page_size=ps, dtype=torch.float32, device="cpu")
        calls = {
            "torch": partial(decode_attention, q, k_rows, v_rows, layout, use_native=False),
            "native": partial(decode_attention, q, k_rows, v_rows, layout),
        }
        errs = {
            key: _attention_error(fn()[0], q, k_rows, v_rows, tables, lengths, a.kv_heads)
            for key, fn in calls.items()
        }
        us = _median_call_us(calls, 200, max(a.repeats, 7), "cpu")
        print(
            f"| {min(lengths)}-{max(lengths)} | {us['torch']:.0f} | {us['native']:.0f} | "
            f"{us['torch'] / us['native']:.2f}x | {errs['torch']:.1e} / {errs['native']:.1e} |"
        )


def _attention_error(out, q, k_rows, v_rows, tables, lengths, kv_heads: int) -> float:
    """Max abs difference of `out` [B, Hq, d] from float64 softmax attention over each request's entries."""
    B, Hq, d = q.shape
    err = 0.0
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = (x[table].view(-1, kv_heads, d)[:n].double() for x in (k_rows, v_rows))
        for h in range(Hq):
            kv = h // (Hq // kv_heads)
            ref = (k[:, kv] @ q[b, h].double() / math.sqrt(d)).softmax(0) @ v[:, kv]
            err = max(err, (out[b, h].double() - ref).abs().max().item())
    return err


def _median_call_us(calls: dict[str, Callable], n: int, repeats: int, device: str) -> dict[str, float]:
    """Median over `repeats` rounds (the calls alternate in every round) of CPU us per call."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for _ in range(repeats):
            for key, fn in calls.items():
                fn()
                with _Clock(device) as clock:
                    for _ in range(n):
                        fn()
                times[key].append(clock.cpu / n * 1e6)
    return {key: statistics.median(t) for key, t in times.items()}


def _radix_table(a, path, base) -> None:
    """Pool pages at peak while G samples of each prompt hold their prompt KV (2 tokens generated)."""
    g = torch.Generator().manual_seed(1)
    n_prompts = 4
    prompts = [
        torch.randint(100, a.vocab, (a.radix_prompt_len,), generator=g).tolist() for _ in range(n_prompts)
    ]
    group = [p for p in prompts for _ in range(a.group)]
    peaks = {}
    for radix in (False, True):
        cfg = EngineConfig(**{**base, "max_running_requests": len(group)}, radix_cache=radix)
        engine = EmbeddedEngine(path, cfg)
        engine.generate(_requests(group, 2))
        peaks[radix] = engine.pool.peak_used
    per_sample_unshared = math.ceil((a.radix_prompt_len + 1) / a.page_size)
    goal = per_sample_unshared / a.group + 1
    print(
        f"\n| radix cache | pool pages at peak ({n_prompts} prompts x G={a.group}, "
        f"{a.radix_prompt_len} tokens each) "
        "| pages per sample | goal (1/G + 1 page) |\n|---|---|---|---|"
    )
    for radix in (False, True):
        per_sample = peaks[radix] / len(group)
        print(f"| {'on' if radix else 'off'} | {peaks[radix]} | {per_sample:.2f} | {goal:.2f} |")
    print(f"shared / unshared = {peaks[True] / peaks[False]:.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
