"""The rollout-engine contract: what the trainer and the HTTP server code against.

`EmbeddedEngine` (in-process, this package) and the serve engineer's `RemoteEngine` (HTTP client)
both implement `RolloutEngine`. Everything here is plain data so it crosses process boundaries
(JSON over HTTP) unchanged; `SamplingParams` validates on construction so a bad request fails
before it reaches the scheduler.

Log-prob convention (the learner uses the same one): each sampled token's log-prob is
``log_softmax(logits / T)[token]`` with ``T = temperature``, taken BEFORE top-p / top-k
filtering; with ``temperature == 0`` (greedy) it is ``log_softmax(logits)[token]`` (T = 1). The
logits are those of the forward pass that actually produced the token, i.e. over the compressed
KV cache when compression is on (pi_sparse in Sparse-RL's notation).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]
# SGLang's pause_generation modes: "abort" finishes every in-flight request as "abort"; "retract"
# frees their KV and requeues them (they restart from the prompt on resume, under the weights of
# that moment); "in_place" parks them with their KV, to continue where they stopped.
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's `sampling_params` names and ranges).

    temperature 0 means greedy; top_k -1 and top_p 1.0 disable those filters (top_k 0 is refused,
    as SGLang does); min_p keeps the tokens whose probability is at least min_p times the most
    likely one's (0 disables); `stop` holds stop strings, matched on the decoded output text (needs
    the model's tokenizer); `seed` makes one request's draws reproducible regardless of what else
    is in the batch. The model's EOS token ids (config.json / generation_config.json) also stop a
    request unless `ignore_eos`. max_new_tokens 0 returns at once with no output.

    Types are checked, not coerced: "5" is not 5 and a bool is not a number, so a malformed JSON
    request is refused (ValueError naming the field) before it reaches an engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists arrive from JSON; store tuples so the params stay hashable and immutable.
        set_ = functools.partial(object.__setattr__, self)
        set_("temperature", _real("temperature", self.temperature))
        set_("top_p", _real("top_p", self.top_p))
        set_("min_p", _real("min_p", self.min_p))
        set_("top_k", _int("top_k", self.top_k))
        set_("max_new_tokens", _int("max_new_tokens", self.max_new_tokens))
        set_("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids, allow_empty=True))
        set_("stop", _stop_strings(self.stop))
        if self.seed is not None:
            set_("seed", _int("seed", self.seed))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be true or false")
        check_temperature(self.temperature)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]; use 1.0 to disable")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p!r}: must be in [0, 1]; use 0 to disable")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 1, or -1 to disable")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be >= 0")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r}: must be null or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON object, rejecting unknown keys by name. null means the default, as
        with SGLang, except for max_new_tokens (SGLang reads null there as "up to the context",
        which this engine does not offer: refused rather than silently different)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if v is not None or k == "max_new_tokens"})


# The smallest sampling temperature taken (SGLang's _SAMPLING_EPS): logits / T overflows float32
# for T much below it, so a smaller positive T is refused rather than turned into NaN draws.
MIN_TEMPERATURE = 1e-6


def check_temperature(temperature: float) -> None:
    """0 (greedy) or at least MIN_TEMPERATURE; ValueError naming the value and the fix otherwise."""
    if temperature < 0.0:
        raise ValueError(f"temperature={temperature!r}: must be >= 0 (0 = greedy)")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature!r}: below {MIN_TEMPERATURE:g}, logits / temperature overflow; "
            "use 0 for greedy decoding"
        )


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r}: must be an integer")
    return int(value)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")
    return float(value)


def _token_ids(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    ids = tuple(value)
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty: a request needs at least one prompt token")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{name} holds {t!r}: token ids are integers >= 0")
    return tuple(int(t) for t in ids)


def _stop_strings(value: Any) -> tuple[str, ...]:
    stop = (value,) if isinstance(value, str) else value
    if not isinstance(stop, Sequence) or any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop={value!r}: must be a non-empty string or a list of them")
    return tuple(stop)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One prompt to complete. `rid` is echoed back in the `Sample` (a uuid is made when empty).

    return_routed_experts (SGLang's `GenerateReqInput` field): the sample carries the experts each
    token it fed through the model was routed to (`Sample.routed_experts`); refused on a dense model.
    routing_key: requests with one key belong together (a multi-turn episode group): sglang-router
    sends them to one worker (`sglang.client.SGLangRouter`); engines ignore it.
    """

    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""
    return_routed_experts: bool = False
    routing_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", _token_ids("input_ids", self.input_ids, allow_empty=False))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.rid, str):
            raise ValueError(f"rid={self.rid!r}: must be a string")
        if not isinstance(self.routing_key, str):
            raise ValueError(f"routing_key={self.routing_key!r}: must be a string")
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts={self.return_routed_experts!r}: must be true or false")


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """What a served model accepts beyond the sampling contract (None: no such bound).

    vocab_size: every token id (prompt, stop_token_ids) must be below it. context_length: prompt +
    max_new_tokens must fit (positions past the model's context length produce garbage); SGLang
    refuses the same requests, and also one that fills the context exactly. max_new_tokens: the
    operator's cap (`sparserl serve --max-new-tokens`). kv_tokens / kv_budget: the KV pool's size in
    tokens and the compression budget (None: no compression); a request whose cache could outgrow
    the whole pool would be retracted and restarted forever, so it is refused (SGLang likewise
    bounds a request by its KV pool, max_total_num_tokens).
    """

    vocab_size: int | None = None
    context_length: int | None = None
    max_new_tokens: int | None = None
    kv_tokens: int | None = None
    kv_budget: int | None = None

    def check(self, req: GenerateRequest) -> None:
        """ValueError naming the field when `req` breaks a limit."""
        n, m = len(req.input_ids), req.sampling.max_new_tokens
        if self.vocab_size is not None:
            for name, ids in (("input_ids", req.input_ids), ("stop_token_ids", req.sampling.stop_token_ids)):
                if ids and max(ids) >= self.vocab_size:
                    raise ValueError(
                        f"{name} holds token {max(ids)}, outside the vocabulary "
                        f"(vocab_size {self.vocab_size})"
                    )
        if self.max_new_tokens is not None and m > self.max_new_tokens:
            raise ValueError(f"max_new_tokens={m}: above this server's limit of {self.max_new_tokens}")
        ctx = self.context_length
        if ctx is not None and n >= ctx + (m == 0):
            raise ValueError(f"input_ids: the prompt has {n} tokens, the model's context length is {ctx}")
        if ctx is not None and n + m > ctx:
            raise ValueError(
                f"max_new_tokens={m}: with the {n}-token prompt that makes {n + m} tokens, more than "
                f"the model's context length {ctx}; lower max_new_tokens or shorten the prompt"
            )
        if self.kv_tokens is not None and self.peak_kv_tokens(n, m) > self.kv_tokens:
            raise ValueError(
                f"max_new_tokens={m}: with the {n}-token prompt the request caches up to "
                f"{self.peak_kv_tokens(n, m)} tokens, more than the whole KV pool ({self.kv_tokens}); "
                "lower max_new_tokens or give the server more KV capacity"
            )

    def peak_kv_tokens(self, n: int, m: int) -> int:
        """Most cache entries a request with an n-token prompt and m new tokens holds at once: all
        of them, or with compression the budget (a longer prompt is compressed after its prefill)."""
        full = max(n, n + m - 1)  # the last sampled token is never fed back
        return full if self.kv_budget is None else min(full, max(n + 1, self.kv_budget))


@dataclass(frozen=True, kw_only=True)
class KVStats:
    """KV-cache usage of one request over its lifetime.

    peak_retained_tokens: most cached positions the request attended over at any decode step
    (per layer and KV head; every layer/head keeps the same count). evictions: cached positions
    dropped by compression in total (per layer and head). compressions: how many times it was
    compressed. peak_pages / peak_kv_bytes: most pool pages (and their K+V bytes over all layers)
    the request referenced at once, shared prefix pages included.
    """

    peak_retained_tokens: int = 0
    evictions: int = 0
    compressions: int = 0
    peak_pages: int = 0
    peak_kv_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A finished request: generated tokens, the sampler's log-prob of each, and KV stats.

    weight_version: the engine's version when the request finished. output_versions: the weight
    version of the forward that sampled each output token; a request that ran across an in-place
    weight update holds several (its earlier KV was computed under the older ones). Empty when the
    engine does not report them (then `token_versions` takes every token at `weight_version`).

    routed_experts (asked for with `GenerateRequest.return_routed_experts`, else None): the expert
    ids the engine routed each fed-in token to, [n, layers, top_k] integers, for the positions
    [routed_experts_start, seqlen - 1) of prompt + output (SGLang's range; the last sampled token is
    never fed in). routed_experts_start > 0 where the prompt's first tokens came from the prefix
    cache (routed by an earlier request): the learner routes those itself.
    """

    rid: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    kv_stats: KVStats = field(default_factory=KVStats)
    weight_version: int = 0
    cached_prompt_tokens: int = 0
    output_versions: tuple[int, ...] = ()
    routed_experts: torch.Tensor | None = field(default=None, compare=False, repr=False)
    routed_experts_start: int = 0

    def __post_init__(self) -> None:
        if self.output_versions and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"sample {self.rid}: {len(self.output_versions)} token versions for "
                f"{len(self.output_ids)} output tokens"
            )
        if self.routed_experts is not None:
            routed_experts_problem(self)

    @property
    def seqlen(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_versions(self) -> tuple[int, ...]:
        """The weight version that sampled each output token."""
        return self.output_versions or (self.weight_version,) * len(self.output_ids)


def routed_experts_problem(sample: Sample) -> None:
    """ValueError naming the mismatch when a sample's routed experts do not cover exactly the
    positions [routed_experts_start, seqlen - 1) with one [layers, top_k] row each."""
    x, start, end = sample.routed_experts, sample.routed_experts_start, max(0, sample.seqlen - 1)
    if x is None:
        return
    if x.dim() != 3 or x.dtype not in (torch.int16, torch.int32, torch.int64, torch.uint8):
        raise ValueError(
            f"sample {sample.rid}: routed_experts {tuple(x.shape)} {x.dtype}: must be integer "
            "[tokens, layers, top_k]"
        )
    if not 0 <= start <= len(sample.prompt_ids) or x.shape[0] != end - start:
        raise ValueError(
            f"sample {sample.rid}: routed_experts has {x.shape[0]} rows from position {start}, but "
            f"positions [{start}, {end}) of its {len(sample.prompt_ids)}-token prompt + "
            f"{len(sample.output_ids)} outputs need {end - start}"
        )


class RequestsFailed(RuntimeError):
    """`generate` could not complete every request; the others completed normally.

    outcomes[i] is request i's Sample, or the exception it failed with."""

    def __init__(self, outcomes: Sequence[Sample | BaseException]) -> None:
        self.outcomes = list(outcomes)
        failed = [o for o in self.outcomes if isinstance(o, BaseException)]
        first = f"{type(failed[0]).__name__}: {failed[0]}" if failed else "none"
        super().__init__(f"{len(failed)} of {len(self.outcomes)} requests failed; first: {first}")


class WeightVersionConflict(ValueError):
    """A sparse patch made against another base version than the one served (HTTP 409): a missed or
    repeated sync, or two writers. The sender falls back to a full update, which is authoritative
    and may set any version (a resumed or new run restarts from its own step)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator, in-process or remote."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Complete every request; results are in request order. ValueError when a request is
        invalid for this engine (nothing was started); RequestsFailed when some failed while
        running (the others' samples are in it)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace weights in place from HF-named tensors (all or a subset); flushes the prefix cache.
        ValueError (nothing changed) for an unknown name, a wrong shape or a non-float dtype;
        WeightVersionConflict when `version` is older than the one served."""
        ...

    def apply_patch(self, patch_bytes: bytes) -> int:
        """Apply + verify a sparse sync patch (sparserl_mcore.sync); returns the new weight version."""
        ...

    def flush_cache(self) -> None:
        """Drop every unreferenced prefix-cache entry so no stale KV is reused."""
        ...

    def abort(self, rid: str) -> None:
        """Finish request `rid` early with finish_reason "abort" (no-op if it is not in flight)."""
        ...

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop generating until `resume`; returns once no step is in progress. In-flight requests
        are parked ("in_place"), requeued without their KV ("retract") or aborted ("abort")."""
        ...

    def resume(self) -> None: ...

    def model_info(self) -> dict[str, Any]:
        """At least: model_path, architecture, vocab_size, weight_version, kv_compression."""
        ...
