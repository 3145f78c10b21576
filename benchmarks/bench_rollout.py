"""Embedded rollout engine: throughput vs HF transformers, KV memory under compression, radix sharing.

Same random-weight model (sparserl_mcore.ckpt.tiny) and prompts for every row, one timed run each
after one short warm-up run per system. Speed is reported as tokens per wall second AND per CPU
second of the process (one torch thread by default); ratios use CPU seconds, which stay meaningful
on a shared machine where wall time depends on the neighbours' load.
1. tokens/s of `EmbeddedEngine` vs HF `generate` (batched, left-padded, KV cache on, greedy), with
   equal response lengths and with RL-like varied ones;
2. each compression policy at budgets of 25% and 50% of the generated length: mean per-request
   peak KV bytes relative to `none` (goal: <= budget share + one page) and tokens/s relative to
   `none` (goal: >= 0.9);
3. radix sharing: pool pages holding the prompts of G samples per prompt, radix on vs off (goal:
   <= 1/G + one page per sample).

`python -m benchmarks bench_rollout` (defaults) or `python -m benchmarks.bench_rollout --device cuda ...`;
results are recorded in docs/benchmarks.md ("## Rollout engine").
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.kvcompress import METHODS, KVCompressionConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams


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
    p.add_argument("--group", type=int, default=8, help="samples per prompt in the radix row")
    p.add_argument("--radix-prompt-len", type=int, default=200)
    return p.parse_args(argv)


def _requests(prompts: list[list[int]], gens: int | list[int]) -> list[GenerateRequest]:
    gens = gens if isinstance(gens, list) else [gens] * len(prompts)
    return [
        GenerateRequest(
            input_ids=p, sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
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

    def cell(self) -> str:
        return f"{self.tokens / self.wall_s:.0f} / {self.per_cpu_s:.0f}"


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


def _timed_engine(path, cfg: EngineConfig, prompts, gens: int | list[int]) -> tuple[Rate, list]:
    """Generated tokens over the time of one run, and its samples."""
    engine = EmbeddedEngine(path, cfg)
    engine.generate(_requests(prompts[:2], 8))  # warm-up
    with _Clock(cfg.device) as clock:
        samples = engine.generate(_requests(prompts, gens))
    return Rate(sum(len(s.output_ids) for s in samples), clock.wall, clock.cpu), samples


def _timed_hf(path, device: str, prompts, gens: list[int]) -> Rate:
    """HF `generate` on the left-padded batch. A batch runs until its longest request is done (rows
    stop only at EOS, and stay in the batch); only each request's own tokens count."""
    import transformers

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, **kw)  # warm-up
        with _Clock(device) as clock:
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(gens), min_new_tokens=max(gens), **kw
            )
    assert out.shape[1] - width == max(gens)
    return Rate(sum(gens), clock.wall, clock.cpu)


def _mean_peak_bytes(samples) -> float:
    return sum(s.kv_stats.peak_kv_bytes for s in samples) / len(samples)


def main(argv: list[str]) -> int:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.prompt_len // 2, a.prompt_len * 3 // 2 + 1, (a.batch,), generator=g).tolist()
    prompts = [torch.randint(100, a.vocab, (n,), generator=g).tolist() for n in lengths]
    base = dict(
        device=a.device, page_size=a.page_size, capacity_bytes=2 * 2**30, max_running_requests=a.batch
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
        # Equal lengths (no early exits), then RL-like response lengths (uniform gen/4 .. gen).
        equal, varied = (
            [a.gen] * a.batch,
            torch.randint(a.gen // 4, a.gen + 1, (a.batch,), generator=g).tolist(),
        )
        hf_equal = _timed_hf(path, a.device, prompts, equal)
        none, none_samples = _timed_engine(path, EngineConfig(**base), prompts, equal)
        hf_varied = _timed_hf(path, a.device, prompts, varied)
        ours_varied, _ = _timed_engine(path, EngineConfig(**base), prompts, varied)
        print(
            "\n| response lengths | HF generate tok/s (wall / CPU) | EmbeddedEngine tok/s (wall / CPU) "
            "| ratio (CPU) |\n|---|---|---|---|"
        )
        for label, hf, ours in (
            (f"{a.gen} each", hf_equal, none),
            (f"{min(varied)}-{a.gen}", hf_varied, ours_varied),
        ):
            print(f"| {label} | {hf.cell()} | {ours.cell()} | {ours.per_cpu_s / hf.per_cpu_s:.2f}x |")
        _compression_table(a, path, prompts, base, none, none_samples)
        _radix_table(a, path, base)
    return 0


def _compression_table(a, path, prompts, base, none: Rate, none_samples) -> None:
    none_bytes = _mean_peak_bytes(none_samples)
    total = sum(len(p) for p in prompts) / len(prompts) + a.gen
    print(
        "\n| policy | budget | peak KV bytes / none | goal (budget share + 1 page) | tok/s (wall / CPU) "
        "| vs none (CPU) |\n|---|---|---|---|---|---|"
    )
    for share in (0.25, 0.5):
        budget = int(a.gen * share)
        for method in [m for m in METHODS if m != "none"]:
            kv = KVCompressionConfig(method=method, budget=budget, interval=max(1, budget // 4), window=8)
            rate, samples = _timed_engine(path, EngineConfig(**base, kv_compression=kv), prompts, a.gen)
            ratio = _mean_peak_bytes(samples) / none_bytes
            goal = (budget + a.page_size) / total
            print(
                f"| {method} | {budget} ({share:.0%} of gen) | {ratio:.3f} | {goal:.3f} | {rate.cell()} "
                f"| {rate.per_cpu_s / none.per_cpu_s:.2f}x |"
            )


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
