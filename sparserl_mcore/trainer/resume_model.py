"""Whether `checkpoint.dir` holds training checkpoints of this run's model, known before any rank.

Two mistakes used to surface late or not at all (issue 36):
- a checkpoint of another architecture or shape failed inside every rank about 20 s after launch,
  with megatron's `KeyError` or `Global shape mismatch`. Megatron's dist checkpoint lists every
  tensor's global shape in torch's `.metadata`; read here without a tensor (and through an unpickler
  that builds only torch's checkpoint-metadata types), it is compared with the global shapes the
  run's model has (`ckpt.layout.ModelLayout` at TP = PP = 1, megatron's checkpoint keys: layers
  stacked on a leading axis, experts on the next, norms under their fused names), and the first
  tensor that differs is named with both shapes;
- a directory holding a converted model (`sparserl convert hf-to-mcore`), an HF checkpoint or a
  single training checkpoint (a `step_*` directory) was not a checkpoint root to resume from, so it
  was ignored and the run wrote its own checkpoints into it. Each is named with what to do instead.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from pathlib import Path

from model_providers.hf_config import HFModelConfig
from sparserl_mcore.ckpt.dist_ckpt import META_FILE
from sparserl_mcore.ckpt.layout import ModelLayout

Shapes = dict[str, tuple[int, ...]]
MODEL_KEYS = ("embedding.", "decoder.", "output_layer.")  # the rest is optimizer and loop state
# megatron's local spec saves its norms under the names the transformer-engine spec fuses them to
NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# What torch's `.metadata` pickle is made of (torch 2.x), besides dtypes
METADATA_TYPES = {
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")
_ISLAND = re.compile(r"island(\d+)\.(.*)")


def foreign_contents(directory: str) -> str | None:
    """What `directory` holds when it is not a root of training checkpoints (one line with the
    fix), else None (empty, absent, or `latest` + `step_*`)."""
    root = Path(directory)
    keep_apart = "give checkpoint.dir a directory of its own (this run writes its checkpoints there)"
    if (root / META_FILE).is_file():
        return (
            f"checkpoint.dir={directory} holds a converted model (`sparserl convert hf-to-mcore`: weights "
            "only, no optimizer, data position or RNG), not training checkpoints, so no run resumes from "
            f"it; to train from those weights, export them (`sparserl convert mcore-to-hf --mcore-dir "
            f"{directory} --out DIR`) and set model.hf_path=DIR; {keep_apart}"
        )
    if (root / "config.json").is_file() and any(root.glob("*.safetensors")):
        return (
            f"checkpoint.dir={directory} holds an HF model checkpoint, not training checkpoints; to "
            f"train from it set model.hf_path={directory}; {keep_apart}"
        )
    if (root / "metadata.json").is_file() and (root / "run.json").is_file():
        return (
            f"checkpoint.dir={directory} is one training checkpoint ({root.name}), not the directory "
            f"that holds them; set checkpoint.dir={root.parent} to resume from its latest"
        )
    return None


def model_mismatch(checkpoint: Path, hf: HFModelConfig, tp: int) -> str | None:
    """The first model tensor whose global shape in `checkpoint` is not the one a run of `hf` at
    TP=`tp` builds (or that only one side has), as one phrase with both shapes; None when all agree."""
    if not (checkpoint / ".metadata").is_file():  # not torch_dist: what is missing is `damage`'s
        return None
    saved = saved_model_shapes(checkpoint)
    embedding = saved.get("embedding.word_embeddings.weight")
    padded = embedding[0] if embedding and embedding[0] >= hf.vocab_size else _run_padded_vocab(hf, tp)
    expected = expected_model_shapes(hf, padded)
    for name, shape in expected.items():
        if name not in saved:
            return f"{name}: not in the checkpoint, {shape} in this run's model"
        if saved[name] != shape:
            return f"{name}: {saved[name]} in the checkpoint, {shape} in this run's model"
    for name, shape in saved.items():
        if name not in expected:
            return f"{name}: {shape} in the checkpoint, not in this run's model"
    return None


def expected_model_shapes(hf: HFModelConfig, padded_vocab_size: int) -> Shapes:
    """Global shape of every model tensor of a megatron checkpoint of `hf`, by checkpoint key."""
    layout = ModelLayout(hf, tp_size=1, pp_size=1, padded_vocab_size=padded_vocab_size)
    shapes: Shapes = {}
    for name, param in layout.shard(0, 0).items():
        layer = _LAYER.fullmatch(name)
        if layer is None:
            shapes[name] = param.shape
            continue
        rest = NORM_ALIASES.get(layer.group(2), layer.group(2))
        expert = _EXPERT.fullmatch(rest)
        if expert is None:
            shapes[f"decoder.layers.{rest}"] = (hf.num_layers, *param.shape)
        elif hf.moe is not None:
            shapes[f"decoder.layers.mlp.experts.experts.{expert.group(2)}"] = (
                hf.num_layers,
                hf.moe.num_experts,
                *param.shape,
            )
    return shapes


def saved_model_shapes(checkpoint: Path) -> Shapes:
    """Global shape of every model tensor in dist checkpoint `checkpoint` (island 0's when it was
    saved with DiLoCo islands), norms under their fused names."""
    shapes: Shapes = {}
    for key, shape in _global_shapes(checkpoint):
        island = _ISLAND.fullmatch(key)
        if island is not None:
            if island.group(1) != "0":
                continue
            key = island.group(2)
        if not key.startswith(MODEL_KEYS):
            continue
        head, _, tail = key.partition("decoder.layers.")
        shapes[head + ("decoder.layers." + NORM_ALIASES.get(tail, tail) if tail else "")] = shape
    return shapes


def _global_shapes(checkpoint: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with (checkpoint / ".metadata").open("rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise ValueError(f"{checkpoint / '.metadata'} is not torch checkpoint metadata ({exc})") from None
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            yield key, tuple(entry.size)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the types torch's `.metadata` is made of and nothing else: this process reads the
    file before any rank does, so it must not run what a damaged or foreign file names."""

    def find_class(self, module: str, name: str) -> object:
        import torch

        if name in METADATA_TYPES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def _run_padded_vocab(hf: HFModelConfig, tp: int) -> int:
    """The padded vocabulary a fresh learner of `hf` builds (`model_providers.gpt.padded_vocab_size`)."""
    from model_providers.gpt import padded_vocab_size

    return padded_vocab_size(hf.vocab_size, tp)
