"""The RL trainer: `sparserl train` / `sparserl demo` and what they run.

Entry points: `loop.train(cfg)` (every learner rank), `cli` (`sparserl train`, `--nproc N`
launches torchrun). Pieces: `setup` (config -> parts), `rollouts` (host-rank generation +
broadcast), `engine_pool` (fault-tolerant fan-out over engines),
`batch` (samples -> tensors), `weight_sync` (sparse patches to engines), `evaluate` (pass@1 dense
and compressed), `checkpoint` (atomic dist checkpoints, bit-identical resume), `learner` (megatron
model, DDP, optimizer). Data, tasks and warm start are trainer-base's (`data`, `tasks`, `warmstart`).
"""
