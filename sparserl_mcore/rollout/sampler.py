"""Token sampling with the log-prob convention the learner shares.

The returned log-prob of a token is log_softmax(logits / T)[token] computed BEFORE top-k / top-p
filtering (T = 1 for greedy requests). It is the quantity the learner recomputes for pi_old and
pi_theta, so the importance ratios compare like with like; the truncation only shapes which
tokens can be drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparserl_mcore.rollout.protocol import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of fp32 logits [B, V]; returns (tokens, log-probs)."""
    temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = _draw(logp[row], p, gen)
    chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return tokens, logp.gather(1, chosen[:, None])[:, 0].tolist()


def _draw(logp: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Sample from exp(logp) [V] restricted to the top-k and then the top-p nucleus."""
    probs = logp.exp()
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0) / sorted_probs.sum()
        # Keep each token whose preceding mass is below top_p (so the most likely one always stays).
        drop = (cum - sorted_probs / sorted_probs.sum()) >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))
