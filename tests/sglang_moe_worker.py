"""One SGLang TP rank of an MoE worker on CPU (gloo) for tests/test_moe_sync.py; run as a subprocess.

    python tests/sglang_moe_worker.py RANK WORLD PORT EP HF_A HF_B FRAG_DIR OUT_JSON

Builds SGLang 0.5.23's real `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` for this TP rank with
`--ep-size EP` (SGLang's parallel state over gloo: its `FusedMoE` holds this rank's experts as
`w13_weight` / `w2_weight`), loads checkpoint A with SGLang's own `load_weights`, declares version
1, then applies the learner ranks' fragments of version 2 (tests/moe_sync_worker.py) through
SGLang's real `WeightUpdater.update_weights_from_tensor` and our `--custom-weight-loader`.
Reference: a second SGLang model loaded with B by `load_weights`. Then SGLang's own MoE block
forward (its CPU path, `moe_forward_native`: the Triton and AMX kernels are not available here)
runs layer 0 on fixed hidden states with the synced weights, summed over TP, for the test to
compare with HF transformers' block on B; at EP = 1 only: with --ep-size > 1 SGLang's standard
dispatcher marks the other ranks' experts as id -1 in the top-k ids, which `moe_forward_native`
(`layers/moe/fused_moe_native.py`: `cnts.scatter_(1, topk_ids, 1)`) does not handle ("index -1 is
out of bounds"); on GPUs the Triton kernel takes them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sglang_cpu import require_sglang  # noqa: E402
from sglang_tp_worker import init_sglang_parallel, sglang_route, shutdown_sglang_parallel  # noqa: E402

MODEL_CLASSES = {
    "qwen3_moe": "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM",
    "qwen2_moe": "sglang.srt.models.qwen2_moe.Qwen2MoeForCausalLM",
}


def sglang_moe_model(hf_dir: Path):
    import importlib

    import torch
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    module, _, name = MODEL_CLASSES[config.model_type].rpartition(".")
    torch.set_default_dtype(torch.bfloat16)
    model = getattr(importlib.import_module(module), name)(config)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(hf_dir / "model.safetensors").items()}
    model.load_weights(list(state.items()))  # SGLang's own loaders: FusedMoE.weight_loader, ...
    return model


def moe_block_output(model, rank: int):
    """Layer 0's MoE block on fixed hidden states, summed over TP (SGLang reduces it later)."""
    import torch
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.model.layers[0].mlp(hidden.to(torch.bfloat16)).float()
    dist.all_reduce(out, group=get_parallel().tp_group.cpu_group)
    return hidden, out


def main() -> None:
    rank, world, port, ep = (int(a) for a in sys.argv[1:5])
    hf_a, hf_b, frags, out = Path(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7]), Path(sys.argv[8])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    require_sglang()
    init_sglang_parallel(rank, world, port, ep_size=ep)

    import torch

    from sparserl_mcore.sglang.client import patch_payloads, version_payloads

    model, ref = sglang_moe_model(hf_a), sglang_moe_model(hf_b)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    send = sglang_route(model, rank)
    assert send(version_payloads(1, world)) == (True, "Success")
    learners = sorted(
        {int(p.stem.rsplit("_l", 1)[1]) for p in frags.glob(f"frag_tp{world}_ep{ep}_r0_l*.bin")}
    )
    answers = []
    for learner in learners:
        per_rank = [(frags / f"frag_tp{world}_ep{ep}_r{r}_l{learner}.bin").read_bytes() for r in range(world)]
        answers.append(list(send(patch_payloads(per_rank))))
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    mismatched = [
        n for n, p in ref_params.items() if not torch.equal(params[n].view(torch.int16), p.view(torch.int16))
    ]
    changed = [n for n, p in params.items() if not torch.equal(before[n], p)]
    experts = model.model.layers[0].mlp.experts
    if ep == 1:  # SGLang's CPU MoE path cannot run EP > 1 (module docstring)
        hidden, output = moe_block_output(model, rank)
        if rank == 0:
            torch.save({"hidden": hidden, "output": output}, out.with_suffix(".pt"))
    out.write_text(
        json.dumps(
            {
                "answers": answers,
                "learners": learners,
                "version": model._sparserl_receiver.version,
                "mismatched": mismatched,
                "changed": changed,
                "params": sorted(ref_params),
                "w13": list(experts.w13_weight.shape),
                "w2": list(experts.w2_weight.shape),
                "moe_ep_rank": experts.moe_ep_rank,
                "moe_tp_rank": experts.moe_tp_rank,
            }
        )
    )
    shutdown_sglang_parallel()


if __name__ == "__main__":
    main()
