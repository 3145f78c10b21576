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

import pytest
from sglang_cpu import require_sglang

from sparserl_mcore.rollout import http_wire
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


def test_a_request_spanning_a_weight_update_carries_its_oldest_version():
    """SGLang labels a response with the LAST version (`weight_version`) and lists the spans; the
    sample's staleness is its oldest."""
    obj = _response("a", [9, 10, 11], "5")
    obj["meta_info"]["weight_versions"] = [
        {"version": "4", "start": 0, "end": 1},
        {"version": "5", "start": 1, "end": 3},
    ]
    assert wire.read_sample(obj, REQUESTS[0]).weight_version == 4
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
