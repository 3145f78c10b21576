"""DiLoCo islands: PULSELoCo (sparse FP32 pseudo-gradients with error feedback) and dense DiLoCo.

Islands (`parallel.islands`, `parallel/islands.py`) train apart; every `diloco.inner_steps`
applied optimizer steps they meet in one outer step over their FP32 master shards
(`outer.OuterStep`), driven from the optimizer the update step already uses
(`optimizer.IslandOptimizer`). Modules: `config` (the run config section), `gate` (the BF16
visibility gate with error feedback), `payload` (the wire format), `shards` (megatron's master
ranges), `outer`, `optimizer`.
"""
