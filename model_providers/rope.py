"""RoPE with its cos/sin tables cached, for megatron's attention without transformer-engine.

megatron-core's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`) takes the cos and the sin of
the angle table, scales and casts them, for the query and again for the key of every layer in every
forward: 12 elementwise ops per layer on a [seq, 1, 1, head_dim] table that changes only with the
sequence length. The angle table itself is already cached (`RotaryEmbedding.forward` is an
`lru_cache`: one tensor per length, device and CP group).

The seam: with `TransformerConfig.apply_rope_fusion=True`, megatron's `apply_rotary_pos_emb` hands
(t, angles) to the module-level slot `rope_utils.fused_apply_rotary_pos_emb`, which megatron fills
with transformer-engine's kernel when TE is installed and leaves None otherwise. `install()` puts
`apply_cached` in the empty slot (never over TE's), and `build_spec` turns the flag on only when
the slot holds it. `apply_cached` is megatron's unfused formula on cos/sin computed once per
(angle table, dtype): the same values (megatron's scale is 1 without YaRN, so the products are
exact) and the same products in the same order, so logits and gradients are bit-identical
(tests/test_rope_cache.py). Packed sequences (THD) never reach it: `SDPACoreAttention` refuses them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from megatron.core.models.common.embeddings import rope_utils

_Entry = tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]


class RopeTables:
    """cos/sin of megatron's angle tables in one dtype, the last `size` (table, dtype) pairs.

    Keyed by the angle tensor itself (megatron returns the same tensor for the same length, device
    and CP group), held here so its id cannot be reused while cached; `computed` counts the tables
    built (for tests and profiles)."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self.computed = 0
        # (id of the angle table, dtype) -> (the table, its version, cos, sin)
        self._tables: OrderedDict[tuple[int, torch.dtype], _Entry] = OrderedDict()

    def get(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(freqs), dtype)
        hit = self._tables.get(key)
        # an inference-mode table must not be saved for backward outside inference mode
        usable = hit is not None and hit[0] is freqs and hit[1] == freqs._version
        if usable and hit is not None and (torch.is_inference_mode_enabled() or not hit[2].is_inference()):
            self._tables.move_to_end(key)
            return hit[2], hit[3]
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        self.computed += 1
        self._tables[key] = (freqs, freqs._version, cos, sin)
        self._tables.move_to_end(key)
        while len(self._tables) > self.size:
            self._tables.popitem(last=False)
        return cos, sin


TABLES = RopeTables()


def apply_cached(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """`rope_utils._apply_rotary_pos_emb_bshd(t, freqs, interleaved)` (scale 1, no MLA) with the
    cos/sin tables from `TABLES`; the signature of transformer-engine's fused RoPE."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = TABLES.get(freqs, t.dtype)
    t = (t * cos) + (rope_utils._rotate_half(t, interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1)


def install() -> bool:
    """Fill megatron's empty fused-RoPE slot with `apply_cached`; True when the slot holds it (False:
    transformer-engine's kernel is there, and the cache stays off)."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_cached
    return rope_utils.fused_apply_rotary_pos_emb is apply_cached
