"""`sparserl sglang-serve`'s process handling, command line and refusals, without SGLang running.

Process handling runs against a REAL stand-in server process: our own `sparserl serve` on a tiny
checkpoint, started through the same `ServerProcess` (own process group, health wait, teardown).
The command line is checked against SGLang's own parser in tests/test_sglang_loader.py, and a
real SGLang started through it in tests/test_sglang_live.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from e2e_support import free_port

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
from sparserl_mcore.sglang import cli
from sparserl_mcore.sglang.client import SGLangWorker
from sparserl_mcore.sglang.launch import (
    CPU_SITE,
    PLUGIN_ENV,
    LaunchConfig,
    ServerProcess,
    check_model,
    child_env,
    sglang_argv,
)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stand_in_server_is_waited_for_used_and_torn_down(tmp_path):
    hf = make_tiny(TinyModelConfig(), tmp_path / "tiny")
    port = free_port()
    cfg = LaunchConfig(model_path=str(hf), port=port, startup_timeout_s=120, grace_s=10)
    argv = [sys.executable, "-m", "sparserl_mcore", "serve", "--hf-dir", str(hf), "--port", str(port)]
    with ServerProcess(cfg, argv=argv) as server:
        server.wait_healthy()
        worker = SGLangWorker(cfg.url, retries=0)
        worker.pause()
        worker.flush_cache()
        worker.resume()
        worker.close()
        pid = server.proc.pid
    assert server.proc.returncode is not None and not _alive(pid)


def test_a_child_that_dies_during_startup_is_reported(tmp_path):
    cfg = LaunchConfig(model_path="unused", port=free_port(), startup_timeout_s=60)
    with ServerProcess(cfg, argv=[sys.executable, "-c", "raise SystemExit(3)"]) as server:
        with pytest.raises(RuntimeError, match="exited with code 3"):
            server.wait_healthy()


def test_command_line_and_environment():
    cfg = LaunchConfig(model_path="/m", host="0.0.0.0", port=31000, tp_size=4, token="0123456789")
    argv = sglang_argv(cfg)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert (
        argv[argv.index("--custom-weight-loader") + 1] == "sparserl_mcore.sglang.loader.load_patch_fragments"
    )
    assert argv[argv.index("--admin-api-key") + 1] == "0123456789"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"  # our patches are BF16 (SGLang: fp32 -> fp16)
    assert "--device" not in argv and "PYTHONPATH" not in child_env(cfg, {})  # on a GPU box: nothing
    env = child_env(cfg, {"SGLANG_PLUGINS": "other"})
    assert env["SGLANG_PLUGINS"] == "other,sparserl" and PLUGIN_ENV in env
    assert "SGLANG_PLUGINS" not in child_env(cfg, {})  # unrestricted: every installed plugin loads
    # log-probs at the sampling temperature, what the learner recomputes, even if the caller set it
    original = "SGLANG_RETURN_ORIGINAL_LOGPROB"
    assert child_env(cfg, {original: "1"})[original] == "false"
    assert "--page-size" not in argv and "--disable-overlap-schedule" not in argv  # no KV: SGLang's defaults
    assert "--enable-return-routed-experts" not in argv
    routed = LaunchConfig(model_path="/m", return_routed_experts=True)
    assert "--enable-return-routed-experts" in sglang_argv(routed)  # what routing replay needs


@pytest.mark.parametrize("method, graphs_off", [("snapkv", True), ("streamingllm", False)])
def test_kv_compression_launches_with_the_settings_the_plugin_needs(method, graphs_off):
    cfg = LaunchConfig(model_path="/m", kv=KVCompressionConfig(method=method, budget=256, interval=64))
    argv = " ".join(sglang_argv(cfg))
    assert "--page-size 1 --disable-overlap-schedule" in argv
    assert ("--cuda-graph-backend-decode disabled" in argv) == graphs_off  # query capture runs in Python
    assert ("--cuda-graph-backend-prefill disabled" in argv) == graphs_off  # the prompt's last queries too
    assert json.loads(child_env(cfg, {})[PLUGIN_ENV])["kv"]["budget"] == 256


@pytest.mark.parametrize(
    "method, given, passed",
    [
        ("snapkv", None, 256),
        ("rkv", 64, 64),
        ("streamingllm", None, None),
        ("streamingllm", 32, 32),
        ("none", None, None),
    ],
)
def test_max_running_requests_reaches_sglang_and_the_plugin(method, given, passed):
    """The query ring (snapkv, rkv) has one row per request SGLang may run: the launcher passes
    SGLang an explicit --max-running-requests and the plugin the same number."""
    cfg = LaunchConfig(model_path="/m", kv=KVCompressionConfig(method=method), max_running_requests=given)
    argv = sglang_argv(cfg)
    got = int(argv[argv.index("--max-running-requests") + 1]) if "--max-running-requests" in argv else None
    assert got == passed == json.loads(child_env(cfg, {})[PLUGIN_ENV])["max_running_requests"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"host": "0.0.0.0"}, "no token"),
        ({"port": 0}, "port=0"),
        ({"kv": KVCompressionConfig(method="h2o")}, "does not work inside SGLang"),
        ({"kv": KVCompressionConfig(method="snapkv"), "extra_args": ("--page-size", "16")}, "--page-size"),
        ({"kv": KVCompressionConfig(method="rkv"), "extra_args": ("--speculative-algorithm=X",)}, "specul"),
        ({"extra_args": ("--dtype", "float16")}, "--dtype float16: the trainer's weight patches are BF16"),
        ({"extra_args": ("--dtype=auto",)}, "--dtype auto"),
        ({"extra_args": ("--quantization", "fp8")}, "--quantization: the sparse weight sync"),
        ({"token": ""}, "token is empty"),
        ({"device": "tpu"}, "device='tpu'"),
        (
            {"kv": KVCompressionConfig(method="snapkv"), "extra_args": ("--max-running-requests", "9")},
            "sparserl sglang-serve --max-running-requests",
        ),
        ({"max_running_requests": 0}, "max_running_requests=0"),
        (
            {"kv": KVCompressionConfig(method="streamingllm"), "return_routed_experts": True},
            "--enable-return-routed-experts with KV compression .*by KV slot",
        ),
        (
            {"kv": KVCompressionConfig(method="snapkv"), "extra_args": ("--enable-return-routed-experts",)},
            "--kv-method none for routing replay",
        ),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(model_path="/m", **kwargs)


def test_cpu_mode_runs_sglangs_cpu_engine_with_the_stand_ins_in_every_process():
    cfg = LaunchConfig(model_path="/m", device="cpu")
    argv = " ".join(sglang_argv(cfg))
    assert "--device cpu --attention-backend torch_native --sampling-backend pytorch --sleep-on-idle" in argv
    env = child_env(cfg, {"PYTHONPATH": "/mine"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [CPU_SITE, "/mine"]  # sitecustomize.py runs first
    assert os.path.isfile(os.path.join(CPU_SITE, "sitecustomize.py"))
    assert LaunchConfig(model_path="/m", extra_args=("--dtype", "bfloat16")).extra_args  # the one we pass


def test_a_checkpoint_the_sparse_sync_cannot_serve_is_refused_before_sglang_starts(tmp_path):
    hf = make_tiny(TinyModelConfig(), tmp_path / "tiny")  # 4 heads, 2 KV heads
    check_model(LaunchConfig(model_path=str(hf), tp_size=2))
    with pytest.raises(ValueError, match="no such directory"):
        check_model(LaunchConfig(model_path=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="--tp-size 3: num_attention_heads=4 is not divisible"):
        check_model(LaunchConfig(model_path=str(hf), tp_size=3))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="a quantized checkpoint"):
        check_model(LaunchConfig(model_path=str(hf)))
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--return-routed-experts: .* is a dense model"):
        check_model(LaunchConfig(model_path=str(hf), return_routed_experts=True))


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--model-path", "/nope"], {}, "--model-path /nope: no such directory"),
        (["--model-path", "/m", "--token", ""], {}, "--token (or $SPARSERL_SERVE_TOKEN) is empty"),
        (["--model-path", "/m"], {"SPARSERL_SERVE_TOKEN": ""}, "is empty"),
        (["--model-path", "/m", "--", "--dtype", "float32"], {}, "--dtype float32"),
        (["--model-path", "/m", "--kv-method", "snapkv", "--return-routed-experts"], {}, "by KV slot"),
    ],
)
def test_the_cli_refuses_in_one_line_before_starting_sglang(argv, env, message, monkeypatch, capsys):
    import argparse

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
