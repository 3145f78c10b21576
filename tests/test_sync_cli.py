"""`sparserl sync diff / apply / inspect` on real safetensors files and HF directories."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from sparserl_mcore.cli import main


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(200, 32, generator=gen) * 0.02).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(64, 32, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }


def _step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return {
        k: (v.float() + 2e-4 * torch.randn(v.shape, generator=gen).sign()).bfloat16()
        for k, v in state.items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def _sync(command: str, **flags: object) -> int:
    """`sparserl sync COMMAND --flag value ...` in-process; returns the exit status."""
    argv = ["sync", command]
    for flag, value in flags.items():
        argv += [f"--{flag}", str(value)]
    return main(argv)


def test_diff_apply_inspect_files(tmp_path, capsys):
    old, new = _weights(0), _step(_weights(0))
    save_file(old, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    patch = tmp_path / "p.srlp"
    assert (
        _sync("diff", old=tmp_path / "a.safetensors", new=tmp_path / "b.safetensors", out=patch, version=5)
        == 0
    )
    capsys.readouterr()
    assert main(["sync", "inspect", str(patch)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["version"], info["base_version"], info["encoding"], info["bytes"]) == (
        5,
        4,
        "sub",
        patch.stat().st_size,
    )
    out = tmp_path / "c.safetensors"
    assert _sync("apply", base=tmp_path / "a.safetensors", patch=patch, out=out) == 0
    assert _same(load_file(out), new)
    assert out.read_bytes() == (tmp_path / "b.safetensors").read_bytes()  # the file itself, too


def test_apply_to_wrong_base_fails_and_writes_nothing(tmp_path, capsys):
    save_file(_weights(0), tmp_path / "a.safetensors")
    save_file(_step(_weights(0)), tmp_path / "b.safetensors")
    save_file(_weights(1), tmp_path / "other.safetensors")
    patch = tmp_path / "p.srlp"
    assert _sync("diff", old=tmp_path / "a.safetensors", new=tmp_path / "b.safetensors", out=patch) == 0
    out = tmp_path / "c.safetensors"
    rc = _sync("apply", base=tmp_path / "other.safetensors", patch=patch, out=out)
    assert rc == 1 and not out.exists()
    assert "digest mismatch" in capsys.readouterr().err


def test_hf_directories_via_console_script(tmp_path):
    old, new = _weights(2), _step(_weights(2))
    names = sorted(old)
    for root, state in (("A", old), ("B", new)):
        d = tmp_path / root
        d.mkdir()
        save_file({n: state[n] for n in names[:2]}, d / "model-00001-of-00002.safetensors")
        save_file({n: state[n] for n in names[2:]}, d / "model-00002-of-00002.safetensors")
        weight_map = {n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (d / "config.json").write_text("{}")
    patch = tmp_path / "p.srlp"
    diff = ["diff", "--old", str(tmp_path / "A"), "--new", str(tmp_path / "B"), "--out", str(patch)]
    # one real console-script run (xor, no zstd); apply in-process
    cmd = [sys.executable, "-m", "sparserl_mcore", "sync", *diff, "--encoding", "xor", "--zstd-level", "0"]
    subprocess.run(cmd, check=True, capture_output=True)
    assert _sync("apply", base=tmp_path / "A", patch=patch, out=tmp_path / "C") == 0
    got = {}
    for f in sorted((tmp_path / "C").glob("*.safetensors")):
        got.update(load_file(f))
    assert _same(got, new)
    assert (tmp_path / "C" / "config.json").exists() and (
        tmp_path / "C" / "model.safetensors.index.json"
    ).exists()
