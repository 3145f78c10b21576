"""Rollout generation, in three rooms with one contract between them.

- `protocol`: the `RolloutEngine` contract every engine implements and the trainer codes against.
- `engine/`: the embedded engine core (`EmbeddedEngine`: paged KV pool, radix prefix cache,
  continuous-batching scheduler, paged attention, sampler, KV compaction) and `kvcompress/`, the
  compression policies it and the SGLang hooks share.
- `http/`: the HTTP edge of `sparserl serve` (FastAPI server, its scheduler-thread worker, the
  SGLang-shaped wire format, error answers, stalled-connection timeouts).
- `client`: the trainer's side of that edge (`RemoteEngine`).

Nothing is imported here, so CLI start-up stays cheap; import the submodule you need.
"""
