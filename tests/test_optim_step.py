"""The optimizer step with one host sync (`parallel.optim_step`, the trainer's `NonFiniteGradGuard`,
fused Adam) against megatron-core's own step, in one CPU process over gloo.

- grad norm and clip: bit-equal to megatron's `get_grad_norm()` / `clip_grad_by_total_norm_fp32`;
- fused Adam: within 1e-6 relative of megatron's default (torch's foreach AdamW) after 3 steps;
- host syncs of one optimizer step (guard + fused Adam): exactly 1, where megatron's step reads
  values once per parameter (counted here too, so the pin can fail);
- NaN gradients skip the step on the verdict; finite gradients whose fp32 norm overflows do not.
"""

from __future__ import annotations

import pytest
import torch
from single_process import cpu_runtime, tiny_qwen2_config

HF = tiny_qwen2_config()


@pytest.fixture(scope="module")
def rt():
    with cpu_runtime(seed=7) as runtime:
        yield runtime


def _learner(rt, *, dtype: str, fused_adam: bool, clip_grad: float = 1.0, seed: int = 3):
    import model_providers
    from sparserl_mcore.config import OptimizerConfig
    from sparserl_mcore.trainer import learner as learner_lib

    torch.manual_seed(seed)
    spec = model_providers.build_spec(HF, rt.parallel, params_dtype=dtype, cpu=True)
    model = model_providers.build_model(
        spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups
    )
    ddp = learner_lib.wrap_ddp(model, spec, rt, distributed_optimizer=True)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=clip_grad)
    optimizer, _ = learner_lib.build_optimizer(ddp, cfg, spec, rt, fused_adam=fused_adam)
    return ddp, optimizer


def _backward(ddp, optimizer, seed: int = 0) -> None:
    """One forward/backward into megatron's grad buffers, reduced as its schedule would."""
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, HF["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16).unsqueeze(0)
    logits = ddp(tokens, positions, None)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    finalize_model_grads([ddp])


def _main_grads(optimizer) -> list[torch.Tensor]:
    return [p.grad for leaf in optimizer.chained_optimizers for p in leaf.get_parameters()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_and_clip_are_megatrons_bit_for_bit(rt, dtype):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from sparserl_mcore.parallel import optim_step

    ddp, optimizer = _learner(rt, dtype=dtype, fused_adam=False, clip_grad=0.05)
    _backward(ddp, optimizer)
    inner = optimizer.optimizer_
    check = optim_step.check_grads(inner, found_inf=bool(inner.prepare_grads()))
    assert not check.found_inf
    assert check.grad_norm == inner.get_grad_norm()  # megatron's fallback: a float per parameter
    before = [g.clone() for g in _main_grads(optimizer)]
    optim_step.clip_grads(inner, check.grad_norm)
    ours = [g.clone() for g in _main_grads(optimizer)]
    for g, b in zip(_main_grads(optimizer), before, strict=True):
        g.copy_(b)
    for leaf in inner.chained_optimizers:
        clip_grad_by_total_norm_fp32(leaf.get_parameters(), leaf.config.clip_grad, check.grad_norm)
    assert check.grad_norm > 0.05  # the clip did scale
    assert all(torch.equal(a, b) for a, b in zip(ours, _main_grads(optimizer), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ours, before, strict=True))


def _fixed_grads(ddp, optimizer, step: int) -> None:
    """The same gradients for both optimizers (a backward would feed weight differences back)."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    g = torch.Generator().manual_seed(step)
    for p in ddp.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)


def test_fused_adam_matches_foreach_within_1e_6(rt):
    runs = {}
    for fused in (False, True):
        ddp, optimizer = _learner(rt, dtype="float32", fused_adam=fused)
        inner = optimizer.optimizer_.chained_optimizers[0].optimizer
        assert inner.param_groups[0]["fused"] is (True if fused else None)
        for step in range(3):
            _fixed_grads(ddp, optimizer, step)
            applied, _, _ = optimizer.step()
            assert applied
        runs[fused] = [p.detach().clone() for p in ddp.module.parameters()]
    for a, b in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)
    diff = max((a - b).abs().max().item() for a, b in zip(runs[False], runs[True], strict=True))
    print(f"fused vs foreach AdamW, 3 steps: max |diff| {diff:.3g}")


def test_one_host_sync_per_optimizer_step(rt):
    from sparserl_mcore.parallel.host_syncs import HostSyncCounter

    ddp, optimizer = _learner(rt, dtype="bfloat16", fused_adam=True, clip_grad=0.05)
    _backward(ddp, optimizer)
    with HostSyncCounter() as ours:
        applied, grad_norm, _ = optimizer.step()
    assert applied and grad_norm > 0.05
    assert ours.count == 1, ours.sites
    # megatron's own step over the same optimizer: one value read per parameter (and more)
    _backward(ddp, optimizer)
    with HostSyncCounter() as megatrons:
        optimizer.optimizer_.step()
    params = sum(len(leaf.get_parameters()) for leaf in optimizer.chained_optimizers)
    assert megatrons.count > params, megatrons.sites


def test_nan_skips_the_step_and_an_overflowing_norm_does_not(rt):
    from sparserl_mcore.parallel.host_syncs import HostSyncCounter

    ddp, optimizer = _learner(rt, dtype="float32", fused_adam=True)
    weights = [p.detach().clone() for p in ddp.module.parameters()]
    _backward(ddp, optimizer)
    next(ddp.module.parameters()).main_grad.view(-1)[5] = float("nan")
    with HostSyncCounter() as syncs:
        assert optimizer.step() == (False, None, None)
    assert syncs.count == 2, syncs.sites  # the verdict, then its element-wise confirmation
    assert all(torch.equal(w, p) for w, p in zip(weights, ddp.module.parameters(), strict=True))
    # finite, but the fp32 norm overflows: megatron (and the guard before) step with clipped grads
    _backward(ddp, optimizer)
    next(ddp.module.parameters()).main_grad.view(-1)[5] = 3e38
    applied, grad_norm, _ = optimizer.step()
    assert applied and grad_norm == float("inf")
