"""The learner: a megatron-core GPTModel stage wrapped in DDP, its optimizer and LR scheduler.

The algorithm lives in `sparserl_mcore.loss` (forward-only log-probs, the K-epoch update with
DGG); this module only assembles the megatron objects those functions take and that the
checkpoint saves. Parameters are fp32 or bf16 as configured, on CPU as on GPU; Adam keeps fp32
master weights, sharded over DP by megatron's distributed optimizer (the default) or replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import model_providers
from model_providers.moe_config import MoEConfig
from sparserl_mcore.config import OptimizerConfig
from sparserl_mcore.loss.lm_head_grad import leaf_optimizers
from sparserl_mcore.parallel import optim_step
from sparserl_mcore.parallel.runtime import Runtime

PARAMS_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # run config name -> build_spec name


def build_model(
    hf_path: str,
    params_dtype: str,
    runtime: Runtime,
    *,
    padded_vocab_size: int | None = None,
    moe: MoEConfig | None = None,
) -> tuple[model_providers.ModelSpec, torch.nn.Module]:
    """This rank's GPTModel stage on the runtime's device, parameters in `params_dtype` ("fp32" or
    "bf16", on CPU as on GPU), random weights: the caller loads the HF checkpoint into it.
    `padded_vocab_size`: keep a checkpoint's padded vocabulary (a resume at another TP size).
    `moe`: the router training settings of an MoE policy (`model.moe`)."""
    tp = runtime.parallel.tensor_model_parallel_size
    spec = model_providers.build_spec(
        hf_path,
        runtime.parallel,
        params_dtype=PARAMS_DTYPES[params_dtype],
        cpu=runtime.cpu,
        vocab_multiple=padded_vocab_size // tp if padded_vocab_size else 128,
        moe=moe,
    )
    if padded_vocab_size and spec.padded_vocab_size != padded_vocab_size:
        raise ValueError(
            f"padded vocabulary {padded_vocab_size} cannot hold {hf_path}'s vocabulary "
            f"{spec.vocab_size} at TP={tp}"
        )
    model = model_providers.build_model(
        spec,
        device=runtime.device,
        pre_process=runtime.is_first_stage,
        post_process=runtime.is_last_stage,
        pg_collection=runtime.groups,
    )
    return spec, model


def wrap_ddp(
    model: torch.nn.Module, spec: model_providers.ModelSpec, runtime: Runtime, *, distributed_optimizer: bool
) -> DistributedDataParallel:
    """Megatron DDP: contiguous fp32 grad buffers, reduced over DP after the last micro-batch
    (reduce-scattered to the owning ranks with the distributed optimizer)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,  # the trainer skips non-finite updates itself, and logs them
    )
    return DistributedDataParallel(spec.config, ddp_config, model, pg_collection=runtime.groups)


def unwrap_model(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside megatron's DDP / Float16 wrappers (their own sharded_state_dict adds prefixes)."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


class NonFiniteGradGuard:
    """The megatron optimizer, with `prepare_grads` also reporting NaN/Inf gradients, and a step
    whose gradient statistics cost one host sync (`parallel.optim_step`).

    Megatron reports non-finite gradients only through the fp16 loss scaler; with fp32 or bf16
    training its `prepare_grads` always says "fine" and the step would write NaN into the weights.
    Here every rank checks its gradients and the verdict is OR-ed over the optimizer's
    grad-statistics group (megatron's own group for found-inf and the grad norm: the model-parallel
    group, or every rank of the distributed optimizer, whose ranks each hold a shard of the
    gradients; data-parallel replicas without it hold the same reduced gradients), so the update
    step (`sparserl_mcore.loss.megatron_step`) skips the step on every rank alike: no weight, LR or
    DGG state changes. The verdict comes with the grad norm in the same host copy
    (`prepare_and_check`). Everything else is the wrapped optimizer's.
    """

    def __init__(self, optimizer):
        self.optimizer_ = optimizer

    def __getattr__(self, name: str):
        return getattr(self.optimizer_, name)

    def prepare_and_check(self) -> optim_step.GradCheck:
        """megatron's `prepare_grads`, then the non-finite verdict and the grad norm (one sync)."""
        return optim_step.check_grads(self.optimizer_, found_inf=bool(self.optimizer_.prepare_grads()))

    def prepare_grads(self) -> bool:
        return self.prepare_and_check().found_inf

    def step(self) -> tuple[bool, float | None, None]:
        """megatron's `ChainedOptimizer.step` contract (applied, grad norm, zeros not counted), with
        non-finite gradients skipping the step and one host sync in all."""
        check = self.prepare_and_check()
        if check.found_inf:
            return False, None, None
        optim_step.clip_grads(self.optimizer_, check.grad_norm)
        return bool(self.optimizer_.step_with_ready_grads()), check.grad_norm, None


def init_adam_state(optimizer) -> None:
    """Give every parameter of megatron's inner torch Adam the state its first step would create
    (step 0, zero moments): numerically a fresh optimizer.

    Without Apex/TE, megatron's `DistributedOptimizer.state_dict` reads one common 'step' from the
    per-parameter state (`assert len(steps) == 1`), and `sharded_state_dict(is_loading=True)` calls
    it first: a fresh optimizer (empty state) could neither resume nor save before its first update.
    """
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam; TE/Apex keep no 'step'
            continue
        for group in inner.param_groups:
            on_param_device = group.get("capturable") or group.get("fused")
            for p in group["params"]:
                if not inner.state[p]:  # as torch.optim.Adam._init_group creates it
                    step_device = p.device if on_param_device else torch.device("cpu")
                    inner.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32, device=step_device),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def use_fused_adam(optimizer) -> None:
    """Switch megatron's inner torch Adam(W) to torch's fused kernel (one launch per step, the step
    counters on the device: no host read per parameter). Call before `init_adam_state`.

    Megatron uses apex/TE FusedAdam when installed and torch's foreach AdamW otherwise; this is the
    fused one without them. Not bit-identical to foreach (within 1e-6 relative after a few steps on
    CPU, tests/test_optim_step.py), so CPU runs, whose golden tests pin foreach numbers, keep foreach.
    """
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            inner.defaults["fused"], inner.defaults["foreach"] = True, False


def build_optimizer(
    model: DistributedDataParallel,
    cfg: OptimizerConfig,
    spec: model_providers.ModelSpec,
    runtime: Runtime,
    *,
    fused_adam: bool | None = None,
):
    """Megatron Adam(W) over the DDP model, and a constant LR schedule with optional warmup.
    `fused_adam`: torch's fused Adam kernel (`use_fused_adam`); None: on GPU only."""
    bf16 = spec.params_dtype == torch.bfloat16
    opt_cfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,  # on CPU too: parallel/cpu_mode.py makes megatron's clip run there
        bf16=bf16,
        params_dtype=spec.params_dtype,
        use_distributed_optimizer=cfg.distributed,
    )
    megatron_optimizer = get_megatron_optimizer(
        opt_cfg, [model], use_gloo_process_groups=False, pg_collection=runtime.groups
    )
    if fused_adam if fused_adam is not None else not runtime.cpu:
        use_fused_adam(megatron_optimizer)
    init_adam_state(megatron_optimizer)
    optimizer = NonFiniteGradGuard(megatron_optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=cfg.lr_warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
