"""One learner rank of the bucket-assembly test (tests/test_sglang_trainer_sync.py); run by torchrun.

    torchrun --nproc_per_node 2 tests/bucket_reduce_worker.py OUT_DIR

`trainer_sync.BucketReducer` over gloo: each rank owns every other element of each tensor (as
learner ranks own disjoint shares of the HF state); buckets of uneven sizes (a large one before
small ones, so a reused buffer would carry stale bytes). The host records whether each reduced
bucket is bit for bit the whole state's bytes; every rank records the storage of each bucket it
got back. Writes OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist

    from sparserl_mcore.sglang.dense_sync import byte_offsets, plan_buckets
    from sparserl_mcore.sglang.trainer_sync import BucketReducer

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = {"a": (300,), "b": (7,), "c": (64, 5), "d": (3,), "e": (90,)}
    gen = torch.Generator().manual_seed(0)
    state = {
        n: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
        for n, shape in shapes.items()
    }
    plan = plan_buckets([(n, torch.bfloat16, s) for n, s in shapes.items()], 200)
    owned = {}
    for name, bits in state.items():
        idx = torch.arange(rank, bits.numel(), world)
        owned[name] = [(idx, bits.reshape(-1)[idx])]
    reducer = BucketReducer(plan, host_rank=0, device="cpu")
    equal, storages = [], set()
    for bucket in plan:
        flat = reducer.reduce(bucket, owned)
        storages.add(flat.untyped_storage().data_ptr())
        if rank == 0:
            whole = torch.cat([state[n].reshape(-1) for n, _, _ in bucket]).view(torch.uint8)
            equal.append(torch.equal(flat, whole))
    reducer.wait()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "equal": equal,
                "buckets": len(plan),
                "storages": len(storages),
                "buffer_bytes": reducer.buffer.numel(),
                "largest_bucket": max(byte_offsets(b)[-1] for b in plan),
                "state_bytes": sum(t.numel() * 2 for t in state.values()),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
