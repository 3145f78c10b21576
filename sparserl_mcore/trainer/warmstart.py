"""Supervised warm start: take a random tiny HF model to a clearly non-zero task reward before RL.

GRPO learns nothing from a policy whose every sample scores 0 (all groups have zero variance), so
the demo first fine-tunes the random `make-tiny` checkpoint on demonstrations of the synthetic
task for about a minute with plain HF transformers on CPU. The demo's demonstrations carry a
systematic slip (trainer/tasks.py, `DigitChainTask.carry_slip`): trained to convergence the policy
writes the format and the rule right except on carry steps, where it samples the slip 60% and the
right digit 40% of the time. Its greedy answers are then wrong on almost every prompt, while its
samples (T=1, what GRPO trains on) find the right carry often enough for the reward to tell them
apart: RL has one rule-level error to fix, the same in every prompt, which is what a held-out
greedy eval can show. `target_accuracy` can instead stop a run part-way through learning.
Seeded and single-threaded (reproducible), the checkpoint written atomically.
Measured by benchmarks/bench_warmstart.py (docs/benchmarks.md, "Warm start").

    policy = prepare_policy("runs/demo")          # data splits + make-tiny + warm start (DEMO_*)
    acc = evaluate_reward(policy.model_dir, eval_rows, digit_chain_reward, max_new_tokens=26)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sparserl_mcore.ckpt.atomic import atomic_output_dir
from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.trainer.tasks import DEMO_TASK, Task, write_splits


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """AdamW on the completion tokens of (prompt, solution) pairs; cosine decay after warmup.

    target_accuracy: stop once the running mean of the teacher-forced exact-match rate (share of
    the batch whose every completion token is the argmax; tracks greedy accuracy, and unlike the
    token loss does not depend on the completion length) reaches it (0 = run all steps).
    threads: torch CPU threads while training. 1 by default: a model this small gains little
    from a second thread, one thread keeps the float reduction order (hence the trajectory) the
    same on every machine, and on a busy box extra OpenMP threads spin (measured 10x slower with
    2 threads than with 1 under load, docs/benchmarks.md).
    """

    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    target_accuracy: float = 0.0
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: must be > 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be in [0, steps={self.steps})")
        if not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy={self.target_accuracy}: must be in [0, 1] (0 = run all steps)")


RECIPE = "recipe.json"  # beside the weights: what they were made from (see prepare_policy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartResult:
    out_dir: Path
    steps: int
    final_loss: float  # running means at the end
    final_accuracy: float
    seconds: float


def _encode(tokenizer, rows: Sequence[dict[str, str]]) -> list[tuple[list[int], int]]:
    """(prompt + solution + EOS ids, prompt length) per row."""
    encoded = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        solution = tokenizer(row["solution"], add_special_tokens=False)["input_ids"]
        encoded.append((prompt + solution + [tokenizer.eos_token_id], len(prompt)))
    return encoded


def _batch(examples: Sequence[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that score only completion tokens."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _lr_at(step: int, cfg: WarmStartConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch CPU threads, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _exact_match(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of rows whose every scored token is the argmax prediction (teacher forcing)."""
    preds, targets = logits[:, :-1].argmax(-1), labels[:, 1:]
    scored = targets != -100
    return ((preds == targets) | ~scored).all(dim=1).float().mean().item()


def _train(
    model: torch.nn.Module,
    examples: Sequence[tuple[list[int], int]],
    pad_id: int,
    cfg: WarmStartConfig,
    log: Callable[[int, float], None] | None,
) -> tuple[int, float, float]:
    """The supervised loop; returns (steps run, running loss, running exact-match rate)."""
    rng = random.Random(cfg.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_avg, acc_avg, step = float("nan"), 0.0, 0
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        batch = _batch(rng.sample(examples, min(cfg.batch_size, len(examples))), pad_id)
        out = model(**batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss, acc = out.loss.item(), _exact_match(out.logits.detach(), batch["labels"])
        loss_avg = loss if math.isnan(loss_avg) else 0.9 * loss_avg + 0.1 * loss
        acc_avg = 0.9 * acc_avg + 0.1 * acc
        step += 1
        if log is not None and step % 25 == 0:
            log(step, loss_avg)
        if cfg.target_accuracy and acc_avg >= cfg.target_accuracy:
            break
    return step, loss_avg, acc_avg


def warm_start(
    model_dir: str | os.PathLike,
    rows: Sequence[dict[str, str]],
    out_dir: str | os.PathLike,
    cfg: WarmStartConfig,
    *,
    overwrite: bool = False,
    log: Callable[[int, float], None] | None = None,
    recipe: Mapping[str, Any] | None = None,
) -> WarmStartResult:
    """Fine-tune the HF checkpoint at `model_dir` on rows with "prompt" and "solution" text.

    Saves model + tokenizer (and `recipe` as recipe.json) to `out_dir` (atomically, fp32) and
    returns steps run, final running loss and wall time. `log(step, loss)` is called every 25 steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not rows:
        raise ValueError("warm_start: no training rows")
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    start = time.perf_counter()
    with torch_threads(cfg.threads):
        step, loss, accuracy = _train(model, _encode(tokenizer, rows), tokenizer.pad_token_id, cfg, log)
    seconds = time.perf_counter() - start
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if recipe is not None:
            (tmp / RECIPE).write_text(json.dumps(recipe, indent=1))
    return WarmStartResult(
        out_dir=Path(out_dir), steps=step, final_loss=loss, final_accuracy=accuracy, seconds=seconds
    )


@torch.no_grad()
def generate_completions(
    model_dir: str | os.PathLike,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
    threads: int = 1,
) -> list[str]:
    """Decode completions with HF generate (dense KV): the independent measurement of the warm start."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out: list[str] = []
    with torch_threads(threads):
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **(sampling if temperature > 0 else {"do_sample": False}),
            )
            out.extend(tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def evaluate_reward(
    model_dir: str | os.PathLike,
    rows: Sequence[dict[str, str]],
    reward: Callable[[str, str], float],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> float:
    """Mean reward of the model's completions of `rows` (prompt/answer) under HF generate."""
    completions = generate_completions(
        model_dir,
        [r["prompt"] for r in rows],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )
    return sum(reward(c, r["answer"]) for c, r in zip(completions, rows, strict=True)) / len(rows)


# The demo's starting policy: make-tiny shape and warm-start schedule. 1000 steps learn the slipped
# demonstrations of DEMO_TASK close to their own distribution (seed 0, 64 held-out prompts, HF
# generate: non-carry steps 97% right greedy and 96% at T=1; carry steps right 3% greedy, 39% at
# T=1). 600 steps left the T=1 non-carry steps at 87%: sampled chains then broke on plain steps
# too, and GRPO on them raised the greedy eval far less (0.04 -> 0.20-0.27 in 40 steps vs 0.04 ->
# 0.61-0.66 from 1000 steps, same seed and settings). benchmarks/bench_warmstart.py measures it.
DEMO_MODEL = TinyModelConfig(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, ffn=256, seed=0)
DEMO_WARM_START = WarmStartConfig(steps=1000, batch_size=32, lr=3e-3, warmup_steps=20, seed=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedPolicy:
    train_path: Path
    eval_path: Path
    model_dir: Path
    result: WarmStartResult | None  # None when an existing warm-started model was reused


def prepare_policy(
    out_dir: str | os.PathLike,
    *,
    task: Task = DEMO_TASK,
    model: TinyModelConfig = DEMO_MODEL,
    cfg: WarmStartConfig = DEMO_WARM_START,
    n_train: int = 4000,
    n_eval: int = 128,
    seed: int = 0,
    log: Callable[[int, float], None] | None = None,
) -> PreparedPolicy:
    """Task splits (out/data/{train,eval}.jsonl), a random tiny model (out/tiny) and its warm
    start (out/warm). `seed` seeds the splits, the random init and the warm start's batch order
    (it replaces model.seed and cfg.seed). An existing out/warm made from the same recipe (task,
    model, schedule, seed: out/warm/recipe.json) is reused, so a re-run skips the training; one
    made from another recipe (an older version, another seed) is rebuilt."""
    out = Path(out_dir)
    model, cfg = dataclasses.replace(model, seed=seed), dataclasses.replace(cfg, seed=seed)
    train_path, eval_path = write_splits(task, out / "data", n_train=n_train, n_eval=n_eval, seed=seed)
    warm, recipe = out / "warm", _recipe(task, model, cfg, n_train)
    if _read_json(warm / RECIPE) == recipe and (warm / "config.json").is_file():
        return PreparedPolicy(train_path=train_path, eval_path=eval_path, model_dir=warm, result=None)
    tiny = make_tiny(model, out / "tiny", overwrite=True)
    rows = [json.loads(line) for line in train_path.read_text().splitlines()]
    result = warm_start(tiny, rows, warm, cfg, overwrite=True, log=log, recipe=recipe)
    return PreparedPolicy(train_path=train_path, eval_path=eval_path, model_dir=warm, result=result)


# The multi-turn demo's warm start (`sparserl demo --env lookup_chain`): measured to a policy whose
# samples answer right about half the time (one hop early otherwise), in about 25 s.
LOOKUP_WARM_START = WarmStartConfig(steps=150, batch_size=32, lr=1e-2, warmup_steps=10, seed=0)
LOOKUP_EARLY = 0.5  # share of demonstrations that answer one hop early


def prepare_lookup_policy(
    out_dir: str | os.PathLike,
    *,
    n_train: int = 4000,
    n_eval: int = 128,
    seed: int = 0,
    log: Callable[[int, float], None] | None = None,
) -> PreparedPolicy:
    """`prepare_policy` for the lookup_chain environment: its splits (out/data), a random
    DEMO_MODEL and its warm start on demonstrations (out/warm), reused when made from the same
    recipe."""
    from sparserl_mcore.agent.envs import lookup_chain

    out = Path(out_dir)
    model, cfg = dataclasses.replace(DEMO_MODEL, seed=seed), dataclasses.replace(LOOKUP_WARM_START, seed=seed)
    train_path, eval_path = lookup_chain.write_splits(out / "data", n_train=n_train, n_eval=n_eval, seed=seed)
    recipe = {
        "task": {"type": "lookup_chain", "early": LOOKUP_EARLY},
        "model": dataclasses.asdict(model),
        "warm_start": dataclasses.asdict(cfg),
        "n_train": n_train,
    }
    warm = out / "warm"
    if _read_json(warm / RECIPE) == recipe and (warm / "config.json").is_file():
        return PreparedPolicy(train_path=train_path, eval_path=eval_path, model_dir=warm, result=None)
    tiny = make_tiny(model, out / "tiny", overwrite=True)
    rows = lookup_chain.warm_start_rows(n_train, early=LOOKUP_EARLY, seed=seed)
    result = warm_start(tiny, rows, warm, cfg, overwrite=True, log=log, recipe=recipe)
    return PreparedPolicy(train_path=train_path, eval_path=eval_path, model_dir=warm, result=result)


def _recipe(task: Task, model: TinyModelConfig, cfg: WarmStartConfig, n_train: int) -> dict:
    """What a warm-started checkpoint was made from (JSON-plain, compared for equality)."""
    return json.loads(
        json.dumps(
            {
                "task": {"type": type(task).__name__, **dataclasses.asdict(task)},
                "model": dataclasses.asdict(model),
                "warm_start": dataclasses.asdict(cfg),
                "n_train": n_train,
            }
        )
    )


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
