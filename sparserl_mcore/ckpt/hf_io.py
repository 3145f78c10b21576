"""HF safetensors <-> a TP/PP-sharded megatron GPTModel, through `ModelLayout`.

Loading: every rank opens the checkpoint's safetensors headers, checks names and shapes for the
whole model (cheap: headers only, so a bad checkpoint fails the same way on every rank), then
reads only the row/column slices its own parameters need (`safe_open(...).get_slice`) straight
into the parameters. No rank ever holds a full copy of the model.

Export: per HF tensor, the TP ranks of a stage gather their pieces on the stage's tp_rank 0, which
assembles the tensor and flushes its buffer to a safetensors file whenever it passes
`max_shard_bytes`; the stages write disjoint files, and global rank 0 writes the index json,
config.json and the tokenizer files. The largest buffer on any rank is one file's worth.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Union

from sparserl_mcore.ckpt.layout import ModelLayout

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

INDEX_FILE = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that the megatron model has no use for.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
# Files that are weights (never copied from a source dir on export); everything else is copied.
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointError(ValueError):
    """The HF checkpoint does not match the model config (missing/unexpected tensor, wrong shape)."""


@contextlib.contextmanager
def _safe_open(path: pathlib.Path) -> Iterator:
    """safetensors' `safe_open`, with a truncated or corrupt file reported as a CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    with handle as f:
        yield f


class HFCheckpoint:
    """Read-only view of an HF safetensors checkpoint (single file or sharded with an index json)."""

    def __init__(self, hf_dir: str | pathlib.Path) -> None:
        self.dir = pathlib.Path(hf_dir)
        self.files: dict[str, pathlib.Path] = self._tensor_files()
        self._headers: dict[str, tuple[tuple[int, ...], str]] = {}

    def _tensor_files(self) -> dict[str, pathlib.Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc!r})") from None
            missing = sorted({f for f in weight_map.values() if not (self.dir / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} names files that do not exist: {missing}")
            return {name: self.dir / f for name, f in weight_map.items()}
        single = self.dir / "model.safetensors"
        if not single.is_file():
            raise CheckpointError(f"no model.safetensors or {INDEX_FILE} in {self.dir}")
        with _safe_open(single) as f:
            return {name: single for name in f.keys()}

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of a tensor from its file's header (each file's header read once)."""
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        if name not in self._headers:
            with _safe_open(self.files[name]) as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    raw = part.get_dtype()
                    self._headers[key] = (tuple(part.get_shape()), _SAFETENSORS_DTYPES.get(raw, raw))
        return self._headers[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name)[0]

    def dtype(self, name: str) -> str:
        return self._header(name)[1]

    def read(self, name: str, rows: slice, cols: slice | None) -> torch.Tensor:
        """Rows (and columns) of one tensor, read from disk without loading the rest of it.

        The file is mapped only for the duration of one read: a mapping kept open would keep every
        page read so far resident, adding up to a whole checkpoint file to the process's RSS.
        """
        from safetensors import safe_open

        self._header(name)
        with safe_open(self.files[name], framework="pt") as f:
            part = f.get_slice(name)
            return part[rows] if cols is None else part[rows, cols]

    def check(self, layout: ModelLayout) -> None:
        """Every tensor the layout needs is present with its shape; nothing unknown is present."""
        missing = [n for n in layout.hf_shapes if n not in self.files]
        if missing:
            raise CheckpointError(
                f"{len(missing)} tensor(s) missing from {self.dir} for {layout!r}: {missing[:8]}"
                + (" ..." if len(missing) > 8 else "")
            )
        for name, expected in layout.hf_shapes.items():
            found = self.shape(name)
            if found != expected:
                raise CheckpointError(
                    f"tensor {name!r} in {self.dir} has shape {list(found)}, expected {list(expected)} "
                    f"from the config ({layout!r})"
                )
        tied_extra = {"lm_head.weight"} if layout.hf.tie_embeddings else set()
        unexpected = [
            n
            for n in self.files
            if n not in layout.hf_shapes and n not in tied_extra and not n.endswith(_IGNORABLE_SUFFIXES)
        ]
        if unexpected:
            raise CheckpointError(
                f"{len(unexpected)} tensor(s) in {self.dir} not described by the config: {unexpected[:8]}"
            )

    def config_dtype(self) -> str | None:
        """The dtype the checkpoint's config.json declares (transformers 5 `dtype` or `torch_dtype`)."""
        config = self.dir / "config.json"
        if not config.is_file():
            return None
        data = json.loads(config.read_text())
        return data.get("dtype") or data.get("torch_dtype")


def load_hf_weights(
    model: torch.nn.Module,
    layout: ModelLayout,
    hf_dir: str | pathlib.Path,
    *,
    tp_rank: int,
    pp_rank: int,
    ep_rank: int = 0,
) -> None:
    """Fill this rank's `model` (one TP/PP/EP shard of a GPTModel) from an HF checkpoint directory."""
    import torch

    ckpt = HFCheckpoint(hf_dir)
    ckpt.check(layout)
    expected = layout.shard(tp_rank, pp_rank, ep_rank)
    params = dict(model.named_parameters())
    _check_param_names(params, expected, tp_rank, pp_rank)
    with torch.no_grad():
        for name, param in params.items():
            layout.fill_local(expected[name], param.data, ckpt.read)


def _check_param_names(params: dict, expected: dict, tp_rank: int, pp_rank: int) -> None:
    missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"model parameters of shard (tp_rank={tp_rank}, pp_rank={pp_rank}) do not match the layout: "
            f"not in model {missing[:6]}, not in layout {extra[:6]} (model built from another config?)"
        )


def export_hf_weights(
    model: torch.nn.Module,
    layout: ModelLayout,
    out_dir: str | pathlib.Path,
    *,
    tp_rank: int,
    pp_rank: int,
    tp_group: dist.ProcessGroup | None = None,
    ep_rank: int = 0,
    expert_group: dist.ProcessGroup | None = None,
    dense: bool = True,
    experts: bool = True,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict[str, str]:
    """Write this stage's HF tensors as safetensors files into existing `out_dir`.

    Collective over `tp_group` (the TP ranks of this stage) for the dense tensors and over
    `expert_group` (the stage's expert-TP x EP ranks, megatron's `tp_ep` group) for the routed
    experts; rank 0 of each group writes. `dense` / `experts` say whether this rank takes part in
    each (one data-parallel copy of each does). Returns this rank's {hf_name: file name}; combine
    them with `write_index`. Files are named `model-pp{stage}-{n}.safetensors` (stages never
    collide) until `write_index`.
    """
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    weight_map: dict[str, str] = {}
    buffer: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal buffer, size
        if buffer:
            name = f"model-pp{pp_rank:03d}-{len(set(weight_map.values())):05d}.safetensors"
            save_file(buffer, out / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(buffer, name))
        buffer, size = {}, 0

    groups = (tp_group if dense else _SKIP, expert_group if experts else _SKIP)
    for hf_name, tensor in _stage_hf_tensors(model, layout, (tp_rank, pp_rank, ep_rank), *groups):
        if tensor is None:
            continue
        tensor = tensor.to(dtype) if dtype is not None else tensor
        if size and size + tensor.nbytes > max_shard_bytes:
            flush()
        buffer[hf_name] = tensor.contiguous()
        size += tensor.nbytes
    flush()
    return weight_map


Pieces = dict[str, list]  # hf_name -> [(rows, cols, tensor)] of this rank
_SKIP = "skip"  # in place of a group: this rank does not take part in that gather
Group = Union["dist.ProcessGroup", None, str]  # None: this rank alone


def _stage_hf_tensors(
    model: torch.nn.Module,
    layout: ModelLayout,
    shard_key: tuple[int, int, int],
    tp_group: Group,
    expert_group: Group,
) -> Iterable[tuple[str, torch.Tensor | None]]:
    """Yield (hf_name, full tensor) on each group's rank 0 and (hf_name, None) elsewhere, one HF
    tensor at a time, in the same order on every rank of the group: the dense tensors over
    `tp_group` (the order of the tp_rank-0 shard's parameters), then the routed experts over
    `expert_group`, one layer's worth per gather. A group given as `_SKIP` is skipped."""
    tp_rank, pp_rank, ep_rank = shard_key
    params = dict(model.named_parameters())
    shard = layout.shard(tp_rank, pp_rank, ep_rank)
    _check_param_names(params, shard, tp_rank, pp_rank)
    # An HF tensor arrives in pieces (QKV segments of each query group, TP ranks): group by HF name.
    pieces: Pieces = {}
    for name, pmap in shard.items():
        for hf_name, rows, cols, piece in layout.hf_pieces(pmap, params[name].detach()):
            pieces.setdefault(hf_name, []).append((rows, cols, piece.cpu()))
    if tp_group != _SKIP:
        yield from _dense_tensors(layout, shard, pp_rank, pieces, _size_rank(tp_group))
    if expert_group != _SKIP:
        yield from _expert_tensors(layout, pp_rank, pieces, _size_rank(expert_group))


def _size_rank(group: Group) -> tuple[int, int, dist.ProcessGroup | None]:
    if group is None or isinstance(group, str):
        return 1, 0, None
    return group.size(), group.rank(), group


def _dense_tensors(
    layout: ModelLayout, shard: dict, pp_rank: int, pieces: Pieces, where: tuple
) -> Iterable[tuple[str, torch.Tensor | None]]:
    import torch.distributed as dist

    size, rank, group = where
    order = list(
        dict.fromkeys(
            n for p in layout.shard(0, pp_rank).values() if p.emit and not p.expert for n in p.hf_names
        )
    )
    # HF tensors that are one whole local param on their own (safetensors refuses two buffered
    # tensors sharing storage, so views of fc1 or QKV are always copied).
    whole = {
        p.hf_names[0]
        for p in shard.values()
        if len(p.segments) == 1 and p.hf_names and p.shape == layout.hf_shapes[p.hf_names[0]]
    }
    for hf_name in order:
        mine = pieces.get(hf_name, [])
        if size > 1:
            gathered: list | None = [None] * size if rank == 0 else None
            dist.gather_object(mine, gathered, group=group, group_dst=0)
            mine = [p for rank_pieces in gathered or [] for p in rank_pieces]
        if rank != 0:
            yield hf_name, None
        elif hf_name in whole and len(mine) == 1:
            yield hf_name, mine[0][2]  # the parameter itself (TP=1 o_proj, norms, ...): no copy
        else:
            yield hf_name, _assemble(layout, hf_name, mine)


def _expert_tensors(
    layout: ModelLayout, pp_rank: int, pieces: Pieces, where: tuple
) -> Iterable[tuple[str, torch.Tensor | None]]:
    """The stage's routed experts, gathered one layer at a time over the expert grid's group."""
    import torch.distributed as dist

    size, rank, group = where
    by_layer: dict[str, dict[str, None]] = {}
    for ep in range(layout.ep_size):
        for p in layout.shard(0, pp_rank, ep).values():
            if p.expert:
                by_layer.setdefault(p.name.split(".mlp.")[0], {}).update(dict.fromkeys(p.hf_names))
    for names in by_layer.values():
        mine = {n: pieces[n] for n in names if n in pieces}
        if size > 1:
            gathered: list | None = [None] * size if rank == 0 else None
            dist.gather_object(mine, gathered, group=group, group_dst=0)
            mine = {}
            for part in gathered or []:
                for n, ps in part.items():
                    mine.setdefault(n, []).extend(ps)
        for hf_name in names:
            yield hf_name, None if rank != 0 else _assemble(layout, hf_name, mine[hf_name])


def _assemble(layout: ModelLayout, hf_name: str, pieces: list) -> torch.Tensor:
    import torch

    full = torch.empty(layout.hf_shapes[hf_name], dtype=pieces[0][2].dtype)
    for rows, cols, piece in pieces:
        full[rows if cols is None else (rows, cols)] = piece
    return full


def write_index(out_dir: str | pathlib.Path, weight_maps: Iterable[dict[str, str]]) -> None:
    """Merge per-stage weight maps, rename the files to HF's `model-0000i-of-0000n.safetensors`
    and write model.safetensors.index.json (rank 0, after every stage has written)."""
    out = pathlib.Path(out_dir)
    weight_map = {k: v for m in weight_maps for k, v in m.items()}
    files = sorted(set(weight_map.values()))
    renamed = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    total = sum((out / f).stat().st_size for f in renamed.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def copy_hf_metadata(
    src_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, dtype: str | None = None
) -> None:
    """Copy config.json and every non-weight file (tokenizer, generation config, chat template)."""
    src, out = pathlib.Path(src_dir), pathlib.Path(out_dir)
    for path in sorted(src.iterdir()):
        if path.is_file() and not any(path.match(p) for p in _WEIGHT_PATTERNS):
            shutil.copy2(path, out / path.name)
    if dtype is not None and (out / "config.json").is_file():
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
