"""The learner layout a training checkpoint was written at, and whether a run can resume from it.

Every checkpoint's run record (`run_record`, `run.json`) holds its `RunLayout`: world size,
TP/PP/CP/DP, params dtype, distributed optimizer or not, and the padded vocabulary. Megatron's dist
checkpoints are keyed by global tensor names (experts by their global index), so model and
optimizer reshard across TP, PP, DP, EP and params dtype (the fp32 master weights and Adam moments
are stored in model space, `fully_reshardable`); what cannot change is checked here, before any
rank loads anything, and refused in one line naming the saved and the requested layout:
- the optimizer kind: the replicated and the distributed optimizer store their state differently;
- the padded vocabulary: it is part of the embedding's global shape, so a resumed learner keeps
  the saved one (`vocab_multiple`), which the new TP size must divide;
- DiLoCo islands: the island count, and with islands any part of the layout (each island's
  model and optimizer, the anchor, residual and momentum are stored per island and per shard).
Pure Python (no torch): the CLI checks before launching any rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunLayout:
    """Where and how the learner ran when it saved (or will run when it resumes)."""

    format_version: int = FORMAT_VERSION
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int = 1
    params_dtype: str  # "fp32" | "bf16" (the run config's names)
    distributed_optimizer: bool
    padded_vocab_size: int | None = None  # None: not built yet (a requested layout)
    expert_model_parallel_size: int = 1  # MoE: experts are stored by global index, so EP reshards
    islands: int = 1  # DiLoCo islands (parallel.islands); records without it had one

    @property
    def data_parallel_size(self) -> int:
        model = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        return self.world_size // (model * self.context_parallel_size)

    def describe(self) -> str:
        opt = "distributed" if self.distributed_optimizer else "replicated"
        ep = f"EP={self.expert_model_parallel_size} " if self.expert_model_parallel_size > 1 else ""
        return (
            f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} "
            f"CP={self.context_parallel_size} DP={self.data_parallel_size} {ep}{self.params_dtype} "
            f"{opt} optimizer" + (f" islands={self.islands}" if self.islands > 1 else "")
        )

    def same_ranks(self, other: RunLayout) -> bool:
        """Whether every rank plays the same role (then per-rank RNG streams carry over exactly)."""
        fields = (
            "world_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        )
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunLayout:
        """A saved layout; ValueError for another format version or a malformed entry."""
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"layout format_version={data.get('format_version')!r}, this code reads {FORMAT_VERSION}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def requested_layout(cfg: Any, world_size: int, padded_vocab_size: int | None = None) -> RunLayout:
    """The layout a run of `cfg` (a `RunConfig`) on `world_size` ranks trains at."""
    par = cfg.parallel
    return RunLayout(
        world_size=world_size,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        context_parallel_size=par.context_parallel_size,
        params_dtype=cfg.model.params_dtype,
        distributed_optimizer=cfg.optimizer.distributed,
        padded_vocab_size=padded_vocab_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        islands=par.islands,
    )


def resume_problem(saved: RunLayout | None, requested: RunLayout, *, same_world_files: bool) -> str | None:
    """Why a run at `requested` cannot resume a checkpoint saved at `saved` (None: it can).

    `same_world_files`: the checkpoint has an RNG file for every requested rank (what a checkpoint
    without a saved layout needs, since its layout is unknown).
    """
    if saved is None:
        if same_world_files:
            return None
        return (
            f"the checkpoint records no layout and has no RNG file for "
            f"every one of the {requested.world_size} ranks; resume it at the world size it was saved at"
        )
    change = f"saved at {saved.describe()}, requested {requested.describe()}"
    if saved.distributed_optimizer != requested.distributed_optimizer:
        want = str(saved.distributed_optimizer).lower()
        return (
            f"cannot resume: {change}; the optimizer state formats differ (set optimizer.distributed={want})"
        )
    if saved.islands != requested.islands:
        return (
            f"cannot resume: {change}; the checkpoint holds {saved.islands} island(s)' state and "
            f"parallel.islands={requested.islands} (set parallel.islands={saved.islands})"
        )
    if saved.islands > 1 and not (
        saved.same_ranks(requested) and saved.params_dtype == requested.params_dtype
    ):
        return (
            f"cannot resume: {change}; with DiLoCo islands the per-island model, optimizer and outer "
            "state are stored per shard: resume at the saved layout"
        )
    padded, tp = saved.padded_vocab_size, requested.tensor_model_parallel_size
    if padded is not None and padded % tp:
        return f"cannot resume: {change}; the saved padded vocabulary {padded} is not divisible by TP={tp}"
    return None
