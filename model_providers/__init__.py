"""HF config -> megatron model for the registered decoder families (Qwen2/2.5, Qwen3, Llama 3.x; the
mixtures of experts Qwen3-MoE and Qwen2-MoE).

- `ARCHITECTURES` (hf_config.py): the explicit registry, keyed by HF `model_type`.
- `parse_hf_config(dict | path) -> HFModelConfig` (pure Python).
- `build_spec(hf_config, parallel_cfg, *, params_dtype, vocab_multiple=128) -> ModelSpec` and
  `build_model(spec, *, device, pre_process, post_process) -> GPTModel` (gpt.py; import megatron-core).

The megatron-importing names load lazily, so reading configs stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model_providers.hf_config import ARCHITECTURES, HFModelConfig, MoEArch, parse_hf_config, resolve_arch

if TYPE_CHECKING:
    from model_providers.gpt import ModelSpec, build_model, build_spec, padded_vocab_size

__all__ = [
    "ARCHITECTURES",
    "HFModelConfig",
    "MoEArch",
    "ModelSpec",
    "build_model",
    "build_spec",
    "padded_vocab_size",
    "parse_hf_config",
    "resolve_arch",
]

_LAZY = {"ModelSpec", "build_model", "build_spec", "padded_vocab_size"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from model_providers import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
