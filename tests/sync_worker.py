"""Multi-rank half of tests/test_sync_distributed.py, run under torchrun with 2 ranks per case.

For one case of WORK/plan.json (TP=2; PP=2; DP=2 with the distributed optimizer) it builds a bf16
GPTModel from a tiny HF checkpoint, trains a few megatron Adam steps (fp32 master weights), and
after every step: each rank diffs its own shard and encodes its own per-rank fragment
(`ShardSyncer.local_changes` + `sync.per_rank.encode_fragment`, the trainer's path), the fragments
are exchanged (all_gather of bytes, standing in for the delivery), and every rank applies them to
an HF-layout receiver and to a receiver with a different TP size. Both are compared bit for bit
with a full HF export (`ckpt.hf_io.export_hf_weights`) of the same step. The last step forces a
wrong base version on rank 1 so the full per-rank fallback runs. The stage-gathered patch
(`make_patch`, a second syncer on the same model) goes through the directory transport
(anchor every 2 versions): a follower and a late joiner must end bit-identical to the export.
Rank results go to WORK/<case>/rank<r>.json.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist


def _train_step(ddp, optimizer, tokens: torch.Tensor, rt) -> None:
    """One Adam step on the mean token NLL of `tokens` (one micro-batch per row)."""
    from distopt_worker import forward_backward

    optimizer.zero_grad()
    forward_backward(ddp, tokens, rt)
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step was skipped"


def _learner(case: dict, hf_dir: str, rt):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from model_providers.gpt import build_model, build_spec
    from sparserl_mcore.ckpt.hf_io import load_hf_weights
    from sparserl_mcore.ckpt.layout import layout_for

    spec = build_spec(hf_dir, rt.parallel, params_dtype="bfloat16", cpu=True)
    model = build_model(
        spec,
        device=rt.device,
        pre_process=rt.is_first_stage,
        post_process=rt.is_last_stage,
        pg_collection=rt.groups,
    )
    layout = layout_for(spec)
    load_hf_weights(model, layout, hf_dir, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank)
    dist_opt = case["distributed_optimizer"]
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    # megatron mixed precision: Float16Module holds the bf16 params the forward pass uses
    ddp = DistributedDataParallel(
        spec.config, ddp_cfg, Float16Module(spec.config, model), pg_collection=rt.groups
    )
    spec.config.finalize_model_grads_func = finalize_model_grads
    spec.config.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=case["lr"],
        clip_grad=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=dist_opt,
    )
    # bf16 params on CPU: parallel.cpu_mode reports the CUDA type names megatron checks (point 4)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False, pg_collection=rt.groups)
    return spec, model, ddp, layout, optimizer


def _receivers(spec, layout, hf_dir: str, other_tp: int):
    from model_providers.gpt import padded_vocab_size
    from sparserl_mcore.ckpt.hf_io import HFCheckpoint
    from sparserl_mcore.ckpt.layout import ModelLayout
    from sparserl_mcore.sync.apply import HFReceiver
    from sparserl_mcore.sync.hf_files import load_state
    from sparserl_mcore.sync.sharded import ShardedReceiver

    hf = HFReceiver(load_state(pathlib.Path(hf_dir)), version=0)
    other = ModelLayout(
        spec.hf,
        tp_size=other_tp,
        pp_size=1,
        padded_vocab_size=padded_vocab_size(spec.hf.vocab_size, other_tp),
    )
    ckpt = HFCheckpoint(hf_dir)
    shards = {}
    for tp in range(other_tp):
        params = {}
        for name, pmap in other.shard(tp, 0).items():
            params[name] = torch.empty(pmap.shape, dtype=torch.bfloat16)
            other.fill_local(pmap, params[name], ckpt.read)
        shards[(tp, 0)] = params
    return hf, ShardedReceiver(other, shards, version=0)


def _export(model, layout, rt, out: pathlib.Path) -> dict[str, torch.Tensor]:
    from sparserl_mcore.ckpt.hf_io import export_hf_weights, write_index
    from sparserl_mcore.sync.hf_files import load_state

    if rt.rank == 0:
        out.mkdir(parents=True)
    dist.barrier()
    weight_map = {}
    if rt.dp_rank == 0:
        weight_map = export_hf_weights(
            model, layout, out, tp_rank=rt.tp_rank, pp_rank=rt.pp_rank, tp_group=rt.groups.tp
        )
    maps = [None] * rt.world_size
    dist.all_gather_object(maps, weight_map)
    if rt.rank == 0:
        write_index(out, maps)
    dist.barrier()
    return load_state(out)


class _Publisher:
    """Directory transport fed by the learner: fragments collected on the first stage source,
    an anchor every 2 versions; rank 0 also follows the directory with its own receiver."""

    def __init__(self, syncer, root: pathlib.Path) -> None:
        from sparserl_mcore.sync.apply import HFReceiver
        from sparserl_mcore.sync.transport_dir import DirectoryConfig, DirectoryPublisher, DirectorySubscriber

        self.syncer, self.root = syncer, root
        self.writer = (
            DirectoryPublisher(root, DirectoryConfig(anchor_every=2)) if dist.get_rank() == 0 else None
        )
        self.follower = None
        self.publish(0, [])
        if self.writer is not None:
            blank = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in syncer.layout.hf_shapes.items()}
            self.follower = DirectorySubscriber(root, HFReceiver(blank, version=None))

    def publish(self, version: int, parts: list[bytes]) -> None:
        sparse = self.syncer.collect_parts(parts)
        full = self.syncer.collect_parts(self.syncer.full_parts())  # a concatenation is one full patch
        if self.writer is not None:
            base = version - 1 if version else None
            self.writer.publish(version=version, base_version=base, parts=sparse, full=lambda: b"".join(full))
        if self.follower is not None:
            assert self.follower.poll() == version and self.follower.fallbacks == 0

    def check_late_joiner(self, export: dict[str, torch.Tensor], latest: int) -> None:
        from sparserl_mcore.sync.apply import HFReceiver
        from sparserl_mcore.sync.transport_dir import DirectorySubscriber

        if self.writer is None:
            return
        blank = {n: torch.zeros_like(t) for n, t in export.items()}
        late = DirectorySubscriber(self.root, HFReceiver(blank, version=None))
        assert late.poll() == latest and late.bytes_read < self.follower.bytes_read  # anchor 2 + patch 3
        for receiver in (late.receiver, self.follower.receiver):
            assert all(_same(receiver.state[n], export[n]) for n in export)


def _check_partition(syncer, rt) -> None:
    """The DP ranks' owned ranges tile every emitted param exactly: no element twice, none missed."""
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, (rt.tp_rank, rt.pp_rank, syncer.owned))
    mine = [o for tp, pp, o in everyone if (tp, pp) == (rt.tp_rank, rt.pp_rank)]
    for name, param in syncer.params.items():
        ranges = sorted(o[name] for o in mine if o[name][1] > o[name][0])
        ends = [0] + [end for _, end in ranges]
        assert [start for start, _ in ranges] == ends[:-1] and ends[-1] == param.numel(), (name, ranges)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _exchange(fragment: bytes) -> bytes:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fragment)
    return b"".join(everyone)


def _sync_per_rank(rank_syncer, flat_syncer, meta, step: int, codec, receivers) -> tuple[int, bool, int]:
    """(bytes, whether any rank fell back, receivers of this rank that did) for one version; the
    receivers get the flat diff's fragments, which must be the per-param path's bytes."""
    from sparserl_mcore.sync.codec import PatchError
    from sparserl_mcore.sync.per_rank import encode_fragment

    rank, world = dist.get_rank(), dist.get_world_size()
    changes = rank_syncer.local_changes()
    frag = encode_fragment(
        changes, meta, version=step, base_version=step - 1, fragment=(rank, world), codec=codec
    )
    flat = flat_syncer.local_diff()
    flat_frag = flat.fragment(meta, version=step, base_version=step - 1, fragment=(rank, world), codec=codec)
    assert flat_frag == frag, f"rank {rank} step {step}: the flat fragment differs from encode_fragment's"
    rank_syncer.version = flat_syncer.version = step
    blob = _exchange(flat_frag)
    failed = []
    for receiver in receivers:
        try:
            receiver.apply(blob)
        except PatchError:
            failed.append(receiver)
    flag = torch.tensor([len(failed)])
    dist.all_reduce(flag)
    if int(flag):
        flat_syncer.owned_elements()  # the flat snapshot starts over from the full sync too
        owned = [(n, i, None, b) for n, i, b in rank_syncer.owned_elements()]
        full = _exchange(
            encode_fragment(owned, meta, version=step, base_version=None, fragment=(rank, world))
        )
        for receiver in failed:
            receiver.apply(full)
    return len(blob), bool(int(flag)), len(failed)


def run_case(case: dict, hf_dir: str, work: pathlib.Path) -> None:
    import dataclasses

    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
    from sparserl_mcore.sync.codec import CodecConfig
    from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer
    from sparserl_mcore.sync.per_rank import ModelMeta

    rt = initialize(
        ParallelConfig(tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"]), seed=0
    )
    try:
        spec, model, ddp, layout, optimizer = _learner(case, hf_dir, rt)
        config = ShardSyncConfig(
            codec=CodecConfig(encoding=case["encoding"]), snapshot=case.get("snapshot", "host")
        )
        syncer = ShardSyncer.for_runtime(ddp, layout, rt, optimizer=optimizer, config=config)
        rank_syncer = ShardSyncer.for_runtime(
            ddp, layout, rt, optimizer=optimizer, config=dataclasses.replace(config, mirror=False)
        )
        flat_syncer = ShardSyncer.for_runtime(
            ddp,
            layout,
            rt,
            optimizer=optimizer,
            config=dataclasses.replace(config, mirror=False, snapshot="flat"),
        )
        flat_syncer.flat.compare = "torch"  # the GPU's path (compare, map and gap-code as torch ops)
        _check_partition(syncer, rt)
        hf, sharded = _receivers(spec, layout, hf_dir, other_tp=2 if case["tp"] == 1 else 1)
        meta = ModelMeta("bfloat16", layout.hf_shapes)
        gen = torch.Generator().manual_seed(100 + rt.dp_rank)
        results = []
        publisher = _Publisher(syncer, work / case["name"] / "dir")
        for step in range(1, case["steps"] + 1):
            tokens = torch.randint(0, spec.hf.vocab_size, (2, 17), generator=gen)
            _train_step(ddp, optimizer, tokens, rt)
            parts = syncer.make_patch(step)
            forced = step == case["steps"] and rt.rank == 1
            if forced:
                hf.ledger.version = -1  # this receiver missed a version: the sparse patch must be refused
            sent, fell_back, local_fallbacks = _sync_per_rank(
                rank_syncer, flat_syncer, meta, step, config.codec, [hf, sharded]
            )
            publisher.publish(step, parts)
            export = _export(model, layout, rt, work / case["name"] / f"v{step}")
            assert set(export) == set(hf.state) == set(layout.hf_shapes)
            hf_bad = [n for n in export if not _same(hf.state[n], export[n])]
            sharded_bad = [n for n in export if not _same(sharded.hf_tensor(n), export[n])]
            assert not hf_bad and not sharded_bad, (step, hf_bad[:3], sharded_bad[:3])
            assert hf.version == sharded.version == step
            assert fell_back == (step == case["steps"]) and local_fallbacks == int(forced)
            results.append({"step": step, "bytes": sent, "gathered_bytes": sum(len(p) for p in parts),
                            "fell_back": fell_back, "flat_runs": len(flat_syncer.flat.runs)})  # fmt: skip
        publisher.check_late_joiner(export, case["steps"])
        (work / case["name"] / f"rank{rt.rank}.json").write_text(json.dumps(results))
    finally:
        shutdown()


def main(work: str, case_name: str) -> None:
    work_dir = pathlib.Path(work)
    plan = json.loads((work_dir / "plan.json").read_text())
    (case,) = [c for c in plan["cases"] if c["name"] == case_name]
    run_case(case, plan["hf_dir"], work_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
