"""One SGLang TP rank compressing a request of a model with ONE KV head (tests/test_sglang_kv.py).

    python tests/sglang_kv_tp_worker.py RANK WORLD PORT OUT_JSON

SGLang's parallel state over gloo (as tests/sglang_tp_worker.py builds it), SGLang's real pools
with one KV head per rank (at TP=2 the model's single KV head is replicated on both ranks, each
holding 2 of the 4 query heads, as `QKVParallelLinear` cuts them), our plugin's hooks around
SGLang's real decode preparation. The same K/V (seeded) and the same full-width queries on every
rank, each rank's attention seeing its own query heads. Writes, per policy, the K this rank keeps
after the compression and the entries a selection with only its own query heads would keep.
`scenario(method, rank, world)` is also what the TP=1 reference runs in the test process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sglang_cpu import require_sglang  # noqa: E402

METHODS = ("snapkv", "rkv")
STEPS = 5  # decode steps before the budget is reached (more than the window: the ring wraps)


def scenario(method: str, rank: int, world: int) -> dict:
    import torch
    from sglang_kv_world import (
        CFG,
        HQ,
        D,
        L,
        decode_batch,
        decode_step,
        model_runner,
        plugin_hooks,
        world_with_shared_prefix,
    )

    w, _, b = world_with_shared_prefix(kv_heads=1)
    n = b.kv.kv_committed_len - STEPS
    w.rtp.req_to_token[b.kv.req_pool_idx, n : b.kv.kv_committed_len] = 0
    b.kv.kv_committed_len = b.kv.kv_allocated_len = n
    q_local = HQ // world
    hooks = plugin_hooks(method, runner=model_runner(q_heads=q_local, kv_heads=1, total_kv_heads=1))
    batch = decode_batch(w, [b])
    gen = torch.Generator().manual_seed(5)
    heads = slice(rank * q_local, (rank + 1) * q_local)
    for _ in range(STEPS):
        decode_step(hooks, batch, torch.randn(L, 1, HQ, D, generator=gen)[:, :, heads], kv_heads=1)
    entries = w.row(b)
    keys = (
        torch.stack([w.kv.k_buffer[layer][entries] for layer in range(L)]).transpose(1, 2).reshape(L, -1, D)
    )
    window = hooks.ring.window_queries(b.kv.req_pool_idx)
    own_only = hooks.compressor.select(keys, window, CFG["budget"] - CFG["interval"])
    decode_step(hooks, batch, torch.randn(L, 1, HQ, D, generator=gen)[:, :, heads], kv_heads=1)  # compresses
    keep = CFG["budget"] - CFG["interval"]
    kept = w.rtp.req_to_token[b.kv.req_pool_idx, :keep].to(torch.int64)
    return {
        "kept_k": [w.kv.k_buffer[layer][kept].tolist() for layer in range(L)],
        "own_heads_only": own_only.tolist(),
        "evicted": int(hooks.compactor.evicted[b.kv.req_pool_idx]),
    }


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    require_sglang()
    from sglang_tp_worker import init_sglang_parallel, shutdown_sglang_parallel

    init_sglang_parallel(rank, world, port)
    out.write_text(json.dumps({m: scenario(m, rank, world) for m in METHODS}))
    shutdown_sglang_parallel()


if __name__ == "__main__":
    main()
