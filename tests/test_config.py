"""Run config: YAML + dotted overrides, typed parsing, and errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparserl_mcore.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    load_config,
    load_config_text,
    to_dict,
    to_yaml,
)

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
BASE = {"model": {"hf_path": "m"}, "data": {"train_path": "t.jsonl"}}


def build(*overrides: str) -> RunConfig:
    return config_from_dict(BASE, overrides)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load_and_round_trip(path: Path) -> None:
    cfg = load_config(path)
    assert load_config_text(to_yaml(cfg)) == cfg
    assert config_from_dict(to_dict(cfg)) == cfg


def test_examples_cover_demo_and_h100_configs() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"demo.yaml", "qwen2.5-1.5b-math.yaml", "qwen2.5-7b-math.yaml"} <= names


def test_dotted_overrides_are_typed_by_the_schema() -> None:
    cfg = build(
        "train.steps=7",
        "optimizer.lr=3e-6",  # YAML 1.1 reads this as a string; the float field parses it
        "optimizer.betas=[0.9, 0.95]",
        "data.prompt_key=123",  # a str field keeps the text
        "rollout.kv.method=snapkv",
        "rollout.kv.budget=64",
        "rollout.kv.interval=16",
        "sync.codec.zstd_level=null",
        "checkpoint.save_hf=none",
        "dgg.enabled=false",
        "parallel.tensor_model_parallel_size=2",
    )
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 3e-6 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.data.prompt_key == "123" and cfg.rollout.kv.method == "snapkv" and cfg.rollout.kv.budget == 64
    assert cfg.sync.codec.zstd_level is None and cfg.checkpoint.save_hf is None and cfg.dgg.enabled is False
    assert cfg.parallel.tensor_model_parallel_size == 2


def test_async_is_off_by_default_and_round_trips_under_its_keyword_key() -> None:
    assert build().train.async_.mode == "off" and build().train.async_.ahead == 0
    cfg = build("train.async.mode=in_flight", "train.async.max_staleness=3")
    assert cfg.train.async_.ahead == 3
    assert "async:" in to_yaml(cfg) and load_config_text(to_yaml(cfg)) == cfg
    # YAML 1.1 reads an unquoted `off` as false, in a file and in an override alike
    text = "model: {hf_path: m}\ndata: {train_path: t.jsonl}\ntrain: {async: {mode: off}}\n"
    assert (
        load_config_text(text).train.async_.mode == "off" == build("train.async.mode=off").train.async_.mode
    )


def test_remote_engine_urls_from_an_override() -> None:
    cfg = build("rollout.engine=remote", "rollout.urls=[http://a:1, http://b:2]")
    assert cfg.rollout.urls == ("http://a:1", "http://b:2")
    assert cfg.rollout.server == "sparserl"  # `sparserl serve` unless said otherwise
    sglang = build("rollout.engine=remote", "rollout.urls=[http://a:1]", "rollout.server=sglang")
    assert sglang.rollout.server == "sglang" and sglang.sync.broadcast is None  # full syncs over HTTP
    sglang = build(
        "rollout.engine=remote", "rollout.urls=[http://a:1]", "rollout.server=sglang",
        "sync.broadcast={master_address: node0, bucket_mb: 64}",
    )  # fmt: skip
    assert sglang.sync.broadcast is not None and sglang.sync.broadcast.master_port == 29700
    routed = build(
        "rollout.engine=remote",
        "rollout.urls=[http://a:1]",
        "rollout.server=sglang",
        "rollout.router_url=http://r:9",
    )
    assert routed.rollout.router_url == "http://r:9"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.stepz=3"], ["unknown key train.stepz", "steps", "prompts_per_step"]),
        (["trian.steps=3"], ["unknown key trian", "train", "rollout"]),
        (["rollout.kv.budgett=3"], ["unknown key rollout.kv.budgett", "budget", "interval"]),
        (["rollout.engine=sglang"], ["rollout.engine", "'sglang'", "embedded, remote"]),
        (["train.steps=ten"], ["train.steps", "expected an integer", "'ten'"]),
        (["train.steps=1.5"], ["train.steps", "expected an integer"]),
        (["dgg.enabled=maybe"], ["dgg.enabled", "true or false"]),
        (["optimizer.lr=fast"], ["optimizer.lr", "expected a number"]),
        (["optimizer.betas=[0.9]"], ["optimizer.betas", "expected 2 values"]),
        (["rollout.kv.method=lru"], ["rollout.kv", "method='lru'", "snapkv"]),
        (["loss.correction.mode=clip"], ["loss.correction", "mode='clip'", "sparse_rl"]),
        (["loss.policy.aggregation=sum"], ["loss.policy", "aggregation='sum'", "seq_mean"]),
        (["dgg.statistic=z"], ["dgg", "statistic='z'", "dg"]),
        (["dgg.max_reuse=4"], ["dgg.max_reuse moved to train.reuse_epochs", "DGG only ends it early"]),
        (["train.reuse_epochs=0"], ["train", "reuse_epochs=0", "> 0"]),
        (["rollout.group_size=1"], ["rollout", "group_size=1", ">= 2"]),
        (["train.steps.max=3"], ["train.steps", "expected an integer"]),
        (["train.steps"], ["KEY=VALUE"]),
        (["rollout.engine=remote"], ["needs urls"]),
        (["rollout.server=vllm"], ["rollout.server", "'vllm'", "sparserl, sglang"]),
        (["rollout.server=sglang"], ["server='sglang' names remote servers", "engine=remote"]),
        (["rollout.router_url=http://r:9"], ["router_url fronts SGLang servers", "server=sglang"]),
        (
            ["rollout.engine=remote", "rollout.urls=[http://a:1]", "rollout.router_url=http://r:9"],
            ["router_url fronts SGLang servers"],
        ),
        (
            [
                "rollout.engine=remote",
                "rollout.urls=[http://a:1]",
                "rollout.server=sglang",
                "rollout.router_url=http://a:1",
            ],
            ["router_url='http://a:1'", "other than the worker urls"],
        ),
        # the rollout fleet's faults (issue 35)
        (["rollout.max_retries=-1"], ["rollout", "max_retries=-1", ">= 0"]),
        (["rollout.retry_backoff_s=soon"], ["rollout.retry_backoff_s", "expected a number", "'soon'"]),
        (["rollout.retry_backoff_s=-1"], ["retry_backoff_s=-1", ">= 0 seconds"]),
        (["rollout.probe_interval_s=-2"], ["probe_interval_s=-2", "0: never probe"]),
        (
            ["rollout.engine=remote", "rollout.urls=[http://a:1, http://b:1, http://a:1/]"],
            ["urls lists http://a:1, http://a:1/ more than once", "list each server once"],
        ),
        (["sync.transport=http"], ["unknown key sync.transport", "codec", "every"]),
        (["sync.broadcast={master_address: n0}"], ["sync.broadcast", "needs rollout.server=sglang"]),
        (["sync.broadcast={master_address: ''}"], ["sync.broadcast", "master_address is empty"]),
        (["sync.broadcast={master_address: n0, master_port: 0}"], ["master_port=0", "TCP port"]),
        (["rollout.sampling.seed=3"], ["rollout.sampling.seed=3", "from train.seed"]),
        (["train.prompts_per_step=3"], ["3 * 8 = 24", "global_batch_size=256"]),
        # every number inside the range its consumer takes (issue 27)
        (["train.seed=-1"], ["train", "seed=-1", "[0, 2147483647]", "numpy seeds take 32 bits"]),
        (["train.seed=2147483648"], ["seed=2147483648", "[0, 2147483647]"]),
        (["train.steps=9223372036854775808"], ["train.steps", "does not fit a 64-bit integer"]),
        (["optimizer.lr=nan"], ["optimizer.lr: nan is not a setting"]),
        (["optimizer.lr=.inf"], ["optimizer.lr: inf is not allowed here"]),
        (["optimizer.betas=[0.9, .nan]"], ["optimizer.betas[1]: nan"]),
        (["rollout.request_timeout_s=1e999"], ["rollout.request_timeout_s: inf"]),
        (
            ["rollout.request_timeout_s=1e300"],
            ["rollout", "request_timeout_s=1e+300: must be <= 9.22337e+09"],
        ),
        (["rollout.kv.rkv_lambda=-inf"], ["rollout.kv.rkv_lambda: -inf is not allowed"]),
        (["loss.policy.kl_coef=inf"], ["loss.policy.kl_coef: inf is not allowed"]),
        (["dgg.eps=nan"], ["dgg.eps: nan"]),
        (["train.steps=[1"], ["cannot parse '[1'", "(line 1, column 3)"]),
        (["train.async.mode=later"], ["train.async.mode", "'later'", "off, one_step, in_flight"]),
        (["train.async.max_staleness=0"], ["max_staleness=0", "staleness 0 is mode=off"]),
        (["train.async.mode=one_step", "train.async.max_staleness=2"], ["exactly one batch ahead"]),
        (["train.async.mode=in_flight", "sync.every=2"], ["sync.every=2", "set sync.every=1"]),
        (
            ["train.async.mode=in_flight", "loss.correction.mode=off"],
            ["loss.correction.mode=off", "behavior correction"],
        ),
        (["train.async_.mode=off"], ["unknown key train.async_", "async"]),
        (
            [
                "model.moe.routing_replay=true",
                "rollout.engine=remote",
                "rollout.urls=[http://a:1]",
                "rollout.server=sglang",
                "rollout.kv.method=snapkv",
            ],
            ["routing_replay=true with rollout.server=sglang and rollout.kv.method=snapkv", "by KV slot"],
        ),
        (
            [
                "model.moe.routing_replay=true",
                "rollout.engine=remote",
                "rollout.urls=[http://a:1]",
                "rollout.server=sglang",
                "rollout.router_url=http://r:9",
            ],
            ["routing_replay=true with rollout.router_url", "drops return_routed_experts"],
        ),
        (
            ["parallel.islands=2", "parallel.expert_model_parallel_size=2"],
            ["islands=2 with expert_model_parallel_size=2", "cut its token all-to-all", "docs/islands.md"],
        ),
    ],
)
def test_errors_name_the_key_and_the_allowed_values(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build(*overrides)
    for fragment in expected:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_an_infinite_bound_is_a_setting_only_where_it_means_no_bound() -> None:
    cfg = build(
        "loss.correction.truncate_max=inf", "loss.correction.reject_high=.inf", "train.seed=2147483647"
    )
    assert cfg.loss.correction.truncate_max == cfg.loss.correction.reject_high == float("inf")
    assert cfg.train.seed == 2**31 - 1
    with pytest.raises(ConfigError, match="nan is not a setting"):
        build("loss.correction.truncate_max=nan")


def test_missing_required_key_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing required key model.hf_path"):
        config_from_dict({"model": {}, "data": {"train_path": "t"}})
    with pytest.raises(ConfigError, match="missing required key data"):
        config_from_dict({"model": {"hf_path": "m"}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hf_path: m\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML: .* \(line 2, column 1\)$") as err:
        load_config(bad)
    assert "\n" not in str(err.value)  # PyYAML's own text spans several lines
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: {hf_path: m}\ndata: {train_path: t}\ntrain: 5\n")
    with pytest.raises(ConfigError, match="nested.yaml: train: expected a mapping"):
        load_config(nested)


def test_file_values_and_overrides_compose(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {hf_path: m}\ndata: {train_path: t}\ntrain: {steps: 5, seed: 3}\n")
    cfg = load_config(path, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.seed) == (9, 3)
