"""Start one SGLang server with our weight loader and KV plugin, wait for health, tear it down.

`sparserl sglang-serve` runs `python -m sglang.launch_server` (sglang 0.5.23) as a child in its
own process group with:
- `--custom-weight-loader sparserl_mcore.sglang.loader.load_patch_fragments` (the sparse sync
  seam: `/update_weights_from_tensor` with `load_format` set to that path calls it on every TP
  worker, see docs/sglang.md);
- the plugin's settings in `SPARSERL_SGLANG` (JSON), read by `sparserl_mcore.sglang.plugin` in
  every SGLang process; `SGLANG_PLUGINS` is extended with `sparserl` only when the user already
  restricts the plugins (otherwise every installed plugin loads, ours included);
- with KV compression: `--page-size 1 --disable-overlap-schedule`, and for the policies that score
  with queries `--cuda-graph-backend-decode/-prefill disabled` and `--max-running-requests N` (default
  `RING_MAX_RUNNING_REQUESTS`: the plugin's query ring has N + 1 rows and is allocated when the
  model is loaded, before SGLang sizes its KV pool; docs/sglang.md "KV compression"); flags it
  cannot follow are refused (`KV_REFUSED_FLAGS`);
- `--admin-api-key <token>` when a token is given: SGLang then requires it on the weight, pause
  and flush routes (auth level ADMIN_OPTIONAL) while /generate stays open, the same split as
  `sparserl serve`;
- `--enable-return-routed-experts` with `return_routed_experts` (rollout routing replay: SGLang then
  answers `meta_info["routed_experts"]` to requests that ask, docs/moe.md "R3"); refused with KV
  compression, and on a dense checkpoint (`check_model`);
- `--dtype bfloat16`: our patches carry BF16 bits, and SGLang would otherwise serve a float32 (or
  dtype-less) checkpoint in float16 (`srt/configs/model_config.py: _get_and_verify_dtype`), which
  every patch would then fail against; another `--dtype` among the extra flags is refused;
- with `device="cpu"`: SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`, torch SDPA
  attention, PyTorch sampling, the scheduler asleep when idle) and our stand-ins for the CUDA-only
  packages in every SGLang process (`cpu_site/sitecustomize.py` on PYTHONPATH, `cpu_stubs.py`).
`check_model` refuses, before SGLang starts, a checkpoint the sparse sync cannot serve.
It then polls `GET /health` until 200 (SGLang answers 503 while starting), prints one
`sparserl sglang-serve: ready <url>` line, and waits. SIGTERM / SIGINT, a failed start or the
child's exit end the whole process group (SIGTERM, then SIGKILL after `grace_s`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from sparserl_mcore.rollout.http.server import is_loopback
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
from sparserl_mcore.sglang.loader import LOADER_PATH

DEVICES = ("cuda", "cpu")
SERVED_DTYPE = "bfloat16"  # what the sparse sync's patches carry
CPU_SITE = str(pathlib.Path(__file__).with_name("cpu_site"))  # sitecustomize.py: the CPU stand-ins
# SGLang's CPU engine (x86 default `intel_amx` and the flashinfer sampler call sgl_kernel / CUDA ops)
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch")

PLUGIN_NAME = "sparserl"  # the entry point name in pyproject.toml (group sglang.srt.plugins)
PLUGIN_ENV = "SPARSERL_SGLANG"  # JSON settings of the plugin; unset: the plugin stays inert
SGLANG_MODULE = "sglang.launch_server"
# requests one server decodes at once when a query ring is needed (snapkv, rkv) and none is given:
# SGLang's own default (`mem_cache/kv_cache_configurator.py: resolve_max_num_reqs`, 2048-4096)
# would make the ring 3.3 GB for a 7B model at window 8
RING_MAX_RUNNING_REQUESTS = 256
ROUTER_MODULE = "sglang_router.launch_router"  # sglang-router 0.3.2, the `sglang` extra
# `srt/arg_groups/fields/exec_.py: enable_return_routed_experts`: SGLang captures every MoE layer's
# top-k (`srt/state_capturer/routed_experts.py`) only when started with it
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """One SGLang server. extra_args go to SGLang verbatim, after ours (they may override).
    max_running_requests: SGLang's `--max-running-requests` (None: SGLang's default, or
    `RING_MAX_RUNNING_REQUESTS` when the KV policy keeps a query ring, which is sized from it).
    return_routed_experts: start SGLang with `--enable-return-routed-experts` (routing replay)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    token: str | None = None
    device: str = "cuda"
    kv: KVCompressionConfig = dataclasses.field(default_factory=KVCompressionConfig)
    max_running_requests: int | None = None
    return_routed_experts: bool = False
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 1800.0
    grace_s: float = 30.0
    python: str = sys.executable
    module: str = SGLANG_MODULE

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in [1, 65535] (SGLang needs a fixed port)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size}: must be >= 1")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"host={self.host!r} is reachable from the network but no token is set: pass --token "
                "(or SPARSERL_SERVE_TOKEN) so only the trainer can update weights, or bind 127.0.0.1"
            )
        if self.token is not None and len(self.token) < 8:
            what = "is empty" if not self.token else "is shorter than 8 characters"
            raise ValueError(f"token {what}; use a long random string (or give none on loopback)")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: choose from {list(DEVICES)}")
        _check_sync_launch(self.extra_args)
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests={self.max_running_requests}: must be >= 1")
        if self.kv.enabled:
            _check_kv_launch(self.kv, self.extra_args)
            if self.return_routed_experts or ROUTED_EXPERTS_FLAG in self.extra_args:
                raise ValueError(
                    f"{ROUTED_EXPERTS_FLAG} with KV compression (--kv-method {self.kv.method}): SGLang "
                    "reads a request's routed experts back by KV slot, and the plugin's compaction moves "
                    "kept entries to other slots, so the ids would belong to other tokens; use "
                    "--kv-method none for routing replay"
                )
        if self.running_requests is not None and any(
            a.split("=", 1)[0] == "--max-running-requests" for a in self.extra_args
        ):
            raise ValueError(
                "--max-running-requests among the SGLang flags: pass it as sparserl sglang-serve "
                "--max-running-requests N (the KV plugin's query ring is sized from it)"
            )
        if self.startup_timeout_s <= 0 or self.grace_s <= 0:
            raise ValueError("startup_timeout_s and grace_s must be > 0 seconds")

    @property
    def running_requests(self) -> int | None:
        """The `--max-running-requests` the server gets (None: SGLang chooses)."""
        if self.max_running_requests is None and _needs_query_ring(self.kv):
            return RING_MAX_RUNNING_REQUESTS
        return self.max_running_requests

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


def check_startable(cfg: LaunchConfig) -> None:
    """What SGLang itself needs before it is started, or a ValueError naming the fix: the package,
    and a CUDA device unless `device` is "cpu" (SGLang would otherwise fail after
    seconds of imports with a traceback of its own). Stand-in servers (`module`) are not checked."""
    import importlib.util

    if cfg.module != SGLANG_MODULE:
        return
    if importlib.util.find_spec("sglang") is None:
        raise ValueError(
            "SGLang is not installed here: pip install 'sparserl-mcore[sglang]', or use `sparserl serve`"
        )
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "no CUDA device here: SGLang serves on GPUs; run it on a GPU node, pass `--device cpu` "
            "for SGLang's CPU engine, or use `sparserl serve` (the embedded engine runs on CPU)"
        )


def sglang_argv(cfg: LaunchConfig) -> list[str]:
    """The child's command line (checked against sglang 0.5.23's own parser in the tests)."""
    argv = [cfg.python, "-m", cfg.module, "--model-path", cfg.model_path]
    argv += ["--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size)]
    argv += ["--custom-weight-loader", LOADER_PATH, "--dtype", SERVED_DTYPE]
    if cfg.device == "cpu":
        argv += [*CPU_ARGS, "--sleep-on-idle"]  # an idle scheduler otherwise polls half a core
    if cfg.kv.enabled:
        # the plugin compresses between steps on the scheduler's own batch (docs/sglang.md)
        argv += ["--page-size", "1", "--disable-overlap-schedule"]
        if cfg.kv.method != "streamingllm":
            # query capture runs inside RadixAttention.forward (decode steps and the prompt's last
            # queries), which a replayed CUDA graph skips
            argv += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if cfg.running_requests is not None:
        argv += ["--max-running-requests", str(cfg.running_requests)]
    if cfg.return_routed_experts:
        argv += [ROUTED_EXPERTS_FLAG]
    if cfg.token is not None:
        argv += ["--admin-api-key", cfg.token]
    return argv + list(cfg.extra_args)


def _needs_query_ring(kv: KVCompressionConfig) -> bool:
    """snapkv / rkv score with the window queries, which the plugin keeps in a ring per request row."""
    from sparserl_mcore.rollout.kvcompress import COMPRESSORS

    return kv.enabled and COMPRESSORS[kv.method].needs_window_queries


# SGLang flags the KV plugin cannot work with: decode positions and kv lengths would not be the
# ones it rewrites (speculative / mixed batches), slots are not single tokens (pages), the batch it
# compresses is not the one the model runs next (DP attention), or it would override ours.
KV_REFUSED_FLAGS = (
    "--speculative-algorithm",
    "--enable-mixed-chunk",
    "--page-size",
    "--enable-dp-attention",
    "--attn-dp-size",
)


def _flag_values(extra_args: tuple[str, ...], flag: str) -> list[str]:
    """Values given to `flag` among SGLang's extra flags (`--flag v` or `--flag=v`)."""
    values = []
    for i, arg in enumerate(extra_args):
        if arg == flag:
            values.append(extra_args[i + 1] if i + 1 < len(extra_args) else "")
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def _check_sync_launch(extra_args: tuple[str, ...]) -> None:
    """SGLang settings under which our sparse BF16 patches cannot land."""
    for dtype in _flag_values(extra_args, "--dtype"):
        if dtype != SERVED_DTYPE:
            raise ValueError(
                f"--dtype {dtype}: the trainer's weight patches are BF16, so SGLang must serve "
                f"{SERVED_DTYPE} weights (sparserl sglang-serve passes it); drop --dtype"
            )
    if _flag_values(extra_args, "--quantization"):
        raise ValueError(
            "--quantization: the sparse weight sync writes BF16 values into unquantized parameters; "
            "serve the BF16 checkpoint"
        )


def check_model(cfg: LaunchConfig) -> None:
    """Refuse, in one line and before SGLang starts, a checkpoint the sparse sync cannot serve: a
    directory that is not a complete HF checkpoint with a tokenizer, an architecture without an
    SGLang layout, a quantized one, or one whose heads `tp_size` does not split; routed experts
    asked of a dense one."""
    from sparserl_mcore.ckpt.preflight import check_hf_checkpoint
    from sparserl_mcore.sglang.layout import SGLangLayout

    hf = check_hf_checkpoint(cfg.model_path, label="--model-path", tokenizer=True)
    config = json.loads((pathlib.Path(cfg.model_path) / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(
            f"--model-path {cfg.model_path}: a quantized checkpoint; the sparse weight sync serves "
            "BF16 weights only"
        )
    try:
        SGLangLayout(hf, tp_size=cfg.tp_size)
    except ValueError as exc:
        raise ValueError(f"--model-path {cfg.model_path} at --tp-size {cfg.tp_size}: {exc}") from None
    if cfg.return_routed_experts and hf.moe is None:
        raise ValueError(
            f"--return-routed-experts: {cfg.model_path} is a dense model ({hf.arch}), it routes no "
            "experts; drop the flag"
        )


def _check_kv_launch(kv: KVCompressionConfig, extra_args: tuple[str, ...]) -> None:
    from sparserl_mcore.sglang.kv_hooks import SGLANG_METHODS

    if kv.method not in SGLANG_METHODS:
        raise ValueError(
            f"kv method {kv.method!r} does not work inside SGLang; choose from {list(SGLANG_METHODS)} "
            "(h2o needs per-step attention mass; use `sparserl serve` for it)"
        )
    for arg in extra_args:
        if arg.split("=", 1)[0] in KV_REFUSED_FLAGS:
            raise ValueError(
                f"{arg}: not supported with KV compression inside SGLang (docs/sglang.md, Limits); "
                "drop it or use --kv-method none"
            )


def plugin_settings(cfg: LaunchConfig) -> dict[str, Any]:
    """What `sparserl_mcore.sglang.plugin` reads from $SPARSERL_SGLANG in every SGLang process."""
    return {"required": True, "kv": dataclasses.asdict(cfg.kv), "max_running_requests": cfg.running_requests}


# SGLang 0.5.23 (`srt/layers/sampler.py: Sampler.forward`) returns log_softmax(logits / T) of the
# sampled token unless this is true, when it returns log_softmax(logits) (no temperature): not the
# quantity the learner recomputes (`rollout/engine/sampler.py`), so the servers we start never set it.
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def child_env(cfg: LaunchConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: our plugin's settings, our plugin allowed, our log-prob convention."""
    env = dict(os.environ if base is None else base)
    env[PLUGIN_ENV] = json.dumps(plugin_settings(cfg), sort_keys=True)
    env[ORIGINAL_LOGPROB_ENV] = "false"
    if cfg.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's `is_cpu()`; without it the CUDA paths are taken
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_SITE, env.get("PYTHONPATH")) if p)
    allowed = [p.strip() for p in env.get("SGLANG_PLUGINS", "").split(",") if p.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        env["SGLANG_PLUGINS"] = ",".join([*allowed, PLUGIN_NAME])
    return env


def router_argv(
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int,
    python: str = sys.executable,
    policy: str | None = None,
) -> list[str]:
    """sglang-router in front of `worker_urls`, with its defaults otherwise (cache_aware policy,
    a failed call retried on another worker); its Prometheus metrics on `port + 1` (not its fixed
    default 29000, so two routers on one host do not collide). `policy`: "manual" keeps the
    requests of one routing key (a multi-turn episode group) on one worker (`SGLangRouter`). Run it
    with `ServerProcess` (it answers GET /health)."""
    chosen = ["--policy", policy] if policy is not None else []
    return [
        python, "-m", ROUTER_MODULE, "--host", host, "--port", str(port),
        "--prometheus-port", str(port + 1), *chosen, "--worker-urls", *worker_urls,
    ]  # fmt: skip


class ServerProcess:
    """The SGLang child and its process group; a context manager that always tears down."""

    def __init__(self, cfg: LaunchConfig, *, argv: Sequence[str] | None = None) -> None:
        self.cfg = cfg
        self.argv = list(argv) if argv is not None else sglang_argv(cfg)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.argv, env=child_env(self.cfg), start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, stop: threading.Event | None = None) -> None:
        """Return once GET /health answers 200; raise if the child exits or the timeout passes."""
        assert self.proc is not None, "start the process first (use it as a context manager)"
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        stop = stop or threading.Event()
        with httpx.Client(timeout=5.0) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(f"SGLang exited with code {code} before answering /health")
                try:
                    if http.get(self.cfg.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SGLang did not answer {self.cfg.url}/health within {self.cfg.startup_timeout_s:g} s"
                    )
                if stop.wait(0.5):  # a signal arrived: give up at once
                    raise InterruptedError("stopped while waiting for SGLang to start")

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; the child's exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.cfg.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers of the group (schedulers)
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def serve(cfg: LaunchConfig, *, on_ready: Callable[[str], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT or the child exits; 0 on a signal, else the child's exit code."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ServerProcess(cfg) as server:
            try:
                server.wait_healthy(stop)
            except InterruptedError:
                return 0
            (on_ready or _print_ready)(cfg.url)
            while not stop.wait(0.5):
                code = server.proc.poll() if server.proc else None
                if code is not None:
                    print(f"sparserl sglang-serve: SGLang exited with code {code}", file=sys.stderr)
                    return code or 1
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_ready(url: str) -> None:
    print(f"sparserl sglang-serve: ready {url}", flush=True)
