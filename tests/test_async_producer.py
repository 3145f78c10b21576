"""The rollout producer the loop consumes (trainer/producer.py) in one gloo process: synchronous
(ahead 0) generates on the caller's thread when a batch is taken, asynchronous generates on submit
in the background; batches are taken in order, exactly once; the data position a checkpoint records
is the one before the oldest batch not yet trained; closing aborts what is generating."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from sparserl_mcore.rollout.protocol import Sample
from sparserl_mcore.trainer.producer import RolloutProducer
from sparserl_mcore.trainer.rollouts import Prompt


@pytest.fixture(scope="module")
def group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class Engines:
    """Stands in for the host's engine pool + reward: records which thread made which batch; a
    batch waits for `release` when `gated`, and `abort` releases everything at once."""

    def __init__(self, gated: bool = False) -> None:
        self.calls: list[tuple[int, str]] = []
        self.release = {s: threading.Event() for s in range(1, 10)}
        self.gated = gated

    def score(self, step: int, prompts):
        self.calls.append((step, threading.current_thread().name))
        if self.gated:
            self.release[step].wait(30)
        samples = [
            Sample(
                rid=f"step{step}-{i}",
                prompt_ids=p.input_ids,
                output_ids=(1,),
                output_logprobs=(-1.0,),
                finish_reason="length",
            )
            for i, p in enumerate(prompts)
        ]
        return samples, [float(step)] * len(samples)

    def abort(self) -> None:
        for event in self.release.values():
            event.set()


def _prompts(step: int) -> list[Prompt]:
    return [Prompt(input_ids=(step, i), answer="") for i in range(2)]


def test_synchronous_producer_generates_when_taken_on_the_calling_thread(group):
    engines = Engines()
    producer = RolloutProducer(engines.score, ahead=0, host=True, group=group)
    producer.submit(1, _prompts(1), {"offset": 0})
    assert engines.calls == []  # nothing generated ahead
    got = producer.take(1)
    assert engines.calls == [(1, threading.current_thread().name)]
    assert [s.rid for s in got.samples] == ["step1-0", "step1-1"] and got.rewards == [1.0, 1.0]
    assert producer.resume_data_state() is None


def test_asynchronous_producer_runs_ahead_in_order_and_regenerates_what_is_in_flight(group):
    engines = Engines(gated=True)
    producer = RolloutProducer(engines.score, ahead=2, host=True, group=group, abort=engines.abort)
    for step in (1, 2, 3):
        producer.submit(step, _prompts(step), {"offset": 2 * (step - 1)})
    engines.release[1].set()
    assert producer.take(1).rewards == [1.0, 1.0]
    assert {s for s, _ in engines.calls} == {1, 2, 3}  # started on submit, before being taken
    assert all(name.startswith("sparserl-rollout") for _, name in engines.calls)
    with pytest.raises(ValueError, match="oldest submitted is \\[2\\]"):
        producer.take(3)
    with pytest.raises(ValueError, match="submitted after batch 3"):
        producer.submit(3, _prompts(3), {})
    # a checkpoint now records the position before batch 2: batches 2 and 3 are regenerated
    assert producer.resume_data_state() == {"offset": 2}
    engines.release[2].set()
    assert producer.take(2).samples[0].rid == "step2-0"
    assert producer.resume_data_state() == {"offset": 4}
    producer.close()  # batch 3 still waits on its engine: aborted, dropped
    assert engines.release[3].is_set() and producer.submitted == []


def test_a_failed_batch_raises_when_taken(group):
    def broken(step, prompts):
        raise RuntimeError(f"engine lost during batch {step}")

    producer = RolloutProducer(broken, ahead=1, host=True, group=group)
    producer.submit(1, _prompts(1), {})
    with pytest.raises(RuntimeError, match="engine lost during batch 1"):
        producer.take(1)


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_checkpoint_after_a_failed_batch_draws_its_prompts_again(group, ahead):
    """Batch 2 fails when taken (the loop then checkpoints and stops): the data position saved is
    the one before batch 2, not after it, synchronous (drawn at take) or ahead (drawn at submit)."""

    def engines(step, prompts):
        if step == 2:
            raise RuntimeError("no rollout engine left mid-batch")
        return [], []

    producer = RolloutProducer(engines, ahead=ahead, host=True, group=group, abort=lambda: None)
    producer.submit(1, _prompts(1), {"offset": 0})
    producer.take(1)
    for step in range(2, 3 + ahead):
        producer.submit(step, _prompts(step), {"offset": 2 * (step - 1)})
    with pytest.raises(RuntimeError, match="no rollout engine left"):
        producer.take(2)
    assert producer.resume_data_state() == {"offset": 2}  # batch 2's prompts are drawn again
    producer.close()
