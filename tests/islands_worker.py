"""Multi-rank half of tests/test_diloco_islands.py: 4 gloo ranks under torchrun, several layouts.

    python -m torch.distributed.run --nproc_per_node 4 tests/islands_worker.py WORK

WORK/plan.json: the tiny HF checkpoint and token batches per island and inner step. Phases (each
its own `parallel.initialize`, same processes):

- `tp2`: 2 islands x TP=2 (one replica each), fp32 params, megatron's distributed optimizer and
  Adam (the trainer's `build_optimizer`). Runs `dense`, `pulse` and `open` (pulse with the gate
  forced open) for ROUNDS outer steps of H inner steps; before each outer step every island exports
  its local weights (HF, fp32: exactly its masters), after it the anchor: WORK/tp2/<run>/island<i>/
  {local,anchor}<k>. The test recomputes every outer step from those locals with its own
  single-process DiLoCo / PULSELoCo on the unsharded (HF) tensors; WORK/tp2/stats<rank>.json the
  outer steps' metrics.
- `average`: 2 islands x DP 2, bf16 params + FP32 masters sharded by the distributed optimizer
  (each island's params split between its two DP ranks), Adam, dense, outer lr 1, momentum 0:
  WORK/average.pt holds the start masters, then per step each island's masters before the outer
  step and the masters after it.
- `sgd_islands` / `sgd_ddp`: TP=2, fp32, megatron's replicated optimizer with SGD; 2 islands of one
  replica with H=1, outer lr 1, momentum 0, and one island of 2 replicas (plain DDP) on the same
  rows: WORK/sgd_<name>.pt, the masters after each step.
- `diverged`: 2 islands x DP 2, bf16 params, distributed Adam, `dense` and `pulse`: after one
  inner step, one outer step per fault injected on one rank (state restored after each): an FP32
  anchor element moved off, one BF16 weight element left a cell off by the publish, and (pulse) a
  payload damaged on its way. WORK/diverged/rank<r>.json: per fault, the tensor it hit and what
  the rank raised.
- `resume`: 2 islands x DP 2, bf16, Adam, pulse, H=2: 3 inner steps, a training checkpoint
  (`trainer.checkpoint`, mid round), 3 more; then everything rebuilt from the HF files, the checkpoint
  loaded and the same 3 steps again. WORK/resume/{straight,resumed}.pt: masters, anchor, residual,
  momentum, counters.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

H, ROUNDS, LR_ADAM, LR_SGD = 2, 2, 2e-5, 0.05


def build(hf_dir: str, rt, *, params: str, sgd: bool):
    """The trainer's learner pieces (`trainer.learner`), megatron SGD instead of Adam when asked."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for
    from sparserl_mcore.config import OptimizerConfig
    from sparserl_mcore.trainer import learner

    spec, gpt = learner.build_model(hf_dir, params, rt)
    layout = layout_for(spec)
    load_hf_weights(gpt, layout, hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
    ddp = learner.wrap_ddp(gpt, spec, rt, distributed_optimizer=not sgd)  # megatron: Adam only
    if sgd:
        cfg = MegatronOptimizerConfig(
            optimizer="sgd", lr=LR_SGD, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0,
            bf16=params == "bf16", params_dtype=spec.params_dtype, use_distributed_optimizer=False,
        )  # fmt: skip
        optimizer = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False, pg_collection=rt.groups)
        scheduler = None
    else:
        cfg = OptimizerConfig(lr=LR_ADAM, weight_decay=0.0, clip_grad=0.0)
        optimizer, scheduler = learner.build_optimizer(ddp, cfg, spec, rt)
    spec.config.finalize_model_grads_func = finalize_model_grads
    spec.config.no_sync_func = ddp.no_sync
    return spec, gpt, ddp, layout, optimizer, scheduler


def inner_step(ddp, optimizer, tokens: torch.Tensor, rt) -> None:
    """One update on this DP rank's rows of an island's batch."""
    inner_step_rows(ddp, optimizer, tokens[rt.dp_rank :: rt.dp_size], rt)


def inner_step_rows(ddp, optimizer, rows: torch.Tensor, rt) -> None:
    """One update on `rows`, the way `loss.megatron_step` drives the optimizer."""
    from distopt_worker import forward_backward

    forward_backward(ddp, rows, rt)
    assert not optimizer.prepare_grads(), "a non-finite update in the test"
    optimizer.step_with_ready_grads()


def export(gpt, layout, rt, out: pathlib.Path) -> None:
    """This island's weights as HF safetensors (its DP rank 0 ranks write, TP gathered)."""
    from sparserl_mcore.ckpt.hf_io import export_hf_weights, write_index

    if rt.dp_rank == 0:
        if rt.tp_rank == 0:
            out.mkdir(parents=True)
        dist.barrier(group=rt.groups.tp)
        found = export_hf_weights(gpt, layout, out, tp_rank=rt.tp_rank, pp_rank=0, tp_group=rt.groups.tp)
        if rt.tp_rank == 0:
            write_index(out, [found])
    dist.barrier()


def masters(shards, rt) -> dict[str, torch.Tensor] | None:
    """Every FP32 master weight (key: name/tp<rank>), gathered whole on rank 0 from the owned ranges
    of island 0's ranks."""
    mine = [
        (f"{s.name}/tp{rt.tp_rank}", s.start, s.end, s.param.numel(), s.main.clone()) for s in shards.shards
    ]
    everyone: list = [None] * rt.world_size
    dist.all_gather_object(everyone, (rt.island, mine))
    if rt.rank != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for island, pieces in everyone:
        for key, start, end, numel, values in pieces if island == 0 else []:
            out.setdefault(key, torch.full((numel,), float("nan"))).narrow(0, start, end - start).copy_(
                values
            )
    assert all(not t.isnan().any() for t in out.values()), "owned ranges do not cover the params"
    return out


def island_masters(shards, rt) -> dict[str, torch.Tensor] | None:
    """Each island's masters on rank 0: {island<i>/name/tp<r>: values}."""
    mine = [(f"island{rt.island}/{s.name}/tp{rt.tp_rank}", s.start, s.end, s.param.numel(), s.main.clone())
            for s in shards.shards]  # fmt: skip
    everyone: list = [None] * rt.world_size
    dist.all_gather_object(everyone, mine)
    if rt.rank != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for key, start, end, numel, values in (piece for pieces in everyone for piece in pieces):
        out.setdefault(key, torch.full((numel,), float("nan"))).narrow(0, start, end - start).copy_(values)
    return out


def phase_tp2(plan: dict, work: pathlib.Path) -> None:
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.gate import open_gate
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(ParallelConfig(tensor_model_parallel_size=2, islands=2), seed=0)
    try:
        assert (rt.islands, rt.island, rt.dp_size, rt.tp_size) == (2, rt.rank // 2, 1, 2), rt
        stats = {}
        for run in ("dense", "pulse", "open"):
            _, gpt, ddp, layout, inner, _ = build(plan["hf_dir"], rt, params="fp32", sgd=False)
            cfg = DiLoCoConfig(mode="dense" if run == "dense" else "pulse", inner_steps=10**6)
            optimizer = with_islands(inner, ddp, cfg, rt)
            if run == "open":
                optimizer.outer.gate = open_gate
            batches = torch.tensor(plan["batches"][rt.island])
            here = work / "tp2" / run / f"island{rt.island}"
            for k in range(1, ROUNDS + 1):
                for j in range(H):
                    inner_step(ddp, optimizer, batches[(k - 1) * H + j], rt)
                export(gpt, layout, rt, here / f"local{k}")
                record = optimizer.outer.step()
                export(gpt, layout, rt, here / f"anchor{k}")
                stats.setdefault(run, []).append(record)
        (work / "tp2" / f"stats{rt.rank}.json").write_text(json.dumps(stats))
    finally:
        shutdown()


def phase_diverged(plan: dict, work: pathlib.Path) -> None:
    """Faults on one rank between or inside outer steps: every rank must raise the same one line."""
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(ParallelConfig(islands=2), seed=0)
    try:
        found = {}
        for mode in ("dense", "pulse"):
            _, _, ddp, _, inner, _ = build(plan["hf_dir"], rt, params="bf16", sgd=False)
            optimizer = with_islands(inner, ddp, DiLoCoConfig(mode=mode, inner_steps=10**6), rt)
            inner_step(ddp, optimizer, torch.tensor(plan["batches"][rt.island][0]), rt)
            for fault in ("anchor", "weights", "payload") if mode == "pulse" else ("anchor", "weights"):
                found[f"{mode}/{fault}"] = inject(optimizer.outer, fault, rt.rank)
        (work / "diverged").mkdir(exist_ok=True)
        (work / "diverged" / f"rank{rt.rank}.json").write_text(json.dumps(found))
    finally:
        shutdown()


def inject(outer, fault: str, rank: int) -> dict:
    """One outer step with `fault` on one rank: `anchor` (rank 2 moves an element of its first
    owned FP32 anchor range off), `weights` (rank 2's publish leaves an element of its last BF16
    weight one cell off), `payload` (the payload rank 0 receives from island 1 has a flipped byte).
    Then the state from before the step comes back, so the islands agree again. Returns the
    tensor hit (on the faulty rank) and what this rank raised."""
    from sparserl_mcore.diloco import outer as outer_module

    kept = {
        n: getattr(outer, n).clone()
        for n in ("anchor", "residual", "momentum")
        if getattr(outer, n) is not None
    }
    masters, steps, hit = outer.shards.read(), outer.outer_steps, None
    publish, gather = outer.shards.publish, outer_module.all_gather_bytes

    def off_by_a_cell() -> None:
        publish()
        with torch.no_grad():
            outer.shards.params[-1][1].view(-1).view(torch.int16)[0] += 1

    def damaged(blob, group, device) -> list[bytes]:
        blobs = gather(blob, group, device)
        bad = bytearray(blobs[1])
        bad[len(bad) // 2] ^= 0x10
        return [blobs[0], bytes(bad)]

    if fault == "anchor" and rank == 2:
        outer.anchor[0] += 0.25
        hit = outer.shards.shards[0].name
    elif fault == "weights" and rank == 2:
        outer.shards.publish = off_by_a_cell
        hit = outer.shards.params[-1][0]
    elif fault == "payload" and rank == 0:
        outer_module.all_gather_bytes = damaged
    try:
        outer.step()
        raised = None
    except outer_module.OuterStepFailed as exc:
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        outer.shards.__dict__.pop("publish", None)
        outer_module.all_gather_bytes = gather
    for name, value in kept.items():
        getattr(outer, name).copy_(value)
    outer.shards.write(masters)
    outer.shards.publish()
    outer.outer_steps = steps
    return {"hit": hit, "raised": raised}


def phase_average(plan: dict, work: pathlib.Path) -> None:
    """2 islands x DP 2, bf16 params, distributed Adam, dense, outer lr 1, momentum 0: each outer
    step must land on the islands' mean master weights."""
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(ParallelConfig(islands=2), seed=0)
    try:
        ranks = dist.get_process_group_ranks
        mine = [2 * rt.island, 2 * rt.island + 1]
        assert ranks(rt.groups.dp) == ranks(rt.groups.dp_cp) == ranks(rt.groups.tp_dp_cp) == mine
        assert ranks(rt.island_group) == mine
        assert ranks(rt.cross_island_group) == [rt.rank % 2, rt.rank % 2 + 2]
        assert (rt.replicas, rt.replica_rank) == (4, rt.rank)
        _, _, ddp, _, inner, _ = build(plan["hf_dir"], rt, params="bf16", sgd=False)
        cfg = DiLoCoConfig(mode="dense", inner_steps=10**6, outer_lr=1.0, outer_momentum=0.0)
        optimizer = with_islands(inner, ddp, cfg, rt)
        shards = optimizer.outer.shards
        assert 0 < shards.numel < sum(p.numel() for p in ddp.parameters()), "masters not split over DP"
        batches = torch.tensor(plan["batches"][rt.island])
        found = [(None, masters(shards, rt))]
        for k in range(3):
            inner_step(ddp, optimizer, batches[k], rt)
            before = island_masters(shards, rt)
            optimizer.outer.step()
            found.append((before, masters(shards, rt)))
        if rt.rank == 0:
            torch.save(found, work / "average.pt")
    finally:
        shutdown()


def phase_sgd(plan: dict, work: pathlib.Path, name: str) -> None:
    """TP=2 with megatron's replicated (FP32) optimizer and SGD: `islands` = 2 islands of one
    replica, H=1, outer lr 1, momentum 0; `ddp` = one island of 2 replicas on the same rows."""
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.diloco.shards import MainShards
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(
        ParallelConfig(tensor_model_parallel_size=2, islands=2 if name == "islands" else 1), seed=0
    )
    try:
        if name == "ddp":  # one island: megatron's own groups, exactly as before islands existed
            from megatron.core import parallel_state

            assert rt.groups.dp is parallel_state.get_data_parallel_group()
            assert rt.cross_island_group is None and rt.island_group is rt.learner_group
            assert (rt.replicas, rt.replica_rank) == (rt.dp_size, rt.dp_rank) == (2, rt.rank // 2)
        # fp32: with bf16 weights the two runs' last-bit differences would flip BF16 cells and part
        _, _, ddp, _, inner, _ = build(plan["hf_dir"], rt, params="fp32", sgd=True)
        optimizer, shards = inner, MainShards(inner, ddp)
        if name == "islands":
            cfg = DiLoCoConfig(mode="dense", inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
            optimizer = with_islands(inner, ddp, cfg, rt)
        steps = []
        for k in range(3):  # replica r of the job trains on rows r::2 of the step's batch
            rows = torch.tensor(plan["sgd_batches"][k])[rt.replica_rank :: rt.replicas]
            inner_step_rows(ddp, optimizer, rows, rt)
            steps.append(masters(shards, rt))
        if rt.rank == 0:
            torch.save(steps, work / f"sgd_{name}.pt")
    finally:
        shutdown()


def phase_resume(plan: dict, work: pathlib.Path) -> None:
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.trainer import checkpoint
    from sparserl_mcore.trainer.run_layout import RunLayout

    rt = initialize(ParallelConfig(islands=2), seed=0)
    layout = RunLayout(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        params_dtype="bf16", distributed_optimizer=True, islands=2,
    )  # fmt: skip
    root = work / "resume"
    batches = torch.tensor(plan["batches"][rt.island])

    def learner(mode: str = "pulse"):
        _, _, ddp, _, inner, scheduler = build(plan["hf_dir"], rt, params="bf16", sgd=False)
        optimizer = with_islands(inner, ddp, DiLoCoConfig(mode=mode, inner_steps=H), rt)
        ids = checkpoint.IslandState(
            island=rt.island, position=rt.rank % 2, dp_cp_group=rt.groups.dp_cp, outer=optimizer.outer
        )
        return ddp, optimizer, scheduler, ids

    def train(ddp, optimizer, scheduler, steps: range) -> None:
        for k in steps:
            inner_step(ddp, optimizer, batches[k], rt)
            scheduler.step(1)

    def result(ddp, optimizer) -> dict:
        outer = optimizer.outer
        state = {n: getattr(outer, n).clone() for n in ("anchor", "residual", "momentum")}
        return {
            "masters": outer.shards.read(),
            "weights": [p.detach().clone() for p in ddp.parameters()],
            "adam": [dict(st) for st in inner_state(optimizer)],
            "counters": outer.state_dict(),
            **state,
        }

    try:
        ddp, optimizer, scheduler, ids = learner()
        train(ddp, optimizer, scheduler, range(3))
        assert optimizer.outer.state_dict()["inner"] == 1 and optimizer.outer.outer_steps == 1
        record = {"config": {}, "world_size": 4, "data": {}, "layout": layout}
        saved = checkpoint.save_checkpoint(
            root / "ckpt", 3, model=ddp, optimizer=optimizer, scheduler=scheduler,
            loop_state={"diloco": optimizer.outer.state_dict()}, record=record, islands=ids,
        )  # fmt: skip
        train(ddp, optimizer, scheduler, range(3, 6))
        straight = result(ddp, optimizer)

        ddp, optimizer, scheduler, ids = learner()
        loop, same = checkpoint.load_checkpoint(
            saved, model=ddp, optimizer=optimizer, scheduler=scheduler, layout=layout, seed=0,
            pp_rank=0, islands=ids,
        )  # fmt: skip
        optimizer.outer.load_state_dict(loop["diloco"])
        train(ddp, optimizer, scheduler, range(3, 6))
        resumed = result(ddp, optimizer)
        torch.save(
            {"straight": straight, "resumed": resumed, "rng_restored": same}, root / f"rank{rt.rank}.pt"
        )
        # a dense-mode checkpoint (no residual saved) resumes in pulse mode: the residual starts at 0
        ddp, optimizer, scheduler, ids = learner("dense")
        train(ddp, optimizer, scheduler, range(3))
        dense = checkpoint.save_checkpoint(
            root / "ckpt_dense", 3, model=ddp, optimizer=optimizer, scheduler=scheduler,
            loop_state={"diloco": optimizer.outer.state_dict()}, record=record, islands=ids,
        )  # fmt: skip
        anchor = optimizer.outer.anchor.clone()
        ddp, optimizer, scheduler, ids = learner("pulse")
        optimizer.outer.residual.fill_(1.0)
        checkpoint.load_checkpoint(
            dense, model=ddp, optimizer=optimizer, scheduler=scheduler, layout=layout, seed=0,
            pp_rank=0, islands=ids,
        )  # fmt: skip
        assert torch.equal(optimizer.outer.anchor, anchor) and not optimizer.outer.residual.any()
    finally:
        shutdown()


class ReceiverEngine:
    """An in-process rollout engine that only holds weights: an HF receiver (`sync.apply`)."""

    def __init__(self, hf_dir: str) -> None:
        from sparserl_mcore.sync.apply import HFReceiver
        from sparserl_mcore.sync.hf_files import load_state

        state = {n: t.to(torch.bfloat16) for n, t in load_state(pathlib.Path(hf_dir)).items()}
        self.receiver = HFReceiver(state, version=None)

    def apply_patch(self, blob: bytes) -> int:
        return self.receiver.apply(blob).version

    def close(self) -> None:
        pass


def phase_sync(plan: dict, work: pathlib.Path) -> None:
    """The trainer's weight sync with islands: engines get bf16(anchor), not an island's weights.
    2 islands x DP 2, bf16, Adam, pulse, H=2: a full sync at the start, 2 inner steps (an outer
    step), 1 more (the local weights move on), then a sparse sync. WORK/sync/: the receiver after
    each sync, island 0's weights after the outer step (`agreed`) and at the sparse sync (`local`)."""
    from sparserl_mcore.diloco.agreed import AgreedWeights
    from sparserl_mcore.diloco.config import DiLoCoConfig
    from sparserl_mcore.diloco.optimizer import with_islands
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.sync.codec import CodecConfig
    from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig
    from sparserl_mcore.trainer.weight_sync import WeightSyncer

    rt = initialize(ParallelConfig(islands=2), seed=0)
    try:
        _, gpt, ddp, layout, inner, _ = build(plan["hf_dir"], rt, params="bf16", sgd=False)
        optimizer = with_islands(inner, ddp, DiLoCoConfig(mode="pulse", inner_steps=H), rt)
        agreed = AgreedWeights(optimizer.outer, sender=rt.island == 0)
        syncer = WeightSyncer(ddp, layout, rt, CodecConfig(), lambda *a: None, agreed=agreed)
        engine = ReceiverEngine(plan["hf_dir"]) if rt.rank == 0 else None
        pool = EnginePool({"receiver": engine}, PoolConfig(chunk_size=1)) if engine else None
        out = work / "sync"
        syncer.full_sync([pool], version=0)
        found = {"start": {n: t.clone() for n, t in engine.receiver.state.items()}} if engine else {}
        batches = torch.tensor(plan["batches"][rt.island])
        for k in range(H):
            inner_step(ddp, optimizer, batches[k], rt)
        assert optimizer.outer.outer_steps == 1
        export(gpt, layout, rt, out / f"island{rt.island}" / "agreed")
        inner_step(ddp, optimizer, batches[H], rt)
        ddp.start_param_sync(force_sync=True)
        export(gpt, layout, rt, out / f"island{rt.island}" / "local")
        metrics = syncer.sync([pool], version=1)
        if engine:
            found["synced"] = {n: t.clone() for n, t in engine.receiver.state.items()}
            found["version"] = engine.receiver.version
            found["patch_bytes"] = metrics["sync/patch_bytes"]
            torch.save(found, out / "receiver.pt")
    finally:
        shutdown()


def inner_state(optimizer) -> list[dict]:
    from sparserl_mcore.diloco.shards import megatron_leaves

    out = []
    for leaf in megatron_leaves(optimizer):
        for group in leaf.optimizer.param_groups:
            for p in group["params"]:
                out.append({k: v.clone() for k, v in leaf.optimizer.state[p].items()})
    return out


def main(work: pathlib.Path) -> int:
    plan = json.loads((work / "plan.json").read_text())
    phase_tp2(plan, work)
    phase_diverged(plan, work)
    phase_average(plan, work)
    phase_sgd(plan, work, "islands")
    phase_sgd(plan, work, "ddp")
    phase_resume(plan, work)
    phase_sync(plan, work)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    sys.exit(main(pathlib.Path(sys.argv[1])))
