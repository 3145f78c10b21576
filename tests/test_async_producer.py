"""The rollout producer the loop consumes (trainer/producer.py) in one gloo process: synchronous
(ahead 0) generates on the caller's thread when a batch is taken, asynchronous generates on submit
in the background; batches are taken in order, exactly once; the data position a checkpoint records
is the one before the oldest batch not yet trained; closing aborts what is generating, on the real
embedded engine through the real engine pool too."""

from __future__ import annotations

import threading
import types

import pytest
import torch.distributed as dist
from waiting import wait_until

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.protocol import Sample, SamplingParams
from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
from sparserl_mcore.trainer.loop import Trainer
from sparserl_mcore.trainer.producer import RolloutProducer
from sparserl_mcore.trainer.rollouts import Prompt, score_on_host


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


class Counted:
    """The real embedded engine, counting the `generate` calls (one per chunk) the pool makes."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.started, self.running = engine, 0, 0
        self._lock = threading.Lock()

    def generate(self, requests):
        with self._lock:
            self.started, self.running = self.started + 1, self.running + 1
        try:
            return self.engine.generate(requests)
        finally:
            with self._lock:
                self.running -= 1

    def pause(self, mode):
        self.engine.pause(mode)

    def resume(self):
        self.engine.resume()


def test_a_stop_aborts_every_chunk_the_embedded_engine_has_still_to_run(group, tmp_path):
    """Two batches generating ahead, 6 chunks each (the embedded engine takes one chunk per call):
    the stop (the loop's own abort, through the real pool) ends the chunks running and starts no
    other, so `close` returns with nothing generating, instead of the batches' other chunks
    running one after another (until close gave up after its timeout)."""
    hf = make_tiny(TinyModelConfig(), tmp_path / "tiny")
    engine = Counted(EmbeddedEngine(hf, EngineConfig(device="cpu")))
    pool = EnginePool({"embedded": engine}, PoolConfig(chunk_size=1))
    trainer = Trainer.__new__(Trainer)  # the loop's abort needs only the pool (and telemetry)
    trainer.parts = types.SimpleNamespace(pool=pool, telemetry=None)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=1000, ignore_eos=True)

    def score(step, prompts):
        reward = lambda sample, prompt: 0.0  # noqa: E731
        return score_on_host(pool, prompts, tag=f"step{step}", group_size=1, sampling=sampling,
                             run_seed=0, reward_fn=reward)  # fmt: skip

    at_stop = []

    def abort():
        at_stop.append(engine.started)
        trainer._abort_generation()

    producer = RolloutProducer(score, ahead=1, host=True, group=group, abort=abort)
    prompts = [Prompt(input_ids=(5, 6, i), answer="") for i in range(6)]
    producer.submit(1, prompts, {})
    producer.submit(2, prompts, {})
    generated = lambda: engine.engine.scheduler.stats.generated_tokens  # noqa: E731
    wait_until(lambda: engine.started == 2 and generated() > 0, timeout=120, what="both batches decoding")
    producer.close(timeout_s=120)
    assert at_stop == [2] and engine.running == 0  # both first chunks aborted, nothing left running
    assert engine.started == 2, f"{engine.started - 2} chunks started after the stop"
    assert generated() < 2 * 1000  # neither aborted chunk ran to its end
