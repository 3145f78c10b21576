"""Per-step metrics of a batch of episodes (logged beside the single-turn rollout metrics).

agent/turns_mean: policy turns per episode. agent/end_<reason>: episodes that ended so
(trajectory.END_REASONS: tool_error and tool_timeout count failing tools). agent/tokens_mean:
trajectory length; agent/sampled_tokens_mean: the tokens of it the policy sampled (the loss mask's
ones, unless `on_truncation: mask` zeroed a truncated episode's).
agent/prefill_tokens_turn<k> and agent/cached_tokens_turn<k>: mean prompt tokens turn k computed,
and took from the prefix cache (the engine's radix hit).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparserl_mcore.agent.trajectory import END_REASONS, Episode


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    n = len(episodes)
    out = {
        "agent/turns_mean": sum(len(e.turns) for e in episodes) / n,
        "agent/tokens_mean": sum(len(e.tokens) for e in episodes) / n,
        "agent/sampled_tokens_mean": sum(len(s.output_ids) for e in episodes for s in e.turns) / n,
    }
    out.update({f"agent/end_{r}": float(sum(e.end_reason == r for e in episodes)) for r in END_REASONS})
    turns = max(len(e.turns) for e in episodes)
    for k in range(turns):
        at_k = [e.turns[k] for e in episodes if len(e.turns) > k]
        prefill = [len(s.prompt_ids) - s.cached_prompt_tokens for s in at_k]
        out[f"agent/prefill_tokens_turn{k}"] = sum(prefill) / len(at_k)
        out[f"agent/cached_tokens_turn{k}"] = sum(s.cached_prompt_tokens for s in at_k) / len(at_k)
    return out
