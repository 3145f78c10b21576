"""SGLang 0.5.23's returned token log-probs against the convention our loss correction assumes.

Ours (`rollout/engine/sampler.py`): a token's log-prob is log_softmax(logits / T)[token] BEFORE top-k /
top-p truncation (T = 1 for greedy), which the learner recomputes with `loss/vocab_parallel.py:
vocab_parallel_logprobs(temperature=T)`. SGLang's real `layers/sampler.py: Sampler.forward` runs
on CPU (pytorch sampling backend) in tests/sglang_sampler_worker.py on a batch of our requests
(T=0.7 top_p=0.9, T=1.3 top_k=5, greedy); the log-probs it writes to `LogitsProcessorOutput.
next_token_logprobs` (what /generate returns as `output_token_logprobs`) are compared with the
learner's function on the tokens SGLang drew. Once with SGLang's default environment, once with
SGLANG_RETURN_ORIGINAL_LOGPROB=1 (read at import: the worker reloads the module), which drops T:
the reason our launcher pins it to 0. Not covered: the CUDA backends (flashinfer's fused sampler
draws the token, the returned log-prob is computed by the same lines), a real server's scheduler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_support import free_port
from sglang_cpu import require_sglang

from sparserl_mcore.loss.vocab_parallel import vocab_parallel_logprobs
from sparserl_mcore.rollout.engine.sampler import sample
from sparserl_mcore.rollout.protocol import SamplingParams

HERE = Path(__file__).parent
TEMPERATURE = {"top_p": 0.7, "top_k": 1.3, "greedy": 1.0}  # the worker's KINDS; greedy is T=1
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The worker's findings, "default" and "original" (SGLANG_RETURN_ORIGINAL_LOGPROB=1)."""
    require_sglang()
    out = tmp_path_factory.mktemp("sampler") / "found.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
    cmd = [sys.executable, str(HERE / "sglang_sampler_worker.py"), str(free_port()), str(out)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout.decode(errors='replace')[-3000:]}"
    return json.loads(out.read_text())


def _rows(run: dict, batch: str) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kinds, logits [N, V] fp32, SGLang's tokens [N], SGLang's log-probs [N]) of one batch."""
    b = run[batch]
    logits = torch.tensor([run["logits"][kind] for kind in b["rows"]], dtype=torch.float32)
    return b["rows"], logits, torch.tensor(b["tokens"]), torch.tensor(b["logprobs"])


def _learner(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """What the learner recomputes for these tokens at the sampler's temperature."""
    logp, _ = vocab_parallel_logprobs(logits, tokens, group=None, vocab_start=0, temperature=temperature)
    return logp


def _by_kind(kinds: list[str], kind: str) -> torch.Tensor:
    return torch.tensor([k == kind for k in kinds])


def _kept(kind: str, logits: torch.Tensor) -> list[int]:
    """The tokens a request of this kind may draw from one row of logits (SGLang's rules)."""
    if kind == "top_k":
        return logits.topk(5).indices.tolist()
    if kind == "top_p":
        probs, order = torch.softmax(logits / 0.7, dim=-1).sort(descending=True)
        return order[(probs.cumsum(0) - probs) <= 0.9].tolist()  # mass before a token <= top_p
    return [int(logits.argmax())]


def test_sglang_runs_its_cpu_path_and_drops_our_seeds(runs):
    for run, original in ((runs["default"], False), (runs["original"], True)):
        assert run["backend"] == "pytorch" and run["return_original_logprob"] is original
        assert run["mixed"]["temperatures"] == pytest.approx([0.7] * 200 + [1.3] * 200 + [1.0] * 200)
        assert not run["mixed"]["is_all_greedy"] and run["all_greedy"]["is_all_greedy"]
        # our per-request seed reaches SGLang as sampling_seed, which only deterministic inference reads
        assert not run["mixed"]["seeds_used"]


def test_default_logprobs_are_ours_before_truncation(runs):
    kinds, logits, tokens, got = _rows(runs["default"], "mixed")
    for kind, temperature in TEMPERATURE.items():
        rows = _by_kind(kinds, kind)
        expected = _learner(logits[rows], tokens[rows], temperature)
        torch.testing.assert_close(got[rows], expected, rtol=0, atol=ATOL)
        if kind != "greedy":  # and not the truncated distribution's: that differs by > 0.05 here
            row = logits[rows][0]
            kept_mass = torch.softmax(row / temperature, dim=-1)[_kept(kind, row)].sum()
            assert (got[rows] - (expected - kept_mass.log())).abs().min() > 0.05


def test_drawn_tokens_respect_top_k_and_top_p(runs):
    kinds, logits, tokens, _ = _rows(runs["default"], "mixed")
    for kind, temperature in TEMPERATURE.items():
        rows = _by_kind(kinds, kind)
        kept = _kept(kind, logits[rows][0])
        assert set(tokens[rows].tolist()) <= set(kept)
        if kind != "greedy":  # a sample (not a constant) from a truncation that drops real mass
            assert len(set(tokens[rows].tolist())) >= 3
            assert torch.softmax(logits[rows][0] / temperature, dim=-1)[kept].sum() < 0.99
        else:
            assert set(tokens[rows].tolist()) == set(kept)


def test_greedy_matches_our_sampler(runs):
    for batch in ("mixed", "all_greedy"):
        kinds, logits, tokens, got = _rows(runs["default"], batch)
        rows = _by_kind(kinds, "greedy")
        greedy = [SamplingParams(temperature=0.0)]
        ours_tokens, ours_logp = sample(logits[rows][:1], greedy, [torch.Generator()])
        assert set(tokens[rows].tolist()) == set(ours_tokens)
        torch.testing.assert_close(got[rows], torch.full_like(got[rows], ours_logp[0]), rtol=0, atol=ATOL)


def test_return_original_logprob_drops_the_temperature(runs):
    kinds, logits, tokens, got = _rows(runs["original"], "mixed")
    for kind, temperature in TEMPERATURE.items():
        rows = _by_kind(kinds, kind)
        torch.testing.assert_close(got[rows], _learner(logits[rows], tokens[rows], 1.0), rtol=0, atol=ATOL)
        if kind != "greedy":  # what the learner would compare it with is another number
            gap = (got[rows] - _learner(logits[rows], tokens[rows], temperature)).abs().max()
            assert gap > 0.05
    kinds, logits, tokens, got = _rows(runs["original"], "all_greedy")
    torch.testing.assert_close(got, _learner(logits, tokens, 1.0), rtol=0, atol=ATOL)
