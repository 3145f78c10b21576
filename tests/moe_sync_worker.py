"""Learner half of tests/test_moe_sync.py: per-rank sparse sync of an MoE learner at EP=2 (torchrun).

    torchrun --nproc_per_node 2 tests/moe_sync_worker.py HF_A HF_B OUT_DIR TP,EP [TP,EP ...]

Every rank builds its bf16 stage of the model at EP=2 (TP=1, dense DP=2, expert DP=1), loads
checkpoint A, snapshots it (`ShardSyncer`, per-rank, as the trainer does), loads checkpoint B in
place (B = A with scattered one-ulp changes in every tensor, experts included) and takes
`local_changes()`: its own changed elements, in HF coordinates. Rank 0 writes every rank's changes
(OUT_DIR/changes.pt: the test checks each HF element is reported once and that they are exactly
A -> B), and every rank encodes its fragments for SGLang workers of each (TP, EP) given
(`split_by_receiver(SGLangLayout)` + `encode_fragment`, what `SGLangDelivery` sends) into
OUT_DIR/frag_tp{TP}_ep{EP}_r{SGLang rank}_l{learner rank}.bin.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.distributed as dist


def main() -> None:
    hf_a, hf_b, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    receivers = [tuple(int(x) for x in spec.split(",")) for spec in sys.argv[4:]]
    from model_providers import build_model, build_spec
    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.sglang.layout import SGLangLayout
    from sparserl_mcore.sync.hashing import dtype_name
    from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer, build_sync_groups, runtime_ranges
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment, split_by_receiver

    rt = initialize(ParallelConfig(expert_model_parallel_size=2), seed=0)
    spec = build_spec(hf_a, rt.parallel, params_dtype="bfloat16")
    model = build_model(spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups)
    layout = layout_for(spec)
    shard = {"tp_rank": rt.tp_rank, "pp_rank": rt.pp_rank, "ep_rank": rt.ep_rank}
    load_hf_weights(model, layout, hf_a, **shard)
    syncer = ShardSyncer(
        model,
        layout,
        groups=build_sync_groups(rt),
        owned=runtime_ranges(model, layout, rt),
        version=1,
        config=ShardSyncConfig(mirror=False),
        **shard,
    )
    load_hf_weights(model, layout, hf_b, **shard)
    changes = syncer.local_changes()
    everyone: list = [None] * rt.world_size
    dist.all_gather_object(everyone, [(n, i, o, w) for n, i, o, w in changes])
    if rt.rank == 0:
        torch.save({"changes": everyone, "local_experts": rt.ep_size}, out / "changes.pt")
    meta = ModelMeta(dtype_name(torch.bfloat16), layout.hf_shapes)
    hf = parse_hf_config(hf_a)
    for tp, ep in receivers:
        per_rank = split_by_receiver(changes, SGLangLayout(hf, tp_size=tp, ep_size=ep))
        for r, part in enumerate(per_rank):
            frag = encode_fragment(part, meta, version=2, base_version=1, fragment=(rt.rank, rt.world_size))
            (out / f"frag_tp{tp}_ep{ep}_r{r}_l{rt.rank}.bin").write_bytes(frag)
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
