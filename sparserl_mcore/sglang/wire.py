"""SGLang 0.5.23's native POST /generate, as the trainer uses it (batch of token-id prompts).

`rollout.http_wire` speaks `sparserl serve`'s dialect of the same route, which differs from
SGLang's where this module adapts (read in the 0.5.23 wheel, file: symbol):
- request: SGLang's sampling dict becomes `sampling/sampling_params.py: SamplingParams(**dict)`
  (`managers/tokenizer_manager.py`, `sampling_params_class(**sampling_kwargs)`), a msgspec struct
  that refuses unknown keys: our `seed` is SGLang's `sampling_seed`, and is left out when unset.
  Everything else (`input_ids`, `rid`, `return_logprob`, per-request `sampling_params`) is
  `managers/io_struct.py: GenerateReqInput` as ours.
- response (`managers/tokenizer_manager.py: TokenizerManager._handle_batch_output`): `output_ids`,
  `meta_info` with `id`, `finish_reason` ({"type": "stop"|"length"|"abort", ...}),
  `cached_tokens`, `weight_version` (SGLang's label string: the version our sync sent, or
  "default" on a worker that never got our weights), `weight_versions` (the label of each span of
  output tokens, [{"version", "start", "end"}, ...]: `utils/weight_versions.py:
  add_weight_versions_to_meta_info`, recorded by the scheduler at every weight-version change, so a
  request an in-place update landed in names both) and `output_token_logprobs` as
  [logprob, token_id, text|null] (`detokenize_logprob_tokens`). SGLang has no KV statistics
  of its own: our plugin adds `sparserl_kv` (`kv_report`), read into the sample's `KVStats`; a
  server without our plugin gives zero `KVStats`.
- `extra_key` (`GenerateReqInput.extra_key`, part of the radix cache's key, forwarded by
  sglang-router 0.3.2 too): in-flight updates set it per run and weight version (`prefix_key`), so
  a request never matches prefix KV that requests of an older version cached (SGLang cannot flush
  while requests run in place), nor KV another run cached under the same version number on a
  server that outlived it.
- `return_routed_experts` (`GenerateReqInput`, one flag per batch body; rollout routing replay):
  a server started with `--enable-return-routed-experts` answers `meta_info["routed_experts"]`,
  base64 of the int32 [seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k] ids
  (`managers/detokenizer_manager.py: _b64_encode_per_request` of `state_capturer/base.py:
  BaseTopkCapturer.get_topk`, native byte order: little-endian on every host SGLang runs on). We
  ask from position 0 (`routed_experts_start_len` left at its default): SGLang keeps the ids of a
  radix-cached prefix with its KV slots, so they cover the whole sequence but its last token. A
  server started without the flag answers none (the sample arrives without ids and is refused).
  sglang-router 0.3.2 drops the field (its typed `GenerateRequest` has none; measured live: the
  worker behind it answered without ids), so replay through a router is refused
  (`RunConfig`) and `single_body` never asks.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sparserl_mcore.rollout.http import wire as http_wire
from sparserl_mcore.rollout.protocol import GenerateRequest, KVStats, Sample, SamplingParams
from sparserl_mcore.sglang import kv_report


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    """Our sampling settings under SGLang's `SamplingParams` names."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def prefix_key(run: str, version: int) -> str:
    """The `extra_key` of the requests one trainer run (`run`: drawn once per run) makes while the
    workers hold `version`."""
    return f"weight-version:{run}:{version}"


def generate_body(requests: Sequence[GenerateRequest], extra_key: str | None = None) -> dict[str, Any]:
    """One batch /generate body: ours, with SGLang's sampling names (and the prefix-cache key)."""
    body = http_wire.generate_body(requests, params_json=sampling_json)
    if extra_key is not None:
        body["extra_key"] = [extra_key] * len(requests)
    return body


def single_body(request: GenerateRequest, extra_key: str | None = None) -> dict[str, Any]:
    """One prompt's /generate body: what sglang-router takes (it refuses batch bodies)."""
    body = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling_json(request.sampling),
        "rid": request.rid or uuid.uuid4().hex,
        "return_logprob": True,
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    return body


def _version(label: Any) -> int:
    label = str(label)
    if not label.isdigit():
        raise ValueError(f"weight_version={label!r}: this worker holds no weights synced by the trainer")
    return int(label)


def token_versions(meta: dict[str, Any], n: int) -> tuple[int, ...]:
    """Per output token, the version that sampled it, from `weight_versions` spans (empty when the
    worker sends none: then every token counts at `weight_version`). ValueError unless the spans
    cover the n tokens in order."""
    spans = meta.get("weight_versions")
    if spans is None:
        return ()
    out: list[int] = []
    for span in spans:
        if int(span["start"]) != len(out) or int(span["end"]) < len(out):
            raise ValueError(f"weight_versions {spans!r} do not cover the {n} output tokens in order")
        out += [_version(span["version"])] * (int(span["end"]) - len(out))
    if len(out) != n:
        raise ValueError(f"weight_versions {spans!r} cover {len(out)} of the {n} output tokens")
    return tuple(out)


def read_sample(
    obj: dict[str, Any], request: GenerateRequest, routed_shape: tuple[int, int] | None = None
) -> Sample:
    """One SGLang response object as a `Sample`; KeyError / TypeError / ValueError when malformed
    or when the worker does not hold weights this trainer sent (its label is not a version).
    routed_shape: the model's (layers, top_k), to read routed experts by; a payload that does not
    fit the sample is dropped with one logged line (`http_wire.read_routed_experts`)."""
    meta = obj["meta_info"]
    output_ids, logprobs = http_wire.read_outputs(obj, request)
    seqlen = len(request.input_ids) + len(output_ids)
    routed, start = http_wire.read_routed_experts(meta, request, seqlen, routed_shape)
    return Sample(
        rid=str(meta["id"]),
        prompt_ids=request.input_ids,
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=meta["finish_reason"]["type"],
        kv_stats=read_kv_stats(meta),
        weight_version=_version(meta["weight_version"]),
        cached_prompt_tokens=int(meta.get("cached_tokens", 0)),
        output_versions=token_versions(meta, len(output_ids)),
        routed_experts=routed,
        routed_experts_start=start,
    )


def read_kv_stats(meta: dict[str, Any]) -> KVStats:
    """The request's KV figures as our plugin reported them (`kv_report`); zeros without them."""
    figures = kv_report.read(meta)
    if figures is None:
        return KVStats()
    peak, evictions, compressions, peak_bytes = figures
    return KVStats(
        peak_retained_tokens=peak,
        evictions=evictions,
        compressions=compressions,
        peak_pages=peak,  # page size 1: one slot per retained position
        peak_kv_bytes=peak_bytes,
    )
