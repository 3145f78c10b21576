"""Parallel runtime: layout config, process-group start-up, CPU execution mode, local launcher.

Public API:
- `ParallelConfig` (pure Python): TP / PP / CP sizes, `validate_world(world)`, `validate_model(...)`.
- `initialize(cfg, seed=..., backend=None) -> Runtime` and `shutdown()` (import torch + megatron).
- `cpu_mode`: the one module making megatron-core run on CPU (entered by `initialize` on CPU).
- `launch.run_ranks(argv, nproc, log_dir=...)`: torchrun as a subprocess whose ranks log to files and
  go down with it (signals forwarded, parent-death signals); `launch.launch_local` for tests;
  `rank_entry.rank_main(main)`: what every rank entry runs (per-rank logs, exit records).
- `forward.forward_only(model, micro_batches, post_fn=..., groups=...)` and `forward.forward_logits`:
  forward-only passes through megatron's pipeline schedules (log-prob recompute, verification);
  `forward.run_schedule` is the one call into megatron's schedules (the RL update trains through it).

`initialize`, `shutdown` and `Runtime` are loaded lazily so importing the config stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparserl_mcore.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from sparserl_mcore.parallel.runtime import Runtime, initialize, shutdown

__all__ = ["ParallelConfig", "Runtime", "initialize", "shutdown"]


def __getattr__(name: str) -> Any:
    if name in ("Runtime", "initialize", "shutdown"):
        from sparserl_mcore.parallel import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
