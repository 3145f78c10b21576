"""Checks of an HF checkpoint directory that need neither torch nor megatron, run by every command
(train, convert, verify, serve) before it starts ranks or loads an engine, so a bad directory is
refused in one line naming the file, field or tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

from model_providers.hf_config import HFModelConfig, parse_hf_config
from sparserl_mcore.ckpt.hf_io import CheckpointError, HFCheckpoint
from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.parallel.config import ParallelConfig

# Any one of these makes `AutoTokenizer.from_pretrained(dir)` possible.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_hf_checkpoint(
    hf_dir: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    parallel: ParallelConfig | None = None,
    label: str = "--hf-dir",
    tokenizer: bool = False,
) -> HFModelConfig:
    """The checkpoint's config, once it is known to load at (tp, pp), or at `parallel` when given
    (expert parallelism included).

    Checked: the directory exists; config.json parses, names a registered architecture and has
    every field the model needs; TP divides the heads, PP fits the layers, EP divides the experts
    (`ParallelConfig.validate_model`); every safetensors
    file is complete; every tensor is present with its shape (headers only); and, with
    `tokenizer`, that tokenizer files exist. Raises CheckpointError (a ValueError) prefixed by
    `label` and the path.
    """
    path = Path(hf_dir)
    where = f"{label} {hf_dir}"
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "no such directory"
        raise CheckpointError(f"{where}: {what}")
    try:
        hf = parse_hf_config(path)
        par = parallel or ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        par.validate_model(**hf.layout_shape())
        tp = par.tensor_model_parallel_size
        step = 128 * tp  # any padded size passes the name/shape check; the ranks use build_spec's
        padded = -(-hf.vocab_size // step) * step
        layout = ModelLayout(
            hf,
            tp_size=tp,
            pp_size=par.pipeline_model_parallel_size,
            padded_vocab_size=padded,
            ep_size=par.expert_model_parallel_size if hf.moe else 1,
            etp_size=par.expert_tensor_size if hf.moe else None,
        )
        HFCheckpoint(path).check(layout)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{label if str(path) in str(exc) else where}: {exc}") from None
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{where}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    return hf


def check_mcore_checkpoint(
    mcore_dir: str | os.PathLike,
    tp: int | None,
    pp: int | None,
    hf_config_dir: str | None,
    label: str = "--hf-config-dir",
    *,
    ep: int | None = None,
    etp: int | None = None,
) -> ParallelConfig:
    """Readable metadata, a layout the model allows, and a matching HF config (`label` names its
    flag in errors); returns the layout (each size not given: the one it was saved at)."""
    from sparserl_mcore.ckpt.dist_ckpt import HF_SUBDIR, McoreCheckpointMeta

    meta = McoreCheckpointMeta.read(Path(mcore_dir))
    tp, pp = tp or meta.tensor_model_parallel_size, pp or meta.pipeline_model_parallel_size
    hf = parse_hf_config(Path(mcore_dir) / HF_SUBDIR)
    par = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep or meta.expert_model_parallel_size,
        expert_tensor_parallel_size=etp,
    )
    par.validate_model(**hf.layout_shape())
    if meta.padded_vocab_size % tp:
        raise ValueError(f"--tp {tp} does not divide the checkpoint's padded vocab {meta.padded_vocab_size}")
    if hf_config_dir is not None:
        given = parse_hf_config(hf_config_dir)
        diff = [f for f in type(hf).__dataclass_fields__ if getattr(hf, f) != getattr(given, f)]
        if diff:
            raise ValueError(f"{label} {hf_config_dir} does not match the checkpoint: fields {diff} differ")
    return par
