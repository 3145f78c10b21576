"""Everything about a training run that can be checked before any rank starts.

`sparserl train` runs `check_run` in the launching process (ranks started by an external
torchrun or srun run it themselves). It needs neither megatron nor a process group:
- layout: the world size divides by TP x PP x CP (and by ETP x EP x PP, megatron's expert grid), TP
  divides the heads, PP fits the layers, EP divides the experts (`ParallelConfig.validate_model`),
  `model.moe` suits the checkpoint's routing, and a step's rollouts fill at least one micro-batch
  on every data-parallel rank;
- model.hf_path (and model.ref_path when the KL term is on): a complete HF checkpoint with a
  tokenizer (`ckpt.preflight.check_hf_checkpoint`, safetensors headers only);
- data: the files exist, parse, have the prompt and answer keys, and split as configured; every
  prompt of either split has a token and leaves room for rollout.sampling.max_new_tokens in the
  model's context (`trainer.prompts.tokenize_rows`: refused naming file and line, or skipped and
  counted under data.skip_bad_rows);
- reward: the function imports and accepts reward.kwargs (with rollout.env: the Env class imports);
- outputs: telemetry.dir, checkpoint.dir and checkpoint.save_hf are directories this process can
  create files in (tried, as the run will: `ckpt.atomic.output_problem`); a remote engine's token
  variable is set;
- remote servers (`probe_servers`, the launching rank only): each one that answers is the kind
  `rollout.server` says (`sglang.client.server_kind`: one GET /server_info), since SGLang and
  `sparserl serve` take weights through different routes and a mix-up would fail at the first sync;
  an SGLang worker lets the trainer's token through to its weight routes
  (`sglang.client.weight_routes_refuse`), since a refused token loses the worker at the first sync;
  with `model.moe.routing_replay` it was started with `--enable-return-routed-experts`
  (`returns_routed_experts`), since without it every sample would arrive without ids and be refused;
  a `rollout.router_url` that answers routes to exactly `rollout.urls` (`router_workers`), since
  weights reach only those;
- resume (`run_record`): what the run continues from and which settings changed since; refused
  when the prompt data or its seed changed (the sampler could not continue), or when the
  checkpoint holds another model (`resume_model`: the first tensor whose shape differs); "complete"
  when the checkpoint is already at train.steps, so nothing is run and nothing is overwritten;
  checkpoint.dir holding a converted model, an HF checkpoint or one step's checkpoint is refused
  (`resume_model.foreign_contents`), since the run would write its own checkpoints into it.
A problem is one `PreflightError` line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from sparserl_mcore.ckpt.atomic import output_problem
from sparserl_mcore.config import RolloutConfig, RunConfig, to_dict
from sparserl_mcore.trainer.resume_model import foreign_contents, model_mismatch
from sparserl_mcore.trainer.run_layout import requested_layout
from sparserl_mcore.trainer.run_record import (
    LATEST,
    SavedRun,
    check_resumable,
    config_changes,
    damage,
    latest_checkpoint,
    read_saved_run,
)


class PreflightError(ValueError):
    """The run cannot work; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What to tell the user before the ranks start; `complete`: nothing left to run."""

    notes: tuple[str, ...] = ()
    complete: bool = False
    resumes: bool = False  # continues from a checkpoint (its metrics history is kept)


def check_run(cfg: RunConfig, *, world_size: int, probe_servers: bool = True) -> RunPlan:
    """Run every check of the module docstring; raises PreflightError on the first problem."""
    context = _check_model(cfg, world_size)
    n_train, data_notes = _check_data(cfg, context)
    _check_reward(cfg)
    _check_outputs(cfg)
    if probe_servers:
        _check_servers(cfg)
    plan = _resume_plan(cfg, world_size, n_train)
    plan = dataclasses.replace(plan, notes=(*data_notes, *plan.notes))
    metrics = Path(cfg.telemetry.dir) / "metrics.jsonl"
    if not plan.complete and not plan.resumes and metrics.is_file() and metrics.stat().st_size:
        note = f"{metrics} holds an earlier run's metrics: this run starts it over"
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    return plan


def _check_servers(cfg: RunConfig) -> None:
    from sparserl_mcore.sglang.client import (
        overlap_scheduled,
        returns_routed_experts,
        server_kind,
        weight_routes_refuse,
    )

    rc = cfg.rollout
    if rc.engine != "remote":
        return
    token = os.environ.get(rc.token_env) if rc.token_env else None
    for url in rc.urls:
        kind = server_kind(url, token)
        if kind is not None and kind != rc.server:
            what = "an SGLang server" if kind == "sglang" else "`sparserl serve` (no GET /server_info)"
            raise PreflightError(
                f"rollout.urls: {url} answers as {what}, but rollout.server={rc.server}; "
                f"set rollout.server={kind}"
            )
        refused = weight_routes_refuse(url, token) if kind == "sglang" else None
        if refused is not None:
            given = f"the token in ${rc.token_env}" if token else "no token (rollout.token_env is unset)"
            raise PreflightError(
                f"rollout.urls: {url} refuses its weight routes with {given} (HTTP {refused}); set "
                "rollout.token_env to the variable holding the token the server was started with"
            )
        if kind == "sglang" and cfg.model.moe.routing_replay and returns_routed_experts(url, token) is False:
            raise PreflightError(
                f"rollout.urls: {url} is an SGLang server started without --enable-return-routed-experts, "
                "so it returns no routed experts and model.moe.routing_replay=true would refuse every "
                "sample; restart it with `sparserl sglang-serve --return-routed-experts ...` or leave "
                "replay off"
            )
        if kind == "sglang" and cfg.train.async_.mode == "in_flight" and overlap_scheduled(url, token):
            raise PreflightError(
                f"rollout.urls: {url} runs SGLang's overlap scheduler, under which an in-flight update "
                "(train.async.mode=in_flight) reports the first token after each update under the new "
                "version though the old weights sampled it; start it with `sparserl sglang-serve ... -- "
                "--disable-overlap-schedule` (KV compression sets it), or use train.async.mode=one_step"
            )
    _check_router(rc)


def _check_router(rc: RolloutConfig) -> None:
    """A router that answers routes to exactly the workers that get weights."""
    import httpx

    from sparserl_mcore.sglang.client import router_workers

    if rc.router_url is None:
        return
    try:
        routed = router_workers(rc.router_url)
    except (httpx.HTTPError, ValueError):  # unreachable or still starting: left to the run, as above
        return
    if routed and set(routed) != set(rc.urls):  # none yet: still registering, left to the run too
        raise PreflightError(
            f"rollout.router_url: {rc.router_url} routes to {sorted(routed)} but rollout.urls are "
            f"{sorted(rc.urls)}; only those get weights: list the same servers in both"
        )


def _check_hf(path: str, key: str, cfg: RunConfig) -> Any:
    from model_providers.moe_config import check_moe_config
    from sparserl_mcore.ckpt.preflight import check_hf_checkpoint

    try:
        hf = check_hf_checkpoint(path, parallel=cfg.parallel, label=key, tokenizer=True)
        check_moe_config(hf, cfg.model.moe)
        return hf
    except ValueError as exc:
        hint = " (relative paths are read from the current directory)" if not Path(path).is_absolute() else ""
        raise PreflightError(f"{exc}{hint if not Path(path).exists() else ''}") from None


def check_before_assets(
    cfg: RunConfig, *, world_size: int, num_layers: int, num_heads: int, num_kv_heads: int
) -> None:
    """What can be checked before the model and data exist (`sparserl demo` runs it before it makes
    them): the layout against the world size and a model of this shape, the reward, the outputs."""
    _check_layout(cfg, world_size)
    try:
        cfg.parallel.validate_model(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads)
    except ValueError as exc:
        raise PreflightError(f"parallel: {exc}") from None
    _check_reward(cfg)
    _check_outputs(cfg)


def _check_layout(cfg: RunConfig, world_size: int) -> None:
    try:
        cfg.parallel.validate_world(world_size)
    except ValueError as exc:
        raise PreflightError(f"parallel: {exc}") from None
    dp = world_size // cfg.parallel.model_parallel_size
    rollouts = cfg.train.prompts_per_step * cfg.rollout.group_size
    if rollouts < cfg.train.micro_batch_size * dp:
        raise PreflightError(
            f"train.prompts_per_step * rollout.group_size = {rollouts} sequences per step cannot fill one "
            f"micro-batch (train.micro_batch_size={cfg.train.micro_batch_size}) on each of {dp} "
            "data-parallel ranks; sample more per step or use fewer data-parallel ranks"
        )


def _check_model(cfg: RunConfig, world_size: int) -> int:
    """The layout and the checkpoints; returns the model's context (max_position_embeddings)."""
    _check_layout(cfg, world_size)
    hf = _check_hf(cfg.model.hf_path, "model.hf_path", cfg)
    if cfg.loss.policy.kl_coef > 0 and cfg.model.ref_path:
        ref = _check_hf(cfg.model.ref_path, "model.ref_path", cfg)
        if ref != hf:
            diff = [f.name for f in dataclasses.fields(hf) if getattr(hf, f.name) != getattr(ref, f.name)]
            raise PreflightError(
                f"model.ref_path {cfg.model.ref_path}: not the policy's architecture ({diff} differ)"
            )
    dp = world_size // cfg.parallel.model_parallel_size
    islands = cfg.parallel.islands
    if islands > 1 and not cfg.optimizer.distributed and dp > islands:
        raise PreflightError(
            f"parallel.islands={islands} with optimizer.distributed=false and {dp // islands} data-parallel "
            "replicas per island: each replica would exchange the same master weights across islands; "
            "set optimizer.distributed=true (or one replica per island)"
        )
    _check_sampling(cfg, vocab_size=hf.vocab_size, context=hf.max_position_embeddings)
    return int(hf.max_position_embeddings)


def _check_sampling(cfg: RunConfig, *, vocab_size: int, context: int) -> None:
    """The sampling settings fit the model: every request of the run would be refused otherwise."""
    sampling = cfg.rollout.sampling
    beyond = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if beyond:
        raise PreflightError(
            f"rollout.sampling.stop_token_ids: {beyond} are not token ids of the model "
            f"(vocab_size={vocab_size})"
        )
    if sampling.max_new_tokens >= context:
        raise PreflightError(
            f"rollout.sampling.max_new_tokens={sampling.max_new_tokens}: the model's context holds "
            f"{context} positions (max_position_embeddings), the prompt included; lower it"
        )


def _check_data(cfg: RunConfig, context: int) -> tuple[int, tuple[str, ...]]:
    """The data loads, splits and fits the context as configured; returns the number of training
    prompts and a note per split whose bad rows are skipped."""
    from sparserl_mcore.trainer.prompts import bad_rows_message, load_tokenizer, tokenized_splits

    try:
        train, held_out = tokenized_splits(
            cfg.data,
            load_tokenizer(cfg.model.hf_path),
            seed=cfg.train.seed,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
            context=context,
        )
    except (ValueError, OSError) as exc:
        raise PreflightError(f"data: {exc}") from None
    refused = train.refused + held_out.refused
    if refused and not cfg.data.skip_bad_rows:
        raise PreflightError(f"data: {bad_rows_message(refused)}")
    if not train.prompts:
        raise PreflightError(f"data: every training row is skipped ({len(train.refused)} rows); fix the data")
    notes = [
        f"data.skip_bad_rows: skipping {len(split.refused)} {name} rows (first: {split.refused[0]})"
        for name, split in (("training", train), ("eval", held_out))
        if split.refused
    ]
    return len(train.prompts), tuple(notes)


def _check_reward(cfg: RunConfig) -> None:
    from sparserl_mcore.rewards import build_reward

    if cfg.rollout.env is not None:
        _check_env(cfg.rollout.env.name)
        return
    assert cfg.reward.name is not None  # RunConfig resolves the default
    try:
        build_reward(cfg.reward.name, cfg.reward.kwargs)
    except KeyError as exc:
        raise PreflightError(f"reward.name: {exc.args[0]}") from None
    except ValueError as exc:  # build_reward's own message names the reward
        raise PreflightError(str(exc)) from None
    except Exception as exc:  # user code: an import can raise anything
        raise PreflightError(f"reward.name={cfg.reward.name}: {type(exc).__name__}: {exc}") from None


def _check_env(name: str) -> None:
    """The environment class imports and is an `Env` (its module is user code: it may raise anything)."""
    from sparserl_mcore.agent import resolve_env

    try:
        resolve_env(name)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    except Exception as exc:
        raise PreflightError(f"rollout.env.name={name}: {type(exc).__name__}: {exc}") from None


def _check_outputs(cfg: RunConfig) -> None:
    outputs = {
        "telemetry.dir": cfg.telemetry.dir,
        "checkpoint.dir": cfg.checkpoint.dir,
        "checkpoint.save_hf": cfg.checkpoint.save_hf,
    }
    for key, value in outputs.items():
        problem = output_problem(value) if value is not None else None
        if problem:
            raise PreflightError(f"{key}={value}: {problem}; choose a directory this run can write")
    token_env = cfg.rollout.token_env
    if cfg.rollout.engine == "remote" and token_env and not os.environ.get(token_env):
        raise PreflightError(f"rollout.token_env={token_env}: the environment variable is not set")


def _resume_plan(cfg: RunConfig, world_size: int, n_train: int) -> RunPlan:
    ckpt = cfg.checkpoint
    if not ckpt.dir:
        return RunPlan()
    foreign = foreign_contents(ckpt.dir)
    if foreign:
        raise PreflightError(foreign)
    try:
        path = latest_checkpoint(ckpt.dir)
        saved = read_saved_run(path) if path is not None else None
    except (OSError, ValueError) as exc:
        raise PreflightError(f"checkpoint.dir: {exc}; set checkpoint.resume=false to start over") from None
    if saved is None:
        return RunPlan()
    if not ckpt.resume:
        return RunPlan((f"starting over (checkpoint.resume=false): checkpoints in {ckpt.dir} are replaced",))
    if saved.step >= cfg.train.steps:
        return RunPlan(
            (
                f"already complete: {saved.path} is at step {saved.step} and train.steps={cfg.train.steps}; "
                "nothing to do (raise train.steps to continue, or give a new run its own checkpoint.dir)",
            ),
            complete=True,
        )
    problem = damage(saved)
    if problem:
        raise PreflightError(
            f"checkpoint.dir: cannot resume {saved.path.name}: {problem}; set checkpoint.resume=false "
            f"to start over, or delete {saved.path} and write the name of an earlier step_* "
            f"directory into {saved.path.parent / LATEST}"
        )
    _check_same_data(cfg, saved, n_train)
    problem = check_resumable(saved, requested_layout(cfg, world_size))
    if problem:
        raise PreflightError(problem)
    _check_same_model(cfg, saved)
    return RunPlan(_resume_notes(cfg, saved, world_size), resumes=True)


def _check_same_model(cfg: RunConfig, saved: SavedRun) -> None:
    """The checkpoint's tensors have the global shapes of this run's model (`resume_model`)."""
    from model_providers.hf_config import parse_hf_config

    try:
        mismatch = model_mismatch(
            saved.path, parse_hf_config(cfg.model.hf_path), cfg.parallel.tensor_model_parallel_size
        )
    except (OSError, ValueError) as exc:
        raise PreflightError(f"checkpoint.dir: cannot resume {saved.path.name}: {exc}") from None
    if mismatch:
        raise PreflightError(
            f"checkpoint.dir: cannot resume {saved.path}: it was saved from another model than "
            f"model.hf_path={cfg.model.hf_path} ({mismatch}); give this run its own checkpoint.dir, "
            "or set checkpoint.resume=false to start over"
        )


def _check_same_data(cfg: RunConfig, saved: SavedRun, n_train: int) -> None:
    """The prompt sampler continues only over the same rows, seed and shuffle."""
    if not saved.data:
        return
    now = {"n": n_train, "seed": cfg.train.seed, "shuffle": cfg.data.shuffle}
    then = {k: saved.data.get(k) for k in now}
    if then != now:
        raise PreflightError(
            f"cannot resume {saved.path}: its prompt sampler ran over {then} and this run has {now} "
            "(train prompts, train.seed, data.shuffle); use the same data and seed, or set "
            "checkpoint.resume=false / another checkpoint.dir to start over"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _resume_notes(cfg: RunConfig, saved: SavedRun, world_size: int) -> tuple[str, ...]:
    notes = [f"resuming from {saved.path} at step {saved.step} of {cfg.train.steps}"]
    if saved.config is None:
        return (*notes, "the checkpoint has no run record: changed settings are unknown")
    changes = config_changes(saved.config, to_dict(cfg))
    settings = [f"{k} {_short(a)} -> {_short(b)}" for k, a, b in changes if not k.startswith("parallel.")]
    if settings:
        notes.append("changed since that run: " + ", ".join(settings))
    layout = [f"{k.rpartition('.')[2]} {a} -> {b}" for k, a, b in changes if k.startswith("parallel.")]
    if saved.world_size != world_size:
        layout.append(f"world size {saved.world_size} -> {world_size}")
    if layout:
        notes.append(
            f"parallel layout changed ({', '.join(layout)}): weights and optimizer state reshard; "
            "RNG streams restart, so this run is not bit-identical to an uninterrupted one"
        )
    return tuple(notes)
