"""Byte format of a sparse BF16 weight patch (format version 3; layout in docs/sync.md): the
constants, value encodings, `CodecConfig` and the in-memory patch types. `encode.py` writes this
format, `decode.py` reads and validates it; `codec.py` is the public API over the three.

A patch lists, per HF tensor, the flat positions whose 16-bit pattern changed and the new values
in one of `VALUE_ENCODINGS`. Positions are split into magnitude classes of the *base* values
(`positions.py`: small weights flip far more often, and the receiver holds the base exactly), and
each class's changed positions travel as gaps among that class's elements (gap = distance to the
previous changed rank minus one), at a per-run width of one byte or two byte planes (two when
>= 1/8 of the gaps would not fit a byte); the largest value of that width escapes into a stream
of the narrowest unsigned width that fits. A tensor without cuts (one class) is the plain model,
which needs no base. Values travel in the same class-major order as two byte planes (low, high):
uniform statistics per stream are what zstd's entropy stage needs. Each stream (and the JSON
header) is its own zstd frame. A *full* patch (`base_version=None`) carries every element densely
and is the fallback / anchor.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FORMAT_VERSION = 3
MAGIC = b"SRLPATCH"
# magic, format version, compression id, reserved, stored header bytes, raw header bytes,
# stored body bytes, raw body bytes
PREFIX = struct.Struct("<8sHBBIIQQ")
COMPRESSIONS = {0: "none", 1: "zstd"}
STREAMS = ("gaps", "escapes", "values_lo", "values_hi")
WIDTHS = (1, 2, 4, 8)
GAP_WIDTHS = (1, 2)
# two-byte gaps once this share of one-byte gaps would escape. Quick bench shape at 99.5 % sparsity:
# shares 1/32..1/4 all within 0.1 % of two-byte gaps everywhere; one-byte gaps everywhere +2.3 %.
WIDE_GAP_SHARE = 1 / 8
# "base": magnitude classes of the base values where the encoder estimates a saving (receivers must
# hold each touched tensor whole); "plain": one class, decodable without the base
POSITION_MODELS = ("base", "plain")
DIGEST_SCOPES = ("tensor", "touched")


class PatchError(ValueError):
    """A patch is malformed, corrupt, or does not fit the receiver; nothing was applied."""


# --- value encodings: (old bits, new bits) -> stored uint16, and back (exact, modulo 2**16) -------


def _zigzag(delta: np.ndarray) -> np.ndarray:
    """Zigzag of int16 deltas in 16-bit arithmetic (no int32 temporaries; the shift wraps mod 2**16)."""
    d = delta.view(np.int16)
    return ((d << 1) ^ (d >> 15)).view(np.uint16)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    z32 = z.astype(np.int32)
    return ((z32 >> 1) ^ -(z32 & 1)).astype(np.uint16)


@dataclass(frozen=True)
class ValueEncoding:
    """How changed values are stored. `needs_base`: applying requires the exact base values."""

    encode: Callable[[np.ndarray, np.ndarray], np.ndarray]
    apply: Callable[[np.ndarray, np.ndarray], np.ndarray]
    needs_base: bool


VALUE_ENCODINGS: dict[str, ValueEncoding] = {
    # new bit patterns: idempotent, no float math
    "overwrite": ValueEncoding(lambda old, new: new, lambda old, stored: stored, needs_base=False),
    # old XOR new: applied exactly once against the named base version
    "xor": ValueEncoding(lambda old, new: old ^ new, lambda old, stored: old ^ stored, needs_base=True),
    # zigzag of (new - old) mod 2**16 on the raw bit patterns: a one-ulp step is 1 or 2
    "sub": ValueEncoding(
        lambda old, new: _zigzag(new - old),  # uint16 subtraction wraps mod 2**16
        lambda old, stored: (old.astype(np.int32) + _unzigzag(stored).astype(np.int32)).astype(np.uint16),
        needs_base=True,
    ),
}


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """encoding: a `VALUE_ENCODINGS` key; zstd_level: 1..22, or None to store the body raw;
    position_model: a `POSITION_MODELS` name ("plain" for receivers holding only part of a tensor,
    e.g. one TP rank of a multi-process engine)."""

    encoding: str = "sub"
    zstd_level: int | None = 1
    position_model: str = "base"

    def __post_init__(self) -> None:
        if self.encoding not in VALUE_ENCODINGS:
            raise ValueError(
                f"encoding={self.encoding!r} is unknown; choose from {', '.join(VALUE_ENCODINGS)}"
            )
        if self.zstd_level is not None and not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level} is out of range; use 1..22, or None for no zstd")
        if self.position_model not in POSITION_MODELS:
            raise ValueError(
                f"position_model={self.position_model!r} is unknown; choose from {', '.join(POSITION_MODELS)}"
            )


# --- in-memory patch ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TensorChange:
    """One tensor's change. indices=None: dense (every element, values are the new bits).

    old_bits is required for sparse changes under a delta encoding (xor, sub). base_bits: the whole
    tensor's flat bits, before or after the change (only unchanged positions are read), which lets
    the `base` position model code positions against the receiver's base; None: plain positions.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    new_bits: np.ndarray
    old_bits: np.ndarray | None
    digest: bytes
    base_bits: np.ndarray | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nnz(self) -> int:
        return int(self.new_bits.size)


@dataclass(frozen=True, kw_only=True)
class Patch:
    """A set of tensor changes taking `base_version` to `version` (base None: a full patch)."""

    version: int
    base_version: int | None
    anchor_version: int
    model_digest: bytes
    model_tensors: int
    model_numel: int
    tensors: tuple[TensorChange, ...]
    # (index, count): a version may travel as several fragments (one per PP stage), applied together
    fragment: tuple[int, int] = (0, 1)
    # "tensor": each digest covers the whole tensor after the patch (and model_digest the model);
    # "touched": each digest covers only the new values at the fragment's positions and
    # model_digest is unused: per-rank fragments, made without any rank holding whole tensors
    digest_scope: str = "tensor"


@dataclass(frozen=True, kw_only=True)
class BaseClasses:
    """Positions still coded against the base: per-class ascending ranks (stored values follow the
    same class-major order) and the class sizes the encoder's base had."""

    cuts: tuple[int, ...]
    sizes: tuple[int, ...]
    ranks: tuple[np.ndarray, ...]


@dataclass(frozen=True, kw_only=True)
class DecodedTensor:
    """indices: ascending flat positions; None for a dense tensor, or (with `classes`) until
    `resolve_positions` has the receiver's base."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    indices: np.ndarray | None
    stored: np.ndarray
    digest: bytes
    classes: BaseClasses | None = None

    @property
    def dense(self) -> bool:
        return self.indices is None and self.classes is None


@dataclass(frozen=True, kw_only=True)
class DecodedPatch:
    version: int
    base_version: int | None
    anchor_version: int
    encoding: str
    model_digest: bytes
    model_tensors: int
    model_numel: int
    tensors: tuple[DecodedTensor, ...]
    fragment: tuple[int, int] = (0, 1)
    digest_scope: str = "tensor"

    @property
    def full(self) -> bool:
        return self.base_version is None


def gap_escape(gap_width: int) -> int:
    """The gap value that says "the real gap is in the escape stream" at this gap width."""
    return (1 << (8 * gap_width)) - 1
