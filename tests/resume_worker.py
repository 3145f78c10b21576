"""Multi-rank half of tests/test_resume_layouts.py, one torchrun launch with 2 ranks.

    resume_worker.py CONFIG.yaml OUT_DIR

1. At TP=2, fp32 params (the config's layout): build the trainer's learner, run two RL updates,
   save a training checkpoint (`trainer.checkpoint.save_checkpoint`) and dump the learner's
   weights and optimizer state in HF coordinates (`learner_support`) to OUT_DIR/saved.pt.
2. For each new layout of LAYOUTS the runtime is re-initialised in the same processes; a fresh
   learner is built there (keeping the saved padded vocabulary), loads the checkpoint
   (`load_checkpoint`), dumps the same to OUT_DIR/<name>.pt, then takes one more RL update, whose
   metrics go to OUT_DIR/<name>.json.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import torch

# name -> (TP, PP, params dtype): TP 2 -> 1 with PP 1 -> 2 and fp32 -> bf16; TP 2 -> 1 with DP 1 -> 2
LAYOUTS = {"pp2_bf16": (1, 2, "bf16"), "dp2_fp32": (1, 1, "fp32")}


def _config(cfg, tp: int, pp: int, dtype: str):
    from sparserl_mcore.parallel import ParallelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return dataclasses.replace(
        cfg, parallel=parallel, model=dataclasses.replace(cfg.model, params_dtype=dtype)
    )


def _dump(learner, rt, path: pathlib.Path) -> None:
    from learner_support import model_hf, optimizer_state_hf

    from sparserl_mcore.loss.lm_head_grad import leaf_optimizers

    (leaf,) = leaf_optimizers(learner.optimizer)
    steps = sorted({float(s["step"]) for s in leaf.optimizer.state.values()})
    if len({id(s["step"]) for s in leaf.optimizer.state.values()}) != len(leaf.optimizer.state):
        steps.append(-1.0)  # a 'step' tensor shared between parameters: Adam would count it N times
    state = {"model": model_hf(learner, rt), "adam_steps": steps, **(optimizer_state_hf(learner, rt) or {})}
    if rt.rank == 0:
        torch.save(state, path)


def save_phase(cfg, out: pathlib.Path) -> None:
    from learner_support import rl_update

    from sparserl_mcore.config import to_dict
    from sparserl_mcore.parallel import initialize, shutdown
    from sparserl_mcore.trainer.checkpoint import save_checkpoint
    from sparserl_mcore.trainer.run_layout import requested_layout
    from sparserl_mcore.trainer.setup import build_learner

    rt = initialize(cfg.parallel, seed=cfg.train.seed)
    try:
        learner = build_learner(cfg, rt)
        for seed in (1, 2):
            rl_update(learner, rt, seed)
        layout = requested_layout(cfg, rt.world_size, learner.spec.padded_vocab_size)
        save_checkpoint(
            out / "ckpt",
            2,
            model=learner.model,
            optimizer=learner.optimizer,
            scheduler=learner.scheduler,
            loop_state={"step": 2},
            record={"config": to_dict(cfg), "world_size": rt.world_size, "data": {}, "layout": layout},
        )
        _dump(learner, rt, out / "saved.pt")
    finally:
        shutdown()


def load_phase(cfg, out: pathlib.Path, name: str) -> None:
    from learner_support import rl_update

    from sparserl_mcore.parallel import initialize, shutdown
    from sparserl_mcore.trainer.checkpoint import load_checkpoint
    from sparserl_mcore.trainer.run_layout import requested_layout
    from sparserl_mcore.trainer.run_record import latest_checkpoint, read_saved_run
    from sparserl_mcore.trainer.setup import build_learner

    path = latest_checkpoint(out / "ckpt")
    rt = initialize(cfg.parallel, seed=cfg.train.seed)
    try:
        learner = build_learner(cfg, rt, padded_vocab_size=read_saved_run(path).layout.padded_vocab_size)
        layout = requested_layout(cfg, rt.world_size, learner.spec.padded_vocab_size)
        loop, same = load_checkpoint(
            path,
            model=learner.model,
            optimizer=learner.optimizer,
            scheduler=learner.scheduler,
            layout=layout,
            seed=cfg.train.seed,
            pp_rank=rt.pp_rank,
        )
        _dump(learner, rt, out / f"{name}.pt")
        after = rl_update(learner, rt, seed=3)
        if rt.rank == 0:
            found = {"loop": loop, "rng_restored": same, "layout": layout.describe(), **after}
            (out / f"{name}.json").write_text(json.dumps(found))
    finally:
        shutdown()


def main() -> int:
    from sparserl_mcore.config import load_config

    cfg, out = load_config(sys.argv[1]), pathlib.Path(sys.argv[2])
    save_phase(cfg, out)
    for name, (tp, pp, dtype) in LAYOUTS.items():
        load_phase(_config(cfg, tp, pp, dtype), out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
