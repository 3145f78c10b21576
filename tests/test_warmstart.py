"""Warm-start mechanics (not quality: the demo and benchmarks/bench_warmstart.py measure that)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparserl_mcore.ckpt.tiny import TinyModelConfig, build_tokenizer, make_tiny
from sparserl_mcore.trainer.tasks import DigitChainTask, generate
from sparserl_mcore.trainer.warmstart import (
    WarmStartConfig,
    _batch,
    _encode,
    generate_completions,
    prepare_policy,
    warm_start,
)


def test_labels_score_only_the_completion_and_eos() -> None:
    tok = build_tokenizer()
    rows = [{"prompt": "sum a1\n", "solution": "a1+0=1\n=1"}, {"prompt": "sum a2b3\n", "solution": "x"}]
    batch = _batch(_encode(tok, rows), tok.pad_token_id)
    labels, ids, mask = batch["labels"], batch["input_ids"], batch["attention_mask"]
    scored = tok.decode([int(t) for t in labels[0] if t >= 0])
    assert scored == "a1+0=1\n=1" + tok.eos_token
    assert tok.decode([int(t) for t in labels[1] if t >= 0]) == "x" + tok.eos_token
    assert (
        int(mask[1].sum()) == len("sum a2b3\nx") + 1
        and int(ids[1, mask[1].sum() :].ne(tok.pad_token_id).sum()) == 0
    )


def test_warm_start_writes_a_loadable_checkpoint_and_is_seeded(tmp_path: Path) -> None:
    tiny = make_tiny(TinyModelConfig(layers=1, hidden=32, heads=2, kv_heads=1, ffn=64), tmp_path / "tiny")
    rows = list(generate(DigitChainTask(length=6), 16, seed=0))  # the demo task, short
    cfg = WarmStartConfig(steps=3, batch_size=4, warmup_steps=1)
    first = warm_start(tiny, rows, tmp_path / "a", cfg)
    second = warm_start(tiny, rows, tmp_path / "b", cfg)
    assert first.steps == 3 and first.final_loss == second.final_loss
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "tiny"]  # no temp dirs left behind
    out = generate_completions(tmp_path / "a", [rows[0]["prompt"]], max_new_tokens=4)
    assert len(out) == 1 and isinstance(out[0], str)
    with pytest.raises(ValueError, match="not empty"):
        warm_start(tiny, rows, tmp_path / "a", cfg)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmStartConfig(steps=3, warmup_steps=3)


def test_prepare_policy_reuses_only_a_warm_start_of_the_same_recipe(tmp_path: Path) -> None:
    small = {
        "task": DigitChainTask(length=4, carry_slip=0.6),
        "model": TinyModelConfig(layers=1, hidden=32, heads=2, kv_heads=1, ffn=64),
        "cfg": WarmStartConfig(steps=2, batch_size=4, warmup_steps=1),
        "n_train": 16,
        "n_eval": 4,
    }
    first = prepare_policy(tmp_path, seed=1, **small)
    assert (
        first.result is not None
        and json.loads((first.model_dir / "recipe.json").read_text())["model"]["seed"] == 1
    )
    assert prepare_policy(tmp_path, seed=1, **small).result is None  # same recipe: reused
    assert prepare_policy(tmp_path, seed=2, **small).result is not None  # another seed: rebuilt
    longer = {**small, "cfg": WarmStartConfig(steps=3, batch_size=4, warmup_steps=1)}
    assert prepare_policy(tmp_path, seed=2, **longer).result is not None  # another schedule: rebuilt
