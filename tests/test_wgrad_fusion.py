"""Gradient-accumulation fusion without apex (`fused_weight_gradient_mlp_cuda.py`, called by
megatron-core's linear layers): on CPU the `main_grad` buffers hold the same bits with the fusion
on as with `gradient_accumulation_fusion=False`, over two accumulated micro-batches, fp32 and bf16
parameters. A tied embedding / LM-head matrix gets its two gradients added to `main_grad` one after
the other instead of summed first, so it is bit-equal for one micro-batch in fp32 only."""

from __future__ import annotations

import pytest
import torch
from single_process import cpu_runtime, tiny_qwen2_config

HF = tiny_qwen2_config(num_hidden_layers=1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def rt():
    with cpu_runtime(seed=11) as runtime:
        yield runtime


def _main_grads(rt, hf: dict, dtype: str, fusion: bool, micro_batches: int) -> dict[str, torch.Tensor]:
    import model_providers
    from sparserl_mcore.trainer import learner as learner_lib

    torch.manual_seed(5)
    spec = model_providers.build_spec(hf, rt.parallel, params_dtype=dtype, cpu=True, wgrad_fusion=fusion)
    assert spec.config.gradient_accumulation_fusion is fusion
    model = model_providers.build_model(
        spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups
    )
    ddp = learner_lib.wrap_ddp(model, spec, rt, distributed_optimizer=False)
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(1)
    for _ in range(micro_batches):
        tokens = torch.randint(0, hf["vocab_size"], (2, 12), generator=g)
        logits = ddp(tokens, torch.arange(12).unsqueeze(0), None)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    fc1 = ddp.module.decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.grad_added_to_main_grad is fusion  # megatron took the fused branch (or not)
    return {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_main_grad_is_bit_equal_to_unfused(rt, dtype):
    off = _main_grads(rt, HF, dtype, fusion=False, micro_batches=2)
    on = _main_grads(rt, HF, dtype, fusion=True, micro_batches=2)
    assert off.keys() == on.keys()
    unequal = [name for name in off if not torch.equal(off[name], on[name])]
    assert not unequal, unequal
    assert all(g.abs().sum() > 0 for g in on.values())


def test_tied_embedding_bit_equal_for_one_fp32_micro_batch(rt):
    hf = {**HF, "tie_word_embeddings": True}
    off = _main_grads(rt, hf, "float32", fusion=False, micro_batches=1)
    on = _main_grads(rt, hf, "float32", fusion=True, micro_batches=1)
    assert all(torch.equal(off[name], on[name]) for name in off)
