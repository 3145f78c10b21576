"""Our SGLang plugin (entry point `sparserl` in group `sglang.srt.plugins`, sglang 0.5.23).

SGLang's `srt/plugins/__init__.py: load_plugins` runs every installed plugin's function in each
SGLang process (launch_server's main process, every scheduler / TP worker, the detokenizer) and
then `srt/plugins/hook_registry.py: HookRegistry.apply_hooks` patches the registered targets.
Both only LOG a failing plugin or a target that does not resolve, so this plugin resolves every
target itself first and raises SystemExit (not caught there: it is not an Exception) when one is
missing: a server whose SGLang lacks a hooked name refuses to start instead of running without it.

Inert unless `$SPARSERL_SGLANG` holds our settings (`sparserl sglang-serve` sets it), so installing
sparserl-mcore next to SGLang changes nothing by itself. Hooks:
- AROUND `model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor`:
  our loader's `SyncRejected` becomes `(False, message)`, which SGLang answers as HTTP 400 (an
  exception there would end the scheduler process).
- always: the KV figures each response carries (`kv_report`: AFTER
  `ScheduleBatch.prepare_for_extend`, BEFORE `ScheduleBatch.prepare_for_decode`);
- with a KV method other than "none": the compression hooks of `kv_hooks.KVHooks` (in the same
  BEFORE hook on `prepare_for_decode`, AFTER `ForwardBatch.init_new`, AFTER
  `ReqToTokenPool.alloc_rows`, AROUND `RadixAttention.forward` and AFTER `ModelRunner.initialize`
  for policies scoring with queries);
  docs/sglang.md, "KV compression".
- on SGLang's CPU engine without CUDA: REPLACE `mem_cache.pool_host.common._cuda_host_register`
  (`HOST_REGISTER`) by `unpinned`. SGLang pins its host-side capture buffers with cudaHostRegister
  whatever the device (`state_capturer/base.py: BaseHostCache`, `ALLOC_MEMORY_FUNCS` defaults to
  `alloc_with_host_register`), so `--enable-return-routed-experts` (routing replay) fails at
  start-up on a CPU-only torch ("Torch not compiled with CUDA enabled"); without a GPU nothing
  transfers from that memory, so it stays plain host memory.
"""

from __future__ import annotations

import json
import os
import pkgutil
from collections.abc import Callable
from typing import Any

from sparserl_mcore.sglang.kv_hooks import KVHooks
from sparserl_mcore.sglang.launch import PLUGIN_ENV

HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
WEIGHT_UPDATER = ".".join(
    (
        "sglang.srt.model_executor.model_runner_components.weight_updater",
        "WeightUpdater.update_weights_from_tensor",
    )
)


def settings() -> dict[str, Any] | None:
    raw = os.environ.get(PLUGIN_ENV)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"sparserl plugin: ${PLUGIN_ENV} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"sparserl plugin: ${PLUGIN_ENV} must be a JSON object, got {value!r:.100}")
    return value


def missing_targets(targets: list[str]) -> list[str]:
    """Dotted paths that do not resolve in the running SGLang."""
    missing = []
    for target in targets:
        module, _, attr = target.rpartition(".")
        try:
            if not hasattr(pkgutil.resolve_name(module), attr):
                missing.append(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


def report_rejections(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: a sparse patch our loader rejected is a failed update, not a crashed scheduler."""
    from sparserl_mcore.sglang.loader import SyncRejected

    try:
        return original(*args, **kwargs)
    except SyncRejected as exc:
        return False, f"sparserl patch rejected: {exc}"


def unpinned(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    """REPLACE of `_cuda_host_register` on a CPU-only box: host memory needs no pinning there."""
    del buffer, registration_granularity_bytes


def cpu_only() -> bool:
    """SGLang's CPU engine on a torch without CUDA (what `sparserl sglang-serve --device cpu` runs)."""
    import torch

    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not torch.cuda.is_available()


def register() -> None:
    """The `sglang.srt.plugins` entry point."""
    config = settings()
    if config is None:
        return
    kv_hooks = _kv_hooks(config)
    hooks: list[tuple[str, Callable[..., Any], str]] = [(WEIGHT_UPDATER, report_rejections, "AROUND")]
    hooks += [(target, kv_hooks.hook(target), kind) for target, kind in kv_hooks.targets()]
    if cpu_only():
        hooks += [(HOST_REGISTER, unpinned, "REPLACE")]
    missing = missing_targets([target for target, _, _ in hooks])
    if missing:
        raise SystemExit(f"sparserl plugin: this SGLang lacks the hooked names {missing}; pin sglang==0.5.23")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, HookType[kind])


def _kv_hooks(config: dict[str, Any]) -> KVHooks:
    """The KV hooks for the settings' "kv" section (method "none": the KV figures only)."""
    from sparserl_mcore.rollout.kvcompress import KVCompressionConfig

    try:
        cfg = KVCompressionConfig(**dict(config.get("kv") or {}))
        return KVHooks(cfg, max_running_requests=config.get("max_running_requests"))
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"sparserl plugin: bad kv settings in ${PLUGIN_ENV}: {exc}") from None
