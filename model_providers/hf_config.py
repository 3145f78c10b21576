"""THE reader of HF config.json files and THE registry of supported architectures.

Pure Python (no torch): the megatron model (`build_spec`), the Megatron <-> HF layout, the
converter, the sparse sync and the rollout engine's own forward (`rollout.engine.hf_model.CausalLM`) all
read one `HFModelConfig`. The registry `ARCHITECTURES` is explicit and keyed by HF `model_type`;
`architectures` class names (e.g. "Qwen2ForCausalLM") resolve through `HF_CLASS_TO_ARCH`; tiny
test checkpoints (`ckpt.tiny`) take their transformers config class from it too.
`HFModelConfig.tensor_shapes()` lists the HF checkpoint's tensors (names and shapes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict


@dataclass(frozen=True, kw_only=True)
class ArchTraits:
    """What distinguishes one registered family from another inside a Llama-style decoder."""

    hf_class: str  # the transformers model class named in config.json's `architectures`
    config_class: str  # the transformers config class (tiny checkpoints are built from it)
    qkv_bias_always: bool = False  # Qwen2: q/k/v projections always carry a bias; others: attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling_types: tuple[str, ...] = ()  # accepted rope_type values besides "default"
    qkv_bias_key: str = "attention_bias"  # the config field that turns q/k/v biases on (when not always)
    qkv_bias_default: bool = False  # its value when the config does not set it
    moe: bool = False  # every decoder layer's MLP is a mixture of experts (`MoEArch`)
    shared_expert: bool = False  # Qwen2-MoE: plus one always-on expert scaled by a sigmoid gate
    # config fields a tiny test checkpoint of the family sets, so tests exercise what is distinctive
    tiny_fields: Mapping[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, ArchTraits] = {
    "qwen2": ArchTraits(
        hf_class="Qwen2ForCausalLM",
        config_class="Qwen2Config",
        qkv_bias_always=True,
        tiny_fields={"rope_theta": 1000000.0},
    ),
    "qwen3": ArchTraits(
        hf_class="Qwen3ForCausalLM",
        config_class="Qwen3Config",
        qk_norm=True,
        tiny_fields={"rope_theta": 1000000.0, "attention_bias": False},
    ),
    "llama": ArchTraits(
        hf_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        rope_scaling_types=("llama3",),
        tiny_fields={
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            "max_position_embeddings": 4096,
        },
    ),
    "qwen3_moe": ArchTraits(
        hf_class="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        qk_norm=True,
        moe=True,
        tiny_fields={"rope_theta": 1000000.0, "attention_bias": False, "norm_topk_prob": True},
    ),
    "qwen2_moe": ArchTraits(
        hf_class="Qwen2MoeForCausalLM",
        config_class="Qwen2MoeConfig",
        qkv_bias_key="qkv_bias",
        qkv_bias_default=True,  # Qwen1.5-MoE / Qwen2-MoE configs predate the field and have biases
        moe=True,
        shared_expert=True,
        tiny_fields={"rope_theta": 1000000.0, "norm_topk_prob": False},
    ),
}
HF_CLASS_TO_ARCH: dict[str, str] = {traits.hf_class: name for name, traits in ARCHITECTURES.items()}


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (HF rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


class LayoutShape(TypedDict):
    """The numbers a parallel layout must divide (`ParallelConfig.validate_model`'s arguments)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int | None
    moe_ffn_hidden_size: int | None


@dataclass(frozen=True, kw_only=True)
class MoEArch:
    """The mixture-of-experts MLP of every decoder layer, as the HF config describes it.

    HF routing (Qwen2-MoE, Qwen3-MoE): probs = softmax(router logits) over all experts, the top-k
    kept, renormalised to sum 1 when `norm_topk_prob`; each token's output is the probs-weighted
    sum of its k experts' SwiGLU MLPs (plus, with a shared expert, sigmoid(gate . x) times the
    shared MLP).
    """

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int  # moe_intermediate_size
    norm_topk_prob: bool
    shared_expert_ffn_hidden_size: int | None = None  # Qwen2-MoE's shared_expert_intermediate_size
    router_aux_loss_coef: float = 0.0  # the HF config's router_aux_loss_coef (training default)


@dataclass(frozen=True, kw_only=True)
class HFModelConfig:
    """The architecture-relevant fields of an HF decoder config, normalised across HF versions."""

    arch: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None  # None when RoPE is unscaled
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float
    moe: MoEArch | None = None  # None: a dense SwiGLU MLP (`ffn_hidden_size`) in every layer
    # generation_config.json's eos_token_id when reading a directory that has one, else config.json's
    eos_token_ids: tuple[int, ...] = ()

    def layout_shape(self) -> LayoutShape:
        """What `ParallelConfig.validate_model` checks a layout against."""
        return {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "num_experts": self.moe.num_experts if self.moe else None,
            "moe_ffn_hidden_size": self.moe.expert_ffn_hidden_size if self.moe else None,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint, by name (a tied lm_head is not one)."""
        h, d = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            a = f"model.layers.{i}."
            shapes[a + "input_layernorm.weight"] = (h,)
            for proj, rows in (
                ("q_proj", self.num_heads * d),
                ("k_proj", self.num_kv_heads * d),
                ("v_proj", self.num_kv_heads * d),
            ):
                shapes[f"{a}self_attn.{proj}.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[f"{a}self_attn.{proj}.bias"] = (rows,)
            if self.qk_norm:
                shapes[a + "self_attn.q_norm.weight"] = (d,)
                shapes[a + "self_attn.k_norm.weight"] = (d,)
            shapes[a + "self_attn.o_proj.weight"] = (h, self.num_heads * d)
            shapes[a + "post_attention_layernorm.weight"] = (h,)
            shapes.update(self._mlp_shapes(a + "mlp."))
        shapes["model.norm.weight"] = (h,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def _mlp_shapes(self, m: str) -> dict[str, tuple[int, ...]]:
        """One layer's MLP tensors under prefix `m` ("model.layers.L.mlp.")."""
        h = self.hidden_size
        if self.moe is None:
            return swiglu_shapes(m, self.ffn_hidden_size, h)
        moe = self.moe
        shapes: dict[str, tuple[int, ...]] = {m + "gate.weight": (moe.num_experts, h)}
        for e in range(moe.num_experts):
            shapes.update(swiglu_shapes(f"{m}experts.{e}.", moe.expert_ffn_hidden_size, h))
        if moe.shared_expert_ffn_hidden_size is not None:
            shapes.update(swiglu_shapes(m + "shared_expert.", moe.shared_expert_ffn_hidden_size, h))
            shapes[m + "shared_expert_gate.weight"] = (1, h)
        return shapes


def swiglu_shapes(prefix: str, ffn: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """gate_proj / up_proj [ffn, hidden] and down_proj [hidden, ffn] under `prefix`."""
    return {
        prefix + "gate_proj.weight": (ffn, hidden),
        prefix + "up_proj.weight": (ffn, hidden),
        prefix + "down_proj.weight": (hidden, ffn),
    }


def resolve_arch(hf: Mapping[str, Any]) -> str:
    """Registry key for an HF config: `model_type` first, then the `architectures` class names."""
    model_type = hf.get("model_type")
    if model_type in ARCHITECTURES:
        return model_type
    for cls in hf.get("architectures") or ():
        if cls in HF_CLASS_TO_ARCH:
            return HF_CLASS_TO_ARCH[cls]
    raise ValueError(
        f"unsupported architecture: model_type={model_type!r}, architectures={hf.get('architectures')!r}; "
        f"supported model_type values: {sorted(ARCHITECTURES)} "
        f"(architectures: {sorted(HF_CLASS_TO_ARCH)})"
    )


def load_hf_config(source: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """An HF config as a dict, from a dict, a config.json path or a checkpoint directory."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _rope(hf: Mapping[str, Any], arch: str) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
    (older config.json files)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ARCHITECTURES[arch].rope_scaling_types:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported for {arch}; supported: "
            f"{['default', *ARCHITECTURES[arch].rope_scaling_types]}"
        )
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing} in the HF config")
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_token_ids(hf: Mapping[str, Any], source: Mapping[str, Any] | str | Path) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if not isinstance(source, Mapping):
        generation = Path(source) / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _check_unsupported(hf: Mapping[str, Any], arch: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported; sliding-window attention is not modelled")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; MLP projections must be bias-free")


def parse_hf_config(source: Mapping[str, Any] | str | Path) -> HFModelConfig:
    """Normalise an HF config (dict, config.json path or checkpoint dir) of a registered family.

    A missing required field or a malformed value is a ValueError naming the field and the source.
    """
    hf = load_hf_config(source)
    where = "the HF config" if isinstance(source, Mapping) else str(source)
    try:
        return _parse(hf, source)
    except KeyError as exc:
        raise ValueError(f"{where}: config.json lacks the required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _parse(hf: dict[str, Any], source: Mapping[str, Any] | str | Path) -> HFModelConfig:
    arch = resolve_arch(hf)
    traits = ARCHITECTURES[arch]
    _check_unsupported(hf, arch)
    theta, scaling = _rope(hf, arch)
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        fields = ", ".join(repr(k) for k in missing)
        raise ValueError(f"config.json lacks the required field{'s' * (len(missing) > 1)} {fields}")
    num_heads = int(hf["num_attention_heads"])
    num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    hidden = int(hf["hidden_size"])
    return HFModelConfig(
        arch=arch,
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=traits.qkv_bias_always or bool(hf.get(traits.qkv_bias_key, traits.qkv_bias_default)),
        qk_norm=traits.qk_norm,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        moe=_moe(hf, traits) if traits.moe else None,
        eos_token_ids=_eos_token_ids(hf, source),
    )


def _moe(hf: Mapping[str, Any], traits: ArchTraits) -> MoEArch:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE config (transformers 5 names Qwen3's expert count
    `num_local_experts`, the Hub's config.json files `num_experts`)."""
    found = hf.get("num_experts") or hf.get("num_local_experts")
    missing = [
        name
        for name, value in (
            ("num_experts", found),
            ("num_experts_per_tok", hf.get("num_experts_per_tok")),
            ("moe_intermediate_size", hf.get("moe_intermediate_size")),
        )
        if not value
    ]
    if missing:
        raise KeyError(missing[0])
    num_experts = int(found or 0)
    dense_layers = list(hf.get("mlp_only_layers") or [])
    if dense_layers or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"mlp_only_layers={dense_layers}, decoder_sparse_step={hf.get('decoder_sparse_step', 1)}: "
            "dense MLP layers between MoE layers are not supported; every layer must be MoE "
            "(mlp_only_layers=[], decoder_sparse_step=1)"
        )
    top_k = int(hf["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    shared = None
    if traits.shared_expert:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared < 1:
            raise ValueError(
                f"shared_expert_intermediate_size={hf.get('shared_expert_intermediate_size')!r}: "
                f"{traits.hf_class} needs its shared expert's width (> 0)"
            )
    return MoEArch(
        num_experts=num_experts,
        top_k=top_k,
        expert_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=shared,
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )


_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
