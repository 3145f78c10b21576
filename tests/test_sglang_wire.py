"""`sglang.wire`: our /generate requests parsed by SGLang 0.5.23's own request classes, and its
response shape read back, corner cases included (a live server answers the common case in
tests/test_sglang_live.py).

The request side goes through SGLang's real `GenerateReqInput.normalize_batch_and_arguments`
and, per request, its real `SamplingParams(**dict)` + `normalize` + `verify` (what
`TokenizerManager` does with each `sampling_params` dict). The response side is a dict shaped as
`TokenizerManager._handle_batch_output` builds it in 0.5.23 (as a live server answered it), with
the cases a quiet server does not produce: weight-version spans of an update mid-request, KV
figures with gaps, malformed figures.
"""

from __future__ import annotations

import dataclasses

import pytest
from sglang_cpu import require_sglang

from sparserl_mcore.rollout.http import wire as http_wire
from sparserl_mcore.rollout.protocol import GenerateRequest, KVStats, SamplingParams
from sparserl_mcore.sglang import wire

REQUESTS = [
    GenerateRequest(input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=4, seed=11), rid="a"),
    GenerateRequest(
        input_ids=(8,), sampling=SamplingParams(temperature=0.0, top_k=-1, stop_token_ids=(2,)), rid="b"
    ),
]


def _sglang_params(d: dict):
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangParams

    params = SGLangParams(**d)
    params.normalize(None)  # no stop strings: the tokenizer is not needed
    params.verify(vocab_size=130)
    return params


def test_sglang_parses_our_batch_request():
    require_sglang()
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = wire.generate_body(REQUESTS)
    req = GenerateReqInput(**body)  # an unknown top-level field would fail here
    req.normalize_batch_and_arguments()
    assert not req.is_single and req.batch_size == 2
    assert req.input_ids == [[5, 6, 7], [8]] and req.rid == ["a", "b"] and req.return_logprob == [True, True]
    first, second = (_sglang_params(d) for d in req.sampling_params)
    assert first.sampling_seed == 11 and first.max_new_tokens == 4
    assert second.sampling_seed is None and second.top_k == 1  # greedy, as SGLang maps temperature 0
    assert second.stop_token_ids == {2}


def test_our_server_dialect_is_refused_by_sglang():
    """Why the adapter exists: `sparserl serve`'s body names the seed `seed`."""
    require_sglang()
    with pytest.raises(TypeError, match="seed"):
        _sglang_params(http_wire.generate_body(REQUESTS)["sampling_params"][0])


def _response(rid: str, ids: list[int], version: str) -> dict:
    """One finished non-streamed result as sglang 0.5.23 returns it (`_handle_batch_output`,
    `convert_logprob_style` -> `detokenize_logprob_tokens` without text)."""
    return {
        "text": "xy",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": 3,
            "weight_version": version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(ids),
            "cached_tokens": 2,
            "output_token_logprobs": [(-0.5 - t, t, None) for t in ids],
        },
    }


def test_sglang_results_become_samples():
    sample = wire.read_sample(_response("a", [9, 10], "3"), REQUESTS[0])
    assert sample.rid == "a" and sample.prompt_ids == (5, 6, 7) and sample.output_ids == (9, 10)
    assert sample.output_logprobs == (-9.5, -10.5) and sample.finish_reason == "length"
    assert sample.weight_version == 3 and sample.cached_prompt_tokens == 2 and sample.kv_stats == KVStats()


@pytest.mark.parametrize(
    ("obj", "error"),
    [
        (_response("a", [9, 10], "default"), "holds no weights synced by the trainer"),
        ({**_response("a", [9, 10], "1"), "output_ids": [9, 11]}, "do not match output_ids"),
    ],
)
def test_results_from_unsynced_or_inconsistent_workers_are_refused(obj, error):
    with pytest.raises(ValueError, match=error):
        wire.read_sample(obj, REQUESTS[0])


def test_a_request_spanning_a_weight_update_names_each_tokens_version():
    """SGLang labels a response with the LAST version (`weight_version`) and lists the spans; each
    token keeps the version that sampled it, so its staleness is its own."""
    obj = _response("a", [9, 10, 11], "5")
    obj["meta_info"]["weight_versions"] = [
        {"version": "4", "start": 0, "end": 1},
        {"version": "5", "start": 1, "end": 3},
    ]
    sample = wire.read_sample(obj, REQUESTS[0])
    assert sample.output_versions == (4, 5, 5) and sample.weight_version == 5
    obj["meta_info"]["weight_versions"][0]["version"] = "default"  # tokens before any sync of ours
    with pytest.raises(ValueError, match="'default'"):
        wire.read_sample(obj, REQUESTS[0])


def test_the_plugins_kv_figures_become_kv_stats():
    obj = _response("a", [9, 10, 11], "1")
    obj["meta_info"]["sparserl_kv"] = [[7, 0, 0, 700], None, [12, 5, 1, 1200]]  # a token no hook saw
    stats = wire.read_sample(obj, REQUESTS[0]).kv_stats
    assert stats == KVStats(
        peak_retained_tokens=12, evictions=5, compressions=1, peak_pages=12, peak_kv_bytes=1200
    )
    obj["meta_info"]["sparserl_kv"] = [[7, 0, 0]]
    with pytest.raises(ValueError, match="sparserl_kv"):
        wire.read_sample(obj, REQUESTS[0])


def test_in_flight_weight_version_spans_become_per_token_versions():
    """A request an in-place update landed in: SGLang's own span bookkeeping
    (`utils/weight_versions.py`: the scheduler's event at the change, then the tokenizer manager's
    meta_info) names the version of every output token."""
    require_sglang()
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    obj = _response("a", [9, 10, 11, 12, 13], "4")
    spans = compute_weight_version_spans(
        [WeightVersionEvent("3", 2)], current_version="4", num_output_tokens=5
    )
    add_weight_versions_to_meta_info(obj["meta_info"], spans, 5)
    sample = wire.read_sample(obj, REQUESTS[0])
    assert sample.output_versions == (3, 3, 4, 4, 4) and sample.weight_version == 4
    untouched = wire.read_sample(_response("a", [9, 10], "3"), REQUESTS[0])
    assert untouched.output_versions == () and untouched.token_versions() == (3, 3)
    gap = _response("a", [9, 10], "3")
    gap["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}]
    with pytest.raises(ValueError, match="cover 1 of the 2 output tokens"):
        wire.read_sample(gap, REQUESTS[0])


def test_the_prefix_cache_key_reaches_sglangs_request_classes():
    """In-flight updates key the radix cache by version (`extra_key`); SGLang's batch and single
    request classes take it per request."""
    require_sglang()
    from sglang.srt.managers.io_struct import GenerateReqInput

    req = GenerateReqInput(**wire.generate_body(REQUESTS, "weight-version:7"))
    req.normalize_batch_and_arguments()
    assert req.extra_key == ["weight-version:7"] * 2
    single = GenerateReqInput(**wire.single_body(REQUESTS[0], "weight-version:7"))
    single.normalize_batch_and_arguments()
    assert single.extra_key == "weight-version:7"
    assert "extra_key" not in wire.generate_body(REQUESTS) and "extra_key" not in wire.single_body(
        REQUESTS[0]
    )


def test_routed_experts_are_asked_for_and_read_in_sglangs_encoding():
    """Rollout routing replay: the flag reaches SGLang's batch request class;
    `meta_info["routed_experts"]` (int32 [seqlen - 1, layers, top_k] as SGLang's detokenizer
    encodes it) is read back in the model's shape, as SGLang's own
    `extract_routed_experts_from_meta_info` reads it; a payload of another shape is dropped."""
    require_sglang()
    import base64

    import torch
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    asking = [dataclasses.replace(r, return_routed_experts=True) for r in REQUESTS]
    req = GenerateReqInput(**wire.generate_body(asking))
    req.normalize_batch_and_arguments()
    assert req.return_routed_experts is True

    ids = torch.randint(0, 8, (3 + 2 - 1, 2, 2), dtype=torch.int32)  # 3 prompt + 2 output tokens
    obj = _response("a", [9, 10], "3")
    obj["meta_info"]["routed_experts"] = base64.b64encode(ids.numpy().tobytes()).decode()
    sample = wire.read_sample(obj, asking[0], (2, 2))
    assert sample.routed_experts is not None and sample.routed_experts_start == 0
    assert torch.equal(sample.routed_experts.int(), ids)
    assert extract_routed_experts_from_meta_info(obj).tolist() == sample.routed_experts.flatten().tolist()
    assert wire.read_sample(obj, asking[0], (3, 2)).routed_experts is None  # not this model's shape
    assert wire.read_sample(obj, REQUESTS[0], (2, 2)).routed_experts is None  # not asked for
