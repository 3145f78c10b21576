"""Worker for tests/test_distopt_cpu.py: megatron mixed precision (bf16 params, fp32 master) on CPU.

    python tests/distopt_worker.py WORK                                  reference: 1 process
    python -m torch.distributed.run --nproc_per_node 2 tests/distopt_worker.py WORK   DP=2

Both train the same tiny untied model on the same data: one megatron Adam step per global batch
of 2 sequences in WORK/plan.json, then one RL update (`rl_update`, 4 more Adam steps). The
reference runs each batch as 2 micro-batches with the plain mixed-precision optimizer
(`Float16OptimizerWithFloat16Params`); the DP=2 run gives each rank 1 sequence and uses the
distributed optimizer (`DistributedOptimizer`) with one DDP bucket per parameter, so every
parameter, the lm_head included, is split between the two ranks' owned ranges. Per step both record
the global lm_head gradient energy (`loss.lm_head_grad_energy`) and megatron's grad norm; per
version both write a full HF export to WORK/<mode>/v<version> (the last: after the RL update).
The DP=2 run overlaps the param all-gather (megatron defers it to the next forward) and syncs
every version right after the step, before any all-gather (`sync.learner.ShardSyncer` with the
distributed optimizer's ranges), into an HF-layout receiver; on the stage source it asserts that
the receiver is bit-identical to the export (taken after a forced all-gather) and that each patch
carries exactly the elements whose bits changed since the previous export (nothing missed,
nothing twice). Results: WORK/<mode>.json.

Why the two runs can agree bit for bit: a sequence's bf16 gradient is the same whether its loss is
scaled by 1/2 (reference: 2 micro-batches) or its fp32 gradient by 1/2 (DDP's 1/dp before the
reduce-scatter), since powers of two commute with rounding; the sum of two terms is order-free;
the RL update's micro-batches hold the same rows in both runs (loss_dist_worker's DP slicing); Adam
is elementwise; and clip_grad is set high enough to run megatron's norm but never clip.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

LR = 1e-3
CLIP = 1.0e6  # megatron's norm + clip path runs (CUDA type checks included) but never scales


def build(hf_dir: str, rt, *, distributed: bool):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import model_providers
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for

    spec = model_providers.build_spec(hf_dir, rt.parallel, params_dtype="bfloat16", cpu=True)
    gpt = model_providers.build_model(
        spec, device=rt.device, pre_process=True, post_process=True, pg_collection=rt.groups
    )
    layout = layout_for(spec)
    load_hf_weights(gpt, layout, hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=distributed,
        # one bucket per param (megatron honours bucket_size only with overlap): every param split
        overlap_grad_reduce=distributed,
        bucket_size=1 if distributed else None,
        # the updated params' all-gather waits for the next forward: the sync must read owned ranges
        overlap_param_gather=distributed,
    )
    ddp = DistributedDataParallel(
        spec.config, ddp_cfg, Float16Module(spec.config, gpt), pg_collection=rt.groups
    )
    spec.config.finalize_model_grads_func = finalize_model_grads
    spec.config.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        clip_grad=CLIP,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=distributed,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False, pg_collection=rt.groups)
    return spec, gpt, ddp, layout, optimizer


def forward_backward(ddp, tokens: torch.Tensor, rt) -> None:
    """Megatron's schedule over `tokens` (one micro-batch per row), mean token NLL per micro-batch."""
    from sparserl_mcore.parallel.forward import run_schedule

    def loss_func(per_token: torch.Tensor):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    def step(data_iterator, model):
        mb = next(data_iterator)
        inputs, labels = mb[:, :-1], mb[:, 1:]
        positions = torch.arange(inputs.shape[1]).unsqueeze(0)
        return model(inputs, positions, None, labels=labels), loss_func

    ddp.zero_grad_buffer()
    run_schedule(
        ddp,
        tokens.split(1),
        step,
        groups=rt.groups,
        micro_batch_size=1,
        seq_length=tokens.shape[1] - 1,
        forward_only=False,
    )


def export(gpt, layout, rt, out: pathlib.Path) -> dict[str, torch.Tensor]:
    """Full HF export by the DP rank 0 (the independent reference for the sync receiver)."""
    from sparserl_mcore.ckpt.hf_io import export_hf_weights, write_index
    from sparserl_mcore.sync.hf_files import load_state

    if rt.rank == 0:
        out.mkdir(parents=True)
        write_index(out, [export_hf_weights(gpt, layout, out, tp_rank=0, pp_rank=0)])
    if rt.world_size > 1:
        dist.barrier()
    return load_state(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).view(-1)


class SyncCheck:
    """Learner-side sparse sync into an HF receiver, checked against each step's export."""

    def __init__(self, ddp, layout, rt, optimizer, hf_dir: str) -> None:
        from sparserl_mcore.sync.apply import HFReceiver
        from sparserl_mcore.sync.hf_files import load_state
        from sparserl_mcore.sync.learner import ShardSyncer

        self.syncer = ShardSyncer.for_runtime(ddp, layout, rt, optimizer=optimizer)
        self.receiver = HFReceiver(load_state(pathlib.Path(hf_dir)), version=0)
        self.previous = {n: t.clone() for n, t in self.receiver.state.items()}
        self.rt = rt
        self.partition = self._owned_partition()

    def _owned_partition(self) -> dict[str, list[tuple[int, int]]]:
        """Both ranks' owned ranges per param; asserts they tile it (no element twice, none missed)."""
        everyone = [None] * self.rt.world_size
        dist.all_gather_object(everyone, self.syncer.owned)
        out = {}
        for name, param in self.syncer.params.items():
            ranges = sorted(o[name] for o in everyone if o[name][1] > o[name][0])
            ends = [0] + [end for _, end in ranges]
            assert [s for s, _ in ranges] == ends[:-1] and ends[-1] == param.numel(), (name, ranges)
            out[name] = ranges
        return out

    def check(self, version: int, parts: list[bytes], export: dict[str, torch.Tensor]) -> dict:
        """`parts`: this version's `make_patch` output, made before the params were all-gathered."""
        from sparserl_mcore.sync.codec import decode_fragments

        if not self.syncer.is_source:
            assert parts == []
            return {}
        patch = decode_fragments(parts)
        nnz = {t.name: int(t.indices.size) for t in patch.tensors}
        for t in patch.tensors:
            assert (t.indices[1:] > t.indices[:-1]).all(), f"{t.name}: an index emitted twice"
        changed = {n: int((bits(export[n]) != bits(self.previous[n])).sum()) for n in export}
        assert nnz == {n: c for n, c in changed.items() if c}, "patch elements != changed elements"
        result = self.receiver.apply(parts)
        bad = [n for n in export if not torch.equal(bits(self.receiver.state[n]), bits(export[n]))]
        assert not bad and result.version == version, (version, bad[:3])
        self.previous = {n: t.clone() for n, t in export.items()}
        return {"patch_bytes": sum(len(p) for p in parts), "changed": sum(nnz.values())}


def rl_update(ddp, optimizer, rt) -> dict:
    """The loss engineer's K-epoch update with DGG (`loss.megatron_step.train_on_batch`): K=2 epochs
    x 2 minibatches of tests/loss_dist_worker.py's rollout; its DP slicing keeps the micro-batches
    of the two runs identical."""
    import loss_dist_worker as lw

    from sparserl_mcore.loss.dgg import DGGConfig, DynamicGradientGate
    from sparserl_mcore.loss.megatron_step import train_on_batch

    batch = lw.local_batch(lw.rollout(2), ddp, rt, with_ref=True)
    gate = DynamicGradientGate(DGGConfig())
    res = train_on_batch(ddp, optimizer, batch, cfg=lw.UPDATE_CFG, gate=gate, runtime=rt)
    return {
        "metrics": res.metrics,
        "energies": [d.energy for d in res.decisions],
        "grad_norms": [u["train/grad_norm"] for u in res.updates],
    }


def run(work: pathlib.Path) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from sparserl_mcore.loss import lm_head_grad
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    plan = json.loads((work / "plan.json").read_text())
    rt = initialize(ParallelConfig(), seed=0)
    distributed = rt.dp_size > 1
    mode = "dist" if distributed else "ref"
    try:
        spec, gpt, ddp, layout, optimizer = build(plan["hf_dir"], rt, distributed=distributed)
        leaves = lm_head_grad.leaf_optimizers(optimizer)
        assert all(isinstance(leaf, DistributedOptimizer) for leaf in leaves) == distributed, leaves
        head = lm_head_grad.lm_head_weight(ddp)
        if distributed:  # the DP-shard branch must see a real split of the head over the ranks
            owned = [leaf._get_model_param_range_map(head)["param"] for leaf in leaves]
            assert len(owned) == 1 and 0 < owned[0].size < head.numel(), owned
        sync = SyncCheck(ddp, layout, rt, optimizer, plan["hf_dir"]) if distributed else None

        def new_version(version: int) -> dict:
            parts = sync.syncer.make_patch(version) if sync else []
            if distributed:  # the export needs every param whole: finish the deferred all-gather now
                stale = [bits(p).clone() for p in gpt.parameters()]
                ddp.start_param_sync(force_sync=True)
                refreshed = sum(
                    int((bits(p) != b).sum()) for p, b in zip(gpt.parameters(), stale, strict=True)
                )
                assert refreshed > 0, "the sync did not run against stale non-owned ranges"
            state = export(gpt, layout, rt, work / mode / f"v{version}")
            return sync.check(version, parts, state) if sync else {}

        rows = []
        for step, batch in enumerate(plan["batches"], start=1):
            tokens = torch.tensor(batch)
            forward_backward(ddp, tokens[rt.dp_rank :: rt.dp_size], rt)
            energy = lm_head_grad.lm_head_grad_energy(
                ddp, optimizer, is_last_stage=True, dp_group=rt.groups.dp, group=None
            )
            ok, grad_norm, _ = optimizer.step()
            assert ok, f"step {step} was skipped"
            rows.append({"step": step, "energy": energy, "grad_norm": grad_norm, **new_version(step)})
        rl = rl_update(ddp, optimizer, rt)
        rl.update(new_version(len(rows) + 1))
        if rt.rank == 0:
            (work / f"{mode}.json").write_text(json.dumps({"lm_steps": rows, "rl_update": rl}))
    finally:
        shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(pathlib.Path(sys.argv[1]))
