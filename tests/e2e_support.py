"""Shared pieces of the end-to-end trainer tests (imported by the tests and, through
`reward.name=e2e_support:lowercase_fraction`, by the training subprocesses)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def lowercase_fraction(completion: str, answer: str) -> float:
    """An easy verifiable task for a random model: the share of lowercase letters in the completion
    (about a quarter of the tiny tokenizer's characters, so every group has reward variance)."""
    del answer
    return sum(c.islower() for c in completion) / max(len(completion), 1)


def free_port() -> int:
    """A loopback port free now (servers under test bind it; the race with other processes is
    accepted in tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    """Small thread counts (the machine is shared) and this directory importable for the reward."""
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def make_assets(root: Path) -> Path:
    """A tiny random Qwen2 checkpoint and 64 prompts; returns the checkpoint dir."""
    from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

    hf = make_tiny(
        TinyModelConfig(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128), root / "tiny"
    )
    rows = [{"prompt": f"say {i}:", "answer": "a"} for i in range(64)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return hf


def write_config(root: Path, hf: Path, name: str, **sections: dict) -> Path:
    """A short GRPO run on the letter task; `sections` override whole keys per section."""
    cfg = {
        "model": {"hf_path": str(hf), "params_dtype": "fp32"},
        "data": {"train_path": str(root / "train.jsonl"), "eval_fraction": 0.125},
        "parallel": {"tensor_model_parallel_size": 2},
        "rollout": {
            "group_size": 8,
            "sampling": {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True},
            "kv": {"method": "snapkv", "budget": 12, "interval": 2, "window": 2, "kernel_size": 3},
        },
        "reward": {"name": "e2e_support:lowercase_fraction"},
        "loss": {"policy": {"kl_coef": 0.0}},
        "dgg": {"window": 2},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "train": {
            "steps": 4,
            "prompts_per_step": 4,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "reuse_epochs": 2,
        },
        "eval": {"every": 0, "num_prompts": 4, "at_start": False},
        "checkpoint": {"dir": str(root / name / "ckpt"), "every": 2, "save_hf": str(root / name / "hf")},
        "telemetry": {"dir": str(root / name / "metrics"), "plot": False, "progress": True},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(root: Path, name: str) -> list[dict]:
    path = root / name / "metrics" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def nan_reward(completion: str, answer: str) -> float:
    """A broken verifier: every reward NaN (the run stops at the first, naming the sample)."""
    del completion, answer
    return float("nan")


def zero_reward(completion: str, answer: str) -> float:
    """Every completion scores 0: no group has reward variance, so no optimizer step happens."""
    del completion, answer
    return 0.0


def overflow_reward(completion: str, answer: str) -> float:
    """Finite as a float32, but a group of them overflows the mean: every advantage, loss and
    gradient is NaN (the learner's non-finite update path)."""
    del completion, answer
    return 3e38


def nan_when_asked(completion: str, answer: str) -> float:
    """NaN for the prompts whose answer is "nan" (a verifier that fails on some rows), else
    `lowercase_fraction`."""
    return float("nan") if answer == "nan" else lowercase_fraction(completion, answer)


def hung_reward(completion: str, answer: str) -> float:
    """A verifier that never returns (a catastrophic regex, a dead remote judge)."""
    del completion, answer
    import time

    time.sleep(3600)
    return 0.0


def misbehaving_reward(completion: str, answer: str) -> float:
    """Misbehaves as `completion` says ("raise", "text", "huge", "exit"); else 0.5."""
    del answer
    if completion == "raise":
        raise ValueError("cannot parse the answer")
    if completion == "exit":
        import os

        os._exit(3)
    return {"text": "high", "huge": 1e300}.get(completion, 0.5)  # type: ignore[return-value]
