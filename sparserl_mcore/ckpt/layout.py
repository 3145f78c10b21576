"""THE one place that knows how Megatron GPTModel parameters map to HF tensors, per TP/PP shard.

Every local parameter of a (tp_rank, pp_rank) shard is described as a stack of row `Segment`s:
local rows [local_row, local_row + rows) hold HF tensor `hf_name` rows [hf_row, hf_row + rows),
columns [hf_col, hf_col + local_cols). That one shape covers every layout Megatron uses:

- column-parallel (split on dim 0): QKV, fc1, embedding, output layer;
- row-parallel (split on dim 1): linear_proj (o_proj) and linear_fc2 (down_proj), via `hf_col`;
- QKV interleave: for each query group of this TP rank, [q heads of the group; k; v] (bias alike);
- fc1 = [gate_shard; up_shard] on every TP rank;
- vocab padding: rows past the HF vocab are a segment with `hf_name=None` (zero on load, dropped
  on export);
- replicated params (norms, q/k layernorm) live on every TP rank but are emitted by tp_rank 0 only;
  tied embeddings are emitted once, from `embedding.word_embeddings` (the last stage's
  `output_layer.weight` under PP > 1 is a copy: loaded, never emitted);
- PP: stage p holds `stage_layers[p]` decoder layers (`ParallelConfig.stage_layers`: megatron's
  first/last/middle split, uneven when P does not divide the layer count); its local layer i is
  global layer `layer_offset(p) + i`, as megatron's `get_transformer_layer_offset` numbers them.

`SegmentLayout` holds the index arithmetic any segment-described layout shares (SGLang's fused
layout in `sparserl_mcore.sglang.layout` reuses it); `ModelLayout` is Megatron's.

Public API (the converter and the sparse sync call these):
    layout = ModelLayout(hf_cfg, tp_size=T, pp_size=P, padded_vocab_size=Vp)   # hf_cfg: HFModelConfig
    layout = ModelLayout(..., stage_layers=(3, 2))     # an explicit split (default: the balanced one)
    layout = layout_for(model_spec)                    # same, from model_providers.build_spec(...)
    layout.hf_shapes                                   # {hf_name: shape} of the HF checkpoint
    layout.shard(tp_rank, pp_rank)                     # {mcore_name: ParamMap}
    layout.fill_local(param_map, out, read)            # load one local param from HF slices
    layout.hf_pieces(param_map, local)                 # (hf_name, rows, cols, view) to export
    layout.to_hf_index(mcore_name, local_flat_idx, tp_rank, pp_rank)
        -> [(hf_name, positions, hf_flat_idx)]         # emitted elements only: each HF element once
    layout.to_local_index(hf_name, hf_flat_idx, tp_rank, pp_rank)
        -> [(mcore_name, positions, local_flat_idx)]   # every copy held by this shard
`positions` index into the query tensor; all indices are int64 1-D tensors; flat indices are
row-major over the local (resp. HF) tensor. Both per-element maps are index arithmetic
(searchsorted over a param's few segments), never a per-element table.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from model_providers.hf_config import HFModelConfig
from sparserl_mcore.parallel.config import ParallelConfig

if TYPE_CHECKING:
    import torch

    from model_providers.gpt import ModelSpec

# Reads HF tensor `name`, rows `rows`, columns `cols` (None for 1-D tensors) -> tensor of that slice.
SliceReader = Callable[[str, slice, "slice | None"], "torch.Tensor"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Local rows [local_row, +rows) = HF `hf_name` rows [hf_row, +rows), cols [hf_col, +local cols)."""

    hf_name: str | None  # None: vocab padding rows, no HF source
    local_row: int
    rows: int
    hf_row: int = 0
    hf_col: int = 0


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One local Megatron parameter of a shard and where its rows come from."""

    name: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]  # ascending local_row, covering every local row once
    emit: bool  # False: a replica (tp_rank > 0 norm, tied output copy) that export skips
    expert: bool = False  # a routed expert's weight: laid out on megatron's expert grid (EP x ETP)

    @property
    def cols(self) -> int:
        """Columns of the row view (a 3-D param, e.g. SGLang's fused experts, is its rows stacked)."""
        return self.shape[-1] if len(self.shape) >= 2 else 1

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.hf_name for s in self.segments if s.hf_name is not None))


@dataclasses.dataclass(frozen=True)
class FlatTable:
    """Segment table of a flat index space over param slices (`SegmentLayout.flat_table`).

    Row k: flat [start, start + length) holds HF tensor `tensor` (an index into sorted HF names;
    -1: nothing, a hole) with flat index f at local flat f - shift of a param of `cols` columns, i.e.
    HF flat ((f - shift) // cols + row_offset) * hf_cols + hf_col + (f - shift) % cols. Each row is
    increasing in HF order; `hf_rank` orders the rows by (tensor, first HF index), holes last, and
    rows of one tensor never interleave in HF order (checked), so changed flat indices grouped by
    row in `hf_rank` order come out sorted by (tensor, HF index) without a sort.
    """

    COLUMNS = ("start", "length", "shift", "cols", "row_offset", "hf_col", "hf_cols", "tensor")

    rows: tuple[tuple[int, ...], ...]
    tensors: int

    def _hf(self, row: tuple[int, ...], f: int) -> int:
        local = f - row[2]
        return (local // row[3] + row[4]) * row[6] + row[5] + local % row[3]

    @functools.cached_property
    def hf_rank(self) -> list[int]:
        real = sorted((r[7], self._hf(r, r[0]), k) for k, r in enumerate(self.rows) if r[7] >= 0)
        for (tensor, _, a), (other, first, _) in itertools.pairwise(real):
            last = self._hf(self.rows[a], self.rows[a][0] + self.rows[a][1] - 1)
            if tensor == other and last >= first:
                raise ValueError(f"flat_table: segments of HF tensor #{tensor} interleave in HF order")
        order = [k for *_, k in real] + [k for k, r in enumerate(self.rows) if r[7] < 0]
        rank = [0] * len(self.rows)
        for position, k in enumerate(order):
            rank[k] = position
        return rank

    def columns(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The rows as int64 columns on `device`, plus `hf_rank`."""
        import torch

        cols = {name: torch.tensor([r[i] for r in self.rows], dtype=torch.int64, device=device)
                for i, name in enumerate(self.COLUMNS)}  # fmt: skip
        cols["hf_rank"] = torch.tensor(self.hf_rank, dtype=torch.int64, device=device)
        return cols

    @staticmethod
    def to_hf(cols: dict[str, torch.Tensor], row: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """HF flat indices of flat indices `flat` lying in rows `row` (holes give garbage)."""
        local = flat - cols["shift"][row]
        width = cols["cols"][row]
        r = local.div(width, rounding_mode="floor")
        return (
            (r + cols["row_offset"][row]) * cols["hf_cols"][row] + cols["hf_col"][row] + (local - r * width)
        )


class SegmentLayout:
    """The per-element and whole-tensor maps every segment-described layout shares.

    A subclass says which parameters a shard holds (`shard`) and sets `hf_shapes`, `tp_size`,
    `pp_size`; the index arithmetic over `Segment`s lives here once. `ModelLayout` is Megatron's
    layout; `sparserl_mcore.sglang.layout.SGLangLayout` is SGLang's (fused qkv_proj / gate_up_proj).
    """

    hf_shapes: dict[str, tuple[int, ...]]
    tp_size: int
    pp_size: int
    _tables: dict[tuple[ParamMap, str | None, str], dict]

    def shard(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, ParamMap]:
        raise NotImplementedError

    def shard_keys(self) -> list[tuple[int, ...]]:
        """Every shard's coordinates, as `shard(*key)` takes them: (tp, pp), or (tp, pp, ep) when
        experts are split over expert-parallel ranks."""
        return [(tp, pp) for tp in range(self.tp_size) for pp in range(self.pp_size)]

    @functools.cache  # noqa: B019
    def _hf_index(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, list[ParamMap]]:
        """hf_name -> the shard's params holding (a part of) it, replicas included."""
        index: dict[str, list[ParamMap]] = {}
        for param in self.shard(tp_rank, pp_rank, ep_rank).values():
            for name in param.hf_names:
                index.setdefault(name, []).append(param)
        return index

    def param(self, mcore_name: str, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> ParamMap:
        shard = self.shard(tp_rank, pp_rank, ep_rank)
        if mcore_name not in shard:
            raise KeyError(
                f"{mcore_name!r} is not a parameter of shard (tp_rank={tp_rank}, pp_rank={pp_rank}, "
                f"ep_rank={ep_rank}) of {self!r}; it has {len(shard)}, e.g. {sorted(shard)[:4]}"
            )
        return shard[mcore_name]

    # ---- whole-shard path -------------------------------------------------------------------------

    def fill_local(self, param: ParamMap, out: torch.Tensor, read: SliceReader) -> None:
        """Fill local tensor `out` (shape `param.shape`) from HF slices; padding rows become zero."""
        if tuple(out.shape) != param.shape:
            raise ValueError(
                f"{param.name}: local tensor has shape {tuple(out.shape)}, layout expects {param.shape}"
            )
        out = _row_view(out)
        for seg in param.segments:
            dst = out[seg.local_row : seg.local_row + seg.rows]
            if seg.hf_name is None:
                dst.zero_()
                continue
            cols = slice(seg.hf_col, seg.hf_col + param.cols) if out.dim() == 2 else None
            dst.copy_(read(seg.hf_name, slice(seg.hf_row, seg.hf_row + seg.rows), cols))

    def hf_pieces(
        self, param: ParamMap, local: torch.Tensor
    ) -> Iterator[tuple[str, slice, slice | None, torch.Tensor]]:
        """(hf_name, hf rows, hf cols or None, view of `local`) for each emitted part of `param`."""
        if not param.emit:
            return
        local = _row_view(local)
        for seg in param.segments:
            if seg.hf_name is None:
                continue
            cols = slice(seg.hf_col, seg.hf_col + param.cols) if local.dim() == 2 else None
            yield (
                seg.hf_name,
                slice(seg.hf_row, seg.hf_row + seg.rows),
                cols,
                local[seg.local_row : seg.local_row + seg.rows],
            )

    # ---- per-element path --------------------------------------------------------------------------

    def to_hf_index(
        self, mcore_name: str, local_flat_idx: torch.Tensor, tp_rank: int, pp_rank: int, ep_rank: int = 0
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Map flat indices into a local param to [(hf_name, positions, hf_flat_idx)].

        Only emitted elements are returned (padding rows, tp_rank > 0 replicas and the tied output
        copy map to nothing), so over all shards every HF element is reported exactly once.
        """
        import torch

        param = self.param(mcore_name, tp_rank, pp_rank, ep_rank)
        if not param.emit:
            return []
        idx = local_flat_idx.to(torch.int64)
        row, col = idx // param.cols, idx % param.cols
        table = self._table(param, None, idx.device)
        seg = torch.searchsorted(table["local_row"], row, right=True) - 1
        hf_row = row - table["local_row"][seg] + table["hf_row"][seg]
        hf_flat = hf_row * table["hf_cols"][seg] + table["hf_col"][seg] + col
        name_id = table["name_id"][seg]
        out = []
        for k, name in enumerate(table["names"]):
            pos = (name_id == k).nonzero().squeeze(1)
            if pos.numel():
                out.append((name, pos, hf_flat[pos]))
        return out

    def to_local_index(
        self, hf_name: str, hf_flat_idx: torch.Tensor, tp_rank: int, pp_rank: int, ep_rank: int = 0
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Map flat indices into HF tensor `hf_name` to [(mcore_name, positions, local_flat_idx)]
        for every local param of this shard holding those elements (replicas and tied copies too)."""
        import torch

        if hf_name not in self.hf_shapes:
            raise KeyError(f"{hf_name!r} is not an HF tensor of {self!r}")
        shape = self.hf_shapes[hf_name]
        hf_cols = shape[1] if len(shape) == 2 else 1
        idx = hf_flat_idx.to(torch.int64)
        hf_row, hf_col = idx // hf_cols, idx % hf_cols
        out = []
        for param in self._hf_index(tp_rank, pp_rank, ep_rank).get(hf_name, []):
            table = self._table(param, hf_name, idx.device)
            seg = (torch.searchsorted(table["hf_row"], hf_row, right=True) - 1).clamp_(min=0)
            row_in = hf_row - table["hf_row"][seg]
            col_in = hf_col - table["hf_col"][seg]
            hit = (hf_row >= table["hf_row"][seg]) & (row_in < table["rows"][seg])
            hit &= (col_in >= 0) & (col_in < param.cols)
            pos = hit.nonzero().squeeze(1)
            if pos.numel():
                local = (table["local_row"][seg[pos]] + row_in[pos]) * param.cols + col_in[pos]
                out.append((param.name, pos, local))
        return out

    def flat_table(
        self, pieces: list[tuple[str, int, int, int]], tp_rank: int, pp_rank: int, ep_rank: int = 0
    ) -> FlatTable:
        """The segment table of a flat index space made of param slices: `pieces` lists
        (mcore_name, local flat start, local flat end, flat offset of the start). Built once; flat
        indices no emitted segment covers (replicas, padding, gaps between pieces) map to nothing."""
        ids = {name: i for i, name in enumerate(sorted(self.hf_shapes))}
        rows: list[tuple[int, ...]] = []  # flat start, length, then FlatTable.COLUMNS[1:]
        for name, start, end, at in pieces:
            param = self.param(name, tp_rank, pp_rank, ep_rank)
            if not param.emit:
                continue
            for seg in param.segments:
                lo = max(seg.local_row * param.cols, start)
                hi = min((seg.local_row + seg.rows) * param.cols, end)
                if seg.hf_name is not None and lo < hi:
                    hf_cols = _cols(self.hf_shapes[seg.hf_name])
                    offset = seg.hf_row - seg.local_row
                    rows.append((at + lo - start, hi - lo, at - start, param.cols,
                                 offset, seg.hf_col, hf_cols, ids[seg.hf_name]))  # fmt: skip
        rows.sort()
        filled: list[tuple[int, ...]] = []
        end_of_last = 0
        for row in rows:
            if row[0] < end_of_last:
                raise ValueError(f"flat_table: pieces overlap at flat index {row[0]}")
            if row[0] > end_of_last:  # a hole: maps to no HF tensor
                filled.append((end_of_last, 0, 0, 1, 0, 0, 1, -1))
            filled.append(row)
            end_of_last = row[0] + row[1]
        filled.append((end_of_last, 0, 0, 1, 0, 0, 1, -1))
        return FlatTable(tuple(filled), len(ids))

    def _table(self, param: ParamMap, hf_name: str | None, device: torch.device) -> dict:
        """Cached segment table of `param` on `device` (that of the queried indices): all segments
        by local row (hf_name None), or the segments of one HF tensor by HF row."""
        cache_key = (param, hf_name, str(device))
        if cache_key not in self._tables:
            if hf_name is None:
                table = _segment_table(param.segments, self.hf_shapes, "local_row")
            else:
                segs = sorted((s for s in param.segments if s.hf_name == hf_name), key=lambda s: s.hf_row)
                table = _segment_table(tuple(segs), self.hf_shapes, "hf_row")
            self._tables[cache_key] = {k: v.to(device) if k != "names" else v for k, v in table.items()}
        return self._tables[cache_key]


class ModelLayout(SegmentLayout):
    """Megatron <-> HF mapping for one model at one (TP, PP) layout.

    `fused_norms=True` names the norms the way the transformer-engine spec does (layer norm fused
    into linear_qkv / linear_fc1); the local spec keeps separate `input_layernorm` /
    `pre_mlp_layernorm` modules. The tensor layout is the same.
    """

    def __init__(
        self,
        hf: HFModelConfig,
        *,
        tp_size: int,
        pp_size: int,
        padded_vocab_size: int,
        fused_norms: bool = False,
        stage_layers: tuple[int, ...] | None = None,
        ep_size: int = 1,
        etp_size: int | None = None,
        grouped_experts: bool = False,
    ) -> None:
        _check_layout(hf, tp_size, pp_size, padded_vocab_size)
        self.hf = hf
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.padded_vocab_size = padded_vocab_size
        self.fused_norms = fused_norms
        self.ep_size, self.etp_size = ep_size, etp_size or tp_size
        self.grouped_experts = grouped_experts
        _check_experts(hf, tp_size, self.ep_size, self.etp_size)
        self.stage_layers = _check_stages(hf, pp_size, stage_layers)
        self.hf_shapes: dict[str, tuple[int, ...]] = hf.tensor_shapes()
        self._tables: dict[tuple[ParamMap, str | None, str], dict] = {}

    def __repr__(self) -> str:
        stages = "" if len(set(self.stage_layers)) == 1 else f", stage_layers={self.stage_layers}"
        experts = "" if self.hf.moe is None else f", ep={self.ep_size}, etp={self.etp_size}"
        return (
            f"ModelLayout(arch={self.hf.arch}, tp={self.tp_size}, pp={self.pp_size}{experts}{stages}, "
            f"vocab={self.hf.vocab_size}->{self.padded_vocab_size})"
        )

    def shard_keys(self) -> list[tuple[int, ...]]:
        if self.ep_size == 1:
            return super().shard_keys()
        return [
            (tp, pp, ep)
            for tp in range(self.tp_size)
            for pp in range(self.pp_size)
            for ep in range(self.ep_size)
        ]

    def layer_offset(self, pp_rank: int) -> int:
        """Global index of stage `pp_rank`'s first decoder layer."""
        return sum(self.stage_layers[:pp_rank])

    def global_layer(self, pp_rank: int, local_layer: int) -> int:
        return self.layer_offset(pp_rank) + local_layer

    @functools.cache  # noqa: B019 -- a layout lives as long as its model; shards are few
    def shard(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, ParamMap]:
        """Every local parameter of shard (tp_rank, pp_rank, ep_rank), keyed by its Megatron name.

        Experts follow megatron's expert grid: this shard holds global experts
        [ep_rank * E / EP, (ep_rank + 1) * E / EP), each split over expert-TP rank
        tp_rank % ETP (megatron's grid puts the ETP ranks innermost, so with ETP dividing TP that
        is the rank's place in its expert-TP group)."""
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size and 0 <= ep_rank < self.ep_size):
            raise ValueError(
                f"shard (tp_rank={tp_rank}, pp_rank={pp_rank}, ep_rank={ep_rank}) is outside "
                f"tp_size={self.tp_size}, pp_size={self.pp_size}, ep_size={self.ep_size}"
            )
        params: list[ParamMap] = []
        if pp_rank == 0:
            params.append(
                self._vocab_param("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_rank)
            )
        for local in range(self.stage_layers[pp_rank]):
            layer = self.global_layer(pp_rank, local)
            params.extend(self._layer_params(tp_rank, local, layer))
            params.extend(
                self._mlp_params(tp_rank, ep_rank, f"decoder.layers.{local}.", f"model.layers.{layer}.")
            )
        if pp_rank == self.pp_size - 1:
            h = self.hf.hidden_size
            params.append(replicated("decoder.final_layernorm.weight", "model.norm.weight", h, tp_rank))
            if not self.hf.tie_embeddings:
                params.append(self._vocab_param("output_layer.weight", "lm_head.weight", tp_rank))
            elif self.pp_size > 1:  # the last stage's copy of the tied embedding
                tied = self._vocab_param("output_layer.weight", "model.embed_tokens.weight", tp_rank)
                params.append(dataclasses.replace(tied, emit=False))
        return {p.name: p for p in params}

    # ---- parameter builders ------------------------------------------------------------------------

    def _vocab_param(self, name: str, hf_name: str, tp_rank: int) -> ParamMap:
        rows = self.padded_vocab_size // self.tp_size
        return vocab_param(name, hf_name, tp_rank * rows, rows, self.hf.vocab_size, self.hf.hidden_size)

    def _layer_params(self, tp_rank: int, local: int, layer: int) -> list[ParamMap]:
        hf, tp = self.hf, self.tp_size
        h, d = hf.hidden_size, hf.head_dim
        m, a = f"decoder.layers.{local}.", f"model.layers.{layer}."
        qkv_rows = (hf.num_heads + 2 * hf.num_kv_heads) * d // tp
        in_norm = (
            "self_attention.linear_qkv.layer_norm_weight" if self.fused_norms else "input_layernorm.weight"
        )
        # an MoE layer's norm is its own module in both specs (no linear to fuse it into)
        fused_mlp_norm = self.fused_norms and hf.moe is None
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm else "pre_mlp_layernorm.weight"
        params = [
            replicated(m + in_norm, a + "input_layernorm.weight", h, tp_rank),
            ParamMap(
                m + "self_attention.linear_qkv.weight",
                (qkv_rows, h),
                self._qkv_segments(a, "weight", tp_rank),
                True,
            ),
        ]
        if hf.qkv_bias:
            params.append(
                ParamMap(
                    m + "self_attention.linear_qkv.bias",
                    (qkv_rows,),
                    self._qkv_segments(a, "bias", tp_rank),
                    True,
                )
            )
        if hf.qk_norm:
            params.append(
                replicated(m + "self_attention.q_layernorm.weight", a + "self_attn.q_norm.weight", d, tp_rank)
            )
            params.append(
                replicated(m + "self_attention.k_layernorm.weight", a + "self_attn.k_norm.weight", d, tp_rank)
            )
        attn_cols = hf.num_heads * d // tp
        params += [
            ParamMap(
                m + "self_attention.linear_proj.weight",
                (h, attn_cols),
                (Segment(a + "self_attn.o_proj.weight", 0, h, 0, tp_rank * attn_cols),),
                True,
            ),
            replicated(m + mlp_norm, a + "post_attention_layernorm.weight", h, tp_rank),
        ]
        return params

    def _mlp_params(self, tp_rank: int, ep_rank: int, m: str, a: str) -> list[ParamMap]:
        """One layer's MLP: dense SwiGLU, or router + this shard's experts (+ the shared expert)."""
        hf, h = self.hf, self.hf.hidden_size
        if hf.moe is None:
            return swiglu_params(m + "mlp.", a + "mlp.", hf.ffn_hidden_size, h, tp_rank, self.tp_size)
        moe = hf.moe
        router = ParamMap(
            m + "mlp.router.weight",
            (moe.num_experts, h),
            (Segment(a + "mlp.gate.weight", 0, moe.num_experts),),
            emit=tp_rank == 0,
        )
        params = [router]
        local = moe.num_experts // self.ep_size
        etp_rank = tp_rank % self.etp_size
        for j in range(local):
            names = (
                (f"{m}mlp.experts.linear_fc1.weight{j}", f"{m}mlp.experts.linear_fc2.weight{j}")
                if self.grouped_experts
                else (
                    f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight",
                    f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight",
                )
            )
            expert = f"{a}mlp.experts.{ep_rank * local + j}."
            fc1, fc2 = swiglu_params("", expert, moe.expert_ffn_hidden_size, h, etp_rank, self.etp_size)
            params += [
                dataclasses.replace(p, name=n, expert=True) for p, n in zip((fc1, fc2), names, strict=True)
            ]
        if moe.shared_expert_ffn_hidden_size is not None:
            shared = moe.shared_expert_ffn_hidden_size
            params += swiglu_params(
                m + "mlp.shared_experts.", a + "mlp.shared_expert.", shared, h, tp_rank, self.tp_size
            )
            params.append(
                ParamMap(
                    m + "mlp.shared_experts.gate_weight",
                    (1, h),
                    (Segment(a + "mlp.shared_expert_gate.weight", 0, 1),),
                    emit=tp_rank == 0,
                )
            )
        return params

    def _qkv_segments(self, hf_prefix: str, kind: str, tp_rank: int) -> tuple[Segment, ...]:
        """[q heads of group g; k of g; v of g] for each query group g of this TP rank."""
        hf, d = self.hf, self.hf.head_dim
        q_per_group = hf.num_heads // hf.num_kv_heads
        groups = hf.num_kv_heads // self.tp_size
        segs, row = [], 0
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            for proj, rows, hf_row in (
                ("q_proj", q_per_group * d, g * q_per_group * d),
                ("k_proj", d, g * d),
                ("v_proj", d, g * d),
            ):
                segs.append(Segment(f"{hf_prefix}self_attn.{proj}.{kind}", row, rows, hf_row))
                row += rows
        return tuple(segs)


def layout_for(spec: ModelSpec) -> ModelLayout:
    """The layout of a model built by `model_providers.build_model(spec, ...)`."""
    return ModelLayout(
        spec.hf,
        tp_size=spec.parallel.tensor_model_parallel_size,
        pp_size=spec.parallel.pipeline_model_parallel_size,
        padded_vocab_size=spec.padded_vocab_size,
        fused_norms=spec.transformer_impl == "transformer_engine",
        stage_layers=spec.stage_layers,
        ep_size=spec.parallel.expert_model_parallel_size,
        etp_size=spec.parallel.expert_tensor_size,
        grouped_experts=spec.grouped_experts,
    )


def swiglu_params(m: str, a: str, ffn: int, hidden: int, rank: int, size: int) -> list[ParamMap]:
    """megatron's SwiGLU MLP at `m` ("...mlp."), HF's at `a`, split over `size` ranks: linear_fc1 =
    [gate rows of rank; up rows of rank] (column-parallel), linear_fc2 = down_proj's columns of
    rank (row-parallel)."""
    f = ffn // size
    return [
        ParamMap(
            m + "linear_fc1.weight",
            (2 * f, hidden),
            (Segment(a + "gate_proj.weight", 0, f, rank * f), Segment(a + "up_proj.weight", f, f, rank * f)),
            True,
        ),
        ParamMap(
            m + "linear_fc2.weight",
            (hidden, f),
            (Segment(a + "down_proj.weight", 0, hidden, 0, rank * f),),
            True,
        ),
    ]


def vocab_param(name: str, hf_name: str, start: int, rows: int, vocab_size: int, hidden: int) -> ParamMap:
    """A vocab-parallel shard: HF rows [start, start + rows), rows past `vocab_size` are padding."""
    real = max(0, min(rows, vocab_size - start))
    segs = [Segment(hf_name, 0, real, start)] if real else []
    if real < rows:
        segs.append(Segment(None, real, rows - real))
    return ParamMap(name, (rows, hidden), tuple(segs), emit=True)


def replicated(name: str, hf_name: str, size: int, tp_rank: int) -> ParamMap:
    return ParamMap(name, (size,), (Segment(hf_name, 0, size, 0),), emit=tp_rank == 0)


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """A param as rows of its last dimension (a view): 3-D expert stacks become [E * rows, cols]."""
    return t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t


def _segment_table(segs: tuple[Segment, ...], hf_shapes: dict[str, tuple[int, ...]], key: str) -> dict:
    """Per-segment columns as int64 tensors (`segs` sorted by `key`) for vectorised lookups."""
    import torch

    names = list(dict.fromkeys(s.hf_name for s in segs if s.hf_name is not None))

    def col(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return {
        "names": names,
        key: col([getattr(s, key) for s in segs]),
        **{
            k: col([getattr(s, k) for s in segs])
            for k in ("local_row", "hf_row", "hf_col", "rows")
            if k != key
        },
        "hf_cols": col([_cols(hf_shapes[s.hf_name]) if s.hf_name else 1 for s in segs]),
        "name_id": col([names.index(s.hf_name) if s.hf_name else -1 for s in segs]),
    }


def _cols(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) == 2 else 1


def _check_layout(hf: HFModelConfig, tp: int, pp: int, padded_vocab: int) -> None:
    if tp < 1 or pp < 1:
        raise ValueError(f"tp_size={tp}, pp_size={pp}: both must be >= 1")
    checks = (
        (hf.num_heads % tp, f"num_attention_heads={hf.num_heads} is not divisible by tp_size={tp}"),
        (hf.num_kv_heads % tp, f"num_key_value_heads={hf.num_kv_heads} is not divisible by tp_size={tp}"),
        (
            hf.num_heads % hf.num_kv_heads,
            f"num_attention_heads={hf.num_heads} is not a multiple of num_key_value_heads={hf.num_kv_heads}",
        ),
        (
            hf.moe is None and hf.ffn_hidden_size % tp,
            f"intermediate_size={hf.ffn_hidden_size} is not divisible by tp_size={tp}",
        ),
        (
            hf.moe is not None and (hf.moe.shared_expert_ffn_hidden_size or 0) % tp,
            f"shared_expert_intermediate_size={hf.moe and hf.moe.shared_expert_ffn_hidden_size} is not "
            f"divisible by tp_size={tp}",
        ),
        (pp > hf.num_layers, f"pp_size={pp} is larger than num_hidden_layers={hf.num_layers}"),
        (padded_vocab % tp, f"padded_vocab_size={padded_vocab} is not divisible by tp_size={tp}"),
        (padded_vocab < hf.vocab_size, f"padded_vocab_size={padded_vocab} < vocab_size={hf.vocab_size}"),
    )
    for failed, message in checks:
        if failed:
            raise ValueError(message)


def _check_experts(hf: HFModelConfig, tp: int, ep: int, etp: int) -> None:
    if hf.moe is None:
        if ep != 1 or etp != tp:
            raise ValueError(f"ep_size={ep}, etp_size={etp}: {hf.arch} has no experts")
        return
    checks = (
        (
            ep < 1 or hf.moe.num_experts % ep,
            f"num_experts={hf.moe.num_experts} is not divisible by ep_size={ep}",
        ),
        (etp < 1 or tp % etp, f"etp_size={etp} does not divide tp_size={tp}"),
        (
            hf.moe.expert_ffn_hidden_size % etp,
            f"moe_intermediate_size={hf.moe.expert_ffn_hidden_size} is not divisible by etp_size={etp}",
        ),
    )
    for failed, message in checks:
        if failed:
            raise ValueError(message)


def _check_stages(hf: HFModelConfig, pp: int, stage_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    """The given split (checked against the model), or the default one of `ParallelConfig`."""
    if stage_layers is None:
        return ParallelConfig(pipeline_model_parallel_size=pp).stage_layers(hf.num_layers)
    stages = tuple(stage_layers)
    if len(stages) != pp or sum(stages) != hf.num_layers or min(stages) < 1:
        raise ValueError(
            f"stage_layers={stages} does not split num_hidden_layers={hf.num_layers} over pp_size={pp} "
            "stages of at least one layer each"
        )
    return stages
