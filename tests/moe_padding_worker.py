"""Worker of tests/test_moe_padding.py: a tiny Qwen3-MoE policy's training forward on one sequence,
unpadded and right-padded, each rank writing its routers' figures.

    python tests/moe_padding_worker.py OUT HF_DIR [--tp T --pp P]   (or under torchrun)

Per rank, three forwards with gradients on (what the training pass runs): the sequence alone; the
sequence right-padded by PAD tokens (21 in all: at TP=2, sequence parallelism pads one more) with
its length given (the padding mask reaches the routers);
and padded without a length (every position counted, the behaviour before the mask). Recorded per
forward: the aux loss (`TorchGatingRouter.take_stats`, summed over this rank's layers), the tokens
per expert per layer, and megatron's z-loss tracker, in OUT/rank{R}.pt.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from model_providers.moe_config import MoEConfig
from sparserl_mcore.ckpt.hf_io import load_hf_weights
from sparserl_mcore.ckpt.layout import layout_for
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.parallel.forward import model_forward, padding_mask, run_schedule
from sparserl_mcore.trainer import learner

# 14 real tokens: no sequence-parallel pad alone; 14 + 7 = 21 padded: SP at TP=2 pads one more
TOKENS = torch.randint(3, 100, (1, 14), generator=torch.Generator().manual_seed(3))
PAD = 7


def routers(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "take_stats")]


def forward(model, tokens: torch.Tensor, lengths: torch.Tensor | None, rt) -> dict:
    """One training pass through megatron's schedule (every stage, a zero loss), as the update runs."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    clear_aux_losses_tracker()
    padding = None if lengths is None else padding_mask(tokens, lengths)

    def step(data_iterator, model):
        output, cut = model_forward(model, next(data_iterator), padding_BT=padding)
        return output, lambda logits: (cut(logits).sum() * 0.0, {})

    seq = tokens.shape[1]
    run_schedule(
        model, [tokens], step, groups=rt.groups, micro_batch_size=1, seq_length=seq, forward_only=False
    )
    stats = [r.take_stats() for r in routers(model)]
    z = get_moe_layer_wise_logging_tracker().get("z_loss", {}).get("values")
    return {
        "tokens_per_expert": torch.stack([s[0] for s in stats]),
        "aux_loss": float(sum(s[1][0] for s in stats)),
        "z_loss": None if z is None else z.detach().clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("hf_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rt = initialize(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp), seed=7
    )
    spec, model = learner.build_model(
        args.hf_dir, "fp32", rt, moe=MoEConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    )
    load_hf_weights(model, layout_for(spec), args.hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
    model.train()
    padded = torch.nn.functional.pad(TOKENS, (0, PAD))
    length = torch.tensor([TOKENS.shape[1]])
    result = {
        "alone": forward(model, TOKENS, None, rt),
        "masked": forward(model, padded, length, rt),
        "unmasked": forward(model, padded, None, rt),
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"pp_rank": rt.pp_rank, **result}, out / f"rank{rt.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
