"""The public Env contract, the `rollout.env` config section and its one-line errors."""

from __future__ import annotations

import textwrap

import pytest

from sparserl_mcore.agent import Reply, Turn
from sparserl_mcore.config import ConfigError, load_config_text, to_yaml
from sparserl_mcore.trainer.preflight import PreflightError, _check_reward

CONFIG = """
model: {hf_path: m}
data: {train_path: t.jsonl}
rollout:
  env:
    name: lookup_chain
    max_turns: 4
    max_tokens_per_turn: 32
    max_episode_tokens: 256
    tool_timeout_s: 30
reward: {}
"""


class NotAnEnv:
    pass


def test_public_names_and_a_user_env():
    from sparserl_mcore.agent import Env, Reply, Turn

    class MyEnv(Env):
        stop = (";",)

        def reset(self, row: dict) -> str:
            return row["prompt"]

        async def step(self, turn: Turn) -> Reply:
            return Reply(observation="=4\n") if turn.index == 0 else Reply(done=True, reward=1.0)

    env = MyEnv()
    assert env.reset({"prompt": "p"}) == "p"
    turn = Turn(text="?7;", index=0, finish_reason="stop")
    with pytest.raises(AttributeError):
        turn.text = "x"  # type: ignore[misc]  # read-only view
    assert Reply(done=True, reward=1.0).observation == ""


def test_yaml_env_section_with_empty_reward_round_trips():
    cfg = load_config_text(CONFIG)
    assert cfg.rollout.env is not None and cfg.rollout.env.max_tokens_per_turn == 32
    assert cfg.reward.name is None
    assert load_config_text(to_yaml(cfg)) == cfg
    assert load_config_text("model: {hf_path: m}\ndata: {train_path: t.jsonl}\n").reward.name == "math_boxed"


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("rollout.env.max_turns=0", "max_turns=0: must be >= 1"),
        ("reward.name=math_boxed", "reward.name=math_boxed with rollout.env.name=lookup_chain"),
        ("rollout.env.tool_timeout_s=0", "tool_timeout_s=0.0: must be > 0"),
    ],
)
def test_bad_env_config_is_one_line_naming_the_field(override, words):
    with pytest.raises(ConfigError) as err:
        load_config_text(CONFIG, [override])
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:NotAnEnv", "NotAnEnv is not a subclass of sparserl_mcore.agent.Env"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        ("lookup", "not a built-in environment (calculator, lookup_chain)"),
    ],
)
def test_preflight_names_an_env_that_cannot_be_used(name, words):
    cfg = load_config_text(textwrap.dedent(CONFIG), [f"rollout.env.name={name}"])
    with pytest.raises(PreflightError) as err:
        _check_reward(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_builtin_envs_resolve():
    from sparserl_mcore.agent import ENVS, Env, resolve_env

    assert all(issubclass(resolve_env(name), Env) for name in ENVS)
    _check_reward(load_config_text(CONFIG))


def test_lookup_chain_scores_only_the_true_pointer_chase():
    import json

    from sparserl_mcore.agent.envs.lookup_chain import LookupChain, demonstration

    info = {"table": "3917284650", "start": 7, "hops": 2}  # T(7) = 6, T(6) = 4
    row = {"prompt": "hop 2 from 7\n", "answer": json.dumps(info)}
    assert demonstration(info) == "?7;=6 r1\n?6;=4 r0\n!4"
    assert demonstration(info, early=True) == "?7;=6 r1\n!6"
    env = LookupChain()
    assert env.reset(row) == "hop 2 from 7\n"
    assert env.step(Turn("?7;", 0, "stop")) == Reply(observation="=6 r1\n")
    assert env.step(Turn("?6;", 1, "stop")) == Reply(observation="=4 r0\n")
    assert env.step(Turn("!4", 2, "eos")) == Reply(done=True, reward=1.0)
    env.reset(row)
    assert env.step(Turn("!6", 0, "eos")) == Reply(done=True, reward=0.0)  # one hop early
    assert env.step(Turn("?7", 0, "length")).done  # a call cut by the turn cap is no call


def test_calculator_calls_and_refuses_what_is_not_arithmetic():
    import asyncio

    from sparserl_mcore.agent.envs.calculator import Calculator, evaluate

    assert evaluate("3*(17-2)+-4") == 41
    with pytest.raises(ValueError):
        evaluate("__import__('os')")
    env = Calculator()
    env.reset({"prompt": "3*17?", "answer": "51"})
    assert asyncio.run(env.step(Turn("[3*17]", 0, "stop"))) == Reply(observation="=51\n")
    assert asyncio.run(env.step(Turn("so 51", 1, "eos"))) == Reply(done=True, reward=1.0)


def test_the_multi_turn_demo_config_passes_the_demos_checks(tmp_path):
    import argparse

    from sparserl_mcore.demo import AGENT_YAML, add_arguments, checked_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--env", "lookup_chain", "--out", str(tmp_path / "demo")])
    config = checked_config(tmp_path / "demo", args)
    assert config["rollout"]["env"]["name"] == "lookup_chain" and config["reward"]["name"] is None
    assert AGENT_YAML.is_file()
