"""The flat diff (`sync.device_diff`, ShardSyncer snapshot "flat") against the per-param path.

One process (gloo, world 1) holds Megatron-layout shards of a small Qwen2 (tied embeddings, padded
vocabulary, TP=2 so rank 1 holds unemitted norm replicas) whose params live in one flat BF16
buffer with padding between them, in reverse order (as megatron's DDP param buffer does), or as
separate tensors. Two syncers diff the same weights: the per-param host path (`snapshot="host"`,
the oracle) and the flat one. After each round of Adam-like bit flips (dense, sparse, one far-apart
pair for wide gaps with escapes) the flat fragment must be byte-identical to `encode_fragment` of
the oracle's changes, for DP ranges that start mid-tensor too. The op counts of one flat diff are
pinned: one `nonzero`, one copy to the host, no scalar reads, and the host reads nothing but that
copy (a few bytes per changed element).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from single_process import tiny_qwen2_config
from torch.utils._python_dispatch import TorchDispatchMode

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import CodecConfig
from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer, SyncGroups, even_ranges
from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment

# embedding 2000 x 64 = 128,000 elements: room for gaps >= 65535
HF = tiny_qwen2_config(vocab_size=2000, max_position_embeddings=256)


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield SyncGroups(stage=dist.group.WORLD, stage_source=0, sources=dist.group.WORLD, source_ranks=(0,))
    dist.destroy_process_group()


class Shard:
    """Megatron-named bf16 params of one (tp, pp) shard, in one buffer (reverse order, 64-element
    padding, like megatron's DDP param buffer) or as separate tensors."""

    def __init__(self, layout: ModelLayout, tp_rank: int, *, one_buffer: bool, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        maps = list(layout.shard(tp_rank, 0).values())
        sizes = [int(np.prod(m.shape)) for m in maps]
        self.params: dict[str, torch.Tensor] = {}
        if one_buffer:
            buffer = torch.zeros(sum(sizes) + 64 * len(maps), dtype=torch.bfloat16)
            at = 0
            for m, n in reversed(list(zip(maps, sizes, strict=True))):
                self.params[m.name] = buffer[at : at + n].view(m.shape)
                at += n + 64
        else:
            self.params = {m.name: torch.empty(m.shape, dtype=torch.bfloat16) for m in maps}
        for p in self.params.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        self.gen = gen

    def named_parameters(self):
        return iter(self.params.items())

    def step(self) -> None:
        """Adam-like flips: +-1 ulp at a per-param rate (dense to none), a few new values, and on
        the embedding one far-apart pair (a width-2 gap escape)."""
        rates = [0.6, 0.05, 0.004, 0.0]
        for k, (name, p) in enumerate(self.params.items()):
            bits = p.view(-1).view(torch.int16)
            rate = 0.0 if "word_embeddings" in name else rates[k % len(rates)]
            flip = torch.rand(bits.numel(), generator=self.gen) < rate
            step = torch.where(torch.rand(bits.numel(), generator=self.gen) < 0.5, -1, 1).to(torch.int16)
            bits.add_(torch.where(flip, step, torch.zeros_like(step)))
            if k % 3 == 0 and bits.numel() > 8 and "word_embeddings" not in name:
                at = torch.randint(0, bits.numel(), (3,), generator=self.gen)
                bits[at] = torch.randint(-30000, 30000, (3,), generator=self.gen, dtype=torch.int16)
            if "word_embeddings" in name:
                far = [5, 5 + 70_000, bits.numel() - 1] if bits.numel() > 70_005 else [5, bits.numel() - 1]
                bits[far] += 3


def _layout(tp: int) -> ModelLayout:
    return ModelLayout(parse_hf_config(HF), tp_size=tp, pp_size=1, padded_vocab_size=2048)


def _syncers(shard: Shard, layout, tp_rank: int, owned, group, encoding: str):
    def make(snapshot: str) -> ShardSyncer:
        config = ShardSyncConfig(codec=CodecConfig(encoding=encoding), snapshot=snapshot, mirror=False)
        return ShardSyncer(
            shard, layout, tp_rank=tp_rank, pp_rank=0, groups=group, owned=owned, config=config
        )

    return make("host"), make("flat")


def _buffer_ranges(shard: Shard, dp_rank: int, dp_size: int) -> dict[str, tuple[int, int]]:
    """Each DP rank a contiguous span of the buffer (ranges start and end mid-tensor)."""
    spans = {
        n: (int(p.storage_offset()), int(p.storage_offset()) + p.numel()) for n, p in shard.params.items()
    }
    lo, hi = min(a for a, _ in spans.values()), max(b for _, b in spans.values())
    a, b = lo + (hi - lo) * dp_rank // dp_size, lo + (hi - lo) * (dp_rank + 1) // dp_size
    out = {}
    for name, (first, last) in spans.items():
        start, end = max(a, first) - first, min(b, last) - first
        out[name] = (start, end) if start < end else (0, 0)
    return out


CASES = [  # (tp, tp_rank, one buffer, DP ranges, encoding, compare: the device's torch or numpy)
    (1, 0, True, "whole", "sub", "torch"),
    (2, 1, True, "buffer", "xor", "torch"),
    (2, 0, False, "even", "overwrite", "torch"),
    (1, 0, True, "buffer", "sub", "numpy"),
    (2, 1, False, "even", "sub", "numpy"),
    (2, 1, True, "buffer", "xor", "numpy"),
    (2, 0, False, "even", "overwrite", "numpy"),
]


@pytest.mark.parametrize("tp,tp_rank,one_buffer,ranges,encoding,compare", CASES)
def test_flat_fragment_is_byte_identical(group, tp, tp_rank, one_buffer, ranges, encoding, compare):
    layout = _layout(tp)
    shard = Shard(layout, tp_rank, one_buffer=one_buffer)
    if ranges == "whole":
        owned = even_ranges(shard, 0, 1)
    elif ranges == "buffer":
        owned = _buffer_ranges(shard, 1, 2)  # DP rank 1 of 2: its first range starts mid-tensor
    else:
        owned = even_ranges(shard, 1, 3)
    host, flat = _syncers(shard, layout, tp_rank, owned, group, encoding)
    flat.flat.compare = compare
    if one_buffer and ranges != "even":
        assert len(flat.flat.runs) == 1  # one compare over one view of the buffer
    meta = ModelMeta("bfloat16", layout.hf_shapes)
    codec = CodecConfig(encoding=encoding)
    for step in range(1, 4):
        shard.step()
        changes = host.local_changes()
        expected = encode_fragment(
            changes, meta, version=step, base_version=step - 1, fragment=(1, 2), codec=codec
        )
        diff = flat.local_diff()
        got = diff.fragment(meta, version=step, base_version=step - 1, fragment=(1, 2), codec=codec)
        assert got == expected, step
        # the decoded lists match the oracle's too (SGLang's per-rank split takes them)
        assert _by_name(diff.changes()) == _by_name(changes, drop_old=encoding == "overwrite")


def _by_name(changes, *, drop_old: bool = False) -> dict[str, tuple[list, list, list | None]]:
    """{name: (indices, old, new)} sorted by index, one entry per HF tensor."""
    parts: dict[str, list] = {}
    for name, idx, old, new in changes:
        parts.setdefault(name, []).append((idx, old, new))
    out = {}
    for name, items in parts.items():
        idx = np.concatenate([i for i, _, _ in items])
        order = np.argsort(idx)
        new = np.concatenate([w for _, _, w in items])[order].astype(np.uint16)
        old = None if drop_old or items[0][1] is None else np.concatenate([o for _, o, _ in items])[order]
        out[name] = (
            idx[order].tolist(),
            None if old is None else old.astype(np.uint16).tolist(),
            new.tolist(),
        )
    return out


def _hf_state(layout: ModelLayout, shard: Shard) -> dict[str, torch.Tensor]:
    state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in layout.hf_shapes.items()}
    for pmap in layout.shard(0, 0).values():
        for name, rows, cols, view in layout.hf_pieces(pmap, shard.params[pmap.name]):
            (state[name][rows] if cols is None else state[name][rows, cols]).copy_(view)
    return state


def test_receiver_of_flat_fragments_is_bit_identical(group):
    layout = _layout(1)
    shard = Shard(layout, 0, one_buffer=True, seed=3)
    _, flat = _syncers(shard, layout, 0, even_ranges(shard, 0, 1), group, "sub")
    receiver = HFReceiver(_hf_state(layout, shard), version=0)
    meta = ModelMeta("bfloat16", layout.hf_shapes)
    for step in range(1, 4):
        shard.step()
        receiver.apply(flat.local_diff().fragment(meta, version=step, base_version=step - 1, fragment=(0, 1)))
        want = _hf_state(layout, shard)
        assert receiver.version == step
        assert all(torch.equal(receiver.state[n].view(torch.int16), want[n].view(torch.int16)) for n in want)


class _Count(TorchDispatchMode):
    """Counts aten ops by name; device moves (`_to_copy` with a device) separately."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.moves = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        if name == "_to_copy" and "device" in (kwargs or {}):
            self.moves += 1
        return func(*args, **(kwargs or {}))


def test_one_nonzero_one_copy_no_host_pass(group, monkeypatch):
    layout = _layout(2)
    shard = Shard(layout, 1, one_buffer=True, seed=5)
    _, flat = _syncers(shard, layout, 1, _buffer_ranges(shard, 0, 2), group, "sub")
    flat.flat.compare = "torch"  # the device's compare (host memory is compared by numpy)
    shard.step()
    numel = flat.flat.snapshot.numel()
    read: list[int] = []  # elements of every tensor the host reads through numpy / tolist / item
    for method in ("numpy", "tolist", "item"):
        original = getattr(torch.Tensor, method)

        def spy(self, *a, _original=original, **k):
            read.append(self.numel())
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, spy)
    with _Count() as count:
        diff = flat.local_diff()
    monkeypatch.undo()
    changed = sum(run[0] for _, run in diff.runs)
    assert 1000 < changed < numel // 10
    assert count.ops["nonzero"] == 1 and count.moves == 1
    assert "_local_scalar_dense" not in count.ops  # no .item() anywhere
    # the host read one buffer: a few bytes per changed element (plus fixed room), nothing O(numel)
    assert len(read) == 1 and read[0] <= 8 * changed + 8 * 4 * (4 + len(layout.hf_shapes)) + 64
