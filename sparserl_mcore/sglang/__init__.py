"""SGLang integration (pinned sglang 0.5.23): sparse-sync weight loader, KV plugin, client, launcher.

Nothing here imports sglang at module import time except `loader`, `plugin` and `kv_compact`,
which run inside SGLang's processes. docs/sglang.md has the data paths and every hooked name.
"""
