"""JSON shapes of POST /generate, shared by the server (parse requests, render samples) and
`RemoteEngine` (build requests, read samples back), so the two can never drift apart.

The shapes are SGLang's native /generate ones (the subset our trainer uses):
request  {"input_ids": [..] | [[..], ..]} or {"text": str | [str, ..]}, "sampling_params": {..} | [{..}, ..],
         "return_logprob": bool, "return_text_in_logprobs": bool, "rid": str | [str, ..],
         "return_routed_experts": bool
response {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
         "cached_tokens", "finish_reason": {"type": "stop"|"length"|"abort", ...}, "weight_version",
         "kv_stats", "output_token_logprobs": [[logprob, token_id, text|null], ..],
         "output_token_versions": [weight_version, ..],
         "routed_experts": base64 of int32 (token, layer, top_k), "routed_experts_start_len": int}}
(`output_token_versions`, ours: the weight version that sampled each token, sent with the
log-probs; a request that ran across an in-place weight update holds several.
`routed_experts` is SGLang's: the expert ids of positions [routed_experts_start_len, seqlen - 1),
little-endian int32, read the same way from both servers; `routed_experts_start_len` is ours (the
positions before it came from the prefix cache; SGLang covers from the start it was asked for, 0).)
A batch request (list of prompts) gets a list of responses in the same order. What sglang-router
forwards is accepted too (`ROUTER_DEFAULTS`, SGLang's `sampling_seed`), so the router can front
`sparserl serve` workers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sparserl_mcore.rollout.protocol import (
    PAUSE_MODES,
    GenerateRequest,
    KVStats,
    PauseMode,
    Sample,
    SamplingParams,
)

log = logging.getLogger(__name__)

GENERATE_KEYS = (
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "return_text_in_logprobs",
    "rid",
    "return_routed_experts",
    "stream",  # accepted only as false: results come back whole
)
# SGLang `GenerateReqInput` fields that sglang-router 0.3.2 adds to every /generate it forwards,
# at these values (its re-serialized body); this server implements none of them, so it accepts
# them at exactly these values and refuses any other.
ROUTER_DEFAULTS: dict[str, Any] = {
    "model": None,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
# SGLang's name for a sampling seed (what `sglang.wire` sends, and the router forwards)
SGLANG_SEED = "sampling_seed"

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class ParsedGenerate:
    requests: list[GenerateRequest]
    batch: bool  # the client sent a list of prompts and gets a list back
    return_logprob: bool
    return_text_in_logprobs: bool


def parse_generate(body: Any, encode: Encode | None) -> ParsedGenerate:
    """Validate a /generate body; ValueError with a client-facing message on any problem."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if body.get("stream", False) is not False:
        raise ValueError("stream=true is not supported: results come back whole; drop the field")
    unknown = sorted(set(body) - set(GENERATE_KEYS) - set(ROUTER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown fields {unknown}; known: {list(GENERATE_KEYS)}")
    for key, default in ROUTER_DEFAULTS.items():
        if key in body and body[key] != default:
            wanted = json.dumps(default)
            raise ValueError(f"{key}={body[key]!r} is not supported here; send {wanted} or drop it")
    prompts, batch = _prompts(body, encode)
    params = _sampling(body.get("sampling_params", {}), len(prompts), batch)
    rids = _rids(body.get("rid"), len(prompts), batch)
    flags = {}
    for key in ("return_logprob", "return_text_in_logprobs", "return_routed_experts"):
        flags[key] = body.get(key, False)
        if not isinstance(flags[key], bool):
            raise ValueError(f"{key} must be true or false, got {flags[key]!r}")
    requests = [
        GenerateRequest(
            input_ids=tuple(ids), sampling=sp, rid=rid, return_routed_experts=flags["return_routed_experts"]
        )
        for ids, sp, rid in zip(prompts, params, rids, strict=True)
    ]
    return ParsedGenerate(requests, batch, flags["return_logprob"], flags["return_text_in_logprobs"])


def _prompts(body: dict[str, Any], encode: Encode | None) -> tuple[list[list[int]], bool]:
    if ("input_ids" in body) == ("text" in body):
        raise ValueError("send exactly one of input_ids or text")
    if "text" in body:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a string or a non-empty list of strings")
        if encode is None:
            raise ValueError("this server has no tokenizer (none in the model directory); send input_ids")
        return [encode(t) for t in texts], batch
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for p in prompts:
        if not isinstance(p, list) or not p or not all(_token_id(t) for t in p):
            raise ValueError("every prompt in input_ids must be a non-empty list of non-negative ints")
    return prompts, batch


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _sampling(raw: Any, n: int, batch: bool) -> list[SamplingParams]:
    if isinstance(raw, dict):
        return [_sampling_params(raw)] * n
    if batch and isinstance(raw, list) and len(raw) == n and all(isinstance(r, dict) for r in raw):
        return [_sampling_params(r) for r in raw]
    raise ValueError(f"sampling_params must be an object, or a list of {n} objects for a batch of {n}")


def _sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """Our names, or SGLang's `sampling_seed` for `seed` (not both)."""
    if SGLANG_SEED in raw:
        if "seed" in raw:
            raise ValueError(f"send one of seed or {SGLANG_SEED}, not both")
        raw = {("seed" if k == SGLANG_SEED else k): v for k, v in raw.items()}
    return SamplingParams.from_dict(raw)


def _rids(raw: Any, n: int, batch: bool) -> list[str]:
    if raw is None:
        return [uuid.uuid4().hex for _ in range(n)]
    rids = raw if batch else [raw]
    if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
        raise ValueError(f"rid must be a non-empty string (a list of {n} for a batch of {n})")
    if len(set(rids)) != n:
        raise ValueError("rid values must be unique within a request")
    return rids


def parse_pause(body: bytes) -> PauseMode:
    """The mode of a /pause_generation body: empty, or {"mode": ...} (SGLang's default "abort")."""
    if not body.strip():
        return "abort"
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ValueError("body is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) - {"mode"}:
        raise ValueError(f'body must be {{"mode": one of {list(PAUSE_MODES)}}} or empty')
    mode = obj.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r}: choose one of {list(PAUSE_MODES)}")
    return mode


def render_sample(
    sample: Sample,
    *,
    return_logprob: bool,
    return_text_in_logprobs: bool,
    decode: Decode | None,
    abort_message: str = "request aborted",
) -> dict[str, Any]:
    """One /generate response object for a finished sample."""
    meta: dict[str, Any] = {
        "id": sample.rid,
        "prompt_tokens": len(sample.prompt_ids),
        "completion_tokens": len(sample.output_ids),
        "cached_tokens": sample.cached_prompt_tokens,
        "finish_reason": _finish_reason(sample, abort_message),
        "weight_version": sample.weight_version,
        "kv_stats": dataclasses.asdict(sample.kv_stats),
    }
    if return_logprob:
        texts = (
            [decode([t]) for t in sample.output_ids]
            if return_text_in_logprobs and decode is not None
            else [None] * len(sample.output_ids)
        )
        meta["output_token_logprobs"] = [
            [lp, tok, txt]
            for lp, tok, txt in zip(sample.output_logprobs, sample.output_ids, texts, strict=True)
        ]
        meta["output_token_versions"] = list(sample.token_versions())
    if sample.routed_experts is not None:
        ids = sample.routed_experts.to(torch.int32).numpy().astype("<i4", copy=False)
        meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode("ascii")
        meta["routed_experts_start_len"] = sample.routed_experts_start
    return {
        "text": decode(sample.output_ids) if decode is not None else None,
        "output_ids": list(sample.output_ids),
        "meta_info": meta,
    }


def _finish_reason(sample: Sample, abort_message: str) -> dict[str, Any]:
    """SGLang's finish_reason object; "matched" is the last output token for a stop."""
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.output_ids)}
    if sample.finish_reason == "stop":
        return {"type": "stop", "matched": sample.output_ids[-1] if sample.output_ids else None}
    return {"type": "abort", "message": abort_message}


def generate_body(
    requests: Sequence[GenerateRequest], params_json: Callable[[SamplingParams], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The batch /generate body `RemoteEngine` sends (always with log-probs; empty rids get uuids).
    `params_json`: the sampling dict of another server's dialect (SGLang's: `sglang.wire`)."""
    to_json = params_json or _params_json
    body = {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [to_json(r.sampling) for r in requests],
        "rid": [r.rid or uuid.uuid4().hex for r in requests],
        "return_logprob": True,
    }
    routed = {r.return_routed_experts for r in requests}
    if len(routed) > 1:  # one flag per body, as SGLang's batch GenerateReqInput has
        raise ValueError("return_routed_experts differs within one batch; send the two kinds apart")
    if routed == {True}:
        body["return_routed_experts"] = True
    return body


def _params_json(params: SamplingParams) -> dict[str, Any]:
    """A shallow copy: the fields are scalars and tuples (`dataclasses.asdict` deep-copies them,
    20x slower per request, on the learner host)."""
    out = dict(vars(params))
    out["stop_token_ids"], out["stop"] = list(params.stop_token_ids), list(params.stop)
    return out


def read_outputs(obj: dict[str, Any], request: GenerateRequest) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A response object's output ids and their log-probs (the part both dialects share)."""
    items = obj["meta_info"]["output_token_logprobs"]
    output_ids = tuple(int(t) for t in obj["output_ids"])
    if [int(item[1]) for item in items] != list(output_ids):
        raise ValueError(f"request {request.rid}: output_token_logprobs do not match output_ids")
    return output_ids, tuple(float(item[0]) for item in items)


def read_routed_experts(
    meta: dict[str, Any], request: GenerateRequest, seqlen: int, shape: tuple[int, int] | None
) -> tuple[torch.Tensor | None, int]:
    """meta_info's routed experts as int16 [n, layers, top_k] and the first position they cover
    (both servers' shape). A payload that does not fit the sample is dropped with one logged line
    (None): the caller refuses the sample rather than replay misattributed ids."""
    raw = meta.get("routed_experts")
    if not request.return_routed_experts or raw is None:
        return None, 0
    start = int(meta.get("routed_experts_start_len", 0))
    problem = ""
    if shape is None:
        problem = "the client was not told the model's (layers, top_k)"
    else:
        flat = np.frombuffer(base64.b64decode(raw), dtype="<i4")
        rows = max(0, seqlen - 1 - start)
        if not 0 <= start <= len(request.input_ids) or flat.size != rows * shape[0] * shape[1]:
            problem = f"{flat.size} ids from position {start}, expected {rows} x {shape[0]} x {shape[1]}"
        elif flat.size and not (0 <= flat.min() and flat.max() < 2**15):
            problem = f"expert ids outside [0, 32767]: {flat.min()}..{flat.max()}"
        else:
            return torch.from_numpy(flat.astype(np.int16)).view(rows, *shape), start
    log.warning("request %s: routed_experts refused: %s", request.rid, problem)
    return None, 0


def read_sample(
    obj: dict[str, Any], request: GenerateRequest, routed_shape: tuple[int, int] | None = None
) -> Sample:
    """A response object back into a `Sample`; KeyError/TypeError/ValueError if malformed.
    routed_shape: the model's (layers, top_k), to read routed experts by."""
    meta = obj["meta_info"]
    output_ids, logprobs = read_outputs(obj, request)
    routed, start = read_routed_experts(meta, request, len(request.input_ids) + len(output_ids), routed_shape)
    return Sample(
        rid=str(meta["id"]),
        prompt_ids=request.input_ids,
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=meta["finish_reason"]["type"],
        kv_stats=KVStats(**meta["kv_stats"]),
        weight_version=int(meta["weight_version"]),
        cached_prompt_tokens=int(meta["cached_tokens"]),
        output_versions=tuple(int(v) for v in meta.get("output_token_versions", ())),
        routed_experts=routed,
        routed_experts_start=start,
    )
