"""Embedded engine vs HF `generate` on one GPU: wall tokens/s, side by side, and compression cost.

A random-weight checkpoint of the Qwen2.5-0.5B shape (`ckpt.tiny.make_tiny`, bf16), prompts of
random token ids (lengths vary +-50 % around `--prompt-len`), every response exactly `--gen`
tokens (ignore EOS), so both systems generate the same number of tokens. Rows:
- greedy, `--batch` prompts (default 64 x 512 new tokens): engine vs HF (left-padded batch,
  KV cache, SDPA);
- RL shape: `--rl-prompts` prompts x G=`--group` samples at temperature 1 (engine: one request
  per sample, its radix cache shares each prompt; HF: `num_return_sequences=G`);
- decode steps: greedy `--batch` x `--gen`, replayed as CUDA graphs or eager
  (`EngineConfig.cuda_graph`), decode attention by the Triton paged kernel or the gather path
  (`EngineConfig.triton_decode`), each against eager + gather, and how many sequences come out
  token-identical to it;
- decode attention alone: the Triton kernel vs the gather path, one layer's call at `--batch` rows
  of the model's heads, every request at one length, the table padded to its CUDA-graph context
  bucket (what the static step reads), microseconds per call by CUDA events;
- compression: every KV policy at a budget of half the generated length, at
  `--compression-batch` x `--compression-gen`, tokens/s relative to `none` (goal >= 0.9x).
Wall tokens/s = generated tokens / wall seconds between device synchronisations; each system is
warmed up first, then timed `--repeats` times (median).

    python -m benchmarks.gpu.engine [--batch 64 --gen 512]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import common


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.engine", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=512)
    p.add_argument("--rl-prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--compression-batch", type=int, default=32)
    p.add_argument("--compression-gen", type=int, default=256)
    p.add_argument("--policies", default=None, help="comma-separated KV methods (default: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-dir", type=Path, default=None, help="use this checkpoint instead of a random one")
    p.add_argument("--smoke", action="store_true", help="tiny shape, runs on CPU (no figures)")
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.gen, args.rl_prompts, args.group = 4, 8, 8, 2, 2
        args.compression_batch, args.compression_gen, args.repeats = 2, 16, 1
    return args


def _checkpoint(args, root: Path) -> Path:
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    if args.hf_dir is not None:
        return args.hf_dir
    hf = common.model_shape(args.smoke)
    cfg = TinyModelConfig(
        arch="qwen2",
        layers=hf["num_hidden_layers"],
        hidden=hf["hidden_size"],
        heads=hf["num_attention_heads"],
        kv_heads=hf["num_key_value_heads"],
        ffn=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        tie_embeddings=hf["tie_word_embeddings"],
        dtype="bfloat16",
    )
    return make_tiny(cfg, root / "model")


def _prompts(n: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, mean_len // 2), mean_len + mean_len // 2 + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in lengths]


def _engine_run(engine, prompts: list[list[int]], gen: int, temperature: float):
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=temperature, max_new_tokens=gen, ignore_eos=True)
    requests = [GenerateRequest(input_ids=tuple(p), sampling=params) for p in prompts]

    def run() -> int:
        engine.flush_cache()  # every timed run prefills, as HF does
        return sum(len(s.output_ids) for s in engine.generate(requests))

    return run


def _hf_run(model, prompts: list[list[int]], gen: int, *, group: int = 1, device: torch.device):
    """HF generate on the left-padded batch; `group` > 1: that many samples per prompt at T=1."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device)[None, :] >= pads[:, None]).long()
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=group)
    kw: dict[str, Any] = dict(max_new_tokens=gen, min_new_tokens=gen, eos_token_id=None, pad_token_id=0)
    kw |= sample if group > 1 else dict(do_sample=False)

    def run() -> int:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kw)
        return (out.shape[1] - width) * out.shape[0]

    return run


def _rate(run, device, repeats: int) -> tuple[float, int]:
    """(median wall tokens/s, tokens per run)."""
    tokens = run()  # warm-up (and the token count)
    times = common.wall_times(run, device, warmup=0, repeats=repeats)
    return tokens / common.median(times), tokens


def _throughput_rows(args, path: Path, device: torch.device, dtype: torch.dtype, vocab: int) -> list[dict]:
    import transformers

    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig

    cfg = EngineConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_running_requests=max(args.batch, args.rl_prompts * args.group),
    )
    engine = EmbeddedEngine(path, cfg)
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    greedy = _prompts(args.batch, args.prompt_len, vocab, seed=1)
    rl = _prompts(args.rl_prompts, args.prompt_len, vocab, seed=2)
    cases = {
        f"greedy {args.batch} x {args.gen}": (
            _engine_run(engine, greedy, args.gen, 0.0),
            _hf_run(hf, greedy, args.gen, device=device),
        ),
        f"RL {args.rl_prompts} x G={args.group} x {args.gen}, T=1": (
            _engine_run(engine, [p for p in rl for _ in range(args.group)], args.gen, 1.0),
            _hf_run(hf, rl, args.gen, group=args.group, device=device),
        ),
    }
    rows = []
    for name, (engine_run, hf_run) in cases.items():
        engine_rate, tokens = _rate(engine_run, device, args.repeats)
        print(f"{name}: engine {engine_rate:,.0f} tokens/s", flush=True)  # partial results survive a limit
        hf_rate, hf_tokens = _rate(hf_run, device, args.repeats)
        print(f"{name}: HF generate {hf_rate:,.0f} tokens/s", flush=True)
        assert tokens == hf_tokens, (name, tokens, hf_tokens)
        rows.append(
            {
                "case": name,
                "tokens": tokens,
                "engine_tok_s": engine_rate,
                "hf_tok_s": hf_rate,
                "engine_vs_hf": engine_rate / hf_rate,
            }
        )
    return rows


# (name, cuda_graph, triton_decode); the first is the reference the others are compared with
DECODE_VARIANTS = (
    ("eager, gather", False, False),
    ("graph, gather", True, False),
    ("graph, triton", True, True),
    ("eager, triton", False, True),
)


def _graph_rows(args, path: Path, device: torch.device, dtype: torch.dtype, vocab: int) -> list[dict]:
    """Greedy at `--batch` x `--gen` for each of DECODE_VARIANTS: tokens/s, and how many sequences
    equal the eager gather path's (bf16: padded rows change GEMM shapes, so an argmax tie may flip;
    fp32 must match, tests/test_gpu.py and tests/test_rollout_triton_decode.py)."""
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig, triton_decode
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    prompts = _prompts(args.batch, args.prompt_len, vocab, seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.gen, ignore_eos=True)
    requests = [GenerateRequest(input_ids=tuple(p), sampling=params) for p in prompts]
    why_not = triton_decode.why_unusable(device)
    rows, reference = [], None
    for name, graphs, triton in DECODE_VARIANTS:
        if triton and why_not is not None:
            print(f"greedy decode, {name}: skipped ({why_not})", flush=True)
            continue
        cfg = EngineConfig(
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_running_requests=args.batch,
            cuda_graph=graphs,
            triton_decode=triton,
        )
        engine = EmbeddedEngine(path, cfg)
        outputs = [s.output_ids for s in engine.generate(requests)]  # the warm-up gives the tokens
        tokens = sum(len(o) for o in outputs)
        run = _engine_run(engine, prompts, args.gen, 0.0)
        rate = tokens / common.median(common.wall_times(run, device, warmup=0, repeats=args.repeats))
        reference = reference or (rate, outputs)
        same = sum(a == b for a, b in zip(outputs, reference[1], strict=True))
        print(f"greedy decode, {name}: {rate:,.0f} tokens/s, {same}/{len(prompts)} identical", flush=True)
        rows.append(
            {
                "case": f"greedy {args.batch} x {args.gen}",
                "decode": name,
                "tok_s": rate,
                "vs_eager_gather": rate / reference[0],
                "identical_to_eager_gather": f"{same}/{len(prompts)}",
            }
        )
    return rows


def _attention_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One layer's decode attention at `--batch` rows, the model's heads: kernel vs gather."""
    from sparserl_mcore.rollout.engine import triton_decode
    from sparserl_mcore.rollout.engine.decode_graphs import context_buckets
    from sparserl_mcore.rollout.engine.paged_attention import DecodeLayout, decode_attention

    if triton_decode.why_unusable(device) is not None or device.type != "cuda":
        print(f"decode attention: skipped ({triton_decode.why_unusable(device) or 'needs CUDA'})", flush=True)
        return []
    hf = common.model_shape(args.smoke)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    d, page, batch = hf["hidden_size"] // heads, 16, args.batch
    rows = []
    for length in (128, 512, 1024, 3000):
        width = next(w for w in context_buckets(page, 4096) if w >= length)  # the static step's bucket
        per_row = width // page
        pool = torch.randn(2, batch * per_row, page * kv_heads * d, device=device, dtype=dtype)
        k_rows, v_rows = pool[0], pool[1]
        tables = torch.randperm(batch * per_row, device="cpu").view(batch, per_row).tolist()
        layout = DecodeLayout.build(tables, [length] * batch, page_size=page, dtype=dtype, device=device)
        q = torch.randn(batch, heads, d, device=device, dtype=dtype)
        inputs = (q, k_rows, v_rows, layout)
        calls = {
            "gather": functools.partial(decode_attention, *inputs, use_native=False),
            "triton": functools.partial(decode_attention, *inputs, use_triton=True),
        }
        us = {name: _event_us(fn) for name, fn in calls.items()}
        diff = (calls["triton"]()[0].float() - calls["gather"]()[0].float()).abs().max().item()
        print(f"decode attention, length {length} in bucket {width}: {us}", flush=True)
        rows.append(
            {
                "attention": f"{batch} x {heads}/{kv_heads} heads x d {d}, length {length}, bucket {width}",
                "gather_us": us["gather"],
                "triton_us": us["triton"],
                "gather_vs_triton": us["gather"] / us["triton"],
                "max_abs_diff": diff,
            }
        )
    return rows


def _event_us(fn, repeats: int = 50) -> float:
    """Median microseconds per call of `fn`, by CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return common.median(times)


def _compression_rows(args, path: Path, device: torch.device, dtype: torch.dtype, vocab: int) -> list[dict]:
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import METHODS, KVCompressionConfig

    methods = (
        args.policies.split(",") if args.policies else ["none", *sorted(m for m in METHODS if m != "none")]
    )
    prompts = _prompts(args.compression_batch, args.prompt_len, vocab, seed=3)
    budget = max(16, args.compression_gen // 2)  # as bench_rollout: interval budget / 4, window 8
    rates = {}
    for method in methods:
        kv = KVCompressionConfig(method=method, budget=budget, interval=budget // 4, window=8)
        cfg = EngineConfig(
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_running_requests=args.compression_batch,
            kv_compression=kv,
        )
        run = _engine_run(EmbeddedEngine(path, cfg), prompts, args.compression_gen, 0.0)
        rates[method] = _rate(run, device, args.repeats)[0]
        print(f"compression {method}: {rates[method]:,.0f} tokens/s", flush=True)
    base = rates.get("none")
    return [
        {
            "policy": m,
            "budget": None if m == "none" else budget,
            "engine_tok_s": r,
            "vs_none": r / base if base else None,
        }
        for m, r in rates.items()
    ]


def main(argv: list[str]) -> int:
    args = _args(argv)
    device = common.device_for(args.smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = common.environment(device)
    vocab = int(common.model_shape(args.smoke)["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(args, Path(tmp))
        rows = _throughput_rows(args, path, device, dtype, vocab)
        graphs = _graph_rows(args, path, device, dtype, vocab)
        attention = _attention_rows(args, device, dtype)
        compression = _compression_rows(args, path, device, dtype, vocab)
    notes = [f"{dtype}, prompts {args.prompt_len} tokens +-50 %", "wall tokens/s between device syncs"]
    if args.smoke:
        notes.append("SMOKE run: tiny shape, figures mean nothing")
    columns = [("case", "case"), ("engine_tok_s", "engine tok/s"), ("hf_tok_s", "HF tok/s")]
    common.print_table(
        f"engine vs HF generate, {env['device']}", rows, [*columns, ("engine_vs_hf", "engine/HF")]
    )
    columns = [("case", "case"), ("decode", "decode"), ("tok_s", "tok/s"), ("vs_eager_gather", "vs eager")]
    columns += [("identical_to_eager_gather", "identical")]
    common.print_table("decode steps: CUDA graphs or eager, Triton kernel or gather", graphs, columns)
    columns = [("attention", "one layer"), ("gather_us", "gather us"), ("triton_us", "triton us")]
    columns += [("gather_vs_triton", "gather/triton"), ("max_abs_diff", "max |diff|")]
    if attention:
        common.print_table("decode attention: Triton kernel vs gather", attention, columns)
    columns = [("policy", "policy"), ("budget", "budget"), ("engine_tok_s", "tok/s"), ("vs_none", "vs none")]
    common.print_table("compression (budget = half the generated length)", compression, columns)
    print(common.write_record(args.out, "engine", env, rows + graphs + attention + compression, notes))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
