"""Multi-rank half of tests/test_explicit_groups.py, run under torchrun with 3 gloo ranks.

Ranks 0 and 1 are "learners" (their own process group); rank 2 is in the world but never takes
part in their collectives. The learners run the trainer's collectives with the learner group:
the DGG gate agreement (`megatron_step._agree`), the host's generate-and-score broadcast
(`rollouts.generate_and_score`, a real `EnginePool` over a deterministic engine) and the eval
broadcast (`Evaluator.run`). Had any of them used the world group, the learners would wait for
rank 2 forever (the test's timeout fails it). Rank 2 waits on the store until both learners are
done. Each learner writes what it received to OUT/rank<r>.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys

import torch
import torch.distributed as dist

LEARNERS = [0, 1]


class CountingEngine:
    """A deterministic generator: output = the prompt's ids + 1, log-prob -0.5 each."""

    def generate(self, requests):
        from sparserl_mcore.rollout.protocol import Sample

        return [
            Sample(
                rid=r.rid,
                prompt_ids=tuple(r.input_ids),
                output_ids=tuple(t + 1 for t in r.input_ids),
                output_logprobs=tuple(-0.5 for _ in r.input_ids),
                finish_reason="length",
            )
            for r in requests
        ]


def learner(rank: int, group: dist.ProcessGroup) -> dict:
    from sparserl_mcore.loss.megatron_step import _agree
    from sparserl_mcore.rollout.protocol import SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.evaluate import Evaluator
    from sparserl_mcore.trainer.rollouts import HOST_RANK, Prompt, generate_and_score

    found: dict = {"agree_or": _agree(rank == 1, torch.device("cpu"), group)}
    found["agree_none"] = _agree(False, torch.device("cpu"), group)
    pool = EnginePool({"counting": CountingEngine()}, PoolConfig(chunk_size=2)) if rank == HOST_RANK else None
    prompts = [Prompt(input_ids=(3, 4, 5), answer="x"), Prompt(input_ids=(7,), answer="y")]

    def reward(sample, prompt) -> float:
        return float(sum(sample.output_ids)) + (1.0 if prompt.answer == "x" else 0.0)

    samples, rewards = generate_and_score(
        pool,
        prompts,
        tag="t",
        group_size=2,
        sampling=SamplingParams(max_new_tokens=3),
        run_seed=5,
        reward_fn=reward,
        group=group,
    )
    found["outputs"] = [list(s.output_ids) for s in samples]
    found["rewards"] = rewards
    eval_cfg = dataclasses.make_dataclass(
        "EvalCfg", [("temperature", float), ("compressed", bool), ("dense", bool)]
    )
    rollout_cfg = dataclasses.make_dataclass("RolloutCfg", [("sampling", SamplingParams)])
    evaluator = Evaluator(
        eval_cfg(0.0, True, False), prompts, reward, rollout_cfg(SamplingParams()), seed=5, group=group
    )
    found["eval"] = evaluator.run(pool, None)
    return found


def main(out: pathlib.Path) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group(LEARNERS)  # collective over the world: every rank creates it
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank in LEARNERS:
            found = learner(rank, group)
            (out / f"rank{rank}.json").write_text(json.dumps(found))
            store.set(f"done{rank}", "1")
        else:
            store.wait([f"done{r}" for r in LEARNERS], datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
