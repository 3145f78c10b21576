"""Rewards: verifiers behind one interface, `reward(completion, answer, **kwargs) -> float`.

Built-in verifiers are listed in `REWARDS`; a user verifier is named by import path
`package.module:function` (same signature). `build_reward(name, kwargs)` resolves either and
binds the keyword arguments, checking them against the function's signature up front.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from sparserl_mcore.rewards.math import math_boxed_reward
from sparserl_mcore.rewards.synthetic import digit_chain_reward, running_sum_reward, worked_chain_reward

RewardFn = Callable[[str, str], float]

# name -> verifier. Exhaustive: a new built-in reward is added here.
REWARDS: dict[str, Callable[..., float]] = {
    "digit_chain": digit_chain_reward,
    "math_boxed": math_boxed_reward,
    "running_sum": running_sum_reward,
    "worked_chain": worked_chain_reward,
}


def _import_path(name: str) -> Callable[..., float]:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {name!r}: an import path looks like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {module_name} has no callable {attr!r}")
    return fn


def build_reward(name: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """The reward function for a registry key or `module:function`, with `kwargs` bound.

    Raises KeyError listing the registered rewards for an unknown plain name, and ValueError when
    the import fails or `kwargs` do not fit the function's signature.
    """
    if ":" in name:
        fn = _import_path(name)
    elif name in REWARDS:
        fn = REWARDS[name]
    else:
        raise KeyError(f"unknown reward {name!r}; registered: {', '.join(REWARDS)} (or use module:function)")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind("completion", "answer", **kwargs)
    except TypeError as exc:
        raise ValueError(f"reward {name!r} does not accept kwargs {sorted(kwargs)}: {exc}") from exc
    return functools.partial(fn, **kwargs) if kwargs else fn


__all__ = [
    "REWARDS",
    "RewardFn",
    "build_reward",
    "digit_chain_reward",
    "math_boxed_reward",
    "running_sum_reward",
    "worked_chain_reward",
]
