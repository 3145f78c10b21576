"""HF transformers greedy decoding: the independent reference the rollout and serve tests compare
the engines' generations against (imported by those tests, like e2e_support)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
