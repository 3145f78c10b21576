"""The weight loader SGLang calls with our patch fragments, on every TP worker (`--custom-weight-loader`).

How sglang 0.5.23 reaches it (file: symbol):
- `entrypoints/http_server.py: update_weights_from_tensor` (POST /update_weights_from_tensor,
  body `UpdateWeightsFromTensorReqInput` from `managers/io_struct.py`: `serialized_named_tensors`
  = one base64 payload per TP rank, `load_format`, `flush_cache`, `weight_version`);
- `managers/scheduler_components/weight_updater.py:
  SchedulerWeightUpdaterManager.update_weights_from_tensor` (only inside a begin/end weight-update
  session) -> `managers/tp_worker.py: deserialize_own_rank` (each rank unpickles ITS payload with
  `utils/common.py: SafeUnpickler`, which admits plain CPU tensors) ->
- `model_executor/model_runner_components/weight_updater.py: WeightUpdater.update_weights_from_tensor`:
  moves every tensor to the device, then, because `load_format` is listed in
  `--custom-weight-loader`, calls `dynamic_import(load_format)(model, named_tensors)`. The return
  value is ignored and an exception would end the scheduler, so a rejection is raised as
  `SyncRejected`, which our plugin's hook on that method turns into `(False, message)`: HTTP 400.

Payload (built by `sparserl_mcore.sglang.client.patch_payloads`): `[(PATCH_TENSOR, uint8 tensor of
one encoded fragment), ...]` for this rank, or `[(VERSION_TENSOR, int64 [version])]` after a dense
NCCL sync to tell the receiver which version it now holds. The fragments are per-rank fragments
(`sync.per_rank`) holding only this TP rank's elements, in HF coordinates; `SGLangLayout` maps them
into this rank's fused parameters, `sync.sharded.ShardedReceiver` writes and verifies them. Every
TP rank then agrees over SGLang's TP CPU group: if any rank rejected, every rank marks itself
as needing a full sync and raises, so the worker never serves a half-applied version silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from model_providers.hf_config import parse_hf_config
from sparserl_mcore.sglang.layout import SGLangLayout
from sparserl_mcore.sync.apply import FragmentLedger
from sparserl_mcore.sync.codec import PatchError
from sparserl_mcore.sync.sharded import ShardedReceiver

LOADER_PATH = "sparserl_mcore.sglang.loader.load_patch_fragments"  # the --custom-weight-loader value
PATCH_TENSOR = "sparserl.patch"
VERSION_TENSOR = "sparserl.version"
_RECEIVER_ATTR = "_sparserl_receiver"
_log = logging.getLogger(__name__)


class SyncRejected(RuntimeError):
    """A patch did not land on this worker (any TP rank); the trainer falls back to a full sync."""


def load_patch_fragments(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-weight-loader entry point: `(model, [(name, tensor)])`, on every TP rank."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    apply_named_tensors(
        model, named_tensors, tp_rank=par.tp_rank, tp_size=par.tp_size, group=par.tp_group.cpu_group
    )


def apply_named_tensors(
    model: torch.nn.Module,
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    tp_rank: int,
    tp_size: int,
    group: dist.ProcessGroup | None,
) -> int | None:
    """Apply this rank's fragments (or take a version marker); collective over `group`.

    Returns the version the worker holds afterwards; raises SyncRejected on every rank when any
    rank rejected or failed. Whatever this rank raises (a bad patch, a device out of memory in
    the middle of a write, a KeyError), it still joins the exchange below, or the other ranks
    would wait in it forever; a failure that is not a rejected patch may have written part of a
    fragment, so it too leaves every rank needing a full sync.
    """
    error = ""
    receiver = None
    try:
        receiver = receiver_for(model, tp_rank, tp_size)
        _apply_local(receiver, named_tensors)
    except (PatchError, ValueError) as exc:
        error = f"tp rank {tp_rank}: {exc}"
    except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange, whatever failed
        _log.error("sparserl loader: tp rank %d failed applying a patch", tp_rank, exc_info=True)
        error = f"tp rank {tp_rank}: {type(exc).__name__}: {exc}"
    errors = [error]
    if group is not None and dist.get_world_size(group) > 1:
        errors = [""] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        if receiver is not None:
            receiver.ledger.failed(failed[0])
            receiver.ledger.broken = failed[0]
        raise SyncRejected("; ".join(failed))
    return receiver.version if receiver is not None else None


def _apply_local(receiver: ShardedReceiver, named_tensors: Sequence[tuple[str, Any]]) -> None:
    names = [name for name, _ in named_tensors]
    if names == [VERSION_TENSOR]:
        version = int(named_tensors[0][1].reshape(-1)[0])
        receiver.ledger = FragmentLedger(version)  # a dense sync replaced every weight
        return
    if not names or any(name != PATCH_TENSOR for name in names):
        raise PatchError(
            f"expected tensors named {PATCH_TENSOR!r} (or one {VERSION_TENSOR!r}), got {names[:4]}"
        )
    for _, tensor in named_tensors:
        data = tensor.detach().to("cpu", torch.uint8).contiguous().numpy()
        receiver.apply(np.ascontiguousarray(data).tobytes())


def receiver_for(model: torch.nn.Module, tp_rank: int, tp_size: int) -> ShardedReceiver:
    """This worker's receiver over the model's own parameters (built once, kept on the model)."""
    receiver = getattr(model, _RECEIVER_ATTR, None)
    if receiver is not None:  # SGLang may swap a parameter's storage between updates
        receiver.shards = {(tp_rank, 0): {n: p.data for n, p in model.named_parameters()}}
    else:
        layout = sglang_layout(model, tp_size)
        params = dict(model.named_parameters())
        expected = layout.shard(tp_rank, 0)
        wrong = sorted(set(params) ^ set(expected))
        wrong += [n for n in expected if n in params and tuple(params[n].shape) != expected[n].shape]
        if wrong:
            raise PatchError(
                f"SGLang's parameters do not match {layout!r} rank {tp_rank} (quantized or unsupported "
                f"model?): {wrong[:4]}"
            )
        receiver = ShardedReceiver(layout, {(tp_rank, 0): {n: p.data for n, p in params.items()}})
        setattr(model, _RECEIVER_ATTR, receiver)
    return receiver


def sglang_layout(model: torch.nn.Module, tp_size: int) -> SGLangLayout:
    """The layout of a loaded SGLang Qwen2 / Qwen3 / Llama model at `tp_size`."""
    config: Any = model.config  # SGLang's model holds the HF PretrainedConfig
    hf = parse_hf_config(config.to_dict())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    replicated = embed is not None and getattr(embed, "tp_size", tp_size) == 1 and tp_size > 1
    return SGLangLayout(hf, tp_size=tp_size, replicate_embedding=replicated)
