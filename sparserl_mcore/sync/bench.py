"""`sparserl sync bench`: sparse patches vs dense safetensors on real Adam steps.

A transformers Qwen2 model (Qwen2.5-0.5B shape with --full, random init unless --hf-dir) holds bf16
parameters; an fp32 master copy takes torch Adam steps on the next-token cross-entropy of fixed
random token sequences, and is cast back to bf16 after each step (megatron-style mixed precision).
Per step and value encoding, two encoders side by side:
- the trainer's per-rank path (the headline): the weights in megatron's layout in one flat BF16
  buffer, as megatron's DDP param buffer holds them (TP = PP = DP = 1), diffed, mapped and coded by
  `sync.device_diff.FlatDiff` into the rank's fragment (`snapshot="flat"`, plain positions,
  touched digests); the copy into the buffer is not timed;
- `make_patch` + `encode_patch`, the directory transport's stage-gathered patch (whole-tensor and
  model digests, `--position-models`).
Each: patch bytes, ratio vs dense BF16, bytes per changed element, encode time, the patched
receiver's bit-identity; for `make_patch` also decode+apply+verify time; next to a dense
safetensors save (into a new file, alternating with the trainer path's encodes) and load of the
same weights.
`--position-models base plain` measures both position models side by side; `--mid-training` starts
the fp32 master inside each weight's rounding interval (a fresh master makes the first steps flip
by exponent alone, the best case for the base position model).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from sparserl_mcore.sync.apply import HFReceiver
from sparserl_mcore.sync.codec import CodecConfig, encode_patch
from sparserl_mcore.sync.device_diff import FlatDiff, Piece
from sparserl_mcore.sync.diff import make_patch
from sparserl_mcore.sync.hashing import state_dict_digests
from sparserl_mcore.sync.per_rank import ModelMeta

if TYPE_CHECKING:
    from transformers import PreTrainedModel

QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
# `make bench` default: the same architecture, small enough for a shared 2-core box in ~a minute.
QUICK: dict[str, Any] = {**QWEN25_05B, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip


def _model(args: argparse.Namespace) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.hf_dir is not None:
        return AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.bfloat16)
    config = Qwen2Config(**(QWEN25_05B if args.full else QUICK))
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).bfloat16()


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint holds (a tied lm_head is the embedding, listed once)."""
    state = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v for k, v in state.items() if v.is_floating_point()}


def _inside_rounding_interval(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 values anywhere in each bf16 value's rounding interval, as a master copy is mid-training;
    a fresh master sits exactly on its bf16 value, which makes the first steps flip by exponent alone
    (every weight with half an ulp < lr, none above)."""
    bits = weight.view(torch.int16).int()
    mag = bits & 0x7FFF

    def magnitude(m: torch.Tensor) -> torch.Tensor:
        return m.to(torch.int16).view(torch.bfloat16).float()

    here, down, up = magnitude(mag), magnitude((mag - 1).clamp_min(0)), magnitude(mag + 1)
    # 0.999: stay strictly inside, so the master still rounds to the same bf16 value (ties excluded)
    low, high = here + 0.4995 * (down - here), here + 0.4995 * (up - here)
    master = low + torch.rand(weight.shape, generator=gen) * (high - low)
    master = torch.where(bits < 0, -master, master)
    if not torch.equal(master.bfloat16().view(torch.int16), weight.view(torch.int16)):
        raise RuntimeError("mid-training master does not round to its bf16 weight")
    return master


class MixedPrecisionAdam:
    """bf16 model params, fp32 master params in torch Adam, cast back after every step."""

    def __init__(self, model: torch.nn.Module, lr: float, mid_training: bool = False) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        gen = torch.Generator().manual_seed(2)
        self.master = [
            (
                _inside_rounding_interval(p.detach(), gen) if mid_training else p.detach().float()
            ).requires_grad_(True)
            for p in self.params
        ]
        # per-tensor (not foreach) Adam: no model-sized temporaries on a shared 24 GB box
        self.optimizer = torch.optim.Adam(self.master, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)

    def step(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            assert p.grad is not None  # every parameter is in the loss
            m.grad = p.grad.float()
            p.grad = None
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)  # round-to-nearest-even fp32 -> bf16, what megatron's cast does
                m.grad = None


def _time(fn, repeat: int, setup=lambda: None):
    """(last result, fastest of `repeat` runs): the machine is shared, the minimum is the signal."""
    best, out = float("inf"), None
    for _ in range(repeat):
        arg = setup()
        t0 = time.perf_counter()
        out = fn(arg)
        best = min(best, time.perf_counter() - t0)
    return out, best


class TrainerPath:
    """The trainer's per-rank sync on this model: megatron-layout params in one flat BF16 buffer
    (what megatron's DDP param buffer holds at TP = PP = DP = 1), diffed by a `FlatDiff`."""

    def __init__(self, model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
        from model_providers.gpt import padded_vocab_size
        from model_providers.hf_config import parse_hf_config
        from sparserl_mcore.ckpt.layout import ModelLayout

        hf = parse_hf_config(model.config.to_dict())
        vocab = padded_vocab_size(hf.vocab_size, 1)
        self.layout = ModelLayout(hf, tp_size=1, pp_size=1, padded_vocab_size=vocab)
        maps = list(self.layout.shard(0, 0).values())
        sizes = [int(torch.Size(m.shape).numel()) for m in maps]
        self.buffer = torch.zeros(sum(sizes), dtype=torch.bfloat16)
        self.params, at = {}, 0
        for m, n in zip(maps, sizes, strict=True):
            self.params[m.name] = (m, self.buffer[at : at + n].view(m.shape))
            at += n
        self.load(state)
        pieces = [Piece(m.name, p.view(-1).view(torch.int16), 0, p.numel()) for m, p in self.params.values()]
        self.flat = FlatDiff(self.layout, pieces, (0, 0), "sub")
        self.meta = ModelMeta("bfloat16", self.layout.hf_shapes)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Write HF tensors into the buffer in megatron's layout (what the optimizer step does)."""

        def read(name: str, rows: slice, cols: slice | None) -> torch.Tensor:
            return state[name][rows] if cols is None else state[name][rows, cols]

        for m, view in self.params.values():
            self.layout.fill_local(m, view, read)

    def measure(self, prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], step: int,
                encoding: str, repeat: int, save: Callable[[], float]) -> dict:  # fmt: skip
        """Fragment bytes, fastest encode (weights in the buffer -> fragment bytes) and fastest dense
        save (`save`, run before each encode: the two alternate, so load on the shared machine hits
        both alike), and whether a receiver holding `prev` ends bit-identical to `cur`; the
        snapshot holds `prev` after."""
        base = self.flat.snapshot.clone()
        self.flat.encoding = encoding
        codec = CodecConfig(encoding=encoding)

        def encode(_) -> bytes:
            diff = self.flat.diff()
            return diff.fragment(self.meta, version=step, base_version=step - 1, fragment=(0, 1), codec=codec)

        saves: list[float] = []

        def setup() -> None:
            saves.append(save())
            self.flat.snapshot.copy_(base)

        data, seconds = _time(encode, repeat, setup=setup)
        self.flat.snapshot.copy_(base)
        receiver = HFReceiver({k: v.clone() for k, v in prev.items()}, version=step - 1)
        receiver.apply(data)
        identical = all(
            torch.equal(receiver.state[k].view(torch.int16), cur[k].view(torch.int16)) for k in cur
        )
        return {"rank_bytes": len(data), "rank_encode_s": seconds, "rank_bit_identical": identical,
                "dense_save_s": min(saves)}  # fmt: skip


def _dense_save(state: dict[str, torch.Tensor], path: Path) -> float:
    """Seconds of one dense safetensors save of `state` into a new file (the page cache, no fsync:
    the cheapest a dense sync's write gets; overwriting the last file first drops its pages)."""
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    save_file(state, path)
    return time.perf_counter() - t0


def _load(path: Path, _: object) -> dict[str, torch.Tensor]:
    return load_file(path)


def _measure(prev, cur, step: int, config: CodecConfig, digests, repeat: int) -> dict:
    def encode(_) -> bytes:
        patch = make_patch(
            prev, cur, version=step, base_version=step - 1, anchor_version=0, old_digests=digests
        )
        return encode_patch(patch, config)

    def receiver_at_prev() -> HFReceiver:  # a receiver holding `prev`, digests cached
        return HFReceiver({k: v.clone() for k, v in prev.items()}, version=step - 1, digests=digests)

    data, encode_s = _time(encode, repeat)
    _, apply_s = _time(lambda r: r.apply(data), repeat, setup=receiver_at_prev)
    receiver = receiver_at_prev()
    receiver.apply(data)
    identical = all(torch.equal(receiver.state[k].view(torch.int16), cur[k].view(torch.int16)) for k in cur)
    numel = sum(t.numel() for t in cur.values())
    changed = sum(int((prev[k].view(torch.int16) != cur[k].view(torch.int16)).sum()) for k in cur)
    return {
        "step": step,
        "encoding": config.encoding,
        "positions": config.position_model,
        "sparsity": 1 - changed / numel,
        "changed": changed,
        "patch_bytes": len(data),
        "dense_bytes": 2 * numel,
        "ratio": 2 * numel / len(data),
        "bytes_per_changed": len(data) / max(1, changed),
        "encode_s": encode_s,
        "apply_s": apply_s,
        "bit_identical": identical,
    }


def _run_lr(args: argparse.Namespace, lr: float, steps: int, tmp: Path) -> list[dict]:
    model = _model(args)
    model.train()
    opt = MixedPrecisionAdam(model, lr, mid_training=args.mid_training)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    prev = {k: v.clone() for k, v in _hf_state(model).items()}
    trainer = TrainerPath(model, prev)
    rows = []
    for step in range(1, steps + 1):
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        cur = _hf_state(model)
        dense = tmp / "dense.safetensors"
        digests = state_dict_digests(prev)
        trainer.load(cur)
        for encoding in args.encodings:
            rank = trainer.measure(prev, cur, step, encoding, args.repeat, partial(_dense_save, cur, dense))
            _, load_s = _time(partial(_load, dense), args.repeat)
            for model_name in args.position_models:  # side by side in one run: timings comparable
                config = CodecConfig(encoding=encoding, position_model=model_name)
                row = _measure(prev, cur, step, config, digests, args.repeat)
                row.update(rank, lr=lr, loss=loss.item(), dense_load_s=load_s)
                row["rank_vs_save"] = row["rank_encode_s"] / row["dense_save_s"]
                rows.append(row)
                print(_format(row), flush=True)
        dense.unlink()
        trainer.flat.reset()  # the snapshot moves on to this step's weights
        prev = {k: v.clone() for k, v in cur.items()}
    return rows


# "rank": the trainer's per-rank path (headline); "patch": make_patch, the directory transport's
HEADER = (
    f"{'lr':>7} {'step':>4} {'enc':>9} {'sparsity':>9} {'rank MB':>8} {'B/chg':>6} {'rank s':>6} "
    f"{'/save':>6} {'pos':>5} {'patch MB':>8} {'ratio':>7} {'B/chg':>6} {'enc s':>6} {'apply s':>7} "
    f"{'save s':>6} {'load s':>6} {'exact':>5}"
)


def _format(r: dict) -> str:
    changed = max(1, r["changed"])
    exact = r["bit_identical"] and r["rank_bit_identical"]
    return (
        f"{r['lr']:>7.2g} {r['step']:>4} {r['encoding']:>9} {100 * r['sparsity']:>8.3f}% "
        f"{r['rank_bytes'] / 2**20:>8.3f} {r['rank_bytes'] / changed:>6.3f} {r['rank_encode_s']:>6.2f} "
        f"{r['rank_vs_save']:>5.2f}x {r['positions']:>5} {r['patch_bytes'] / 2**20:>8.3f} "
        f"{r['ratio']:>6.1f}x {r['bytes_per_changed']:>6.3f} {r['encode_s']:>6.2f} {r['apply_s']:>7.2f} "
        f"{r['dense_save_s']:>6.2f} {r['dense_load_s']:>6.2f} {'yes' if exact else 'NO':>5}"
    )


def run_bench(args: argparse.Namespace) -> int:
    for encoding in args.encodings:
        for model_name in args.position_models:
            CodecConfig(encoding=encoding, position_model=model_name)  # unknown names fail before training
    if args.repeat < 1 or args.seq_len < 1 or args.batch < 1 or (args.steps is not None and args.steps < 1):
        raise ValueError("--repeat, --seq-len, --batch and --steps must be >= 1")
    torch.set_grad_enabled(True)
    steps = args.steps or (3 if args.full else 2)
    shape = (
        "from " + str(args.hf_dir) if args.hf_dir else ("Qwen2.5-0.5B shape" if args.full else "quick shape")
    )
    master = "mid-training master (inside each rounding interval)" if args.mid_training else "fresh master"
    print(
        f"sparse sync bench: {shape}, {steps} Adam steps per lr, batch {args.batch} x seq {args.seq_len}, "
        f"{master}"
    )
    print(HEADER)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lrs:
            rows.extend(_run_lr(args, lr, steps, Path(tmp)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    _summary(rows)
    return 0 if all(r["bit_identical"] and r["rank_bit_identical"] for r in rows) else 1


def _summary(rows: list[dict]) -> None:
    """Per encoding: the trainer path's encode against the dense save; the worst bytes per changed
    element and how often encode beat the dense save."""
    for encoding in dict.fromkeys(r["encoding"] for r in rows):
        mine = list({(r["lr"], r["step"]): r for r in rows if r["encoding"] == encoding}.values())
        print(
            f"trainer path {encoding:>9}: encode / dense save {min(r['rank_vs_save'] for r in mine):.2f}.."
            f"{max(r['rank_vs_save'] for r in mine):.2f}x (median "
            f"{sorted(r['rank_vs_save'] for r in mine)[len(mine) // 2]:.2f}x), encode "
            f"{min(r['rank_encode_s'] for r in mine):.3f}..{max(r['rank_encode_s'] for r in mine):.3f} s, "
            f"bytes/changed {min(r['rank_bytes'] / max(1, r['changed']) for r in mine):.3f}.."
            f"{max(r['rank_bytes'] / max(1, r['changed']) for r in mine):.3f}"
        )
    for encoding, positions in dict.fromkeys((r["encoding"], r["positions"]) for r in rows):
        mine = [r for r in rows if (r["encoding"], r["positions"]) == (encoding, positions)]
        faster = sum(r["encode_s"] <= r["dense_save_s"] for r in mine)
        print(
            f"{encoding:>9} {positions:>5}: bytes/changed {min(r['bytes_per_changed'] for r in mine):.3f}.."
            f"{max(r['bytes_per_changed'] for r in mine):.3f}, ratio {min(r['ratio'] for r in mine):.1f}.."
            f"{max(r['ratio'] for r in mine):.1f}x, encode <= dense save in {faster}/{len(mine)} steps"
        )
    exact = sum(r["bit_identical"] and r["rank_bit_identical"] for r in rows)
    print(f"bit-identical (both receivers): {exact}/{len(rows)}")
