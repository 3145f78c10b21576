"""The plugin's KV-compression hooks around SGLang 0.5.23's REAL decode preparation, on CPU.

Each decode step runs as SGLang's scheduler drives it, with our hook functions called where the
plugin registers them: our BEFORE hook, then SGLang's own `ScheduleBatch.prepare_for_decode`
(its `alloc_for_decode` puts the next slot at `seq_lens`), the decode `ForwardBatch` with SGLang's
own `clamp_position(seq_lens)` positions and our AFTER `init_new` hook, then our AROUND hook on
each layer's real `RadixAttention` (the original forward replaced by a recorder: no attention
backend runs on CPU). The last test loads the plugin through SGLang's own `load_plugins` in a
fresh process and checks that SGLang's `HookRegistry` applied every target (init_new stays a
classmethod) and that the BEFORE hook now runs inside the real `prepare_for_decode`.
`ForwardBatch.init_new` itself needs a ModelRunner and is not run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang_kv_world import (
    CACHES,
    CFG,
    HK,
    HQ,
    D,
    L,
    decode_batch,
    decode_step,
    model_runner,
    plugin_hooks,
    sglang_context,
    world_with_shared_prefix,
)

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
from sparserl_mcore.sglang.kv_hooks import MODEL_INIT, KVHooks
from sparserl_mcore.sglang.plugin import HOST_REGISTER, WEIGHT_UPDATER

pytestmark = pytest.mark.usefixtures(sglang_context.__name__)


@pytest.mark.parametrize("cache", CACHES)
def test_a_decode_step_compacts_then_sglang_allocates_after_the_kept_entries_at_true_positions(cache):
    w, a, b = world_with_shared_prefix(cache)
    hooks = plugin_hooks("streamingllm")
    batch = decode_batch(w, [a, b])
    n_a, n_b = a.kv.kv_committed_len, b.kv.kv_committed_len
    fb = decode_step(hooks, batch)

    kv_b = hooks.cfg.keep_tokens  # 16: b was compressed before SGLang's preparation
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu.tolist() == [n_a + 1, kv_b + 1]
    assert batch.orig_seq_lens.tolist() == [n_a + 1, kv_b + 1]
    row_b = w.rtp.req_to_token[b.kv.req_pool_idx]
    assert int(row_b[kv_b]) == int(batch.out_cache_loc[1])  # SGLang's next slot right after the kept ones
    assert (b.kv.kv_committed_len, a.kv.kv_committed_len) == (kv_b + 1, n_a + 1)
    assert fb.positions.tolist() == [n_a, n_b]  # true positions for RoPE (a: untouched)
    fb2 = decode_step(hooks, batch)
    assert fb2.positions.tolist() == [n_a + 1, n_b + 1]


@pytest.mark.parametrize("cache", CACHES)
def test_window_queries_captured_in_attention_reach_the_policy(cache):
    w, a, b = world_with_shared_prefix(cache)
    w.rtp.req_to_token[b.kv.req_pool_idx, b.kv.kv_committed_len - 5 : b.kv.kv_committed_len] = 0
    b.kv.kv_committed_len = b.kv.kv_allocated_len = b.kv.kv_committed_len - 5  # 5 decode steps before due
    hooks = plugin_hooks("snapkv")
    batch = decode_batch(w, [b])
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(L, 1, HQ, D, generator=gen) for _ in range(5)]  # 5 > window: the ring wraps
    for q in steps:
        decode_step(hooks, batch, q)
    row = b.kv.req_pool_idx
    entries = w.row(b)
    assert hooks.compactor.due(b)
    window = torch.cat(steps[-CFG["window"] :], dim=1)  # [L, w, Hq, d], oldest first
    expected_q = window.transpose(1, 2).reshape(L * HQ, CFG["window"], D)
    assert torch.equal(hooks.ring.window_queries(row), expected_q)
    keys = (
        torch.stack([w.kv.k_buffer[layer][entries] for layer in range(L)])
        .transpose(1, 2)
        .reshape(L * HK, -1, D)
    )
    keep = hooks.cfg.keep_tokens
    idx = hooks.compressor.select(keys, expected_q, keep).view(L, HK, keep)
    k_before = [x.clone() for x in w.kv.k_buffer]

    decode_step(hooks, batch, steps[-1])

    kept = w.rtp.req_to_token[row, :keep].to(torch.int64)
    for layer in range(L):
        for h in range(HK):
            assert torch.equal(w.kv.k_buffer[layer][kept, h], k_before[layer][entries[idx[layer, h]], h])


def test_a_prefill_puts_each_prompts_last_queries_into_the_ring():
    """As the embedded engine does (`rollout/engine/batch_forward.py`), so a compression right after the
    prompt scores with its last `window` queries, not with none."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    hooks = plugin_hooks("snapkv")
    lens, rows = [6, 2], [1, 3]  # one prompt longer than the window (4), one shorter
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(8, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=torch.arange(8),
        seq_lens_sum=8, extend_seq_lens_cpu=lens,
    )  # fmt: skip
    hooks.after_alloc_rows(rows)
    fb = hooks.after_init_new(fb, ForwardBatch, None, None)
    q = torch.randn(L, 8, HQ, D, generator=torch.Generator().manual_seed(5))  # the batch's tokens
    for layer in range(L):
        attn = RadixAttention(num_heads=HQ, head_dim=D, scaling=1.0, num_kv_heads=HK, layer_id=layer)
        hooks.around_attention(lambda *args, **kw: None, attn, q[layer].reshape(8, -1), None, None, fb)

    def expected(tokens: slice) -> torch.Tensor:  # [L * Hq, w', d], oldest first
        part = q[:, tokens]
        return part.transpose(1, 2).reshape(L * HQ, part.shape[1], D)

    assert torch.equal(hooks.ring.window_queries(1), expected(slice(2, 6)))  # its last 4 of 6
    assert torch.equal(hooks.ring.window_queries(3), expected(slice(6, 8)))  # both of its 2
    assert hooks.ring.window_queries(0) is None


def test_the_query_ring_is_allocated_at_model_load_from_max_running_requests(capsys):
    """Sized from the launcher's --max-running-requests (+1: SGLang's request pool has a padding
    row), allocated in the AFTER hook of ModelRunner.initialize, i.e. before SGLang measures free
    memory for its KV pool, never inside a decode forward; its size is printed at start-up."""
    hooks = plugin_hooks("snapkv", max_running_requests=7, runner=model_runner(dtype=torch.bfloat16))
    ring = hooks.ring
    assert ring is not None and tuple(ring.buf.shape) == (L, 8, CFG["window"], HQ, D)
    assert ring.buf.dtype == torch.bfloat16
    nbytes = L * 8 * CFG["window"] * HQ * D * 2
    assert ring.buf.numel() * ring.buf.element_size() == nbytes
    err = capsys.readouterr().err
    assert (
        "snapkv query ring" in err
        and f"{L} layers x 8 rows" in err
        and "before SGLang sizes its KV pool" in err
    )
    storage = ring.buf.data_ptr()
    w, a, b = world_with_shared_prefix()
    decode_step(hooks, decode_batch(w, [a, b]), torch.randn(L, 2, HQ, D))
    assert ring.buf.data_ptr() == storage and int(ring.seen[b.kv.req_pool_idx]) == 1  # recorded in place
    assert KVHooks(KVCompressionConfig(method="streamingllm", **CFG)).ring is None  # no ring, no size needed
    with pytest.raises(ValueError, match="max_running_requests"):
        KVHooks(KVCompressionConfig(method="rkv", **CFG))


def test_a_request_pool_larger_than_the_ring_is_refused_at_the_first_decode():
    w, a, b = world_with_shared_prefix()  # SGLang's pool: 4 requests + its padding row
    with pytest.raises(SystemExit, match="request pool has 5 rows but the query ring has 4"):
        plugin_hooks("snapkv", max_running_requests=3).before_prepare_for_decode(decode_batch(w, [a, b]))
    unhooked = KVHooks(KVCompressionConfig(method="snapkv", **CFG), max_running_requests=4)
    with pytest.raises(SystemExit, match="no query ring"):  # ModelRunner.initialize never hooked
        unhooked.before_prepare_for_decode(decode_batch(w, [a, b]))
    plugin_hooks("snapkv", max_running_requests=4).before_prepare_for_decode(decode_batch(w, [a, b]))  # fits


def test_compressed_requests_are_retracted_last():
    """SGLang retracts the request with the fewest outputs first (`_get_decode_retraction_order`,
    popped from the end). A compressed request frees at most the budget and costs a dense
    re-prefill of prompt + output: our AFTER hook (applied with SGLang's own hook wrapper) puts it
    behind every uncompressed one."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    w, a, b = world_with_shared_prefix()
    w.grow(a, 12, tokens=list(range(300, 312)))  # a: 22 entries, 12 outputs, below the budget
    hooks = plugin_hooks("streamingllm")
    decode_step(hooks, decode_batch(w, [a, b]))  # b (24 entries, 11 outputs) is compressed
    assert hooks.compactor.compressed(b) and not hooks.compactor.compressed(a)
    original = ScheduleBatch._get_decode_retraction_order
    wrapped = _wrap_fn(original, hooks.after_retraction_order, HookType.AFTER)
    assert original([a, b])[-1] == 1  # SGLang alone would retract b, the compressed one
    assert wrapped([a, b])[-1] == 0 and wrapped([b, a])[-1] == 1  # now a goes first
    assert wrapped([a]) == original([a])


def test_a_retracted_compressed_request_is_compressed_again_after_its_dense_re_prefill():
    """SGLang's own retraction (`release_req`: row freed without a radix insert, `reset_for_retract`
    keeps output_ids) then re-admission re-prefills prompt + output densely on a fresh row (our
    AFTER hook on alloc_rows resets it); the first decode step compresses it back to the budget and
    decodes at its true position."""
    from sglang.srt.managers.schedule_batch import release_req

    w, a, b = world_with_shared_prefix()
    hooks = plugin_hooks("streamingllm")
    decode_step(hooks, decode_batch(w, [b]))
    b.output_ids.append(299)  # the token that step sampled
    assert hooks.compactor.compressed(b) and b.kv.kv_committed_len == hooks.cfg.keep_tokens + 1
    free_before = w.alloc.available_size()
    held = b.kv.kv_committed_len - b.kv.cache_protected_len
    release_req(
        req=b, remaing_req_count=0, req_to_token_pool=w.rtp, token_to_kv_pool_allocator=w.alloc,
        tree_cache=w.tree, hisparse_coordinator=None,
    )  # fmt: skip
    assert w.alloc.available_size() == free_before + held and b.kv.req_pool_idx is None
    tokens = list(b.origin_input_ids) + list(b.output_ids)  # what SGLang re-prefills
    again = w.admit("b-again", tokens)  # through SGLang's prefix match: A's prompt is still shared
    hooks.after_alloc_rows([again.kv.req_pool_idx])
    assert not hooks.compactor.compressed(again) and again.kv.kv_committed_len == len(tokens) == 25
    fb = decode_step(hooks, decode_batch(w, [again]))
    assert again.kv.kv_committed_len == hooks.cfg.keep_tokens + 1  # compressed before this step
    assert fb.positions.tolist() == [len(tokens)]  # the new token's true position


def test_refusals_when_sglang_runs_what_the_plugin_cannot_follow():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    with pytest.raises(ValueError, match="h2o"):
        KVHooks(KVCompressionConfig(method="h2o", **CFG))
    w, a, b = world_with_shared_prefix()
    batch = decode_batch(w, [a, b])
    batch.enable_overlap = True
    with pytest.raises(SystemExit, match="--disable-overlap-schedule"):
        KVHooks(KVCompressionConfig(method="streamingllm", **CFG)).before_prepare_for_decode(batch)
    batch.enable_overlap, batch.spec_algorithm = False, SpeculativeAlgorithm.EAGLE
    with pytest.raises(SystemExit, match="speculative"):
        KVHooks(KVCompressionConfig(method="streamingllm", **CFG)).before_prepare_for_decode(batch)


PLUGIN_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from sglang_cpu import require_sglang
require_sglang()
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0))
from sglang.srt.plugins import load_plugins
load_plugins()  # our entry point: resolves every target, registers, SGLang applies
from sglang.srt.plugins.hook_registry import HookRegistry
from sparserl_mcore.sglang.kv_hooks import MODEL_INIT
from sglang_kv_world import decode_batch, model_runner, world_with_shared_prefix
for _, hook, _ in HookRegistry._hooks.get(MODEL_INIT, []):  # what SGLang runs after ModelRunner.initialize
    hook(None, model_runner())
w, a, b = world_with_shared_prefix()
batch = decode_batch(w, [a, b])
batch.prepare_for_decode()  # SGLang's method, now wrapped by our BEFORE hook
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
print(json.dumps({{
    "seq_lens": batch.seq_lens.tolist(), "skip": b.skip_radix_cache_insert,
    "applied": sorted(HookRegistry._patched),  # SGLang's record of the targets it patched
    "init_new_classmethod": isinstance(ForwardBatch.__dict__["init_new"], classmethod),
}}))
"""


@pytest.mark.parametrize("method, ok", [("snapkv", True), ("streamingllm", True), ("h2o", False)])
def test_sglangs_load_plugins_wires_the_hooks_or_refuses_to_start(method, ok):
    tests = str(Path(__file__).parent)
    settings = {"required": True, "kv": {"method": method, **CFG}, "max_running_requests": 4}
    env = {**os.environ, "SPARSERL_SGLANG": json.dumps(settings)}
    code = PLUGIN_PROCESS.format(tests=tests)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if not ok:
        assert proc.returncode != 0 and "does not work inside SGLang" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    hooks = KVHooks(KVCompressionConfig(method=method, **CFG), max_running_requests=4)
    cpu_only = [] if torch.cuda.is_available() else [HOST_REGISTER]  # no CUDA to pin host memory with
    assert sorted([*(t for t, _ in hooks.targets()), WEIGHT_UPDATER, *cpu_only]) == out["applied"]
    assert (MODEL_INIT in out["applied"]) == (method == "snapkv")  # the ring is sized at model load
    assert out["init_new_classmethod"]
    if method == "snapkv":  # no decode query recorded yet: compression waits one step
        assert (out["seq_lens"], out["skip"]) == ([11, 25], False)
    else:
        assert (out["seq_lens"], out["skip"]) == ([11, 17], True)
