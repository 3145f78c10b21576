"""HF transformers greedy decoding: the independent reference the rollout and serve tests compare
the engines' generations against, and the tiny Qwen2 they run (imported by those tests, like
e2e_support)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import transformers


def tiny_qwen2(path: Path, vocab: int, dtype: torch.dtype = torch.float32):
    """A random 2-layer Qwen2 (hidden 64, 4 query / 2 KV heads, EOS the last id, seed 0) saved
    under `path` in `dtype`; returns the fp32 model in eval mode."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        eos_token_id=vocab - 1,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    (model if dtype == torch.float32 else model.to(dtype)).save_pretrained(path)
    return model.float()


def hf_greedy(model, prompt: Sequence[int], n: int, device: str = "cpu") -> list[int]:
    """`n` greedy tokens after `prompt` from an HF causal LM (on `device`), never stopping at EOS."""
    ids = torch.tensor([list(prompt)], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
