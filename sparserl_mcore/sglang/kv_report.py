"""Per-request KV figures from inside SGLang (0.5.23), returned with each response's meta_info.

SGLang reports no KV statistics, but it forwards a request's `Req.customized_info` (a dict of
per-output-token lists) into its response: `managers/scheduler_components/output_streamer.py:
_GenerationStreamAccumulator.accept` sends each list's entries for the tokens it sends, and
`managers/tokenizer_manager.py: update_request_meta_info` concatenates them into
`meta_info[key]`. So the plugin's hooks write, at the output index of the token each forward will
produce, the request's running figures up to that forward:

    meta_info["sparserl_kv"][t] = [peak retained positions, evictions, compressions, peak KV bytes]

- retained positions: cache positions (per layer and KV head) the forward attended over: the
  prompt (shared prefix included) at prefill, the kept positions + 1 at a decode step. The same
  figure as the embedded engine's `KVStats.peak_retained_tokens`.
- evictions / compressions: positions dropped by the KV plugin, and how often (0 without it).
- KV bytes: retained positions x the K+V bytes of one slot over all layers and all TP ranks (page
  size 1: one slot per position; the embedded engine's `peak_kv_bytes` counts pages alike).
An entry is None for a token no hook saw (e.g. after a chunk SGLang streamed early); the figures
only grow, so the client takes the largest of each (`read`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KEY = "sparserl_kv"


def slot_bytes(kv_pool: Any, tp_size: int) -> int:
    """K+V bytes of one token slot over every layer (this rank's heads x `tp_size`), from the
    pool's own buffers; 0 for a pool without per-layer `k_buffer` / `v_buffer` lists."""
    total = 0
    for name in ("k_buffer", "v_buffer"):
        for buf in getattr(kv_pool, name, None) or ():
            total += buf[0].numel() * buf.element_size()
    return total * tp_size


class KVReport:
    """Writes the running figures of each request into its `customized_info`."""

    def __init__(self, bytes_per_slot: int) -> None:
        self.bytes_per_slot = bytes_per_slot

    def record(self, req: Any, attended: int, *, evicted: int = 0) -> None:
        """The forward about to run produces output token len(req.output_ids) over `attended`
        cached positions, after this step's compression dropped `evicted` positions."""
        info = req.customized_info if req.customized_info is not None else {}
        values: list[list[int] | None] = info.setdefault(KEY, [])
        index = len(req.output_ids)
        earlier = [v for v in values[: index + 1] if v is not None]
        peak, evictions, compressions, peak_bytes = earlier[-1] if earlier else (0, 0, 0, 0)
        entry = [
            max(peak, attended),
            evictions + evicted,
            compressions + (evicted > 0),
            max(peak_bytes, attended * self.bytes_per_slot),
        ]
        values.extend([None] * (index + 1 - len(values)))
        values[index] = entry
        req.customized_info = info


def read(meta_info: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(peak retained, evictions, compressions, peak KV bytes) from one response's meta_info;
    None when the server sent no figures (not our plugin, or a request no hook saw)."""
    values: Sequence[Any] = meta_info.get(KEY) or ()
    entries = [v for v in values if v is not None]
    if not entries:
        return None
    if not all(isinstance(v, list) and len(v) == 4 and all(type(x) is int for x in v) for v in entries):
        raise ValueError(
            f"meta_info[{KEY!r}]: expected [int, int, int, int] per token, got {entries[0]!r:.80}"
        )
    peak, evictions, compressions, peak_bytes = (max(column) for column in zip(*entries, strict=True))
    return peak, evictions, compressions, peak_bytes
