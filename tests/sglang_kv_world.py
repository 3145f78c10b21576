"""SGLang 0.5.23's real KV pools, allocator, req-to-token map and radix tree on CPU, sized small,
with requests placed through SGLang's own prefix match (shared by the KV compression tests)."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang_cpu import require_sglang

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, build_compressor

L, HK, HQ, D = 3, 2, 4, 8  # layers, KV heads, query heads (GQA 2), head dim
PROMPT = list(range(100, 110))  # 10 tokens, radix-shared
CFG = dict(
    budget=24, interval=8, window=4, sink_tokens=2
)  # keep_tokens 16; own keep 6 after a 10-token prefix


@pytest.fixture
def sglang_context():
    """SGLang importable, and its runtime context published (its release path reads the serving
    and speculative settings from it), as a server process would have it."""
    require_sglang()
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0))
    yield
    reset_context()


class World:
    """SGLang's real pools and radix tree, sized small, with K/V of every slot a distinct value."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.kv = MHATokenToKVPool(
            size=128, page_size=1, dtype=torch.float32, head_num=HK, head_dim=D, layer_num=L,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.alloc = TokenToKVPoolAllocator(
            size=128, dtype=torch.float32, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1
            )
        )
        gen = torch.Generator().manual_seed(0)
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen))

    def admit(self, rid: str, prompt: list[int]):
        """A request through SGLang's prefix match, its row and its own slots for the unmatched prompt."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=64))
        req.init_next_round_input(self.tree)  # sets prefix_len, last_node and cache_protected_len
        req.lock = self.tree.lock(req.last_node)
        (row,) = self.rtp.alloc([req])
        prefix = self.tree.path_device_indices(req.last_node)
        self.rtp.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(prefix)
        req.extend_end = len(prompt)
        self.grow(req, len(prompt) - len(prefix))
        return req

    def grow(self, req, n: int, tokens: list[int] | None = None) -> None:
        """n more tokens with KV (prefill remainder, or decode steps when `tokens` are outputs)."""
        slots = self.alloc.alloc(n)
        start = req.kv.kv_committed_len
        self.rtp.write((req.kv.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n
        if tokens is not None:
            req.output_ids.extend(tokens)

    def row(self, req) -> torch.Tensor:
        return self.rtp.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64).clone()


def world_with_shared_prefix() -> tuple[World, object, object]:
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    w = World()
    a = w.admit("a", PROMPT)
    checkpoint_kv_cache(a, w.tree)  # A's prompt enters the radix tree, as after its prefill
    b = w.admit("b", PROMPT + [7, 8, 9])
    assert b.kv.cache_protected_len == len(PROMPT)  # the radix tree owns the shared prompt
    w.grow(b, 11, tokens=list(range(200, 211)))  # decode: own tail = 14 = own keep 6 + interval 8
    return w, a, b


def compactor(w: World, method: str):
    from sparserl_mcore.sglang.kv_compaction import SGLangCompactor

    cfg = KVCompressionConfig(method=method, **CFG)
    return SGLangCompactor(cfg, build_compressor(cfg), w.tree)
