"""Every model this project builds lives wholly on the runtime's device, in its params dtype.

On a CPU box every default lands on the CPU, so a tensor left behind would stay invisible; the
tests therefore build for the `meta` device, which no allocation reaches by default: whatever was
not placed stays on `cpu` and is caught by name (parameters, buffers and plain tensor attributes
such as RoPE's `inv_freq`). On GPUs this is the bug "weight is on cpu ... _fused_rms_norm" (the
local spec's norms) and, in bf16, fp32 norm weights reaching the BF16 sync. The entry points are
exercised through their own build functions with the runtime's device set to `meta`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from model_providers import ARCHITECTURES, build_model, build_spec
from model_providers.placement import misplaced
from sparserl_mcore.ckpt import convert
from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.trainer import learner as learner_lib

META = torch.device("meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def runtime():
    rt = initialize(ParallelConfig(), seed=3)  # gloo + CPU mode here, NCCL on a GPU box
    yield rt
    shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    return {arch: make_tiny(TinyModelConfig(arch=arch, layers=2), root / arch) for arch in ARCHITECTURES}


def test_megatron_alone_leaves_norms_and_rope_on_the_default_device(runtime, checkpoints):
    """The control: without `place`, megatron's GPTModel keeps what the fix exists for."""
    spec = build_spec(checkpoints["qwen2"], runtime.parallel, params_dtype="bfloat16")
    raw = GPTModel(
        config=spec.config,
        transformer_layer_spec=spec.layer_spec,
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_sequence_length,
        position_embedding_type="rope",
    )
    found = misplaced(raw, META, torch.bfloat16)
    assert any("layernorm.weight on cpu" in f for f in found), found
    assert any("rotary_pos_emb.inv_freq on" in f for f in found), found
    raw.to(META)  # Module.to alone: the norms are now on meta, but inv_freq (a plain attribute) is not
    assert [f for f in misplaced(raw, META) if "inv_freq" in f], "Module.to moved inv_freq: update the docs"
    assert any("layernorm.weight is torch.float32" in f for f in misplaced(raw, META, torch.bfloat16))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_build_model_places_every_tensor(runtime, checkpoints, arch, dtype):
    spec = build_spec(checkpoints[arch], runtime.parallel, params_dtype=dtype)
    model = build_model(spec, device=META, pre_process=True, post_process=True)
    assert misplaced(model, META, DTYPES[dtype]) == []
    rope = model.rotary_pos_emb.inv_freq
    assert rope.device == META and rope.dtype == torch.float32  # RoPE stays fp32, as in megatron


@pytest.mark.parametrize("params_dtype", ["fp32", "bf16"])
def test_trainer_builds_on_the_runtime_device_in_the_configured_dtype(runtime, checkpoints, params_dtype):
    on_meta = dataclasses.replace(runtime, device=META)
    spec, model = learner_lib.build_model(str(checkpoints["llama"]), params_dtype, on_meta)
    assert spec.params_dtype == DTYPES[learner_lib.PARAMS_DTYPES[params_dtype]]
    assert misplaced(model, META, spec.params_dtype) == []


def test_converter_builds_on_the_runtime_device(runtime, checkpoints):
    on_meta = dataclasses.replace(runtime, device=META)
    spec = build_spec(checkpoints["qwen3"], runtime.parallel, params_dtype="bfloat16")
    assert misplaced(convert.build_for_load(spec, on_meta), META, torch.bfloat16) == []


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_gpu_model_config_runs_and_matches_hf_on_cpu(runtime, checkpoints, arch):
    """build_spec(cpu=False), what a GPU run builds (fused bias-SwiGLU and bias-dropout-add, params
    allocated on the current device), run here under the CPU execution mode: same logits as HF."""
    from transformers import AutoModelForCausalLM

    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.parallel.forward import forward_logits

    spec = build_spec(checkpoints[arch], runtime.parallel, params_dtype="float32", cpu=False)
    assert spec.config.bias_activation_fusion and not spec.config.use_cpu_initialization
    model = build_model(spec, device=runtime.device, pre_process=True, post_process=True)
    load_hf_weights(model, layout_for(spec), checkpoints[arch], tp_rank=0, pp_rank=0)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    on_device = tokens.to(runtime.device)
    got = forward_logits(
        model.eval(), on_device, micro_batch_size=1, vocab_size=spec.vocab_size, groups=runtime.groups
    ).cpu()
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
    want = reference(input_ids=tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    positions = torch.arange(12, device=runtime.device).unsqueeze(0)
    # a GPU build accumulates weight gradients straight into main_grad (gradient-accumulation
    # fusion), the fp32 buffer megatron's DDP gives every parameter: given here as DDP would
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    model.train()(on_device, positions, None).float().square().mean().backward()

    def has_gradient(p: torch.nn.Parameter) -> bool:
        if p.grad is not None and p.grad.shape == p.shape and p.grad.abs().sum() > 0:
            return bool(torch.isfinite(p.grad).all())
        return bool(p.main_grad.abs().sum() > 0 and torch.isfinite(p.main_grad).all())

    assert all(has_gradient(p) for p in model.parameters())
