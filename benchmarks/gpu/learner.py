"""Learner throughput and MFU of a bf16 train step on one GPU (megatron local spec by default).

The Qwen2.5-0.5B shape, random weights, sequence 2048, bf16 params with fp32 master weights in
megatron's distributed optimizer (the trainer's GPU default), built with the trainer's own
`model_providers.build_model` / `trainer.learner` functions. Two rows per layer spec:
- `fwd+bwd+adam`: megatron's schedule over `--micro-batches` micro-batches of `--micro-batch`
  sequences with the token NLL through the learner's log-probs (the fused head, or with
  `--logprob today` the output layer + vocab-parallel log-probs), then the Adam step: the standard
  training step MFU is quoted for;
- `rl update`: `loss.megatron_step.train_on_batch` as the trainer runs it (K=1): the pi_old
  recompute (forward only) plus the same update with the policy loss, Sparse-RL weights and DGG.
  The sampler's log-probs it corrects against (in a real run they come with the rollouts) are a
  forward pass of the initial weights computed once before the clock starts, not inside the row.
MFU = model FLOPs (common.train_flops_per_token; the rl row adds the recompute's forward third)
per second / the device's dense BF16 peak. `--impls local,transformer_engine` adds megatron's TE
spec when transformer_engine is importable. Adam is torch's fused kernel (as on any GPU run of the
trainer). Two counts per row from one more, untimed call (`parallel.host_syncs`): `syncs/opt` the
host syncs of the optimizer step alone (fwd+bwd+adam row; at most 1), `syncs/step` of the whole
call.

    python -m benchmarks.gpu.learner [--micro-batch 4 --micro-batches 2 --seq 2048]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.gpu import common


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.learner", description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="accumulated per optimizer step")
    p.add_argument("--impls", default="local", help="comma-separated: local, transformer_engine")
    p.add_argument(
        "--logprob", choices=("fused", "today"), default="fused", help="the learner's log-prob path"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's BF16 peak")
    p.add_argument(
        "--profile", action="store_true", help="OUT/learner_profile.txt: where each step's time goes"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shape, runs on CPU (no figures)")
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.micro_batch, args.micro_batches, args.warmup, args.repeats = 64, 2, 2, 1, 2
    return args


def _learner(hf: dict, impl: str, rt, *, lr: float = 1e-6):
    import model_providers
    from sparserl_mcore.config import OptimizerConfig
    from sparserl_mcore.trainer import learner as learner_lib

    spec = model_providers.build_spec(
        hf, rt.parallel, params_dtype="bfloat16", cpu=rt.cpu, transformer_impl=impl
    )
    model = model_providers.build_model(
        spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups
    )
    ddp = learner_lib.wrap_ddp(model, spec, rt, distributed_optimizer=True)
    optimizer, scheduler = learner_lib.build_optimizer(
        ddp, OptimizerConfig(lr=lr, weight_decay=0.0), spec, rt, fused_adam=True
    )
    return spec, ddp, optimizer, scheduler


def _nll_backward(ddp, optimizer, batches: list[torch.Tensor], rt, vocab: int, fused: bool) -> None:
    """Forward and backward over `batches` (micro-batches) with the token NLL, grads reduced."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from sparserl_mcore.loss.fused_head import Head, fused_token_logprobs
    from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs
    from sparserl_mcore.parallel.forward import hidden_forward, run_schedule

    config = get_model_config(ddp)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    head = Head.of(ddp) if fused else None

    def step(data_iterator, model):
        tokens = next(data_iterator)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        if fused:
            output, cut = hidden_forward(model, tokens)
        else:
            output, cut = model(tokens, positions, None), (lambda x: x)

        def loss_func(out: torch.Tensor):
            out = cut(out)
            if head is not None:
                logp = fused_token_logprobs(
                    out, tokens, None, head=head, runtime=rt, temperature=1.0, vocab_size=vocab
                )[0][:, 1:]
            else:
                logp, _ = vocab_parallel_logprobs(
                    out[:, :-1],
                    tokens[:, 1:],
                    group=rt.groups.tp,
                    vocab_start=0,
                    vocab_size=vocab,
                    temperature=1.0,
                )
            loss = -logp.mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    b, s = batches[0].shape
    run_schedule(ddp, batches, step, groups=rt.groups, micro_batch_size=b, seq_length=s, forward_only=False)


def _nll_step(ddp, optimizer, batches: list[torch.Tensor], rt, vocab: int, fused: bool) -> None:
    """One optimizer step over `batches` (micro-batches) with the token NLL."""
    _nll_backward(ddp, optimizer, batches, rt, vocab, fused)
    optimizer.step()


def _optimizer_syncs(ddp, optimizer, batches: list[torch.Tensor], rt, vocab: int, fused: bool) -> int:
    """Host syncs of one optimizer step (prepare, norm, clip, Adam, copy back), after a backward."""
    from sparserl_mcore.parallel.host_syncs import HostSyncCounter

    _nll_backward(ddp, optimizer, batches, rt, vocab, fused)
    with HostSyncCounter() as syncs:
        optimizer.step()
    return syncs.count


def _rl_update(ddp, optimizer, scheduler, batch, rt, micro_batch: int, vocab: int, fused: bool) -> None:
    from sparserl_mcore.loss import megatron_step
    from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate

    cfg = megatron_step.UpdateConfig(micro_batch_size=micro_batch, vocab_size=vocab, fused_logprob=fused)
    gate = DynamicGradientGate(DGGConfig())  # cfg.epochs=1: one update
    megatron_step.train_on_batch(ddp, optimizer, batch, cfg=cfg, gate=gate, runtime=rt, scheduler=scheduler)


def _rl_batch(ddp, tokens: torch.Tensor, rt, micro_batch: int, vocab: int, fused: bool):
    """The update's batch; the sampler log-probs stand-in is one forward pass, run here, untimed."""
    from sparserl_mcore.loss import megatron_step

    logp = megatron_step.compute_logprobs(
        ddp, tokens, micro_batch_size=micro_batch, temperature=1.0, vocab_size=vocab, runtime=rt, fused=fused
    )
    assert logp is not None  # one pipeline stage: it is the last
    mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    mask[:, 0] = 0
    return megatron_step.UpdateBatch(
        tokens_BT=tokens,
        mask_BT=mask,
        advantages_B=torch.randn(tokens.shape[0], device=tokens.device),
        logp_sparse_BT=logp * mask,
    )


def _measure(args, hf: dict, impl: str, rt, peak: float | None) -> list[dict]:
    spec, ddp, optimizer, scheduler = _learner(hf, impl, rt)
    vocab, n = spec.vocab_size, args.micro_batch * args.micro_batches
    g = torch.Generator(device=rt.device).manual_seed(0)
    tokens = torch.randint(0, vocab, (n, args.seq), device=rt.device, generator=g)
    batches = list(tokens.split(args.micro_batch))
    per_token = common.train_flops_per_token(hf, args.seq)
    fused = args.logprob == "fused"
    batch = _rl_batch(ddp, tokens, rt, args.micro_batch, vocab, fused)

    def nll() -> None:
        _nll_step(ddp, optimizer, batches, rt, vocab, fused)

    def rl() -> None:
        _rl_update(ddp, optimizer, scheduler, batch, rt, args.micro_batch, vocab, fused)

    # The rl row's pi_old recompute is a forward pass: a third of the fwd+bwd FLOPs on top; the
    # sampler log-probs stand-in is outside the timed call, so nothing else runs in it.
    runs = {"fwd+bwd+adam": (nll, per_token), "rl update": (rl, per_token * 4 / 3)}
    rows = []
    for name, (fn, flops_per_token) in runs.items():
        times = common.wall_times(fn, rt.device, warmup=args.warmup, repeats=args.repeats)
        step_syncs = _syncs(fn)
        opt_syncs = _optimizer_syncs(ddp, optimizer, batches, rt, vocab, fused) if fn is nll else None
        if args.profile:
            _profile(fn, rt.device, args.out / "learner_profile.txt", f"{impl} {name}")
        seconds = common.median(times)
        tflops = flops_per_token * n * args.seq / seconds / 1e12
        rows.append(
            {
                "spec": impl,
                "step": name,
                "tokens": n * args.seq,
                "step_s": seconds,
                "step_s_min": min(times),
                "tokens_per_s": n * args.seq / seconds,
                "model_tflops": tflops,
                "mfu_pct": 100 * tflops * 1e12 / peak if peak else None,
                "peak_mem_gib": _peak_gib(rt.device),
                "opt_syncs": opt_syncs,
                "step_syncs": step_syncs,
            }
        )
    return rows


def _syncs(fn) -> int:
    from sparserl_mcore.parallel.host_syncs import HostSyncCounter

    with HostSyncCounter() as syncs:
        fn()
    return syncs.count


def _profile(fn, device: torch.device, path: Path, title: str) -> None:
    """Append the top operators of one profiled call of `fn` by self device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        common.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"## {title}\n{table}\n")


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def main(argv: list[str]) -> int:
    from model_providers.layer_specs import te_available
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    args = _args(argv)
    device = common.device_for(args.smoke)
    env = common.environment(device)
    hf = common.model_shape(args.smoke)
    peak = common.peak_bf16_flops(env.get("device", ""), args.peak_tflops) if device.type == "cuda" else None
    rows: list[dict] = []
    notes = [
        f"seq {args.seq}, {args.micro_batches} x {args.micro_batch} sequences per step, "
        f"log-probs: {args.logprob}"
    ]
    rt = initialize(ParallelConfig(), seed=0)
    try:
        for impl in args.impls.split(","):
            if impl == "transformer_engine" and not te_available():
                notes.append("transformer_engine spec skipped: transformer_engine is not importable")
                continue
            rows.extend(_measure(args, hf, impl, rt, peak))
    finally:
        shutdown()
    if peak is None:
        notes.append("MFU not computed: unknown device peak (pass --peak-tflops)")
    if args.smoke:
        notes.append("SMOKE run: tiny shape, figures mean nothing")
    columns = [
        ("spec", "spec"),
        ("step", "step"),
        ("step_s", "s/step"),
        ("tokens_per_s", "tokens/s"),
        ("model_tflops", "TFLOP/s"),
        ("mfu_pct", "MFU %"),
        ("peak_mem_gib", "peak GiB"),
        ("opt_syncs", "syncs/opt"),
        ("step_syncs", "syncs/step"),
    ]
    common.print_table(f"learner, bf16, {env['device']}", rows, columns)
    print(common.write_record(args.out, "learner", env, rows, notes))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
