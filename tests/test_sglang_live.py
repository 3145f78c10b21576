"""The SGLang integration against LIVE SGLang 0.5.23 servers (its real launcher, tokenizer manager,
scheduler, detokenizer, HTTP server, radix cache, pause / retract, weight-update routes), started
on loopback by `sparserl sglang-serve --device cpu` (tests/sglang_live.py): BF16 weights, radix
cache on, our weight loader and KV plugin. Two servers for the whole module (snapkv and
streamingllm, budget 16), both behind one sglang-router. Server start-up costs minutes on a 2-core
box (each spawned SGLang process imports SGLang), so they are shared by every test here.

What each test shows:
- KV compression inside the server equals our embedded engine's under the same policy, weights
  and dtype (greedy; bf16 on both sides): tokens, log-probs, the server's KV figures, a radix-shared
  prompt prefix left intact;
- a weight update while requests run (pause "retract", update, continue): every request answers,
  the tokens before the update equal the old weights' and those after it the new weights';
- `sparserl train` (TP=2 learner over gloo) through the router into both workers: the first full
  sync by broadcast over SGLang's weight-update group, a sparse patch accepted every step, and the
  workers' parameters bit-equal to the learner's exported BF16 weights, read back through SGLang's
  own `/get_weights_by_name`;
- the same with full syncs as HTTP fragments and one patch corrupted in flight: rejected, a full
  fallback, bit-equal again;
- preflight refusing a token the workers refuse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import threading

import httpx
import numpy as np
import pytest
import torch
from e2e_support import PY, free_port, metrics, subprocess_env, write_config
from sglang_live import TOKEN, CorruptingProxy, LiveServer, post, read_weights, start
from waiting import wait_until

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None or importlib.util.find_spec("uvloop") is None,
    reason="a live SGLang server needs `make setup` (sglang 0.5.23 and its HTTP server's packages)",
)

KV = {
    "snapkv": {"method": "snapkv", "budget": 16, "interval": 4, "window": 4, "kernel_size": 3},
    "streamingllm": {"method": "streamingllm", "budget": 16, "interval": 4, "window": 4, "sink_tokens": 2},
}
TOKEN_ENV = "SPARSERL_LIVE_SGLANG_TOKEN"
PREFIX = tuple(range(10, 22))  # a prompt prefix the requests share (radix cache)
# two bf16 implementations (SGLang's CPU layers vs ours) over the same cache: measured <= 2.1e-3;
# a different kept set moves a log-prob by 1e-2 or more
LOGPROB_TOL = 0.01


def _assets(root):
    """A tiny Llama (SGLang's Llama has `get_weights_by_name`; its Qwen2 does not) whose attention
    is peaked (q and k scaled x3), so which positions a policy keeps changes the outputs; and 64
    prompts for the trainer."""
    from safetensors.torch import load_file, save_file

    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    hf = make_tiny(
        TinyModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seed=1), root / "hf"
    )
    state = load_file(hf / "model.safetensors")
    for name in state:
        if "q_proj" in name or "k_proj" in name:
            state[name] *= 3
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    rows = [{"prompt": f"say {i}:", "answer": "a"} for i in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return hf


class Live:
    def __init__(self, root, hf, servers: dict[str, LiveServer], router_url: str) -> None:
        self.root, self.hf, self.servers, self.router_url = root, hf, servers, router_url

    def url(self, name: str) -> str:
        return self.servers[name].url


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from sparserl_mcore.sglang.client import router_workers
    from sparserl_mcore.sglang.launch import LaunchConfig, ServerProcess, router_argv

    root = tmp_path_factory.mktemp("sglang-live")
    hf = _assets(root)
    servers = {name: start(hf, root / f"{name}.log", kv) for name, kv in KV.items()}  # both start at once
    router = None
    try:
        for server in servers.values():
            server.wait_ready()
        urls = sorted(s.url for s in servers.values())
        cfg = LaunchConfig(model_path="unused", port=free_port(), startup_timeout_s=120, grace_s=10)
        # round robin (not the default cache-aware policy, which sends prompts sharing a prefix to
        # one worker): both workers generate
        argv = [*router_argv(urls, host=cfg.host, port=cfg.port), "--policy", "round_robin"]
        router = ServerProcess(cfg, argv=argv).__enter__()
        router.wait_healthy()
        wait_until(
            lambda: sorted(router_workers(cfg.url)) == urls, timeout=60, what="router lists both workers"
        )
        yield Live(root, hf, servers, cfg.url)
    finally:
        if router is not None:
            router.stop()
        for server in servers.values():
            server.terminate()  # both at once: each takes seconds to stop
        for server in servers.values():
            server.stop()


# -- generation -------------------------------------------------------------------------------


def _generate(url: str, prompts, max_new: int, **extra) -> list[dict]:
    """One batch /generate, greedy, with log-probs and the top-2 log-probs of every step."""
    body = {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": [{"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}]
        * len(prompts),
        "return_logprob": True,
        "top_logprobs_num": 2,
        **extra,
    }
    answer = httpx.post(url + "/generate", json=body, timeout=600)
    assert answer.status_code == 200, answer.text[:500]
    return answer.json()


def _compare_greedy(served: dict, ids, logprobs, *, strict: bool = True) -> int:
    """A served greedy response against a reference: how many leading tokens agree (same token,
    log-prob within LOGPROB_TOL). At the first different token the server's own top-2 must show a
    near-tie (two bf16 implementations may order two nearly equal logits differently; after that the
    continuations are not comparable). `strict`: a log-prob off by more than LOGPROB_TOL fails;
    otherwise it ends the comparison too (a near-tie in a policy's scores can keep one other
    position; the caller then requires enough agreement)."""
    meta = served["meta_info"]
    out = served["output_ids"]
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    n = 0
    while n < min(len(out), len(ids)) and out[n] == ids[n] and abs(got[n] - logprobs[n]) < LOGPROB_TOL:
        n += 1
    if n < min(len(out), len(ids)):
        if out[n] == ids[n]:
            assert not strict, (n, got[n], logprobs[n])
        else:
            top = {tok: lp for lp, tok, _ in meta["output_top_logprobs"][n]}
            assert ids[n] in top and top[out[n]] - top[ids[n]] < LOGPROB_TOL, (n, out[n], ids[n], top)
    return n


def _reset_weights(live, url: str) -> None:
    """The checkpoint's weights back on the server (another test may have updated them), labelled
    "checkpoint"; SGLang flushes its radix cache with them."""
    post(url, "/update_weights_from_disk", {"model_path": str(live.hf), "weight_version": "checkpoint"})


@pytest.mark.parametrize("method", list(KV))
def test_kv_compression_in_the_server_equals_the_embedded_engine(live, method):
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.sglang import kv_report

    url, new = live.url(method), 40
    _reset_weights(live, url)
    prompts = [PREFIX + (30 + i, 40 + i, 50 + i) for i in range(8)]
    served = _generate(url, prompts[:1], new) + _generate(url, prompts[1:], new)  # 1st: prefix cached
    assert all(r["meta_info"]["cached_tokens"] >= len(PREFIX) for r in served[1:]), served[1]["meta_info"]

    # the same requests in the same order, page size 1 as the server's (both cache the same tokens)
    kv = KVCompressionConfig(**KV[method])
    engine = EmbeddedEngine(
        live.hf, EngineConfig(device="cpu", dtype="bfloat16", page_size=1, kv_compression=kv)
    )
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling=sampling, rid=str(i)) for i, p in enumerate(prompts)]
    reference = engine.generate(requests[:1]) + engine.generate(requests[1:])
    assert [r.cached_prompt_tokens for r in reference] == [r["meta_info"]["cached_tokens"] for r in served]
    compressed_and_compared = 0
    for response, ref in zip(served, reference, strict=True):
        figures = kv_report.read(response["meta_info"])
        assert figures is not None and figures[0] <= kv.budget, figures  # retained positions within budget
        stats = ref.kv_stats
        assert figures[:3] == (stats.peak_retained_tokens, stats.evictions, stats.compressions), (
            figures,
            stats,
        )
        agreed = _compare_greedy(response, ref.output_ids, ref.output_logprobs, strict=False)
        per_token = response["meta_info"][kv_report.KEY]  # running figures: [2] = compressions so far
        compressed_and_compared += sum(1 for entry in per_token[:agreed] if entry and entry[2] > 0)
    # compression starts at the second decode step (15-token prompts, budget 16) and repeats every
    # 4 tokens: the tokens that agree over a compressed cache before a bf16 near-tie parts the two
    # engines (measured: about 160 of 8 x 39; a policy keeping other positions parts them at its
    # first compression, about 1 per request)
    assert compressed_and_compared >= 4 * len(prompts), compressed_and_compared

    # the shared prefix is intact after the compressed requests: a new request reusing it gets
    # the dense model's next token
    check = PREFIX + (60, 61, 62)
    after = _generate(url, [check], 1)[0]
    assert after["meta_info"]["cached_tokens"] >= len(PREFIX), after["meta_info"]
    dense = EmbeddedEngine(live.hf, EngineConfig(device="cpu", dtype="bfloat16"))
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    ref = dense.generate([GenerateRequest(input_ids=check, sampling=one, rid="c")])[0]
    _compare_greedy(after, ref.output_ids, ref.output_logprobs)


# -- a weight update with requests in flight ----------------------------------------------------


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's BF16 bits, flat (what the sync's changes carry)."""
    return t.to(torch.bfloat16).contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def _full_changes(state: dict[str, torch.Tensor]) -> list:
    """The trainer's full sync of `state`: every element, overwrite (no old bits)."""
    return [(name, np.arange(t.numel()), None, _bits(t)) for name, t in sorted(state.items())]


def _encoder(state: dict[str, torch.Tensor], version: int, base: int | None):
    """(changes, fragment) -> one encoded fragment of `version` (base None: full), as the trainer's
    `WeightSyncer._encoder`."""
    from sparserl_mcore.sync.hashing import dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment

    meta = ModelMeta(dtype_name(torch.bfloat16), {n: tuple(t.shape) for n, t in state.items()})
    return lambda changes, fragment: encode_fragment(
        changes, meta, version=version, base_version=base, fragment=fragment
    )


def _full_fragments(hf, state: dict[str, torch.Tensor], version: int) -> list[bytes]:
    """The trainer's full sync of `state` (bf16) to one TP=1 worker: every element, overwrite."""
    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.sglang.layout import SGLangLayout
    from sparserl_mcore.sync.per_rank import split_by_receiver

    per_rank = split_by_receiver(_full_changes(state), SGLangLayout(parse_hf_config(hf), tp_size=1))
    encode = _encoder(state, version, None)
    return [encode(c, (0, 1)) for c in per_rank]


class Streams:
    """Streamed greedy requests, one thread each: the latest chunk of each (SGLang's chunks carry
    the whole output so far) and a wait on their progress."""

    def __init__(self, url: str, prompts, max_new: int, **extra) -> None:
        self.outs: list[dict] = [{} for _ in prompts]
        self._ended = [False] * len(prompts)
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._run, args=(i, url, p, max_new, extra), daemon=True)
            for i, p in enumerate(prompts)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, i: int, url: str, prompt, max_new: int, extra: dict) -> None:
        body = {
            "input_ids": list(prompt),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "stream": True,
            **extra,
        }
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=600) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        chunk = json.loads(line[5:])
                        with self._changed:
                            self.outs[i] = chunk
                            self._changed.notify_all()
        finally:
            with self._changed:
                self._ended[i] = True
                self._changed.notify_all()

    def counts(self) -> list[int]:
        with self._changed:
            return [len(o.get("output_ids", [])) for o in self.outs]

    def wait_tokens(self, at_least: list[int], timeout: float = 300.0) -> list[int]:
        """Block until request i has streamed `at_least[i]` output tokens, for every i; their
        counts. Fails if one ended first (it would have no tokens left to update within)."""

        def reached() -> bool:
            done = all(len(o.get("output_ids", [])) >= n for o, n in zip(self.outs, at_least, strict=True))
            return done or any(self._ended)

        with self._changed:
            self._changed.wait_for(reached, timeout)
        counts = self.counts()
        ok = all(c >= n for c, n in zip(counts, at_least, strict=True)) and not any(self._ended)
        assert ok, f"streams ended or stalled at {counts} (wanted {at_least})"
        return counts

    def join(self, timeout: float = 600.0) -> list[dict]:
        for t in self._threads:
            t.join(timeout)
        assert all(self._ended), "a streamed request did not end"
        return self.outs


def test_a_weight_update_while_requests_run_loses_none_and_serves_no_stale_tokens(live):
    from safetensors.torch import load_file

    from sparserl_mcore.sglang.client import SGLangWorker

    url, new, version = live.url("snapkv"), 96, 7
    prompts = [PREFIX + (70 + i,) for i in range(2)]
    _reset_weights(live, url)
    old = _generate(url, prompts, new)  # what the current weights answer
    state = load_file(live.hf / "model.safetensors")
    noise = torch.Generator().manual_seed(3)
    state["lm_head.weight"] = (
        state["lm_head.weight"] + torch.randn(state["lm_head.weight"].shape, generator=noise) * 0.2
    )
    fragments = _full_fragments(live.hf, state, version)

    post(url, "/flush_cache", {})
    streams = Streams(url, prompts, new)
    post(url, "/slow_down", {"forward_sleep_time": 0.1})  # SGLang's test knob: >= 9.6 s per request
    try:
        streams.start()
        streams.wait_tokens([4] * len(prompts))
        with SGLangWorker(url, TOKEN, retries=0) as worker:  # what the trainer does per worker
            worker.open_update_session()  # pause "retract" + begin: the requests are still running
            post(url, "/slow_down", {"forward_sleep_time": None})
            worker.send_fragments(fragments, version)
            worker.close_update_session()  # end + flush + continue
    finally:
        post(url, "/slow_down", {"forward_sleep_time": None})
    outs = streams.join()
    cuts = []
    for out, before in zip(outs, old, strict=True):
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == new, meta  # not lost
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["checkpoint", str(version)], spans
        cut = spans[1]["start"]
        assert 4 <= cut < new and meta["num_retractions"] >= 1, (spans, meta["num_retractions"])
        assert out["output_ids"][:cut] == before["output_ids"][:cut]  # old weights before the update
        assert out["output_ids"][cut:] != before["output_ids"][cut:]  # the update changed the answer
        cuts.append(cut)
    # after it: what the new weights continue from the same tokens (fresh requests, batched as
    # the two retracted ones were re-prefilled), never the old weights' continuation
    post(url, "/flush_cache", {})
    body = {
        "input_ids": [[*p, *o["output_ids"][:c]] for p, o, c in zip(prompts, outs, cuts, strict=True)],
        "sampling_params": [
            {"temperature": 0.0, "max_new_tokens": new - c, "ignore_eos": True} for c in cuts
        ],
        "return_logprob": True,
    }
    fresh = httpx.post(url + "/generate", json=body, timeout=600).json()
    for out, ref, cut in zip(outs, fresh, cuts, strict=True):
        meta = out["meta_info"]
        tail = {"output_ids": out["output_ids"][cut:], "meta_info": {
            "output_token_logprobs": meta["output_token_logprobs"][cut:],
            "output_top_logprobs": meta["output_top_logprobs"][cut:],
        }}  # fmt: skip
        lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
        assert _compare_greedy(tail, ref["output_ids"], lps) >= min(8, new - cut)


# -- in-flight updates (train.async.mode=in_flight) --------------------------------------------


@contextlib.contextmanager
def _one_rank_world():
    """The learner's default group, one gloo rank in this process (`SGLangDelivery` is collective)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _changes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list:
    """Every element that differs between two bf16 states, as the trainer's diff lists it (HF name,
    flat indices, old bits, new bits): a sparse patch's changes."""
    out = []
    for name in sorted(old):
        before, after = _bits(old[name]), _bits(new[name])
        idx = np.flatnonzero(before != after)
        if idx.size:
            out.append((name, idx, before[idx], after[idx]))
    return out


def _nudged(state: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """`share` of the elements of every tensor but the LM head moved by noise (an optimizer step's
    sparse footprint); the LM head as it is."""
    noise = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        pick = torch.rand(t.shape, generator=noise) < share
        moved = (t.float() + 0.02 * torch.randn(t.shape, generator=noise)).to(torch.bfloat16)
        out[name] = t if name == "lm_head.weight" else torch.where(pick, moved, t)
    return out


def test_in_flight_updates_keep_requests_running_and_key_the_prefix_cache_per_version(live):
    """The trainer's in-flight bracket (`SGLangDelivery(in_flight=True)`: pause "in_place", begin,
    the patch through our loader, end, continue; no flush) while streamed requests decode."""
    from safetensors.torch import load_file

    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams
    from sparserl_mcore.sglang.client import SGLangWorker
    from sparserl_mcore.sglang.trainer_sync import SGLangDelivery
    from sparserl_mcore.sglang.wire import prefix_key, token_versions

    url, new, run = live.url("streamingllm"), 160, "live-test"
    prompts = [PREFIX + (70,), PREFIX + (72,)]  # two to which v0 never answers token 0 (below)
    hf = parse_hf_config(live.hf)
    # v1 zeroes the LM head: every logit 0, so greedy picks token 0 (argmax's first index) from the
    # first forward under v1 on; v2 and v3 move 1 % of every other tensor (token 0 still)
    states = [{n: t.to(torch.bfloat16) for n, t in load_file(live.hf / "model.safetensors").items()}]
    states.append({**states[0], "lm_head.weight": torch.zeros_like(states[0]["lm_head.weight"])})
    states += [_nudged(states[1], 0.01, seed=11)]
    states += [_nudged(states[2], 0.01, seed=12)]
    versions = [100, 101, 102, 103]
    pauses = []
    with _one_rank_world():
        synced = SGLangDelivery([url], hf, host_rank=0, token=TOKEN)  # the synchronous bracket
        full = synced.deliver(_full_changes(states[0]), _encoder(states[0], versions[0], None),
                              version=versions[0], only=None)  # fmt: skip
        assert full == {}, full  # the checkpoint's weights as v0, radix cache flushed
        old = _generate(url, prompts, new)  # what v0 answers (no extra_key: another cache namespace)
        # v0 never answers token 0 here: where v0's tokens end and v1's begin is visible
        assert all(0 not in o["output_ids"] for o in old), [o["output_ids"] for o in old]

        in_flight = SGLangDelivery([url], hf, host_rank=0, token=TOKEN, in_flight=True)
        streams = Streams(url, prompts, new, extra_key=prefix_key(run, versions[0]))
        # SGLang's test knob (>= 0.1 s per decode step) while the updates land: they find the
        # requests running whatever the box's load
        post(url, "/slow_down", {"forward_sleep_time": 0.1})
        try:
            streams.start()
            counts = streams.wait_tokens([4] * len(prompts))
            for k in range(1, len(versions)):
                if k > 1:  # each version samples tokens before the next one lands
                    counts = streams.wait_tokens([c + 8 for c in counts])
                changes = _changes(states[k - 1], states[k])
                encode = _encoder(states[k], versions[k], versions[k - 1])
                failed = in_flight.deliver(changes, encode, version=versions[k], only=None)
                assert failed == {}, failed
                pauses.append(in_flight.pause_ms[url])
                counts = streams.counts()
        finally:
            post(url, "/slow_down", {"forward_sleep_time": None})
        outs = streams.join()
    assert len(pauses) == 3 and all(p > 0 for p in pauses), pauses

    for out, before in zip(outs, old, strict=True):
        meta, ids = out["meta_info"], out["output_ids"]
        # not lost, not retracted (kept its KV: no re-prefill), every version named in order
        assert meta["finish_reason"]["type"] == "length" and len(ids) == new, meta
        assert meta["num_retractions"] == 0, meta["num_retractions"]
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == [str(v) for v in versions], spans
        per_token = token_versions(meta, new)  # our reading of the spans: every token, monotone
        assert list(per_token) == sorted(per_token) and set(per_token) == set(versions), spans
        cut = spans[1]["start"]
        assert 4 <= cut < new - 16, spans
        # every token before the first update is v0's answer; every token after it v1's own (0):
        # none sampled by v0 is labelled v1, none sampled by v1 is labelled v0
        assert ids[:cut] == before["output_ids"][:cut]
        assert set(ids[cut:]) == {0}, (cut, ids[cut - 2 :])

    # the in-place writes landed exactly (SGLang's own /get_weights_by_name)
    shapes = {n: tuple(t.shape) for n, t in states[-1].items()}
    served = read_weights(url, sorted(states[-1]), shapes)
    assert all(torch.equal(served[n].view(torch.int16), t.view(torch.int16)) for n, t in states[-1].items())

    # the prefix cache after the updates (not flushed: requests were running): the streams'
    # prompts, prefilled under v0, are cached under v0's key only
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    with SGLangWorker(url, TOKEN, retries=0) as worker:

        def ask(version: int, last: int):
            worker.prefix_key = prefix_key(run, version)
            (sample,) = worker.generate([GenerateRequest(input_ids=PREFIX + (last,), sampling=one)])
            return sample

        fresh = ask(versions[-1], 90)
        stale = ask(versions[0], 91)  # a request still carrying v0's key
        again = ask(versions[-1], 92)
    assert fresh.cached_prompt_tokens == 0, fresh  # nothing v0 (or earlier) computed
    assert fresh.weight_version == versions[-1] and fresh.output_versions == (versions[-1],)
    # SGLang serves v0's prefix KV to v0's key: why the trainer moves every request to the new key
    assert stale.cached_prompt_tokens >= len(PREFIX), stale
    assert again.cached_prompt_tokens >= len(PREFIX), again  # the new key's namespace caches as usual


# -- sparserl train against the live workers ----------------------------------------------------


def _train(
    live, name: str, urls: list[str], *, sync=None, train=None, loss=None, **rollout
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cfg = write_config(
        live.root,
        live.hf,
        name,
        model={"hf_path": str(live.hf), "params_dtype": "bf16"},
        rollout={
            "engine": "remote",
            "server": "sglang",
            "urls": urls,
            "token_env": TOKEN_ENV,
            "group_size": 4,
            "kv": KV["snapkv"],
            **rollout,
        },
        eval={"every": 0, "at_start": False, "dense": False, "compressed": False},
        train={
            "steps": 2,
            "prompts_per_step": 4,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            **(train or {}),
        },
        sync=sync or {},
        loss=loss or {},
    )
    env = {**subprocess_env(), TOKEN_ENV: TOKEN}
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg), "--nproc", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc, metrics(live.root, name)


def _assert_bit_equal(live, name: str, urls: list[str]) -> None:
    """Every HF tensor of the learner's final export, read back from each worker through SGLang."""
    from safetensors.torch import load_file

    exported = {}
    for f in sorted((live.root / name / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    shapes = {n: tuple(t.shape) for n, t in exported.items()}
    for url in urls:
        served = read_weights(url, sorted(exported), shapes)
        wrong = [
            n
            for n in exported
            if not torch.equal(served[n].view(torch.int16), exported[n].to(torch.bfloat16).view(torch.int16))
        ]
        assert not wrong, f"{url}: {wrong[:5]}"


def _since(routes: list[tuple[str, int]], mark: int) -> list[tuple[str, int]]:
    return [
        r for r in routes[mark:] if r[0] not in ("/health", "/server_info", "/get_server_info", "/model_info")
    ]


def test_train_through_the_router_with_broadcast_then_sparse_patches(live):
    urls = sorted(s.url for s in live.servers.values())
    marks = {name: len(s.routes()) for name, s in live.servers.items()}
    sync = {"broadcast": {"master_port": free_port()}}
    _, records = _train(live, "routed", urls, router_url=live.router_url, sync=sync)
    events = [r for r in records if "event" in r]
    assert not [e for e in events if e["event"].startswith("sync_")], events  # no rejection, no fallback
    steps = [r for r in records if "sync/patch_bytes" in r]
    assert len(steps) == 2 and all(0 < r["sync/patch_bytes"] < r["sync/dense_bytes"] for r in steps), steps
    # the servers' own KV figures reached the run's metrics: within the budget (both workers
    # compress at 16), below the dense figure, one slot = K+V of 2 layers x 2 KV heads x 16 x bf16
    rollouts = [r for r in records if "rollout/peak_retained_tokens" in r]
    assert len(rollouts) == 2, records
    for r in rollouts:
        peak = r["rollout/peak_retained_tokens"]
        assert (
            0 < peak <= KV["snapkv"]["budget"] and r["rollout/peak_kv_bytes"] == peak * 2 * 2 * 2 * 16 * 2
        ), r
        assert r["rollout/peak_kv_bytes"] < r["rollout/dense_kv_bytes"], r
    generated = 0
    for name, server in live.servers.items():
        routes = _since(server.routes(), marks[name])
        # preflight's token probe (let through, then refused as malformed: nothing updated)
        assert routes[0] == ("/update_weights_from_tensor", 400), routes[:3]
        routes = routes[1:]
        paths = [p for p, _ in routes]
        assert all(code == 200 for _, code in routes), routes
        assert "/generate" in paths, f"{name} generated nothing through the router"
        first = paths.index("/generate")
        # the first full sync by broadcast over SGLang's weight-update group, before any generation
        assert (
            "/init_weights_update_group" in paths[:first]
            and "/update_weights_from_distributed" in paths[:first]
        )
        # then one sparse patch per step through our loader (2 learner ranks: 2 POSTs each)
        assert paths[first:].count("/update_weights_from_tensor") == 2 * 2, paths
        assert "/update_weights_from_distributed" not in paths[first:], paths
        generated += paths.count("/generate")
    assert generated == 2 * 4 * 4  # every sample went through the router to a worker, one call each
    _assert_bit_equal(live, "routed", urls)


def test_train_with_fragments_survives_a_patch_corrupted_in_flight(live):
    proxy = CorruptingProxy(live.url("snapkv"), arm_on="/generate")  # corrupts step 1's sparse patch
    try:
        _, records = _train(live, "corrupted", [proxy.url])
    finally:
        proxy.close()
    assert proxy.corrupted_answer == 400  # our loader rejected it: SGLang answered 400, kept serving
    events = [(r["event"], r) for r in records if "event" in r]
    assert [k for k, _ in events] == ["sync_engine_failed", "sync_fallback_full"], events
    failed = events[0][1]
    assert failed["what"] == "sparse weight sync" and "sparserl patch rejected" in failed["reason"], failed
    routes = _since(proxy.routes, 0)
    assert routes[0] == ("/update_weights_from_tensor", 400)  # preflight's token probe
    paths = [p for p, _ in routes]
    assert "/init_weights_update_group" not in paths  # every full sync as fragments
    tensors = [code for p, code in routes if p == "/update_weights_from_tensor"]
    # start: 2 ranks' full fragments; step 1: 2 sparse (one corrupted: 400) then 2 full fallback;
    # step 2: 2 sparse, accepted
    assert tensors[1:3] == [200, 200] and 400 in tensors[3:5] and tensors[-4:] == [200] * 4, tensors
    _assert_bit_equal(live, "corrupted", [live.url("snapkv")])


def test_train_in_flight_through_the_router(live):
    """`train.async.mode=in_flight`: the next batch generates through the router while the learner
    updates, and each sync is an in-place bracket (pause "in_place", no flush). Whether a sync
    lands inside a running request here is up to timing (this model's batch and update both take
    well under a second); test_in_flight_updates_keep_requests_running_... makes it land."""
    urls = sorted(s.url for s in live.servers.values())
    # KV compression turned SGLang's overlap scheduler off (else preflight refuses in_flight)
    assert all(httpx.get(u + "/server_info").json()["disable_overlap_schedule"] is True for u in urls)
    marks = {name: len(s.routes()) for name, s in live.servers.items()}
    train = {"steps": 3, "async": {"mode": "in_flight", "max_staleness": 1}}
    loss = {"correction": {"mode": "sparse_rl"}}
    _, records = _train(live, "in-flight", urls, router_url=live.router_url, train=train, loss=loss)
    events = [r for r in records if "event" in r]
    assert not [e for e in events if e["event"].startswith("sync_")], events  # no rejection, no fallback
    steps = [r for r in records if "staleness/lag_max" in r]
    assert len(steps) == 3, records
    # every trained token's version came back from the workers (SGLang's spans): lag 0 or 1
    for r in steps:
        lags = sum(r[f"staleness/tokens_lag{k}"] for k in (0, 1))
        assert lags > 0 and r["staleness/masked_tokens"] == 0 and r["staleness/lag_max"] <= 1, r
        assert r["time/sync_pause_ms"] > 0, r
    for name, server in live.servers.items():
        paths = [p for p, _ in _since(server.routes(), marks[name])][1:]  # after preflight's probe
        pauses = paths.count("/pause_generation")
        # every sync (the first full one, then one patch per step) in its own bracket, never flushed
        assert pauses == 1 + 3 and paths.count("/continue_generation") == pauses, paths
        assert "/flush_cache" not in paths, paths
    _assert_bit_equal(live, "in-flight", urls)


def test_preflight_refuses_a_token_the_workers_refuse(live, monkeypatch):
    from sparserl_mcore.config import config_from_dict
    from sparserl_mcore.trainer.preflight import PreflightError, _check_servers

    def cfg(token_env):
        rollout = {
            "engine": "remote",
            "server": "sglang",
            "urls": [live.url("snapkv")],
            "token_env": token_env,
        }
        return config_from_dict(
            {"model": {"hf_path": str(live.hf)}, "data": {"train_path": "unused"}, "rollout": rollout}
        )

    with pytest.raises(PreflightError, match=r"refuses its weight routes with no token .*HTTP 401"):
        _check_servers(cfg(None))
    monkeypatch.setenv("SPARSERL_LIVE_WRONG_TOKEN", "not-the-servers-token")
    with pytest.raises(PreflightError, match=r"the token in \$SPARSERL_LIVE_WRONG_TOKEN .*HTTP 401"):
        _check_servers(cfg("SPARSERL_LIVE_WRONG_TOKEN"))
    monkeypatch.setenv("SPARSERL_LIVE_WRONG_TOKEN", TOKEN)
    _check_servers(cfg("SPARSERL_LIVE_WRONG_TOKEN"))  # the right token passes
