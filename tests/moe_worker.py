"""Multi-rank half of tests/test_moe.py: megatron-core MoE over gloo, 4 ranks, one torchrun.

    moe_worker.py OUT_DIR HF_DIR...

Per layout (the runtime re-initialised each time) and every HF checkpoint, the logits of fixed
token ids through megatron's forward-only schedule against HF transformers (fp32), reported by the
rank holding the last stage's tp_rank 0, dp_rank 0:

1. TP=2 x EP=2, all-to-all dispatcher: weights from the HF files; then saved as a dist checkpoint;
2. EP=4 (TP=1, dense DP=4), all-gather dispatcher: weights from that dist checkpoint (experts and
   tensors resharded on the way); then exported as HF safetensors (the test compares them bit for
   bit with the source);
3. PP=2 x EP=2 (dense DP=2, expert DP=1), all-to-all: weights from the HF files.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

TOKENS = torch.randint(0, 100, (4, 15), generator=torch.Generator().manual_seed(1234))  # 15: SP pads
LAYOUTS = {  # name -> (TP, PP, EP, dispatcher, source)
    "tp2_ep2": (2, 1, 2, "alltoall", "hf"),
    "ep4_from_dist": (1, 1, 4, "allgather", "dist"),
    "pp2_ep2": (1, 2, 2, "alltoall", "hf"),
}


def hf_logits(hf_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def reporting(rt) -> bool:
    return rt.is_last_stage and rt.tp_rank == 0 and rt.dp_rank == 0


def load(name: str, hf_dir: str, mcore_dir: pathlib.Path, rt):
    """This rank's stage of the model, from the HF files or the dist checkpoint."""
    from model_providers import build_spec
    from sparserl_mcore.ckpt.convert import build_for_load
    from sparserl_mcore.ckpt.dist_ckpt import load_dist, spec_for_checkpoint
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for

    if LAYOUTS[name][4] == "hf":
        spec = build_spec(hf_dir, rt.parallel, params_dtype="float32")
        model = build_for_load(spec, rt)
        layout = layout_for(spec)
        load_hf_weights(model, layout, hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank, ep_rank=rt.ep_rank)
    else:
        spec = spec_for_checkpoint(mcore_dir, rt.parallel, params_dtype="float32")
        model = build_for_load(spec, rt)
        load_dist(model, mcore_dir)
    return spec, model.eval()


def fresh_dir(path: pathlib.Path, rt) -> pathlib.Path:
    if rt.rank == 0:
        path.mkdir()
    dist.barrier()
    return path


def run_layout(name: str, out: pathlib.Path, hf_dirs: list[str], refs: dict[str, torch.Tensor]) -> dict:
    from sparserl_mcore.ckpt import convert
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.parallel.forward import forward_logits

    tp, pp, ep, dispatcher, _ = LAYOUTS[name]
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
    )
    rt = initialize(par, seed=7)
    found = {}
    try:
        for hf_dir in hf_dirs:
            model_name = pathlib.Path(hf_dir).name
            mcore_dir = out / f"mcore_{model_name}"
            spec, model = load(name, hf_dir, mcore_dir, rt)
            got = forward_logits(
                model, TOKENS, micro_batch_size=2, vocab_size=spec.vocab_size, groups=rt.groups
            )
            if reporting(rt):
                want = refs[model_name]
                experts = {
                    n.split(".local_experts.")[1].split(".")[0]
                    for n, _ in model.named_parameters()
                    if ".local_experts." in n
                }
                found[model_name] = {
                    "max_rel": ((got - want).abs().max() / want.abs().max()).item(),
                    "shape": list(got.shape),
                    "local_experts": len(experts),
                }
            if name == "tp2_ep2":  # the real conversion, HF -> dist checkpoint at this layout
                convert.hf_to_mcore(hf_dir, fresh_dir(mcore_dir, rt), rt)
            if name == "ep4_from_dist":  # and back, resharded: dist checkpoint -> HF at EP=4
                convert.mcore_to_hf(mcore_dir, fresh_dir(out / f"export_{model_name}", rt), rt)
    finally:
        shutdown()
    return found


def main() -> int:
    out, hf_dirs = pathlib.Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ["RANK"])
    refs = {pathlib.Path(d).name: hf_logits(d) for d in hf_dirs}
    reported = {name: run_layout(name, out, hf_dirs, refs) for name in LAYOUTS}
    (out / f"rank{rank}.json").write_text(json.dumps(reported))
    return 0


if __name__ == "__main__":
    sys.exit(main())
