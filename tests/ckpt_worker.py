"""Multi-rank half of tests/test_ckpt_convert.py (2 ranks) and tests/test_uneven_pipeline.py.

Reads WORK/plan.json and, re-initialising the parallel runtime for each layout (the runtime keys
each initialisation apart in torchrun's store, so no per-round rendezvous is needed here):
- "roundtrips": HF -> dist checkpoint at (tp, pp) -> HF at (tp2, pp2), files left for the test
  process to compare bit for bit with the source;
- "save_hf": load a bf16 HF checkpoint at TP=1 PP=1 (DP=2: only DP rank 0 may write) and export
  it twice into the same directory with `convert.save_hf` (the trainer's export; the second
  replaces the first), for the test process to compare bit for bit;
- "reshard" (optional): load HF at TP=1, keep logits, save a dist checkpoint; load that at TP=2 and at PP=2
  and save their logits (WORK/logits_*.pt) for the test process to compare.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

PROMPTS = torch.tensor([[3, 17, 42, 5, 99, 12, 7, 64], [1, 2, 3, 4, 5, 6, 7, 8]])


def _runtime(tp: int, pp: int):
    from sparserl_mcore.parallel import ParallelConfig, initialize

    return initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)


def _fresh_dir(rt, path: pathlib.Path) -> pathlib.Path:
    if rt.rank == 0:
        path.mkdir(parents=True)
    dist.barrier()
    return path


def roundtrip(case: dict) -> None:
    from sparserl_mcore.ckpt import convert
    from sparserl_mcore.parallel import shutdown

    rt = _runtime(*case["save_at"])
    try:
        convert.hf_to_mcore(case["hf"], _fresh_dir(rt, pathlib.Path(case["mcore"])), rt)
    finally:
        shutdown()
    rt = _runtime(*case["export_at"])
    try:
        out = _fresh_dir(rt, pathlib.Path(case["out"]))
        convert.mcore_to_hf(case["mcore"], out, rt, max_shard_bytes=case.get("max_shard_bytes", 2**31))
    finally:
        shutdown()


def save_hf_twice(case: dict) -> None:
    from model_providers.gpt import build_model, build_spec
    from sparserl_mcore.ckpt import convert
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import shutdown

    rt = _runtime(1, 1)
    try:
        spec = build_spec(case["hf"], rt.parallel, params_dtype="bfloat16")
        model = build_model(spec, device=rt.device, pre_process=True, post_process=True)
        load_hf_weights(model, layout_for(spec), case["hf"], tp_rank=0, pp_rank=0)
        for _ in range(2):
            convert.save_hf(model, spec, rt, case["out"], hf_config_dir=case["hf"], max_shard_bytes=100_000)
    finally:
        shutdown()


def _logits(model, rt, vocab: int) -> torch.Tensor | None:
    from sparserl_mcore.parallel.forward import forward_logits

    return forward_logits(model, PROMPTS, micro_batch_size=1, vocab_size=vocab, groups=rt.groups)


def reshard(hf_dir: str, work: pathlib.Path) -> None:
    from model_providers.gpt import build_model, build_spec
    from sparserl_mcore.ckpt import convert
    from sparserl_mcore.ckpt.dist_ckpt import load_dist, spec_for_checkpoint
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel import shutdown

    mcore = work / "reshard_mcore"
    rt = _runtime(1, 1)
    try:
        spec = build_spec(hf_dir, rt.parallel)
        model = build_model(spec, device=rt.device, pre_process=True, post_process=True)
        load_hf_weights(model, layout_for(spec), hf_dir, tp_rank=0, pp_rank=0)
        logits = _logits(model, rt, spec.vocab_size)
        if rt.rank == 0:
            torch.save(logits, work / "logits_tp1.pt")
        convert.hf_to_mcore(hf_dir, _fresh_dir(rt, mcore), rt)
    finally:
        shutdown()
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        rt = _runtime(tp, pp)
        try:
            spec = spec_for_checkpoint(mcore, rt.parallel)
            model = build_model(
                spec, device=rt.device, pre_process=rt.is_first_stage, post_process=rt.is_last_stage
            )
            load_dist(model, mcore)
            logits = _logits(model, rt, spec.vocab_size)
            if rt.is_last_stage and rt.tp_rank == 0 and rt.dp_rank == 0:
                torch.save(logits, work / f"logits_reload_tp{tp}_pp{pp}.pt")
        finally:
            shutdown()


def main(work: pathlib.Path) -> int:
    plan = json.loads((work / "plan.json").read_text())
    for case in plan["roundtrips"]:
        roundtrip(case)
    if "save_hf" in plan:
        save_hf_twice(plan["save_hf"])
    if "reshard_hf" in plan:
        reshard(plan["reshard_hf"], work)
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
