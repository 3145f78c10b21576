"""Megatron dist checkpoints (torch_dist) of a GPTModel, self-describing and re-shardable.

A checkpoint directory M holds megatron's `dist_checkpointing` files (keys are global, so a save at
one TP/PP loads at another) plus:
- `sparserl_mcore.json`: format version, arch, the TP/PP it was saved at, vocab and padded vocab,
  params dtype, transformer impl (`McoreCheckpointMeta`);
- `hf/`: the source's config.json and tokenizer files, so M alone is enough to build the model
  and to export it back to HF.

The padded vocabulary is part of the tensors' global shape, so a load at another TP keeps the
saved padded size (it must divide by the new TP) instead of re-padding.
`dist_checkpointing` starts a multiprocessing Manager with "spawn": scripts calling save/load need
an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from model_providers.gpt import ModelSpec
    from sparserl_mcore.parallel.config import ParallelConfig

FORMAT_VERSION = 1
META_FILE = "sparserl_mcore.json"
HF_SUBDIR = "hf"


@dataclasses.dataclass(frozen=True, kw_only=True)
class McoreCheckpointMeta:
    """What a dist checkpoint was saved from; stored beside megatron's own metadata."""

    format_version: int = FORMAT_VERSION
    arch: str
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    vocab_size: int
    padded_vocab_size: int
    params_dtype: str
    transformer_impl: str  # informational: the stored keys are the same for "local" and TE specs
    expert_model_parallel_size: int = 1  # informational too: experts are stored by global index

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"format_version={self.format_version} is not supported by this sparserl-mcore "
                f"(reads version {FORMAT_VERSION}); re-convert the checkpoint"
            )

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> McoreCheckpointMeta:
        return cls(
            arch=spec.arch,
            tensor_model_parallel_size=spec.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=spec.parallel.pipeline_model_parallel_size,
            vocab_size=spec.vocab_size,
            padded_vocab_size=spec.padded_vocab_size,
            params_dtype=str(spec.params_dtype).removeprefix("torch."),
            transformer_impl=spec.transformer_impl,
            expert_model_parallel_size=spec.parallel.expert_model_parallel_size,
        )

    def write(self, ckpt_dir: str | pathlib.Path) -> None:
        path = pathlib.Path(ckpt_dir) / META_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, ckpt_dir: str | pathlib.Path) -> McoreCheckpointMeta:
        path = pathlib.Path(ckpt_dir) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {ckpt_dir} is not a checkpoint written by `sparserl convert hf-to-mcore`"
            )
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}; known: {sorted(known)}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"{path}: missing fields {missing}")
        return cls(**data)


def spec_for_checkpoint(
    ckpt_dir: str | pathlib.Path, parallel: ParallelConfig, *, params_dtype: str | None = None
) -> ModelSpec:
    """The ModelSpec to load checkpoint `ckpt_dir` at layout `parallel` (any TP/PP the model allows).

    Keeps the saved padded vocabulary so tensor shapes match the checkpoint whatever the new TP.
    """
    from model_providers.gpt import build_spec

    meta = McoreCheckpointMeta.read(ckpt_dir)
    tp = parallel.tensor_model_parallel_size
    if meta.padded_vocab_size % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} does not divide the checkpoint's padded vocab "
            f"{meta.padded_vocab_size} (saved at TP={meta.tensor_model_parallel_size})"
        )
    spec = build_spec(
        pathlib.Path(ckpt_dir) / HF_SUBDIR,
        parallel,
        params_dtype=params_dtype or meta.params_dtype,
        vocab_multiple=meta.padded_vocab_size // tp,
    )
    assert spec.padded_vocab_size == meta.padded_vocab_size  # by the choice of vocab_multiple
    return spec


def save_dist(model: GPTModel, ckpt_dir: str | pathlib.Path) -> None:
    """Collective over all ranks: write `model`'s sharded state into existing empty `ckpt_dir`."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt_dir))


def load_dist(model: GPTModel, ckpt_dir: str | pathlib.Path) -> None:
    """Collective over all ranks: fill `model` (any TP/PP) from a dist checkpoint."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    model.load_state_dict(state)
