"""Sparse weight sync on one GPU: diff + encode of real Adam steps vs a dense BF16 safetensors save.

The Qwen2.5-0.5B shape as the trainer builds it (megatron GPTModel, bf16 params, fp32 master
weights in the distributed optimizer), `--steps` Adam steps at `--lr` on the token NLL of random
sequences. Before the first step two learner-side syncers (`sync.learner.ShardSyncer`) snapshot
the weights: one keeps its snapshot on the GPU (`snapshot="device"`: compare where the weights
live, move only changed pairs), one on the host (the CPU default). After each step each makes the
version's patch (diff + HF index mapping + mirror update + xxh3 digests + encode), timed between
device synchronisations, next to `safetensors.save_file` of the same weights' dense BF16 HF
tensors (into the page cache of a temp dir). A receiver holding the initial weights applies every
patch and must end bit-identical to the learner's final weights.

    python -m benchmarks.gpu.sync [--steps 3 --lr 1e-6]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu import common
from benchmarks.gpu.learner import _learner, _nll_step


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.sync", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="tiny shape, runs on CPU (no figures)")
    p.add_argument("--out", type=Path, default=Path("gpu-results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.seq, args.batch, args.lr = 2, 32, 2, 1e-3
    return args


def _syncers(core, layout, optimizer, rt) -> dict:
    from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer

    places = ["device", "host"] if rt.device.type == "cuda" else ["host"]
    return {
        place: ShardSyncer.for_runtime(
            core, layout, rt, optimizer=optimizer, config=ShardSyncConfig(snapshot=place)
        )
        for place in places
    }


def _timed(fn, device):
    common.synchronize(device)
    start = time.perf_counter()
    out = fn()
    common.synchronize(device)
    return out, time.perf_counter() - start


def _step_rows(step: int, syncers: dict, receiver, device, tmp: Path) -> list[dict]:
    from safetensors.torch import save_file

    rows = []
    for place, syncer in syncers.items():
        parts, seconds = _timed(lambda s=syncer: s.make_patch(step), device)
        if place == next(iter(syncers)):
            receiver.apply(parts)
        rows.append(
            {"step": step, "snapshot": place, "encode_s": seconds, "patch_bytes": sum(map(len, parts))}
        )
    mirror = next(iter(syncers.values())).mirror
    _, dense_s = _timed(lambda: save_file(mirror, tmp / "dense.safetensors"), device)
    dense_bytes = (tmp / "dense.safetensors").stat().st_size
    for row in rows:
        row.update(
            dense_save_s=dense_s,
            encode_vs_dense=row["encode_s"] / dense_s,
            dense_bytes=dense_bytes,
            bytes_ratio=dense_bytes / max(row["patch_bytes"], 1),
        )
    return rows


def main(argv: list[str]) -> int:
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.sync.apply import HFReceiver
    from sparserl_mcore.trainer.learner import unwrap_model

    args = _args(argv)
    device = common.device_for(args.smoke)
    env = common.environment(device)
    hf = common.model_shape(args.smoke)
    rows: list[dict] = []
    rt = initialize(ParallelConfig(), seed=0)
    try:
        spec, ddp, optimizer, _ = _learner(hf, "local", rt, lr=args.lr)
        core = unwrap_model(ddp)
        syncers = _syncers(core, layout_for(spec), optimizer, rt)
        first = next(iter(syncers.values()))
        receiver = HFReceiver({n: t.clone() for n, t in first.mirror.items()}, version=0)
        g = torch.Generator(device=rt.device).manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(1, args.steps + 1):
                tokens = torch.randint(
                    0, spec.vocab_size, (args.batch, args.seq), device=rt.device, generator=g
                )
                _nll_step(ddp, optimizer, list(tokens.split(1)), rt, spec.vocab_size)
                rows.extend(_step_rows(step, syncers, receiver, rt.device, Path(tmp)))
        identical = all(
            torch.equal(receiver.state[n].view(torch.int16), t.view(torch.int16))
            for n, t in first.mirror.items()
        )
    finally:
        shutdown()
    notes = [
        f"lr {args.lr}, {args.batch} x {args.seq} tokens per step",
        f"receiver bit-identical: {identical}",
    ]
    if args.smoke:
        notes.append("SMOKE run: tiny shape, figures mean nothing")
    common.print_table(
        f"sparse sync encode vs dense BF16 save, {env['device']}",
        rows,
        [
            ("step", "step"),
            ("snapshot", "snapshot"),
            ("encode_s", "encode s"),
            ("dense_save_s", "dense save s"),
            ("encode_vs_dense", "encode/dense"),
            ("patch_bytes", "patch B"),
            ("bytes_ratio", "dense/patch"),
        ],
    )
    print(common.write_record(args.out, "sync", env, rows, notes))
    return 0 if identical else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
