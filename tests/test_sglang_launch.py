"""`sparserl sglang-serve`'s process handling, against a REAL stand-in server process.

SGLang itself cannot start here (no CUDA); the stand-in is our own `sparserl serve` on a tiny
checkpoint, started through the same `ServerProcess` (own process group, health wait, teardown),
so what is tested is the launcher's logic, not SGLang. Its command line is checked against
SGLang's own parser in tests/test_sglang_loader.py. The client's pause / flush / continue calls
go to the stand-in's routes of the same names.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from e2e_support import free_port

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
from sparserl_mcore.sglang.client import SGLangWorker
from sparserl_mcore.sglang.launch import PLUGIN_ENV, LaunchConfig, ServerProcess, child_env, sglang_argv


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
    env = child_env(cfg, {"SGLANG_PLUGINS": "other"})
    assert env["SGLANG_PLUGINS"] == "other,sparserl" and PLUGIN_ENV in env
    assert "SGLANG_PLUGINS" not in child_env(cfg, {})  # unrestricted: every installed plugin loads
    # log-probs at the sampling temperature, what the learner recomputes, even if the caller set it
    original = "SGLANG_RETURN_ORIGINAL_LOGPROB"
    assert child_env(cfg, {original: "1"})[original] == "false"
    assert "--page-size" not in argv and "--disable-overlap-schedule" not in argv  # no KV: SGLang's defaults


@pytest.mark.parametrize("method, graphs_off", [("snapkv", True), ("streamingllm", False)])
def test_kv_compression_launches_with_the_settings_the_plugin_needs(method, graphs_off):
    cfg = LaunchConfig(model_path="/m", kv=KVCompressionConfig(method=method, budget=256, interval=64))
    argv = " ".join(sglang_argv(cfg))
    assert "--page-size 1 --disable-overlap-schedule" in argv
    assert ("--cuda-graph-backend-decode disabled" in argv) == graphs_off  # query capture runs in Python
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
        (
            {"kv": KVCompressionConfig(method="snapkv"), "extra_args": ("--max-running-requests", "9")},
            "sparserl sglang-serve --max-running-requests",
        ),
        ({"max_running_requests": 0}, "max_running_requests=0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(model_path="/m", **kwargs)
