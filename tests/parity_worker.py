"""Multi-rank half of tests/test_parity.py, run once under torchrun with 2 ranks.

    parity_worker.py OUT_DIR LAYOUTS HF_DIR...      (LAYOUTS e.g. 1x1,2x1,1x2,1x1:bfloat16)

For each layout (TP, PP) (the runtime re-initialised each time; (1, 1) on 2 ranks runs as DP=2) and
every HF checkpoint: build the megatron model with model_providers, load the HF
weights with sparserl_mcore.ckpt (each rank reads its own slices), run forward-only logits through
megatron's schedules (2 micro-batches) and, on the reporting rank, compare with HF transformers
in fp32 on CPU. A layout with a dtype (":bfloat16") builds the megatron model in that dtype and
also reports HF's own error in that dtype on the same device, the yardstick for its tolerance.
Also records each rank's draws from the model-parallel RNG stream and the default stream, so the
test can check megatron's per-TP-rank seeding through the CPU RNG tracker.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

TOKENS = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1234))


def rng_draws(rt) -> list[dict]:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(4).tolist()
    default = torch.rand(4).tolist()
    mine = {
        "tp_rank": rt.tp_rank,
        "pp_rank": rt.pp_rank,
        "model_parallel": model_parallel,
        "default": default,
    }
    draws: list = [None] * rt.world_size
    dist.all_gather_object(draws, mine)
    return draws


def _reporting(rt) -> bool:
    return rt.is_last_stage and rt.tp_rank == 0 and rt.dp_rank == 0


def _hf_logits(hf_dir: str, dtype: torch.dtype, device) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS.to(device)).logits.float().cpu()


def parity(rt, hf_dir: str, dtype: str) -> dict | None:
    from model_providers import build_model, build_spec
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel.forward import forward_logits

    spec = build_spec(hf_dir, rt.parallel, params_dtype=dtype)
    model = build_model(
        spec,
        device=rt.device,
        pre_process=rt.is_first_stage,
        post_process=rt.is_last_stage,
        pg_collection=rt.groups,
    )
    load_hf_weights(model, layout_for(spec), hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
    model.eval()
    tokens = TOKENS.to(rt.device)
    got = forward_logits(model, tokens, micro_batch_size=2, vocab_size=spec.vocab_size, groups=rt.groups)
    if not _reporting(rt):
        return None
    want = _hf_logits(hf_dir, torch.float32, "cpu")  # the fp32 reference, on CPU everywhere
    scale = want.abs().max().item()
    max_abs = (got.float().cpu() - want).abs().max().item()
    found = {
        "backend": dist.get_backend(),
        "device": str(next(model.parameters()).device),
        "shape": list(got.shape),
        "padded_vocab": spec.padded_vocab_size,
        "max_abs": max_abs,
        "max_rel": max_abs / scale,
    }
    if dtype != "float32":  # HF's own error at this dtype, on the same device: the bf16 yardstick
        hf_low = _hf_logits(hf_dir, getattr(torch, dtype), rt.device)
        found["hf_max_rel"] = (hf_low - want).abs().max().item() / scale
    return found


def run_layout(tp: int, pp: int, dtype: str, hf_dirs: list[str]) -> dict | None:
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=7)
    try:
        results = {"rng": rng_draws(rt), "parity": {}}
        for hf_dir in hf_dirs:
            found = parity(rt, hf_dir, dtype)
            if found is not None:
                results["parity"][pathlib.Path(hf_dir).name] = found
        return results if _reporting(rt) else None
    finally:
        shutdown()


def main() -> int:
    out_dir, layouts, hf_dirs = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    reported = {}
    for layout in layouts:  # "TPxPP" (fp32) or "TPxPP:bfloat16"
        sizes, _, dtype = layout.partition(":")
        tp, pp = (int(n) for n in sizes.split("x"))
        key = f"{tp},{pp}" + (f",{dtype}" if dtype else "")
        reported[key] = run_layout(tp, pp, dtype or "float32", hf_dirs)
    reported = {layout: found for layout, found in reported.items() if found is not None}
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(reported))
    return 0


if __name__ == "__main__":
    sys.exit(main())
