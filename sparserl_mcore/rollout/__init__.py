"""Rollout generation: the engine contract (`protocol`), the embedded engine (`engine`, built from
`hf_model`, `kv_pool`, `radix_cache`, `paged_attention`, `sampler`, `scheduler`), the KV compression
policies (`kvcompress`), and the SGLang-style HTTP server and client (`server`, `client`).

Nothing is imported here, so CLI start-up stays cheap; import the submodule you need.
"""
