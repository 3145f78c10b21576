"""Learner half of tests/test_sglang_trainer_sync.py: the trainer's own learner and `WeightSyncer`
feeding SGLang workers (tests/sglang_dense_world.py) over HTTP.

    torchrun --nproc_per_node 2 tests/sglang_trainer_sync_worker.py CONFIG.yaml OUT_DIR STATES_DIR PORT URL...

PORT "-": full syncs as HTTP fragments; a port: as broadcasts over SGLang's weight-update group
(`sync.broadcast`, gloo, master_address found from the route to the first worker, 48 KiB buckets).

Learner built as `sparserl train` does (`trainer.setup.build_learner`: bf16, TP=2 over gloo), and
`WeightSyncer(remote_server="sglang")`, full syncs cut into 3 pieces per rank: the full sync at
start (v0; worker 1 has a stale
weight-update session open, as left by a trainer that died mid-sync), an RL update and a sparse
sync (v1), then worker 0 is told it holds another version (so its next patch is rejected), an RL
update and a sparse sync (v2: rejected on worker 0, full fallback there); then worker 0 stops,
so v3 fails there twice and drops it, and v4 goes to worker 1 only. After each sync the
learner exports HF safetensors (`Learner.export_hf`, a dense gather independent of the sync) into
STATES_DIR/v<N>.safetensors and the host asks every worker rank to compare its parameters with
SGLang's own `load_weights` of that export (the world's /check route).
Results: OUT_DIR/result.json (host rank).
"""

from __future__ import annotations

import json
import pathlib
import sys


def main() -> int:
    import dataclasses
    import math

    import torch.distributed as dist
    from learner_support import rl_update
    from safetensors.torch import load_file, save_file

    from sparserl_mcore.config import load_config
    from sparserl_mcore.parallel import initialize, shutdown
    from sparserl_mcore.sglang import trainer_sync
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.trainer.setup import broadcast_config, build_learner
    from sparserl_mcore.trainer.weight_sync import WeightSyncer

    out, states, port, urls = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4], sys.argv[5:]
    broadcast = [] if port == "-" else [f"sync.broadcast={{master_port: {port}}}"]  # address: found
    remote = ["rollout.engine=remote", "rollout.server=sglang", f"rollout.urls=[{','.join(urls)}]"]
    cfg = load_config(sys.argv[1], ["model.params_dtype=bf16", *remote, *broadcast])
    rt = initialize(cfg.parallel, seed=cfg.train.seed)
    found: dict = {"events": [], "checks": {}, "patch_bytes": []}
    try:
        learner = build_learner(cfg, rt)
        numel = sum(math.prod(shape) for shape in learner.layout.hf_shapes.values())
        trainer_sync.FULL_CHUNK_ELEMENTS = numel // 5  # a full sync: 3 POSTs per rank and worker
        found["pieces"] = trainer_sync.full_sync_pieces(numel, rt.world_size)
        events = found["events"]
        dense = broadcast_config(cfg, rt)
        if dense is not None:
            dense = dataclasses.replace(dense, bucket_bytes=48 * 1024, timeout_s=120)
        syncer = WeightSyncer(
            learner.model, learner.layout, rt, cfg.sync.codec, lambda k, d: events.append([k, d]),
            remote_urls=cfg.rollout.urls, remote_server=cfg.rollout.server, timeout_s=120, broadcast=dense,
        )  # fmt: skip
        if syncer._broadcast is not None:
            found["buckets"] = len(syncer._broadcast._plan)
        workers = [SGLangWorker(u, retries=0, timeout=120) for u in urls]

        live = list(workers)

        def check(version: int) -> None:
            exported = learner.export_hf(str(out / f"hf{version}"), runtime=rt, source_dir=cfg.model.hf_path)
            if rt.rank == 0:
                state: dict = {}
                for f in sorted(exported.glob("*.safetensors")):
                    state.update(load_file(f))
                save_file(state, str(states / f"v{version}.safetensors"))
                found["checks"][version] = [
                    w._call("POST", "/check", json={"state": f"v{version}"}).json()["message"] for w in live
                ]
            dist.barrier()

        if rt.rank == 0:  # worker 1 has a session left open (as by a trainer that died mid-sync)
            workers[1].begin_weight_update()
        dist.barrier()
        syncer.full_sync([None], version=0)
        check(0)
        found["updates"] = [rl_update(learner, rt, seed=1)["train/updates"]]
        found["patch_bytes"].append(syncer.sync([None], version=1)["sync/patch_bytes"])
        check(1)
        if rt.rank == 0:  # worker 0 now believes it holds v99: the v2 patch (base v1) must be rejected
            w = workers[0]
            w.pause("retract")
            w.begin_weight_update()
            w.declare_version(99, w.tp_size())
            w.end_weight_update()
            w.resume()
        dist.barrier()
        found["updates"].append(rl_update(learner, rt, seed=2)["train/updates"])
        found["patch_bytes"].append(syncer.sync([None], version=2)["sync/patch_bytes"])
        check(2)
        if rt.rank == 0:  # worker 0 stops: v3 fails there twice (sparse, full) and drops it; v4 skips it
            workers[0]._call("POST", "/shutdown", json={})
        live.pop(0)
        dist.barrier()
        seen = len(events)
        for version in (3, 4):
            rl_update(learner, rt, seed=version)
            syncer.sync([None], version=version)
        found["late_events"] = events[seen:]
        check(4)
        if rt.rank == 0:
            (out / "result.json").write_text(json.dumps(found))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
