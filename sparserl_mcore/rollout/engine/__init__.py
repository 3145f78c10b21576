"""The embedded engine core: `EmbeddedEngine` (in-process, CPU or one CUDA device) and its parts.

`embedded` drives `scheduler` (continuous batching over `kv_pool`, `radix_cache`,
`batch_forward`, `paged_attention`, `sampler`, `compaction`) on the model of `hf_model`.
"""

from sparserl_mcore.rollout.engine.embedded import EmbeddedEngine, EngineConfig

__all__ = ["EmbeddedEngine", "EngineConfig"]
