"""RoPE cos/sin tables cached (`model_providers.rope`, megatron's fused-RoPE slot on the local spec):
logits and every gradient bit-identical to megatron's unfused RoPE (`rope_cache=False`) in fp32 and
bf16, over forwards at two sequence lengths; the tables are computed once per length and dtype
instead of twice per layer per forward (aten `cos`/`sin` counted)."""

from __future__ import annotations

import pytest
import torch
from single_process import cpu_runtime, tiny_qwen2_config
from torch.utils._python_dispatch import TorchDispatchMode

HF = tiny_qwen2_config(num_hidden_layers=3)


@pytest.fixture(scope="module")
def rt():
    with cpu_runtime(seed=7) as runtime:
        yield runtime


class _Count(TorchDispatchMode):
    """Counts aten ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _model(rt, dtype: str, rope_cache: bool, state: dict | None = None):
    import model_providers

    torch.manual_seed(3)
    spec = model_providers.build_spec(HF, rt.parallel, params_dtype=dtype, cpu=True, rope_cache=rope_cache)
    assert spec.config.apply_rope_fusion is rope_cache
    model = model_providers.build_model(
        spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups
    )
    if state is not None:
        model.load_state_dict(state)
    return model


def _run(model, lengths: list[int]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], _Count]:
    """Logits of one forward per length, the summed gradients, and the ops of the whole run."""
    g = torch.Generator().manual_seed(1)
    logits = []
    with _Count() as count:
        for s in lengths:
            tokens = torch.randint(0, HF["vocab_size"], (2, s), generator=g)
            out = model(tokens, torch.arange(s).unsqueeze(0), None)
            torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens.flatten()).backward()
            logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads, count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_rope_is_bit_identical_and_computes_each_table_once(rt, dtype):
    from model_providers import rope

    unfused = _model(rt, dtype, rope_cache=False)
    cached = _model(rt, dtype, rope_cache=True, state=unfused.state_dict())
    lengths = [12, 12, 7, 12, 7]  # two lengths, repeated
    want_logits, want_grads, plain_ops = _run(unfused, lengths)
    before = rope.TABLES.computed
    got_logits, got_grads, cached_ops = _run(cached, lengths)
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits, strict=True))
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads), dtype
    layers = HF["num_hidden_layers"]
    # megatron's unfused RoPE: cos and sin for q and for k in every layer of every forward
    assert plain_ops.ops["cos"] == plain_ops.ops["sin"] == 2 * layers * len(lengths)
    # cached: once per length (this dtype)
    assert cached_ops.ops["cos"] == cached_ops.ops["sin"] == 2
    assert rope.TABLES.computed - before == 2


def test_rope_cache_needs_the_local_spec(rt):
    import model_providers

    with pytest.raises(ValueError, match=r"rope_cache=True needs the local spec.*'transformer_engine'"):
        model_providers.build_spec(
            HF, rt.parallel, cpu=True, transformer_impl="transformer_engine", rope_cache=True
        )
    assert model_providers.build_spec(HF, rt.parallel, cpu=True).config.apply_rope_fusion  # default on
