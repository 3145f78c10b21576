"""Config dataclasses <-> plain data: YAML-loaded dicts and dotted `key=value` overrides.

The schema (`sparserl_mcore.config`) says what a run takes; this module only converts. `from_dict`
builds a (nested, frozen) dataclass from plain data, checking every value against its field's type
and refusing unknown keys by their dotted name; `to_dict` is its inverse; `apply_overrides` merges
`key.sub=value` strings, keeping each value as text until its field's type is known (so
`data.prompt_key=123` stays a string). A component's own `__post_init__` ValueError is re-raised as
a `ConfigError` prefixed with the dotted key of its section.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


# Float keys where an infinite value is a setting ("no bound"); every other float must be finite.
UNBOUNDED_KEYS: dict[str, str] = {
    "loss.correction.reject_high": "no upper rejection bound",
    "loss.correction.truncate_max": "no truncation",
    "loss.correction.log_ratio_clamp": "no clamp",
    "loss.policy.clip_eps_high": "no upper clip",
}
INT64 = 2**63  # integers reach torch tensors and C sizes: they must fit a signed 64-bit integer

# Keys that moved: old dotted key -> (new dotted key, why). An old key is refused with this hint.
MOVED_KEYS: dict[str, tuple[str, str]] = {
    "dgg.max_reuse": (
        "train.reuse_epochs",
        "batch reuse (K epochs per rollout batch) is the trainer's; DGG only ends it early",
    ),
}


@dataclasses.dataclass(frozen=True)
class _Raw:
    """An override's right-hand side, kept as text until the target field's type is known.

    `data.prompt_key=123` must stay the string "123", while `train.steps=123` becomes an int.
    """

    text: str

    def __repr__(self) -> str:
        return repr(self.text)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return False, tp


def _unwrap_raw(value: Any, tp: Any) -> Any:
    if not isinstance(value, _Raw):
        return value
    if tp is str or (
        typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))
    ):
        return value.text
    if _is_optional(tp)[0] and value.text.strip().lower() in ("", "null", "none", "~"):
        return None
    try:
        return yaml.safe_load(value.text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse {value.text!r}: {yaml_problem(exc)}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (PyYAML's own text spans several)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one plain value (from YAML or an override) to the field type `tp`."""
    value = _unwrap_raw(value, tp)
    optional, inner = _is_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise ConfigError(f"{key}: null is not allowed; expected {_type_name(tp)}")
    tp = inner
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:  # YAML 1.1 reads an unquoted `off` as false
            value = "off"
        if value not in allowed:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}"
            )
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if not -INT64 <= value < INT64:
            raise ConfigError(f"{key}: {value} does not fit a 64-bit integer")
        return value
    if tp is float:
        return _coerce_float(value, key)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r} (quote it in YAML)")
        return value
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(tp), key)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)} (schema bug)")


def _coerce_float(value: Any, key: str) -> float:
    # YAML 1.1 reads `1e-6` (no dot) as a string; accept any text float() understands.
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if math.isnan(number):
        raise ConfigError(f"{key}: nan is not a setting; give a number")
    general = re.sub(r"\[\d+\]", "", key)  # betas[0] -> betas
    if math.isinf(number) and general not in UNBOUNDED_KEYS:
        raise ConfigError(f"{key}: {number} is not allowed here; give a finite number")
    return number


def _coerce_tuple(value: Any, args: tuple[Any, ...], key: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        value = [value]
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {list(value)!r}")
    return tuple(_coerce(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, args, strict=True)))


def _key(f: dataclasses.Field) -> str:
    """A field's config key: its name, or `metadata["key"]` where the key is a Python keyword
    (`train.async` is the field `async_`)."""
    return f.metadata.get("key", f.name)


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build dataclass `cls` from plain data, rejecting unknown keys and bad values by dotted key."""
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls) if f.init}
    dotted = f"{prefix}." if prefix else ""
    unknown = sorted(set(data) - set(fields))
    for key in unknown:
        if f"{dotted}{key}" in MOVED_KEYS:
            new, why = MOVED_KEYS[f"{dotted}{key}"]
            raise ConfigError(f"{dotted}{key} moved to {new} ({why}); set {new} instead")
    if unknown:
        raise ConfigError(
            f"unknown key {dotted}{unknown[0]}; allowed keys in {prefix or 'the top level'}: "
            f"{', '.join(sorted(fields))}"
        )
    given = {key: f for key, f in fields.items() if key in data}
    kwargs = {f.name: _coerce(data[key], hints[f.name], f"{dotted}{key}") for key, f in given.items()}
    missing = [
        key
        for key, f in fields.items()
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required key {dotted}{missing[0]}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from exc


def to_dict(obj: Any) -> Any:
    """Plain YAML-safe data (dicts, lists, scalars) for a config dataclass tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` set; values are typed later by the schema."""
    out: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. train.steps=10")
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = _Raw(text.strip())
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
