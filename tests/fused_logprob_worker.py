"""One TP rank of tests/test_loss_fused_logprob.py::test_tensor_parallel_two_ranks_over_gloo.

    torchrun --nproc_per_node 2 tests/fused_logprob_worker.py OUT_DIR

Each rank holds half of the padded head (48 rows, 45 real: rank 1's shard ends in padding ids) and
the same hidden states, runs the fused log-prob at T = 0.8 with both upstream gradients, and writes
OUT_DIR/rank<R>.pt: log-probs, entropies, d_hidden (all-reduced) and its shard of d_weight.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    from test_loss_fused_logprob import inputs

    from sparserl_mcore.loss.fused_logprob import linear_logprobs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, weight, target, g_lp, g_h = inputs(seed=3)
    shard = weight.shape[0] // world
    h = hidden.clone().requires_grad_(True)
    w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    logp, ent = linear_logprobs(
        h,
        w,
        target,
        group=dist.group.WORLD,
        vocab_start=rank * shard,
        vocab_size=45,
        temperature=0.8,
        chunk_bytes=4 * shard * 5,
    )
    ((logp * g_lp).sum() + (ent * g_h).sum()).backward()
    out = {"logp": logp.detach(), "entropy": ent.detach(), "d_hidden": h.grad, "d_weight": w.grad}
    torch.save(out, Path(sys.argv[1]) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
