"""The sparse BF16 patch codec's public API (format version 3; byte layout in docs/sync.md).

Three modules own it: `patch_format` (constants, value encodings, `CodecConfig`, the in-memory
`Patch` / `DecodedPatch` types), `encode` (`encode_patch`) and `decode` (`decode_patch`,
`read_header`, `resolve_positions`), with `fragments` for patches travelling as one fragment per
pipeline stage and `inspect_patch`. Callers import from here.
"""

from __future__ import annotations

from sparserl_mcore.sync.decode import decode_patch, read_header, resolve_positions
from sparserl_mcore.sync.encode import encode_patch, worker_count
from sparserl_mcore.sync.fragments import decode_fragments, inspect_patch, merge_fragments, split_fragments
from sparserl_mcore.sync.patch_format import (
    COMPRESSIONS,
    DIGEST_SCOPES,
    FORMAT_VERSION,
    GAP_WIDTHS,
    MAGIC,
    POSITION_MODELS,
    STREAMS,
    VALUE_ENCODINGS,
    BaseClasses,
    CodecConfig,
    DecodedPatch,
    DecodedTensor,
    Patch,
    PatchError,
    TensorChange,
    ValueEncoding,
)

__all__ = [
    "COMPRESSIONS",
    "DIGEST_SCOPES",
    "FORMAT_VERSION",
    "GAP_WIDTHS",
    "MAGIC",
    "POSITION_MODELS",
    "STREAMS",
    "VALUE_ENCODINGS",
    "BaseClasses",
    "CodecConfig",
    "DecodedPatch",
    "DecodedTensor",
    "Patch",
    "PatchError",
    "TensorChange",
    "ValueEncoding",
    "decode_fragments",
    "decode_patch",
    "encode_patch",
    "inspect_patch",
    "merge_fragments",
    "read_header",
    "resolve_positions",
    "split_fragments",
    "worker_count",
]
