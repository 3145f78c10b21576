"""torchrun / srun entry of `sparserl convert verify`: megatron logits vs HF transformers logits.

    torchrun --nproc_per_node TP*PP -m sparserl_mcore.launch.verify --hf-dir H --mcore-dir M \
        --tp T --pp P --result R

Every rank builds its stage of the model at (TP, PP), loads the dist checkpoint M and runs a
forward-only pass over fixed prompts in fp32 (NCCL on GPUs, gloo on CPU); the last stage gathers
full-vocab logits. The rank with pp_rank = last and tp_rank = 0 runs HF transformers on H (CPU,
fp32) over the same token ids and writes the comparison (JSON) to R. Prompts are right-padded;
only real-token positions are compared, which the causal mask makes independent of the padding.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Q: What is 17 * 23? A: 391",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Megatron splits layers across pipeline stages and matrices across tensor ranks.",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparserl_mcore.launch.verify")
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--mcore-dir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--result", required=True, help="JSON file written by the reporting rank")
    return parser


def prompt_token_ids(hf_dir: str, vocab_size: int):
    """[B, S] int64 token ids of PROMPTS (right-padded) and their lengths [B].

    Uses the checkpoint's tokenizer; ids at or above `vocab_size` (a tokenizer larger than the
    model) are rejected rather than silently clipped.
    """
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    lengths = torch.tensor([len(ids) for ids in encoded])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(encoded), int(lengths.max())), pad_id, dtype=torch.long)
    for row, ids in enumerate(encoded):
        tokens[row, : len(ids)] = torch.tensor(ids)
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"tokenizer of {hf_dir} produced id {int(tokens.max())} >= vocab_size {vocab_size}")
    return tokens, lengths


def hf_reference_logits(hf_dir: str, tokens):
    """fp32 logits [B, S, V] of HF transformers on `tokens` (causal, no padding mask)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def compare(got, want, lengths) -> dict[str, object]:
    """Max absolute difference over real-token positions, and that relative to max |want|."""
    import torch

    real = torch.arange(got.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)  # [B, S]
    diff = (got - want).abs()[real]
    scale = want.abs()[real].max().item()
    max_abs = diff.max().item()
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / max(scale, 1e-30), "tokens": int(real.sum())}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from sparserl_mcore.ckpt.convert import build_for_load
    from sparserl_mcore.ckpt.dist_ckpt import load_dist, spec_for_checkpoint
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.parallel.forward import forward_logits

    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
    )
    rt = initialize(parallel, seed=0)
    try:
        spec = spec_for_checkpoint(args.mcore_dir, parallel, params_dtype="float32")
        model = build_for_load(spec, rt)
        load_dist(model, args.mcore_dir)
        model.eval()
        tokens, lengths = prompt_token_ids(args.hf_dir, spec.vocab_size)
        tokens_on_device = tokens.to(rt.device)
        got = forward_logits(
            model, tokens_on_device, micro_batch_size=1, vocab_size=spec.vocab_size, groups=rt.groups
        )
        if rt.is_last_stage and rt.tp_rank == 0 and rt.dp_rank == 0:
            assert got is not None, "the last stage holds the logits"
            result: dict[str, object] = compare(got.cpu(), hf_reference_logits(args.hf_dir, tokens), lengths)
            result.update(arch=spec.arch, tp=args.tp, pp=args.pp, ep=args.ep, prompts=len(PROMPTS))
            pathlib.Path(args.result).write_text(json.dumps(result) + "\n")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    from sparserl_mcore.parallel.rank_entry import rank_main

    sys.exit(rank_main(main))
