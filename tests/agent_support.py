"""Shared pieces of the agent tests: a tiny character-level checkpoint, an engine over it, a
ChatML template with a tool role, a runner over a one-engine pool, and an environment that records
its turns (for runs in a subprocess)."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from sparserl_mcore.agent import Env, Reply, Turn

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_checkpoint(path, **kw):
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    return make_tiny(
        TinyModelConfig(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, **kw), path
    )


def engine(hf, **kw):
    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig

    kw.setdefault("page_size", 4)
    kw.setdefault("capacity_pages", 512)
    return EmbeddedEngine(hf, EngineConfig(device="cpu", dtype="float32", **kw))


def tokenizer(hf, chat: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    if chat:
        tok.chat_template = CHATML
    return tok


def runner(
    engines: dict[str, Any], env_cls, tok, *, renderer=None, sampling=None, context_length=2048, **env_kw
):
    from sparserl_mcore.agent import EnvConfig
    from sparserl_mcore.agent.render import PlainRenderer
    from sparserl_mcore.agent.runner import EpisodeRunner
    from sparserl_mcore.rollout.protocol import SamplingParams
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.rollouts import request_seed

    pool = EnginePool(engines, PoolConfig(chunk_size=4, chunk_timeout_s=120.0, max_attempts=2))
    return EpisodeRunner(
        pool,
        env_cls,
        EnvConfig(name="test", **env_kw),
        renderer or PlainRenderer(tok),
        lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        sampling=sampling or SamplingParams(temperature=1.0, max_new_tokens=8),
        context_length=context_length,
        eos_token_ids=(tok.eos_token_id,),
        seed_of=lambda rid: request_seed(7, rid),
    )


def specs(rows, group_size: int, tag: str = "s1"):
    from sparserl_mcore.agent.runner import EpisodeSpec

    return [
        EpisodeSpec(rid=f"{tag}-p{p}-g{g}", row=row, group=f"{tag}-p{p}")
        for p, row in enumerate(rows)
        for g in range(group_size)
    ]


RECORD_ENV = "SPARSERL_TEST_TURNS"  # where RecordedTurns appends its turns
_record_lock = threading.Lock()


class RecordedTurns(Env):
    """Three turns whatever the policy writes (a random tiny model's episodes are multi-turn), the
    reward the parity of the last turn's length (groups have reward variance, so the policy moves);
    every turn is appended to the JSONL file named by $SPARSERL_TEST_TURNS as (prompt, turn index,
    sampled text). `sparserl train` imports it as `agent_support:RecordedTurns`."""

    def reset(self, row: dict[str, Any]) -> str:
        self.prompt = str(row["prompt"])
        return self.prompt

    def step(self, turn: Turn) -> Reply:
        line = json.dumps({"prompt": self.prompt, "turn": turn.index, "text": turn.text})
        with _record_lock, open(os.environ[RECORD_ENV], "a") as f:
            f.write(line + "\n")
        if turn.index < 2:
            return Reply(observation=f"={turn.index} r1\n")
        return Reply(done=True, reward=float(len(turn.text) % 2))
