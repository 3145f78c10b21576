"""Per-rank fragments vs the stage-gathered path: bytes and time per learner rank, TP=2 x PP=2 on CPU.

`python -m benchmarks bench_sync_transport [--layers 4 --hidden 896 --vocab 32768 --changed 0.01]`
launches 4 gloo ranks (torchrun, megatron parallel state TP=2 x PP=2). Each rank holds the BF16
Megatron shard of a Qwen2-shaped model (random weights, the layout's own parameter names), then:

- full sync: "gathered" = today's path before this change (each stage source gathers its stage
  densely into an HF mirror, then every mirror goes to rank 0 with gather_object); "per-rank" =
  each rank encodes its owned elements as a full fragment and sends those bytes to rank 0 (the
  embedded engine's process).
- sparse sync after flipping `--changed` of every rank's elements by one ulp: "gathered" =
  (index, value) pairs gathered on each stage source, merged, encoded, fragments gathered on rank
  0; "per-rank" = each rank encodes its own fragment and sends it to rank 0. Also the split of each
  rank's changes for an SGLang TP=2 worker (bytes per receiver rank).
Bytes are the pickled payloads gather_object moves (exact); times are the slowest rank's wall
time of each phase, and the ratio gathered / per-rank measured side by side in the same run.
Results: docs/benchmarks.md, "Sync transport".
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def _hf(args: argparse.Namespace):
    from model_providers.hf_config import HFModelConfig

    return HFModelConfig(
        arch="qwen2", num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_heads=14, num_kv_heads=2, head_dim=args.hidden // 14, vocab_size=args.vocab,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
        tie_embeddings=True, qkv_bias=True, qk_norm=False, initializer_range=0.02,
    )  # fmt: skip


class _Shard(torch.nn.Module):
    """The BF16 parameters of one Megatron (tp, pp) shard under their Megatron names."""

    def __init__(self, layout, tp: int, pp: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1000 * tp + pp)
        self._named = {
            n: torch.nn.Parameter((torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16))
            for n, p in layout.shard(tp, pp).items()
        }

    def named_parameters(self, *args, **kwargs):  # noqa: ANN002, ANN003 - nn.Module's signature
        return iter(self._named.items())


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _flip(model: _Shard, share: float, seed: int) -> None:
    gen = np.random.default_rng(seed)
    for p in model._named.values():
        bits = p.data.view(-1).view(torch.int16).numpy().view(np.uint16)
        idx = gen.choice(bits.size, max(1, int(bits.size * share)), replace=False)
        bits[idx] += gen.choice(np.array([1, 65535], np.uint16), idx.size)  # +-1 ulp (wraps in uint16)


def _gather_size(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def run_rank(args: argparse.Namespace, out: Path) -> None:
    from sparserl_mcore.ckpt.layout import ModelLayout
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.sglang.layout import SGLangLayout
    from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer, build_sync_groups, even_ranges
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment, split_by_receiver

    rt = initialize(
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), backend="gloo"
    )
    try:
        hf = _hf(args)
        layout = ModelLayout(hf, tp_size=2, pp_size=2, padded_vocab_size=-(-hf.vocab_size // 128) * 128)
        model = _Shard(layout, rt.tp_rank, rt.pp_rank)
        groups, owned = build_sync_groups(rt), even_ranges(model, rt.dp_rank, rt.dp_size)

        def syncer(mirror: bool) -> ShardSyncer:
            cfg = ShardSyncConfig(mirror=mirror)
            where = {"tp_rank": rt.tp_rank, "pp_rank": rt.pp_rank}
            return ShardSyncer(model, layout, **where, groups=groups, owned=owned, config=cfg)

        meta, row = ModelMeta("bfloat16", layout.hf_shapes), {"rank": rt.rank}
        sg_layout = SGLangLayout(hf, tp_size=2)
        gathered, row["gathered_mirror_s"] = _timed(lambda: syncer(True))  # the dense stage gather
        row["gathered_mirror_bytes"] = (
            _gather_size([(n, r, c, t.clone()) for n, r, c, t in gathered._pieces()])
            if not gathered.is_source
            else 0
        )
        full = gathered.mirror if gathered.is_source else {}
        _, t = _timed(lambda: dist.gather_object(full, [None] * 4 if rt.rank == 0 else None, dst=0))
        row["gathered_full_bytes"] = row["gathered_mirror_bytes"] + (_gather_size(full) if rt.rank else 0)
        row["gathered_full_s"] = row["gathered_mirror_s"] + t
        per_rank = syncer(False)

        def full_fragment() -> bytes:
            owned_now = [(n, i, None, b) for n, i, b in per_rank.owned_elements()]
            frag = encode_fragment(owned_now, meta, version=0, base_version=None, fragment=(rt.rank, 4))
            dist.gather_object(frag, [None] * 4 if rt.rank == 0 else None, dst=0)
            return frag

        frag, row["per_rank_full_s"] = _timed(full_fragment)
        row["per_rank_full_bytes"] = _gather_size(frag) if rt.rank else 0
        _flip(model, args.changed, seed=rt.rank)

        def gathered_sparse() -> list[bytes]:
            parts = gathered.make_patch(1)  # stage gather of (index, value) pairs, merge, encode
            dist.gather_object(parts, [None] * 4 if rt.rank == 0 else None, dst=0)
            return parts

        parts, row["gathered_sparse_s"] = _timed(gathered_sparse)
        box: dict = {}

        def per_rank_sparse() -> bytes:
            box["changes"] = per_rank.local_changes()
            frag = encode_fragment(box["changes"], meta, version=1, base_version=0, fragment=(rt.rank, 4))
            dist.gather_object(frag, [None] * 4 if rt.rank == 0 else None, dst=0)
            return frag

        frag, row["per_rank_sparse_s"] = _timed(per_rank_sparse)
        changes = box["changes"]
        pairs = [(n, i, w) for n, i, _, w in changes]
        row["changed"] = int(sum(i.size for _, i, _, _ in changes))
        row["gathered_sparse_bytes"] = (0 if gathered.is_source else _gather_size(pairs)) + (
            _gather_size(parts) if rt.rank else 0
        )
        row["per_rank_sparse_bytes"] = _gather_size(frag) if rt.rank else 0
        row["per_rank_fragment_bytes"] = len(frag)
        row["gathered_fragment_bytes"] = sum(len(p) for p in parts)
        per_worker_rank = split_by_receiver(changes, sg_layout)
        row["sglang_tp2_bytes"] = [
            len(encode_fragment(c, meta, version=1, base_version=0, fragment=(rt.rank, 4)))
            for c in per_worker_rank
        ]
        out.joinpath(f"rank{rt.rank}.json").write_text(json.dumps(row))
    finally:
        shutdown()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_sync_transport", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--ffn", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--changed", type=float, default=0.01, help="share of elements flipped per step")
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_out:
        run_rank(args, Path(args.rank_out))
        return 0
    from sparserl_mcore.parallel.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        launch_local([__file__, *argv, "--rank-out", tmp], 4, timeout=1800)
        rows = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(4)]
    _report(rows, args)
    return 0


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    """Markdown: bytes each rank sends, per phase and path; slowest-rank times as ratios."""
    print(
        f"layers={args.layers} hidden={args.hidden} ffn={args.ffn} vocab={args.vocab} changed={args.changed}"
    )
    print("| rank | full: gathered B | full: per-rank B | sparse: gathered B | sparse: per-rank B | "
          "SGLang TP=2 fragments B |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['gathered_full_bytes']:,} | {r['per_rank_full_bytes']:,} | "
              f"{r['gathered_sparse_bytes']:,} | {r['per_rank_sparse_bytes']:,} | "
              f"{' / '.join(f'{b:,}' for b in r['sglang_tp2_bytes'])} |")  # fmt: skip
    tot = {
        k: sum(r[k] for r in rows) for k in rows[0] if k.endswith("_bytes") and isinstance(rows[0][k], int)
    }
    print(f"| total | {tot['gathered_full_bytes']:,} | {tot['per_rank_full_bytes']:,} | "
          f"{tot['gathered_sparse_bytes']:,} | {tot['per_rank_sparse_bytes']:,} | |")  # fmt: skip
    changed = sum(r["changed"] for r in rows)
    frag = sum(r["per_rank_fragment_bytes"] for r in rows)
    print(
        f"changed elements {changed:,}; encoded bytes per changed element: per-rank "
        f"{frag / changed:.3f}, gathered {sum(r['gathered_fragment_bytes'] for r in rows) / changed:.3f}"
    )
    for phase in ("full", "sparse"):
        g = max(r[f"gathered_{phase}_s"] for r in rows)
        p = max(r[f"per_rank_{phase}_s"] for r in rows)
        print(f"{phase}: slowest rank gathered / per-rank time = {g / p:.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
