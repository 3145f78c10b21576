"""Token sampling with the log-prob convention the learner shares.

The returned log-prob of a token is log_softmax(logits / T)[token] computed BEFORE top-k / top-p
filtering (T = 1 for greedy requests). It is the quantity the learner recomputes for pi_old and
pi_theta, so the importance ratios compare like with like; the truncation only shapes which
tokens can be drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparserl_mcore.rollout.engine.host_ints import long_tensor
from sparserl_mcore.rollout.protocol import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of fp32 logits [B, V]; returns (tokens, log-probs).

    The draws stay on the device: one read-back per call (tokens and log-probs together), never
    one per row, since on a GPU each read-back waits for the device."""
    temps = [p.temperature or 1.0 for p in params]
    scaled = logits.float()
    if any(t != 1.0 for t in temps):
        scaled = scaled / torch.tensor(temps, dtype=torch.float32, device=logits.device)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if not drawn:
        chosen = logits.max(dim=-1).indices  # argmax's first-maximum index; max measured faster on CPU
    else:
        # the [B, V] argmax only when some row is greedy: an all-sampled (RL) batch skips it
        everyone = len(drawn) == len(params)  # then no row-gather copies of [B, V] below
        chosen = (
            torch.zeros(len(params), dtype=torch.int64, device=logits.device)
            if everyone
            else logits.max(dim=-1).indices
        )
        probs = (logp if everyone else logp[drawn]).exp()  # one op for every sampled row
        # Unfiltered rows sharing a generator (unseeded requests share the engine's) draw in one
        # call; a seeded request has its own generator, so its draws never depend on the batch.
        shared: dict[int, list[int]] = {}
        for i, row in enumerate(drawn):
            if _filtered(params[row], probs.shape[1]):
                chosen[row] = _draw(probs[i], params[row], generators[row])
            else:
                shared.setdefault(id(generators[row]), []).append(i)
        for rows in shared.values():
            picks = torch.multinomial(_rows(probs, rows), 1, generator=generators[drawn[rows[0]]])[:, 0]
            if everyone and len(rows) == len(drawn):
                chosen = picks
            else:
                chosen[long_tensor([drawn[i] for i in rows], logits.device)] = picks
    picked = logp.gather(1, chosen[:, None])[:, 0]
    # one read-back: float64 holds every token id and every fp32 log-prob exactly
    tokens, logprobs = torch.stack([chosen.double(), picked.double()]).tolist()
    return [int(t) for t in tokens], logprobs


def _rows(probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """probs[rows]; all rows or a single one (a seeded request) as a view: the same values, so the
    same draw, without a row-gather copy."""
    if len(rows) == probs.shape[0]:
        return probs
    return probs[rows[0] : rows[0] + 1] if len(rows) == 1 else probs[rows]


def _filtered(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _draw(probs: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """Sample from probs [V] restricted to the top-k, then the top-p nucleus, then the tokens with
    at least min_p times the largest probability (SGLang's order; the largest is never dropped)."""
    if 0 < p.top_k < probs.shape[0]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0) / sorted_probs.sum()
        # Keep each token whose preceding mass is below top_p (so the most likely one always stays).
        drop = (cum - sorted_probs / sorted_probs.sum()) >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return torch.multinomial(probs, 1, generator=gen)[0]  # on the device: no read-back per row
