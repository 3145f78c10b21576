"""Synthetic task generator vs its verifier, tokenizer round trip, datasets, resumable sampler."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparserl_mcore.config import DataConfig
from sparserl_mcore.rewards import digit_chain_reward, running_sum_reward, worked_chain_reward
from sparserl_mcore.trainer.data import PromptSampler, load_datasets, read_examples
from sparserl_mcore.trainer.tasks import (
    DigitChainTask,
    RunningSumTask,
    WorkedChainTask,
    generate,
    write_splits,
)


def _check_steps(prompt: str, solution: str, modulus: int) -> None:
    """Recompute every written step from the prompt, independently of the generator."""
    digits = [int(d) for d in re.findall(r"[a-zA-Z](\d)", prompt)]
    steps = re.findall(r"([a-zA-Z])(\d)\+(\d)=(\d)", solution)
    assert len(steps) == len(digits)
    total = 0
    for (_, d, prev, new), expected in zip(steps, digits, strict=True):
        assert (int(d), int(prev)) == (expected, total)
        total = (total + expected) % modulus
        assert int(new) == total


@pytest.mark.parametrize("task", [DigitChainTask(), DigitChainTask(length=7, lag=3, max_offset=0)])
def test_digit_chains_follow_the_lagged_sum_and_corruptions_score_their_prefix(task: DigitChainTask) -> None:
    assert DigitChainTask(length=8).example([3, 7])["answer"] == "07741561"  # Fibonacci mod 10
    offsets = set()
    for row in generate(task, 200, seed=1):
        given = row["prompt"].removeprefix("chain ")
        offsets.add(len(given) - task.lag)
        digits = [int(d) for d in given + row["solution"]]  # recomputed here, not by the generator
        lag = task.lag
        assert all(digits[t] == (digits[t - 1] + digits[t - lag]) % 10 for t in range(lag, len(digits)))
        assert row["answer"] == row["solution"] and len(row["solution"]) == task.completion_tokens()
        assert digit_chain_reward(row["solution"], row["answer"]) == 1.0
        cut = len(row["answer"]) // 2
        wrong = row["answer"][:cut] + str((int(row["answer"][cut]) + 1) % 10) + row["answer"][cut + 1 :]
        assert digit_chain_reward(wrong, row["answer"]) == cut / len(row["answer"])
    assert offsets == set(range(task.max_offset + 1))
    with pytest.raises(ValueError, match="lag=1"):
        DigitChainTask(lag=1)
    with pytest.raises(ValueError, match="offset=9"):
        task.example([1] * task.lag, offset=9)


@pytest.mark.parametrize("slip", [0.6, 1.0])
def test_slipped_demonstrations_err_only_on_carry_steps_at_the_set_rate(slip: float) -> None:
    task = DigitChainTask(length=24, carry_slip=slip)
    rows = list(generate(task, 400, seed=3))
    carries = slips = 0
    for row in rows:
        digits = [int(d) for d in row["prompt"].removeprefix("chain ") + row["solution"]]
        start = len(digits) - task.length
        for t in range(start, len(digits)):
            total = digits[t - 1] + digits[t - 2]  # the rule applied to what the demonstration wrote
            if total < 10:
                assert digits[t] == total, row
                continue
            carries += 1
            assert digits[t] in (total % 10, (total + 1) % 10), row
            slips += digits[t] == (total + 1) % 10
        clean = DigitChainTask(length=24).example(
            [int(d) for d in row["prompt"][6:8]], offset=len(row["prompt"]) - 8
        )
        assert row["answer"] == clean["answer"]  # the reward always checks the true chain
    assert abs(slips / carries - slip) < 0.03, (slips, carries)
    assert sum(r["solution"] != r["answer"] for r in rows) > 0.9 * len(rows)
    with pytest.raises(ValueError, match="carry_slip"):
        DigitChainTask(carry_slip=1.5)


def test_worked_chains_show_each_lagged_sum_and_follow_the_digit_chain_draws() -> None:
    task = WorkedChainTask(steps=10, carry_slip=0.6)
    chain = DigitChainTask(length=10, lag=2, carry_slip=0.6)
    for row, same in zip(generate(task, 200, seed=4), generate(chain, 200, seed=4), strict=True):
        given = row["prompt"].removeprefix("work ")
        assert given == same["prompt"].removeprefix("chain ")  # same seeds, offsets, slips
        for text, digits in ((row["answer"], same["answer"]), (row["solution"], same["solution"])):
            steps = steps_of(text)
            written = [int(d) for d in given[-2:]] + [c for _, _, c in steps]
            assert [(a, b) for a, b, _ in steps] == list(zip(written, written[1:], strict=False))[
                : len(steps)
            ]
            assert "".join(str(c) for _, _, c in steps) == digits
        assert all((a + b) % 10 == c for a, b, c in steps_of(row["answer"]))  # the reward's truth
        assert len(row["answer"]) == task.completion_tokens() == 59
        assert worked_chain_reward(row["answer"], row["answer"]) == 1.0
    with pytest.raises(ValueError, match="length=0"):
        WorkedChainTask(steps=0)


def steps_of(text: str) -> list[tuple[int, ...]]:
    """(a, b, c) of every `a+b=c` step, parsed here independently of the generator."""
    return [tuple(int(d) for d in re.fullmatch(r"(\d)\+(\d)=(\d)", s).groups()) for s in text.split(" ")]


@pytest.mark.parametrize("task", [RunningSumTask(), RunningSumTask(min_length=3, max_length=20, modulus=7)])
def test_generated_solutions_verify_and_corruptions_do_not(task: RunningSumTask) -> None:
    for row in generate(task, 200, seed=1):
        _check_steps(row["prompt"], row["solution"], task.modulus)
        assert running_sum_reward(row["solution"], row["answer"]) == 1.0
        wrong = str((int(row["answer"]) + 1) % task.modulus)
        assert running_sum_reward(row["solution"][:-1] + wrong, row["answer"]) == 0.0
        assert len(row["solution"]) <= task.completion_tokens()


def test_task_text_round_trips_through_the_tiny_tokenizer() -> None:
    from sparserl_mcore.ckpt.tiny import build_tokenizer

    tok = build_tokenizer()
    for row in generate(RunningSumTask(min_length=1, max_length=52), 50, seed=2):
        for text in (row["prompt"], row["solution"]):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text) and tok.eos_token_id not in ids  # one char, one known token
            assert tok.decode(ids) == text


def test_task_validation_and_length_knob() -> None:
    with pytest.raises(ValueError, match="max_length"):
        RunningSumTask(min_length=5, max_length=60)
    with pytest.raises(ValueError, match="modulus"):
        RunningSumTask(modulus=11)
    short, long = RunningSumTask(min_length=4, max_length=4), RunningSumTask(min_length=16, max_length=16)
    assert len(short.sample(random.Random(0))["solution"]) < len(long.sample(random.Random(0))["solution"])


def test_write_splits_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    task = RunningSumTask(min_length=3, max_length=3)
    train, held = write_splits(task, tmp_path / "a", n_train=300, n_eval=50, seed=5)
    again, _ = write_splits(task, tmp_path / "b", n_train=300, n_eval=50, seed=5)
    assert train.read_text() == again.read_text()
    train_prompts = {json.loads(line)["prompt"] for line in train.read_text().splitlines()}
    eval_prompts = {json.loads(line)["prompt"] for line in held.read_text().splitlines()}
    assert len(eval_prompts) > 40 and not train_prompts & eval_prompts
    assert not list(tmp_path.glob("*/.*tmp*"))


def test_jsonl_and_parquet_with_custom_keys(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "gold": i, "extra": [1]} for i in range(6)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        got = read_examples(path, prompt_key="question", answer_key="gold")
        assert [(e.prompt, e.answer, e.index) for e in got] == [(f"q{i}", str(i), i) for i in range(6)]
    with pytest.raises(
        ValueError, match=r"d\.jsonl:1: missing key 'prompt'; keys present: \['extra', 'gold'"
    ):
        read_examples(jsonl)
    with pytest.raises(ValueError, match=r"missing column 'answer'; columns present"):
        read_examples(parquet, prompt_key="question")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_examples(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="unsupported dataset format '.csv'"):
        read_examples(tmp_path / "d.csv")


def test_held_out_split_by_fraction(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(40)))
    cfg = DataConfig(train_path=str(path), eval_fraction=0.25)
    train, held = load_datasets(cfg, seed=3)
    assert len(held) == 10 and len(train) == 30
    assert not {e.index for e in train} & {e.index for e in held}
    assert [e.index for e in load_datasets(cfg, seed=3)[1]] == [e.index for e in held]
    assert [e.index for e in load_datasets(cfg, seed=4)[1]] != [e.index for e in held]


def test_sampler_resumes_exactly_across_epochs() -> None:
    reference = PromptSampler(10, seed=7)
    uninterrupted = [reference.next_indices(4) for _ in range(8)]  # 3.2 epochs
    sampler = PromptSampler(10, seed=7)
    first = [sampler.next_indices(4) for _ in range(3)]
    state = json.loads(json.dumps(sampler.state_dict()))  # what a checkpoint stores
    resumed = PromptSampler(10, seed=7)
    resumed.load_state_dict(state)
    assert first + [resumed.next_indices(4) for _ in range(5)] == uninterrupted
    flat = [i for batch in uninterrupted for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # each epoch is a fresh permutation
    assert PromptSampler(5, seed=1, shuffle=False).next_indices(7) == [0, 1, 2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="does not match"):
        PromptSampler(11, seed=7).load_state_dict(state)
