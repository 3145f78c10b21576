"""HF tensors <-> SGLang's per-TP-rank parameters (sglang 0.5.23, Qwen2 / Qwen3 / Llama), as segments.

SGLang fuses and shards differently from Megatron, so the same `ckpt.layout.Segment` description
gets its own shard builder here; the per-element maps (`to_local_index`, `hf_pieces`, ...) are
`ckpt.layout.SegmentLayout`'s. Read from sglang 0.5.23 (file: symbol):

- `layers/linear.py: QKVParallelLinear.weight_loader`: rank r's `qkv_proj` rows are
  [q heads of r; k heads of r; v heads of r] (concatenated, NOT interleaved per group as in
  Megatron). q rows start at r * (heads / tp) * head_dim; k/v use shard `r // num_kv_head_replicas`
  of `max(1, kv_heads / tp)` heads, where replicas = tp / kv_heads when tp >= kv_heads, else 1.
  The bias follows the same rows.
- `layers/linear.py: MergedColumnParallelLinear.weight_loader`: `gate_up_proj` = [gate shard r;
  up shard r], each intermediate / tp rows.
- `layers/linear.py: RowParallelLinear.weight_loader`: `o_proj` / `down_proj` hold input columns
  [r * cols, (r + 1) * cols).
- `layers/vocab_parallel_embedding.py: VocabParallelEmbedding.__init__` / `weight_loader` /
  `pad_vocab_size`: the vocab is padded to a multiple of 64 (64 * tp when that is not divisible by
  tp); rank r holds padded rows [r * per, (r + 1) * per), the rows past the HF vocab are zero.
  `ParallelLMHead` shards the same way. With `SGLANG_ENABLE_EMBED_REPLICATION` the embedding is
  not sharded (every rank holds the whole padded table).
- `models/qwen2.py: Qwen2ForCausalLM.__init__` (qwen3.py, llama.py alike): with tied embeddings
  and pp_size 1, `lm_head` IS `model.embed_tokens` (one parameter, `model.embed_tokens.weight`).
- Norms (`input_layernorm`, `post_attention_layernorm`, `model.norm`, Qwen3's `q_norm` / `k_norm`)
  are replicated on every rank under their HF names.

Mixtures of experts (Qwen3-MoE, Qwen2-MoE; `models/qwen3_moe.py`, `models/qwen2_moe.py`):
- `runtime_context.py: derive_parallel_ranks`: with `--ep-size` EP (moe_dp_size 1) the TP ranks
  split into EP groups of moe_tp = tp / EP ranks: TP rank r has moe_ep_rank = r // moe_tp and
  moe_tp_rank = r % moe_tp.
- `layers/moe/fused_moe_triton/layer.py: FusedMoE.__init__`, `_map_global_expert_id_to_local_expert_id`:
  rank r holds experts [moe_ep_rank * E / EP, +E / EP) as `mlp.experts.w13_weight`
  [E / EP, 2 * I / moe_tp, h] and `mlp.experts.w2_weight` [E / EP, h, I / moe_tp];
  `_load_w13`: expert j's rows are [gate rows of moe_tp_rank; up rows of moe_tp_rank] (w1 first,
  unless the runner's weight layout says `load_up_proj_weight_first`: refused by the loader);
  `_load_w2`: down_proj's input columns of moe_tp_rank.
- the router `mlp.gate.weight` [E, h] is a `ReplicatedLinear`; Qwen2-MoE's `mlp.shared_expert`
  (gate_up_proj / down_proj, TP-split like the dense MLP) and `mlp.shared_expert_gate.weight`
  [1, h] (replicated) when shared-expert fusion is off (it is, except on AMD aiter / opted-in CUDA).
"""

from __future__ import annotations

import functools

from model_providers.hf_config import HFModelConfig
from sparserl_mcore.ckpt.layout import ParamMap, Segment, SegmentLayout, replicated, vocab_param

VOCAB_PAD = 64  # sglang/srt/layers/vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE


def sglang_padded_vocab(vocab_size: int, tp_size: int) -> int:
    """`VocabParallelEmbedding`'s padded vocab for `tp_size` ranks (no LoRA-added embeddings)."""
    pad = VOCAB_PAD if -(-vocab_size // VOCAB_PAD) * VOCAB_PAD % tp_size == 0 else VOCAB_PAD * tp_size
    return -(-vocab_size // pad) * pad


class SGLangLayout(SegmentLayout):
    """SGLang's parameters of one TP rank (pp_size 1), keyed by SGLang's parameter names."""

    def __init__(
        self, hf: HFModelConfig, *, tp_size: int, replicate_embedding: bool = False, ep_size: int = 1
    ) -> None:
        problems = [
            (
                hf.num_heads % tp_size,
                f"num_attention_heads={hf.num_heads} is not divisible by tp_size={tp_size}",
            ),
            (
                hf.num_kv_heads % tp_size and tp_size % hf.num_kv_heads,
                f"num_key_value_heads={hf.num_kv_heads} and tp_size={tp_size}: neither divides the other",
            ),
            (
                hf.moe is None and hf.ffn_hidden_size % tp_size,
                f"intermediate_size={hf.ffn_hidden_size} is not divisible by tp_size",
            ),
            *_moe_problems(hf, tp_size, ep_size),
        ]
        for failed, message in problems:
            if tp_size < 1 or failed:
                raise ValueError(message if tp_size >= 1 else f"tp_size={tp_size}: must be >= 1")
        self.hf, self.tp_size, self.pp_size, self.ep_size = hf, tp_size, 1, ep_size
        self.replicate_embedding = replicate_embedding
        self.padded_vocab_size = sglang_padded_vocab(hf.vocab_size, 1 if replicate_embedding else tp_size)
        self.kv_heads_per_rank = max(1, hf.num_kv_heads // tp_size)
        self.kv_replicas = tp_size // hf.num_kv_heads if tp_size >= hf.num_kv_heads else 1
        self.hf_shapes = hf.tensor_shapes()
        self._tables = {}

    def __repr__(self) -> str:
        vocab = f"{self.hf.vocab_size}->{self.padded_vocab_size}"
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        return f"SGLangLayout(arch={self.hf.arch}, tp={self.tp_size}{ep}, vocab={vocab})"

    @functools.cache  # noqa: B019 -- one layout per receiver process; ranks are few
    def shard(self, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0) -> dict[str, ParamMap]:
        """TP rank `tp_rank`'s parameters (its expert-parallel rank follows from it: `ep_rank` is
        not a coordinate of SGLang's layout and must be 0)."""
        if not 0 <= tp_rank < self.tp_size or pp_rank != 0 or ep_rank != 0:
            raise ValueError(f"shard (tp_rank={tp_rank}, pp_rank={pp_rank}) is outside {self!r} (pp_size 1)")
        params = [self._vocab("model.embed_tokens.weight", tp_rank)]
        for layer in range(self.hf.num_layers):
            params += self._layer(layer, tp_rank)
        params.append(replicated("model.norm.weight", "model.norm.weight", self.hf.hidden_size, 0))
        if not self.hf.tie_embeddings:
            params.append(self._vocab("lm_head.weight", tp_rank))
        return {p.name: p for p in params}

    def _vocab(self, name: str, tp_rank: int) -> ParamMap:
        ranks = 1 if self.replicate_embedding and name.startswith("model.") else self.tp_size
        rank = 0 if ranks == 1 else tp_rank
        padded = sglang_padded_vocab(self.hf.vocab_size, ranks)
        rows = padded // ranks
        return vocab_param(name, name, rank * rows, rows, self.hf.vocab_size, self.hf.hidden_size)

    def _layer(self, layer: int, r: int) -> list[ParamMap]:
        hf, tp, a = self.hf, self.tp_size, f"model.layers.{layer}."
        h, d = hf.hidden_size, hf.head_dim
        out = [replicated(a + "input_layernorm.weight", a + "input_layernorm.weight", h, 0)]
        kinds = ("weight", "bias") if hf.qkv_bias else ("weight",)
        for kind in kinds:
            segs = self._qkv_segments(a, kind, r)
            rows = sum(s.rows for s in segs)
            out.append(
                ParamMap(
                    f"{a}self_attn.qkv_proj.{kind}", (rows, h) if kind == "weight" else (rows,), segs, True
                )
            )
        if hf.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out.append(replicated(f"{a}self_attn.{norm}.weight", f"{a}self_attn.{norm}.weight", d, 0))
        attn_cols = hf.num_heads * d // tp
        out += [
            ParamMap(
                a + "self_attn.o_proj.weight",
                (h, attn_cols),
                (Segment(a + "self_attn.o_proj.weight", 0, h, 0, r * attn_cols),),
                True,
            ),
            replicated(a + "post_attention_layernorm.weight", a + "post_attention_layernorm.weight", h, 0),
        ]
        if hf.moe is None:
            return out + _merged_mlp(a + "mlp.", a + "mlp.", hf.ffn_hidden_size // tp, h, r)
        return out + self._moe(a + "mlp.", r)

    def _moe(self, m: str, r: int) -> list[ParamMap]:
        """Router, this rank's fused experts (`w13_weight`, `w2_weight`), Qwen2-MoE's shared expert."""
        moe, h = self.hf.moe, self.hf.hidden_size
        assert moe is not None
        moe_tp = self.tp_size // self.ep_size
        ep_rank, tp_rank = r // moe_tp, r % moe_tp
        local, ffn = moe.num_experts // self.ep_size, moe.expert_ffn_hidden_size // moe_tp
        w13, w2 = [], []
        for j in range(local):
            e = f"{m}experts.{ep_rank * local + j}."
            w13 += [
                Segment(e + "gate_proj.weight", 2 * ffn * j, ffn, tp_rank * ffn),
                Segment(e + "up_proj.weight", 2 * ffn * j + ffn, ffn, tp_rank * ffn),
            ]
            w2.append(Segment(e + "down_proj.weight", h * j, h, 0, tp_rank * ffn))
        out = [
            ParamMap(
                m + "gate.weight",
                (moe.num_experts, h),
                (Segment(m + "gate.weight", 0, moe.num_experts),),
                r == 0,
            ),
            ParamMap(m + "experts.w13_weight", (local, 2 * ffn, h), tuple(w13), True, expert=True),
            ParamMap(m + "experts.w2_weight", (local, h, ffn), tuple(w2), True, expert=True),
        ]
        if moe.shared_expert_ffn_hidden_size is not None:
            shared = moe.shared_expert_ffn_hidden_size // self.tp_size
            out += _merged_mlp(m + "shared_expert.", m + "shared_expert.", shared, h, r)
            gate = m + "shared_expert_gate.weight"
            out.append(ParamMap(gate, (1, h), (Segment(gate, 0, 1),), r == 0))
        return out

    def _qkv_segments(self, a: str, kind: str, r: int) -> tuple[Segment, ...]:
        d = self.hf.head_dim
        q_rows = self.hf.num_heads // self.tp_size * d
        kv_rows = self.kv_heads_per_rank * d
        kv_start = (r // self.kv_replicas) * kv_rows
        return (
            Segment(f"{a}self_attn.q_proj.{kind}", 0, q_rows, r * q_rows),
            Segment(f"{a}self_attn.k_proj.{kind}", q_rows, kv_rows, kv_start),
            Segment(f"{a}self_attn.v_proj.{kind}", q_rows + kv_rows, kv_rows, kv_start),
        )


def _merged_mlp(m: str, a: str, ffn: int, hidden: int, r: int) -> list[ParamMap]:
    """`gate_up_proj` = [gate rows of r; up rows of r] (`MergedColumnParallelLinear`) and `down_proj`
    = input columns of r (`RowParallelLinear`) of one SwiGLU MLP at SGLang prefix `m`, HF prefix `a`."""
    return [
        ParamMap(
            m + "gate_up_proj.weight",
            (2 * ffn, hidden),
            (
                Segment(a + "gate_proj.weight", 0, ffn, r * ffn),
                Segment(a + "up_proj.weight", ffn, ffn, r * ffn),
            ),
            True,
        ),
        ParamMap(
            m + "down_proj.weight",
            (hidden, ffn),
            (Segment(a + "down_proj.weight", 0, hidden, 0, r * ffn),),
            True,
        ),
    ]


def _moe_problems(hf: HFModelConfig, tp: int, ep: int) -> list[tuple[bool, str]]:
    if hf.moe is None:
        return [(ep != 1, f"ep_size={ep}: {hf.arch} has no experts")]
    moe = hf.moe
    moe_tp = tp // ep if ep >= 1 and tp % ep == 0 else 0
    shared = moe.shared_expert_ffn_hidden_size or 0
    return [
        (ep < 1 or tp % ep > 0, f"ep_size={ep} does not divide tp_size={tp} (SGLang's --ep-size)"),
        (moe.num_experts % max(ep, 1) > 0, f"num_experts={moe.num_experts} is not divisible by ep_size={ep}"),
        (
            bool(moe_tp) and moe.expert_ffn_hidden_size % moe_tp > 0,
            f"moe_intermediate_size={moe.expert_ffn_hidden_size} is not divisible by tp / ep={moe_tp}",
        ),
        (shared % tp > 0, f"shared_expert_intermediate_size={shared} is not divisible by tp_size={tp}"),
    ]
