"""Gradient-accumulation fusion for megatron-core without apex: the weight-gradient GEMM adds
straight into the fp32 `main_grad` buffer.

megatron-core's linear layers (`tensor_parallel/layers.py`, `utils.py`), built with
`TransformerConfig.gradient_accumulation_fusion=True`, import a module of this name (apex's CUDA
extension, a source build) and call `wgrad_gemm_accum_fp32(input, grad_output, main_grad)`
(or `_fp16` for a 16-bit `main_grad`) with 2-D `input` [tokens, in] and `grad_output`
[tokens, out]: `main_grad += grad_output^T @ input`. Megatron then hands autograd a dummy weight
gradient and DDP skips its own `main_grad.add_(param.grad)`: no weight-sized bf16 gradient per
layer and micro-batch, and the sum is accumulated in fp32 inside the GEMM.

This module is that extension in torch, found by name (no patching): on a GPU one `addmm` writing
into `main_grad` (cuBLAS accumulates bf16 products in fp32); on CPU the unfused arithmetic
(`grad_output^T @ input` in the input dtype, then `add_`), so a CPU model gives the same
`main_grad` bits with the fusion on or off (tests/test_wgrad_fusion.py). `model_providers` turns
the fusion on for GPU builds. A top-level module because megatron imports it as one; it imports
torch only, as megatron may import it half-way through its own import.
"""

from __future__ import annotations

import torch


def _accumulate(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    if main_grad.device.type == "cpu":
        main_grad.add_(grad_output.t().matmul(input))
    elif input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), input)
    else:  # bf16/fp16 activations, fp32 main_grad: accumulate in the GEMM's fp32 output
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)


def wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output^T @ input."""
    _accumulate(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp16/bf16) += grad_output^T @ input."""
    _accumulate(input, grad_output, main_grad)
