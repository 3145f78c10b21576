"""Inference forward of HF decoder-only models (Qwen2/2.5, Qwen3, Llama 3; the mixtures of experts
Qwen3-MoE and Qwen2-MoE) in plain torch.

The model is described by `model_providers.hf_config.HFModelConfig`, the project's one reader of
HF configs and registry of architectures (the learner's megatron model reads the same one).

Weights stay in HF layout, one tensor per HF name (`CausalLM.params`), so a full state dict or a
sparse sync patch can be applied in place by name. The forward is split into the pieces the
engine's paged attention needs (`qkv`, `finish_layer`, `logits`); `forward_reference` runs the
same pieces with plain causal attention over a whole sequence, optionally masked per layer and KV
head, which the tests use as the dense and the "retained positions only" recompute.

An MoE layer (`MoEWeights`) routes as HF does: softmax over the router logits in fp32, the top-k
experts, renormalised when `norm_topk_prob`, the weights cast to the model dtype; each expert is a
SwiGLU MLP run on the rows routed to it; Qwen2-MoE adds sigmoid(x . g) times its shared expert.
`record_routing(sink)` appends each forward's expert choices to the list `sink` (one entry per
forward: per layer, [T, k] expert ids of the forward's rows), for a caller that wants the sampler's
routing (rollout routing replay, mismatch measurements); `record_routing(None)` stops.

Shape legend: T tokens, D hidden, Hq query heads, Hk KV heads, d head dim, V vocab, E experts,
k experts per token, F expert width.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from model_providers.hf_config import HFModelConfig, parse_hf_config

# The matmuls of one layer. Projections of a group are stored back to back in one tensor so each
# group runs as ONE matmul; the HF-named entries of `CausalLM.params` are views into that tensor, so
# in-place updates by HF name still work. Only q/k/v may carry a bias (`HFModelConfig.qkv_bias`).
LINEARS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


@dataclass(frozen=True, eq=False)
class MoEWeights:
    """One MoE layer's tensors as matmul operands ([in, out], views of `CausalLM.params`)."""

    router: torch.Tensor  # [D, E]
    gate_up: tuple[torch.Tensor, ...]  # per expert [D, 2F]: gate, up back to back
    down: tuple[torch.Tensor, ...]  # per expert [F, D]
    top_k: int
    norm_topk_prob: bool
    shared_gate_up: torch.Tensor | None = None  # Qwen2-MoE's shared expert [D, 2S]
    shared_down: torch.Tensor | None = None  # [S, D]
    shared_gate: torch.Tensor | None = None  # [D, 1]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One layer's tensors, bound once so a step does no name look-ups. Each is the same object as,
    or a view of, a `CausalLM.params` entry, so in-place updates by HF name reach it. Matmul
    operands are [in, out] (`x @ qkv`), views of HF-major storage or input-major contiguous."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3 only
    k_norm: torch.Tensor | None
    qkv: torch.Tensor  # [D, (Hq + 2 Hk) d]: q, k, v projections back to back
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [Hq d, D]
    gate_up: torch.Tensor | None  # [D, 2 I]: gate, up back to back (None: an MoE layer)
    down: torch.Tensor | None  # [I, D]
    moe: MoEWeights | None = None


def load_hf_dir(hf_dir: str | pathlib.Path) -> tuple[HFModelConfig, dict[str, torch.Tensor]]:
    """config.json (+ generation_config.json's eos) and all safetensors shards of an HF checkpoint."""
    root = pathlib.Path(hf_dir)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}/config.json not found: expected an HF checkpoint directory")
    cfg = parse_hf_config(root)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {root}")
    params: dict[str, torch.Tensor] = {}
    for shard in shards:
        params.update(load_file(str(root / shard)))
    return cfg, params


def rope_inv_freq(cfg: HFModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [d/2] (fp32), with Llama 3's frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if not cfg.rope_scaling:
        return inv
    s = cfg.rope_scaling
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_len = float(s.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class CausalLM:
    """Qwen2/Qwen3/Llama decoder over an HF-named parameter dict (no nn.Module: nothing to train)."""

    def __init__(self, cfg: HFModelConfig, params: Mapping[str, torch.Tensor], *, device, dtype) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # fp32 on CPU stores weights input-major ([in, out] contiguous): with MKL, fp32 x @ W ran as
        # fast as or faster (up to 2x at decode row counts) than F.linear's x @ W.T, while bf16 did
        # not gain (bench_rollout's matmul layout table, docs/benchmarks.md). So 16-bit weights keep
        # the HF layout, the one sync patches write in place (see EmbeddedEngine._wire_state).
        self.input_major = self.device.type == "cpu" and dtype == torch.float32
        self.params = self._checked(params)
        self.layers = [self._bind_layer(layer) for layer in range(cfg.num_layers)]
        self.routing_sink: list[list[torch.Tensor]] | None = None  # `record_routing`
        if cfg.tie_embeddings:  # the embedding's rows must stay contiguous for the lookup
            self.head = self.params["model.embed_tokens.weight"].t()
        else:
            self.head = self._pack(["lm_head.weight"])
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self._rope_table = torch.empty(0, 2, 1, cfg.head_dim, dtype=dtype, device=self.device)

    @classmethod
    def from_pretrained(cls, hf_dir: str | pathlib.Path, *, device="cpu", dtype=torch.float32) -> CausalLM:
        cfg, params = load_hf_dir(hf_dir)
        return cls(cfg, params, device=device, dtype=dtype)

    def _checked(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        required = self.cfg.tensor_shapes()
        missing = sorted(set(required) - set(params))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        out = {}
        for name, tensor in params.items():
            shape = required.get(name)
            if shape is None:
                continue  # e.g. rotary inv_freq buffers or a tied lm_head copy: recomputed / shared
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
            out[name] = tensor.to(device=self.device, dtype=self.dtype).contiguous()
        return out

    def _bind_layer(self, layer: int) -> LayerWeights:
        """Pack each LINEARS group of one layer into one tensor (HF names rebound to views)."""
        p = f"model.layers.{layer}."
        mlp = ("gate_up", "down") if self.cfg.moe is not None else ()
        packed = {
            key: self._pack([f"{p}{part}.weight" for part in parts])
            for key, parts in LINEARS.items()
            if key not in mlp or self.cfg.moe is None
        }
        return LayerWeights(
            input_norm=self.params[p + "input_layernorm.weight"],
            post_norm=self.params[p + "post_attention_layernorm.weight"],
            q_norm=self.params.get(p + "self_attn.q_norm.weight"),
            k_norm=self.params.get(p + "self_attn.k_norm.weight"),
            qkv=packed["qkv"],
            qkv_bias=self._pack_qkv_bias(p),
            o=packed["o"],
            gate_up=packed.get("gate_up"),
            down=packed.get("down"),
            moe=self._bind_moe(p + "mlp.") if self.cfg.moe is not None else None,
        )

    def _bind_moe(self, m: str) -> MoEWeights:
        moe = self.cfg.moe
        assert moe is not None
        experts = range(moe.num_experts)
        shared = moe.shared_expert_ffn_hidden_size is not None
        return MoEWeights(
            router=self._pack([m + "gate.weight"]),
            gate_up=tuple(
                self._pack([f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight"])
                for e in experts
            ),
            down=tuple(self._pack([f"{m}experts.{e}.down_proj.weight"]) for e in experts),
            top_k=moe.top_k,
            norm_topk_prob=moe.norm_topk_prob,
            shared_gate_up=self._pack(
                [m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight"]
            )
            if shared
            else None,
            shared_down=self._pack([m + "shared_expert.down_proj.weight"]) if shared else None,
            shared_gate=self._pack([m + "shared_expert_gate.weight"]) if shared else None,
        )

    def _pack_qkv_bias(self, prefix: str) -> torch.Tensor | None:
        """q/k/v biases back to back (when the config has them); their HF names rebound to views."""
        if not self.cfg.qkv_bias:
            return None
        names = [f"{prefix}{part}.bias" for part in LINEARS["qkv"]]
        bias = torch.cat([self.params[n] for n in names])
        for n, view in zip(names, bias.split([self.params[n].shape[0] for n in names]), strict=True):
            self.params[n] = view
        return bias

    def _pack(self, names: list[str]) -> torch.Tensor:
        """Concatenate HF weights [out_i, in] along out; returns the matmul operand [in, sum out_i]."""
        rows = [self.params[n].shape[0] for n in names]
        hf = torch.cat([self.params[n] for n in names])
        if not self.input_major:
            for n, view in zip(names, hf.split(rows), strict=True):
                self.params[n] = view
            return hf.t()
        packed = hf.t().contiguous()
        for n, view in zip(names, packed.split(rows, dim=1), strict=True):
            self.params[n] = view.t()
        return packed

    def update(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the live parameters in place (floating dtypes are cast to the
        model's); all are checked before any is written: ValueError names the first bad one."""
        for name, tensor in state_dict.items():
            if name not in self.params:
                raise ValueError(f"{name!r} is not a parameter of this {self.cfg.arch} model")
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: dtype {tensor.dtype}, expected a floating-point tensor")
            if tuple(tensor.shape) != tuple(self.params[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(self.params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state_dict.items():
                self.params[name].copy_(tensor)

    # ---- forward pieces ------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one op, the same math as the 16-bit path below
            return torch.rms_norm(x, weight.shape, weight, self.cfg.rms_norm_eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, D] residual stream."""
        return F.embedding(ids, self.params["model.embed_tokens.weight"])

    def rope(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, d] for integer positions [T], all < end (`reserve_rope(end)`,
        then `rope_at`)."""
        self.reserve_rope(end)
        return self.rope_at(positions)

    def reserve_rope(self, end: int) -> None:
        """Grow the RoPE table (doubling) to hold positions < end.

        The sign of HF's rotate_half is folded into the sin table: rotate_half(x) * sin ==
        roll(x, d/2) * signed_sin exactly (a sign flip rounds exactly).
        """
        if end > self._rope_table.shape[0]:
            n = max(end, 2 * self._rope_table.shape[0], 256)
            freqs = torch.arange(n, device=self.device).float()[:, None] * self.inv_freq[None, :]
            half = freqs.shape[-1]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, :half].neg_()
            self._rope_table = torch.stack((emb.cos(), sin), dim=1)[:, :, None].to(self.dtype)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, d] looked up in the table (one index_select, no host read:
        the caller reserved the table past every position)."""
        both = self._rope_table.index_select(0, positions)  # [T, 2, 1, d]
        return both[:, 0], both[:, 1]

    def qkv(
        self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE q [T, Hq, d], k [T, Hk, d] and v [T, Hk, d] of `layer` for residual h [T, D]."""
        cfg, w, hq = self.cfg, self.layers[layer], self.cfg.num_heads
        x = self._norm(h, w.input_norm)
        qkv = torch.mm(x, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, x, w.qkv)
        qkv = qkv.view(-1, hq + 2 * cfg.num_kv_heads, cfg.head_dim)
        qk, v = qkv.split_with_sizes([hq + cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
        if w.q_norm is not None and w.k_norm is not None:
            qk = torch.cat((self._norm(qk[:, :hq], w.q_norm), self._norm(qk[:, hq:], w.k_norm)), dim=1)
        # q and k heads rotate together: x * cos + rotate_half(x) * sin, in three ops
        qk = torch.addcmul(qk * cos, qk.roll(cfg.head_dim // 2, -1), sin)
        q, k = qk.split_with_sizes([hq, cfg.num_kv_heads], dim=1)
        return q, k, v

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual + gated-SiLU MLP (or mixture of experts) + residual;
        attn [T, Hq, d]."""
        w = self.layers[layer]
        h = torch.addmm(h, attn.reshape(attn.shape[0], -1), w.o)  # residual add inside the GEMM
        x = self._norm(h, w.post_norm)
        if w.moe is not None:
            return h + self._moe(layer, x, w.moe)
        assert w.gate_up is not None and w.down is not None
        gate, up = torch.mm(x, w.gate_up).chunk(2, dim=-1)
        return torch.addmm(h, F.silu(gate).mul_(up), w.down)

    def record_routing(self, sink: list[list[torch.Tensor]] | None) -> None:
        """Append every forward's expert choices (per layer [T, k]) to `sink`; None: stop."""
        self.routing_sink = sink

    def _moe(self, layer: int, x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
        """The mixture of experts of one layer for normalised rows x [T, D] (HF's routing)."""
        probs = torch.mm(x, w.router).float().softmax(dim=-1)  # [T, E]
        top_p, top_i = probs.topk(w.top_k, dim=-1)  # [T, k]
        if w.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        if self.routing_sink is not None:
            if layer == 0:
                self.routing_sink.append([])
            self.routing_sink[-1].append(top_i)
        weights = top_p.to(x.dtype)
        out = torch.zeros_like(x)
        for e in top_i.unique().tolist():
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            gate, up = torch.mm(x[rows], w.gate_up[e]).chunk(2, dim=-1)
            y = torch.mm(F.silu(gate).mul_(up), w.down[e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if w.shared_gate_up is not None and w.shared_down is not None and w.shared_gate is not None:
            gate, up = torch.mm(x, w.shared_gate_up).chunk(2, dim=-1)
            shared = torch.mm(F.silu(gate).mul_(up), w.shared_down)
            out += torch.sigmoid(torch.mm(x, w.shared_gate)) * shared
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[T, D] -> fp32 logits [T, V]."""
        return (self._norm(h, self.params["model.norm.weight"]) @ self.head).float()

    @torch.no_grad()
    def forward_reference(
        self, ids: torch.Tensor, kv_masks: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Whole-sequence logits [T, V] with causal attention (no KV cache).

        kv_masks: optional per layer bool [Hk, T, T], True where query row t may read key column j
        (intersected with the causal mask). It reproduces a decode that read only some positions,
        because each token's K/V depends only on what that token attended to in lower layers.
        """
        ids = ids.to(self.device)
        T = ids.shape[0]
        cos, sin = self.rope(torch.arange(T, device=self.device), T)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        h = self.embed(ids)
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        for layer in range(self.cfg.num_layers):
            q, k, v = self.qkv(layer, h, cos, sin)
            allowed = causal.expand(self.cfg.num_kv_heads, T, T)
            if kv_masks is not None:
                allowed = allowed & kv_masks[layer].to(self.device)
            qh = q.float().permute(1, 0, 2).reshape(self.cfg.num_kv_heads, group * T, -1)
            scores = qh @ k.float().permute(1, 2, 0) / math.sqrt(self.cfg.head_dim)  # [Hk, g*T, T]
            scores = scores.view(self.cfg.num_kv_heads, group, T, T).masked_fill(~allowed[:, None], -math.inf)
            out = scores.softmax(-1) @ v.float().permute(1, 0, 2)[:, None]  # [Hk, g, T, d]
            attn = out.reshape(self.cfg.num_heads, T, -1).permute(1, 0, 2).to(self.dtype)
            h = self.finish_layer(layer, h, attn)
        return self.logits(h)
