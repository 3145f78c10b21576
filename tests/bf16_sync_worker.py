"""Multi-rank half of tests/test_trainer_bf16_sync.py: the trainer's own bf16 learner and sync.

    torchrun --nproc_per_node 2 tests/bf16_sync_worker.py CONFIG.yaml OUT_DIR [KEY=VALUE ...]

Builds the learner exactly as `sparserl train` does (`trainer.setup.build_learner`: bf16 params,
fp32 master weights in megatron's distributed optimizer, TP=2), and the trainer's `WeightSyncer`
feeding a real embedded engine holding bf16 weights (host rank, on the rank's device). After a
full sync, two RL updates (`loss.megatron_step.train_on_batch`, the trainer's update) are each
followed by a sparse sync.
Then the learner exports HF safetensors (`Learner.export_hf`, a dense gather independent of the
sync), and the host compares the engine's weights with that export bit for bit.
Results: OUT_DIR/result.json (host rank).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def main() -> int:
    from learner_support import rl_update
    from safetensors.torch import load_file

    from sparserl_mcore.config import load_config
    from sparserl_mcore.loss.lm_head_grad import leaf_optimizers
    from sparserl_mcore.parallel import initialize, shutdown
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.learner import unwrap_model
    from sparserl_mcore.trainer.setup import build_learner
    from sparserl_mcore.trainer.weight_sync import WeightSyncer

    cfg = load_config(sys.argv[1], ["model.params_dtype=bf16", *sys.argv[3:]])
    out = pathlib.Path(sys.argv[2])
    rt = initialize(cfg.parallel, seed=cfg.train.seed)
    try:
        learner = build_learner(cfg, rt)
        dtypes = {str(p.dtype) for p in unwrap_model(learner.model).parameters()}
        learner_devices = {str(p.device) for p in unwrap_model(learner.model).parameters()}
        events: list = []
        pool = None
        if rt.rank == 0:
            engine = EmbeddedEngine(cfg.model.hf_path, EngineConfig(device=str(rt.device), dtype="bfloat16"))
            pool = EnginePool({"engine": engine}, PoolConfig(), lambda kind, data: events.append(kind))
        syncer = WeightSyncer(
            learner.model, learner.layout, rt, cfg.sync.codec, lambda k, d: events.append(k)
        )
        syncer.full_sync([pool], version=0)
        patch_bytes, updates = [], []
        for version in (1, 2):
            updates.append(rl_update(learner, rt, seed=version)["train/updates"])
            patch_bytes.append(syncer.sync([pool], version=version).get("sync/patch_bytes", 0.0))
        exported = learner.export_hf(str(out / "hf"), runtime=rt, source_dir=cfg.model.hf_path)
        if rt.rank == 0:
            want, base = {}, {}
            for f in sorted(exported.glob("*.safetensors")):
                want.update(load_file(f))
            for f in sorted(pathlib.Path(cfg.model.hf_path).glob("*.safetensors")):
                base.update(load_file(f))
            held = engine.model.params
            result = {
                "devices": sorted({str(rt.device), str(next(iter(held.values())).device), *learner_devices}),
                "learner_dtypes": sorted(dtypes),
                "optimizers": sorted({type(o).__name__ for o in leaf_optimizers(learner.optimizer)}),
                "updates": updates,
                "patch_bytes": patch_bytes,
                "events": events,
                "engine_version": engine.scheduler.weight_version,
                "names_equal": sorted(held) == sorted(want),
                "export_dtypes": sorted({str(t.dtype) for t in want.values()}),
                "mismatched": [n for n in want if n not in held or not _same_bits(held[n].cpu(), want[n])],
                "changed_vs_base": sum(not _same_bits(t, base[n].to(t.dtype)) for n, t in want.items()),
            }
            (out / "result.json").write_text(json.dumps(result))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
