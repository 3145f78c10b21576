"""Reward verifiers: boxed-answer extraction and normalisation, the synthetic task, the registry."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from sparserl_mcore.rewards import (
    REWARDS,
    build_reward,
    digit_chain_reward,
    running_sum_reward,
    worked_chain_reward,
)
from sparserl_mcore.rewards.math import answers_match, extract_boxed, math_boxed_reward


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{{a}+\sqrt{b}}", r"{a}+\sqrt{b}"),
        (r"\fbox{7}", "7"),
        (r"the answer is \boxed 5$", "5"),
        (r"\boxed{unbalanced", None),
        ("no box here", None),
    ],
)
def test_extract_boxed(text: str, boxed: str | None) -> None:
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac12", "1/2"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        ("1,000", "1000"),
        ("42.", "42"),
        ("2.50", "5/2"),
        ("-3", "-3.0"),
        ("x = 3", "3"),
        (r"30^\circ", "30"),
        (r"10\%", "10"),
        (r"\text{ 7 }", "7"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"),
        ("$12$", "12"),
    ],
)
def test_normaliser_accepts_equivalent_answers(predicted: str, reference: str) -> None:
    assert answers_match(predicted, reference)
    assert math_boxed_reward(rf"... \boxed{{{predicted}}}", reference, use_math_verify=False) == 1.0


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [("3", "4"), ("0.5", "0.25"), (r"\frac{1}{3}", "0.33"), ("12", "1,2"), ("", "0"), ("(1,2)", "(2,1)")],
)
def test_normaliser_rejects_different_answers(predicted: str, reference: str) -> None:
    assert not answers_match(predicted, reference)


def test_math_reward_needs_a_box_and_reads_a_boxed_reference() -> None:
    assert math_boxed_reward("the answer is 4", "4") == 0.0
    assert math_boxed_reward(r"\boxed{4}", r"so \boxed{4}") == 1.0
    assert math_boxed_reward(r"\boxed{5}", "4") == 0.0


def test_running_sum_reward() -> None:
    assert running_sum_reward("a3+0=3 b1+3=4\n=4", "4") == 1.0
    assert running_sum_reward("a3+0=3 b1+3=4\n=4 trailing junk\n=9", "4") == 1.0  # first answer counts
    assert running_sum_reward("a3+0=3 b1+3=4\n=41", "4") == 0.0
    assert running_sum_reward("a3+0=3 b1+3=4", "4") == 0.0
    assert running_sum_reward("=4", "4") == 1.0
    with pytest.raises(ValueError, match="not an integer"):
        running_sum_reward("\n=4", "four")


def test_digit_chain_reward_is_the_correct_prefix_share() -> None:
    assert digit_chain_reward("0774", "0774") == 1.0
    assert digit_chain_reward("0774\njunk", "0774") == 1.0  # what follows a full chain is ignored
    assert digit_chain_reward("0734", "0774") == 0.5  # the right digit after an error earns nothing
    assert digit_chain_reward("07", "0774") == 0.5  # stopped early
    assert digit_chain_reward("", "0774") == 0.0
    with pytest.raises(ValueError, match="not a non-empty digit string"):
        digit_chain_reward("07", "")


def test_worked_chain_reward_counts_whole_steps_before_the_first_wrong_one() -> None:
    answer = "3+7=0 7+0=7 0+7=7"
    assert worked_chain_reward(answer, answer) == 1.0
    assert worked_chain_reward(answer + "junk", answer) == 1.0  # what follows the last step is ignored
    assert worked_chain_reward("3+7=0 7+0=8 0+8=8", answer) == pytest.approx(1 / 3)
    assert worked_chain_reward("3+7=0 7+0=7 0+7=", answer) == pytest.approx(2 / 3)  # stopped mid-step
    assert worked_chain_reward("3+7=07+0=7 0+7=7", answer) == 0.0  # a step needs its separator
    assert worked_chain_reward("", answer) == 0.0
    assert build_reward("worked_chain") is worked_chain_reward
    with pytest.raises(ValueError, match="worked_chain"):
        worked_chain_reward("0774", "0774")


def test_registry_and_import_path_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(REWARDS) == {"digit_chain", "math_boxed", "running_sum", "worked_chain"}
    assert build_reward("running_sum")("\n=3", "3") == 1.0
    with pytest.raises(KeyError, match="digit_chain, math_boxed, running_sum, worked_chain"):
        build_reward("gsm8k")
    (tmp_path / "my_rewards.py").write_text(
        "def length_penalty(completion, answer, *, limit=5):\n"
        "    return 1.0 if answer in completion and len(completion) <= limit else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = build_reward("my_rewards:length_penalty", {"limit": 3})
    assert fn("ab", "a") == 1.0 and fn("abcd", "a") == 0.0
    with pytest.raises(ValueError, match="does not accept kwargs"):
        build_reward("my_rewards:length_penalty", {"limt": 3})
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        build_reward("my_rewards:nope")
    with pytest.raises(ValueError, match="cannot import module"):
        build_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="import path looks like"):
        build_reward("my_rewards:")
    sys.modules.pop("my_rewards", None)


def test_the_runner_names_the_reward_and_the_sample_for_every_misbehaviour():
    """The reward runs in its own process (`rewards.runner`): whatever it does, the caller gets a
    number or one line naming the reward and the sample, and the next call still works."""
    import signal

    from sparserl_mcore.rewards.runner import RewardError, RewardRunner

    name = "e2e_support:misbehaving_reward"
    runner = RewardRunner(name, {}, timeout_s=30)
    try:
        assert runner("fine", "a", sample="s0") == 0.5
        for completion, said in [
            ("raise", f"reward {name} raised ValueError: cannot parse the answer (sample s1)"),
            ("text", f"reward {name} returned 'high', not a number (sample s1)"),
            ("huge", f"reward {name} returned 1e+300 for sample s1 (completion 'huge'): a reward must be"),
            ("exit", f"reward {name}: its process exited (code 3) scoring sample s1"),
        ]:
            with pytest.raises(RewardError) as err:
                runner(completion, "a", sample="s1")
            assert str(err.value).startswith(said) and "\n" not in str(err.value)
            assert runner("fine", "a", sample="s2") == 0.5  # a fresh process if the last one died
        worker = runner._proc
        assert worker is not None
        worker.send_signal(signal.SIGINT)  # Ctrl-C reaches the process group: the trainer decides
        assert runner("fine", "a", sample="s3") == 0.5 and runner._proc is worker
    finally:
        runner.close()
    skipping = RewardRunner(name, {}, timeout_s=30, skip_nonfinite=True)
    try:
        assert math.isnan(skipping("huge", "a", sample="s4"))  # beyond float32: dropped by the caller
    finally:
        skipping.close()


def test_the_reward_process_outlives_the_stop_signals_from_its_first_instruction():
    """The stop signals reach a rank's reward process too (torchrun signals the rank's process
    group; Slurm every process of the step, SIGUSR1 ahead of the time limit), while the stopping
    rank still scores its step. Sent the instant it is spawned (its interpreter still starting) and
    again once it serves, they end nothing."""
    import json
    import signal

    from sparserl_mcore.rewards.runner import spawn_worker

    stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
    worker = spawn_worker()
    assert worker.stdin is not None and worker.stdout is not None

    def ask(message: dict) -> dict:
        worker.stdin.write(json.dumps(message) + "\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
        assert line, f"the reward process died: exit code {worker.wait()}"
        return json.loads(line)

    try:
        for sig in stops:
            worker.send_signal(sig)
        assert ask({"name": "e2e_support:misbehaving_reward", "kwargs": {}}) == {"ready": True}
        for sig in stops:
            worker.send_signal(sig)
        assert ask({"completion": "fine", "answer": "a"}) == {"reward": 0.5}
    finally:
        worker.kill()
        worker.wait()
