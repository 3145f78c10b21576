"""One SGLang TP rank on CPU (gloo) for tests/test_sglang_loader.py; run as a subprocess.

    python tests/sglang_tp_worker.py RANK WORLD PORT HF_DIR OUT_JSON

Builds SGLang 0.5.23's real `Qwen2ForCausalLM` for this TP rank (SGLang's own parallel_state over
gloo), loads checkpoint A through SGLang's `load_weights`, then sends a sparse sync A -> B the way
the trainer does: per-rank touched-digest fragments from two simulated learner ranks, split by
`SGLangLayout` per TP rank, serialized by `client.patch_payloads` and decoded with SGLang's own
`MultiprocessingSerializer.deserialize` (the route's SafeUnpickler), applied by the custom loader.
Reference: a second SGLang model loaded with B through SGLang's `load_weights`. Then a corrupt
base on rank 0 must make EVERY rank reject the next patch (SyncRejected), and a version marker
must clear that; then the loader's failure and dtype checks, and a KV compression with one KV head
replicated over the TP ranks (`sglang_kv_world.replica_scenario`). Writes its findings to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from sglang_cpu import require_sglang  # noqa: E402


def init_sglang_parallel(rank: int, world: int, port: int, **server_args: Any) -> None:
    """SGLang's parallel state over gloo, as SGLang's CPU layer tests set it up (`sglang/test/
    layer_ut_utils.py: init_single_process_dist`, `test_utils.py: publish_build_topology`), with
    `server_args` as extra `ServerArgs` fields."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(
        world_size=world, rank=rank, local_rank=rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    reset_context()
    args = ServerArgs(model_path="dummy", tp_size=world, **server_args)
    publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def shutdown_sglang_parallel() -> None:
    """SGLang's own teardown of its groups, then any group left (e.g. a weight-update group):
    process groups still alive at interpreter exit abort it now and then ("terminate called without
    an active exception" from c10d's threads, exit code -6)."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def sglang_model(hf_dir: Path, state: dict):
    import torch
    import transformers
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    model = Qwen2ForCausalLM(transformers.AutoConfig.from_pretrained(hf_dir))
    model.load_weights(list(state.items()))  # SGLang's own weight_loaders (qkv / gate_up / vocab)
    return model


def parsed_launch_argv() -> dict:
    """`sparserl sglang-serve`'s command line as SGLang 0.5.23's own parser reads it."""
    from sglang.srt.server_args import prepare_server_args

    from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig
    from sparserl_mcore.sglang.launch import LaunchConfig, sglang_argv

    cfg = LaunchConfig(
        model_path="/models/qwen", host="0.0.0.0", port=30001, tp_size=2, token="secret-token",
        kv=KVCompressionConfig(method="snapkv"),
    )  # fmt: skip
    argv = sglang_argv(cfg)
    args = prepare_server_args(argv[3:])  # after `python -m sglang.launch_server`
    fields = (
        "model_path", "host", "port", "tp_size", "custom_weight_loader", "admin_api_key", "page_size",
        "disable_overlap_schedule", "max_running_requests",
    )  # fmt: skip
    return {
        "module": argv[2],
        **{f: getattr(args, f) for f in fields},
        "decode_graph": args.cuda_graph_backend_decode,
    }


def sglang_route(model, rank: int):
    """What /update_weights_from_tensor runs on this TP rank, from the payload list on: SGLang's
    `tp_worker.deserialize_own_rank` step (SafeUnpickler on payload[rank]) and SGLang's real
    `WeightUpdater.update_weights_from_tensor`, which imports and calls our loader through
    `--custom-weight-loader`, wrapped by our plugin's hook (loaded by SGLang's `load_plugins`)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils.common import MultiprocessingSerializer

    from sparserl_mcore.sglang.launch import PLUGIN_ENV, LaunchConfig, plugin_settings
    from sparserl_mcore.sglang.loader import LOADER_PATH

    os.environ[PLUGIN_ENV] = json.dumps(plugin_settings(LaunchConfig(model_path="x")))
    load_plugins()  # discovers our `sglang.srt.plugins` entry point, applies its hook
    updater = WeightUpdater(
        tp_rank=rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[LOADER_PATH],
        get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )  # fmt: skip

    def send(payloads: list) -> tuple:
        named = MultiprocessingSerializer.deserialize(payloads[rank])
        return updater.update_weights_from_tensor(named_tensors=named, load_format=LOADER_PATH)

    return send


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    hf_dir, out = Path(sys.argv[4]), Path(sys.argv[5])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    require_sglang()
    init_sglang_parallel(rank, world, port)

    import torch
    from safetensors.torch import load_file

    from model_providers.hf_config import parse_hf_config
    from sparserl_mcore.sglang.client import patch_payloads, version_payloads
    from sparserl_mcore.sglang.layout import SGLangLayout
    from sparserl_mcore.sglang.plugin import WEIGHT_UPDATER, missing_targets
    from sparserl_mcore.sync.hashing import bits_view, dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment, split_by_receiver

    a = {k: v.to(torch.bfloat16) for k, v in load_file(hf_dir / "model.safetensors").items()}
    gen = torch.Generator().manual_seed(7)
    b = {}
    changes = []  # (name, idx, old, new) of the whole model
    for name, t in sorted(a.items()):
        new = t.clone()
        flat = bits_view(new)
        idx = torch.randperm(flat.size, generator=gen)[: max(1, flat.size // 50)].sort().values.numpy()
        old_bits = flat[idx].copy()
        flat[idx] = old_bits + 1  # one ulp up (never NaN: tiny-model weights are small)
        b[name] = new
        changes.append((name, idx, old_bits, flat[idx].copy()))
    model, ref = sglang_model(hf_dir, a), sglang_model(hf_dir, b)
    send = sglang_route(model, rank)
    # the base the trainer declares after a dense sync, then a sparse patch 1 -> 2 from two learner ranks
    assert send(version_payloads(1, world)) == (True, "Success")
    layout = SGLangLayout(parse_hf_config(hf_dir), tp_size=world)
    meta = ModelMeta(dtype_name(torch.bfloat16), layout.hf_shapes)
    halves = [[(n, i[k::2], o[k::2], w[k::2]) for n, i, o, w in changes] for k in (0, 1)]
    sent = 0
    for learner, part in enumerate(halves):
        per_receiver = split_by_receiver(part, layout)
        frags = [
            encode_fragment(c, meta, version=2, base_version=1, fragment=(learner, 2)) for c in per_receiver
        ]
        sent += len(frags[rank])
        assert send(patch_payloads(frags)) == (True, "Success")
    version = model._sparserl_receiver.version
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    mismatched = [
        n for n, p in ref_params.items() if not torch.equal(params[n].view(torch.int16), p.view(torch.int16))
    ]
    # a corrupt base on rank 0: every rank must reject the next patch, nothing half applied silently
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    if rank == 0:
        params[qkv].data += 1.0  # every touched position of this tensor now has a wrong base
    change3 = [(n, i, w, w + 1) for n, i, _, w in changes]
    frags = [
        encode_fragment(c, meta, version=3, base_version=2, fragment=(0, 1))
        for c in split_by_receiver(change3, layout)
    ]
    rejected = send(patch_payloads(frags))
    after_reject = model._sparserl_receiver.ledger.broken is not None
    assert send(version_payloads(5, world)) == (True, "Success")
    cleared = model._sparserl_receiver.version
    failure = _failure_that_is_not_a_rejection(model, send, changes, meta, layout, rank, world)
    assert send(version_payloads(7, world)) == (True, "Success")
    dtypes = _dtype_checks(hf_dir, a, b, meta, layout, rank, world)
    from sglang_kv_world import replica_scenario  # KV compression in the same TP world

    kv_replicas = {m: replica_scenario(m, rank, world) for m in ("snapkv", "rkv")}
    out.write_text(
        json.dumps(
            {
                "launch_argv": parsed_launch_argv() if world == 1 else None,
                "version": version,
                "mismatched": mismatched,
                "params": len(ref_params),
                "fragment_bytes": sent,
                "rejected": list(rejected),
                "missing_targets": missing_targets(
                    [WEIGHT_UPDATER, "sglang.srt.models.qwen2.NoSuchClass.forward"]
                ),
                "broken_after_reject": after_reject,
                "version_after_marker": cleared,
                "failure": failure,
                "dtypes": dtypes,
                "kv_replicas": kv_replicas,
            }
        )
    )


def _failure_that_is_not_a_rejection(model, send, changes, meta, layout, rank: int, world: int) -> dict:
    """A KeyError on the last TP rank (a parameter missing from its model) while applying a valid
    patch: every rank must still reach the loader's exchange and answer (False, message)."""
    from sparserl_mcore.sglang.client import patch_payloads
    from sparserl_mcore.sync.per_rank import encode_fragment, split_by_receiver

    norm = model.model.norm
    saved = norm._parameters.pop("weight") if rank == world - 1 else None
    overwrite = [(n, i, None, w + 2) for n, i, _, w in changes]  # a full fragment: rank 0 applies it
    frags = [
        encode_fragment(c, meta, version=6, base_version=None, fragment=(0, 1))
        for c in split_by_receiver(overwrite, layout)
    ]
    answer = send(patch_payloads(frags))
    if saved is not None:
        norm._parameters["weight"] = saved
    return {"answer": list(answer), "broken": model._sparserl_receiver.ledger.broken is not None}


def _dtype_checks(hf_dir: Path, a: dict, b: dict, meta, layout, rank: int, world: int) -> dict:
    """The loader on SGLang models holding other dtypes than the patch: one fp32 parameter in a
    bf16 model (a bf16 patch must not write through a 16-bit view of it), a whole fp16 model (what
    SGLang serves for a float32 config without --dtype), then a full sync in fp16 into it."""
    import numpy as np
    import torch
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import MultiprocessingSerializer

    from sparserl_mcore.sglang.client import patch_payloads
    from sparserl_mcore.sglang.loader import SyncRejected, apply_named_tensors
    from sparserl_mcore.sync.hashing import bits_view, dtype_name
    from sparserl_mcore.sync.per_rank import ModelMeta, encode_fragment, split_by_receiver

    group = get_parallel().tp_group.cpu_group

    def full_sync(model, state: dict, dtype: torch.dtype) -> str:
        full = [
            (n, np.arange(t.numel()), None, bits_view(t.to(dtype)).copy()) for n, t in sorted(state.items())
        ]
        meta_d = ModelMeta(dtype_name(dtype), meta.shapes)
        frags = [
            encode_fragment(c, meta_d, version=1, base_version=None, fragment=(0, 1))
            for c in split_by_receiver(full, layout)
        ]
        named = MultiprocessingSerializer.deserialize(patch_payloads(frags)[rank])
        try:
            apply_named_tensors(model, named, tp_rank=rank, tp_size=world, group=group)
        except SyncRejected as exc:
            return str(exc)
        return ""

    def same(m1, m2) -> bool:
        p2 = dict(m2.named_parameters())
        return all(torch.equal(p.data, p2[n].data) for n, p in m1.named_parameters())

    mixed, ref = sglang_model(hf_dir, a), sglang_model(hf_dir, a)
    mixed.model.norm.weight.data = mixed.model.norm.weight.data.float()  # a norm kept in fp32
    ref.model.norm.weight.data = ref.model.norm.weight.data.float()
    mixed_error = full_sync(mixed, b, torch.bfloat16)
    mixed_untouched = same(mixed, ref)
    half, half_ref = sglang_model(hf_dir, b).half(), sglang_model(hf_dir, a).half()
    half_error = full_sync(half, b, torch.bfloat16)
    half_synced = full_sync(half, a, torch.float16)
    return {
        "mixed_error": mixed_error,
        "mixed_untouched": mixed_untouched,
        "half_error": half_error,
        "half_synced_error": half_synced,
        "half_equal": same(half, half_ref),
    }


if __name__ == "__main__":
    main()
