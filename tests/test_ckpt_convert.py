"""HF <-> Megatron conversion on real megatron-core over gloo (2 ranks), real safetensors files.

One torchrun run (tests/ckpt_worker.py) covers the round trips and the dist-checkpoint reshard;
the CLI tests run `sparserl convert` end to end; bad-input tests stop before any rank starts.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sparserl_mcore.ckpt import cli as convert_cli
from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name -> (tiny config, (tp, pp) of hf-to-mcore, (tp, pp) of mcore-to-hf): every arch tied and
# untied, every save/export layout, a re-shard in most, one sharded bf16 source.
ROUNDTRIPS = {
    "qwen2": (TinyModelConfig(arch="qwen2"), (2, 1), (1, 2)),
    "qwen2_tied": (TinyModelConfig(arch="qwen2", tie_embeddings=True), (1, 2), (2, 1)),
    "qwen3": (TinyModelConfig(arch="qwen3", max_shard_size="100KB"), (2, 1), (2, 1)),
    "qwen3_tied_bf16": (TinyModelConfig(arch="qwen3", tie_embeddings=True, dtype="bfloat16"), (1, 2), (1, 2)),
    "llama": (TinyModelConfig(arch="llama", vocab=200), (1, 2), (2, 1)),
    "llama_tied": (TinyModelConfig(arch="llama", tie_embeddings=True), (2, 1), (1, 2)),
    # 5 layers on PP=2: uneven stages (3, 2) both ways, tied (the last stage's copy); PP=3 is in
    # tests/test_uneven_pipeline.py
    "qwen2_5layers_tied": (TinyModelConfig(arch="qwen2", layers=5, tie_embeddings=True), (1, 2), (1, 2)),
}


def read_hf(path: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_bit_exact(src: pathlib.Path, out: pathlib.Path) -> None:
    expected, found = read_hf(src), read_hf(out)
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        assert found[name].dtype == tensor.dtype, name
        assert torch.equal(found[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name} differs"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(expected)
    for name, file in index["weight_map"].items():
        with safe_open(out / file, framework="pt") as f:
            assert name in f.keys()
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((out / extra).read_text()) == json.loads((src / extra).read_text()), extra


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("ckpt")
    plan: dict = {"roundtrips": []}
    for name, (cfg, save_at, export_at) in ROUNDTRIPS.items():
        make_tiny(cfg, work / name)
        plan["roundtrips"].append(
            {
                "hf": str(work / name),
                "mcore": str(work / f"{name}_mcore"),
                "out": str(work / f"{name}_out"),
                "save_at": save_at,
                "export_at": export_at,
                "max_shard_bytes": 100_000,  # several output files per stage
            }
        )
    plan["reshard_hf"] = str(work / "qwen2")
    plan["save_hf"] = {"hf": str(work / "qwen3_tied_bf16"), "out": str(work / "exports" / "qwen3_tied_bf16")}
    (work / "plan.json").write_text(json.dumps(plan))
    launch_local([str(ROOT / "tests" / "ckpt_worker.py"), str(work)], 2, timeout=400)
    return work


@pytest.mark.parametrize("name", list(ROUNDTRIPS))
def test_roundtrip_is_bit_exact(converted, name):
    out = converted / f"{name}_out"
    assert len(list(out.glob("*.safetensors"))) > 1
    assert_bit_exact(converted / name, out)


def test_save_hf_from_the_ranks_is_atomic_bit_exact_and_keeps_the_dtype(converted):
    """The trainer's export: DP=2 (one writer per stage), bf16 kept, a repeat replaces the first."""
    out = converted / "exports" / "qwen3_tied_bf16"
    assert_bit_exact(converted / "qwen3_tied_bf16", out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in out.parent.iterdir()) == ["qwen3_tied_bf16"]  # no temp dirs left


def test_dist_checkpoint_reshards_with_same_logits(converted):
    reference = torch.load(converted / "logits_tp1.pt", weights_only=True)
    assert reference.shape == (2, 8, 128)
    assert torch.equal(torch.load(converted / "logits_reload_tp1_pp1.pt", weights_only=True), reference)
    assert torch.equal(torch.load(converted / "logits_reload_tp1_pp2.pt", weights_only=True), reference)
    # TP=2 sums the row-parallel matmuls in a different order: equal up to fp32 rounding.
    torch.testing.assert_close(
        torch.load(converted / "logits_reload_tp2_pp1.pt", weights_only=True), reference, rtol=1e-5, atol=1e-6
    )


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    convert_cli.add_arguments(parser)
    return convert_cli.run(parser.parse_args(list(argv)))


def _leftovers(parent: pathlib.Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_cli_roundtrip_and_failed_ranks_leave_nothing(tmp_path, capsys):
    src = make_tiny(TinyModelConfig(arch="qwen2", layers=4, max_shard_size="100KB"), tmp_path / "hf")
    assert _cli("hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "m"), "--tp", "2") == 0
    meta = json.loads((tmp_path / "m" / "sparserl_mcore.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["padded_vocab_size"]) == (2, 256)
    assert (
        _cli("mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "h2"), "--pp", "2")
        == 0
    )
    assert_bit_exact(src, tmp_path / "h2")
    # The ranks fail (a data file of the dist checkpoint is gone): no output, no temp directory.
    next((tmp_path / "m").glob("*.distcp")).unlink()
    assert _cli("mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "h3")) == 1
    err = capsys.readouterr().err
    assert "conversion ranks failed" in err and "Traceback" not in err
    line = r"^ranks? [0-9, -]+: CheckpointException: FileNotFoundError: .*\(log: (.*)rank\d\.log\)$"
    found = re.search(line, err, re.M)
    assert found, err
    shutil.rmtree(found.group(1))  # the logs a failed conversion keeps for its user
    assert not (tmp_path / "h3").exists() and _leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> pathlib.Path:
    return make_tiny(TinyModelConfig(arch="qwen3"), tmp_path_factory.mktemp("bad") / "hf")


def _broken_copy(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _edit_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    _broken_copy(src, dst, lambda t: None)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.mark.parametrize(
    ("case", "tp", "message"),
    [
        ("missing", 1, "model.layers.1.self_attn.k_norm.weight"),
        (
            "shape",
            1,
            "'model.layers.0.mlp.up_proj.weight' in .* has shape \\[127, 64\\], expected \\[128, 64\\]",
        ),
        ("arch", 1, "unsupported architecture: model_type='gpt2'.*supported model_type values"),
        ("tp", 3, "tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
        ("fp16", 1, "stores dtype 'float16'; convert with --dtype float32 or bfloat16"),
        ("no_hidden", 1, "config.json lacks the required field 'hidden_size'"),
        ("truncated", 1, "model.safetensors is not a readable safetensors file"),
        ("not_json", 1, "config.json is not valid JSON"),
    ],
)
def test_bad_input_names_the_problem_and_writes_nothing(tiny_hf, tmp_path, capsys, case, tp, message):
    bad = tmp_path / "bad"
    if case == "missing":
        _broken_copy(tiny_hf, bad, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    elif case == "shape":
        _broken_copy(
            tiny_hf, bad, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)})
        )
    elif case == "arch":
        _edit_config(tiny_hf, bad, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    elif case == "fp16":
        _edit_config(tiny_hf, bad, dtype="float16")
    elif case == "no_hidden":
        _edit_config(tiny_hf, bad)
        config = json.loads((bad / "config.json").read_text())
        del config["hidden_size"]
        (bad / "config.json").write_text(json.dumps(config))
    elif case == "truncated":
        _edit_config(tiny_hf, bad)
        weights = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    elif case == "not_json":
        _edit_config(tiny_hf, bad)
        (bad / "config.json").write_text("{ not json")
    else:
        bad = tiny_hf
    out = tmp_path / "out"
    assert _cli("hf-to-mcore", "--hf-dir", str(bad), "--out", str(out), "--tp", str(tp)) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_mcore_dir_without_metadata_is_rejected(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert _cli("mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o")) == 2
    assert "not a checkpoint written by `sparserl convert hf-to-mcore`" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_non_empty_output_needs_overwrite(tiny_hf, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert _cli("hf-to-mcore", "--hf-dir", str(tiny_hf), "--out", str(tmp_path / "out")) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--ep", "3"), "expert_model_parallel_size=3 does not divide num_experts=4"),
        (
            ("--tp", "2", "--etp", "3"),
            "expert_tensor_parallel_size=3 does not divide tensor_model_parallel_size=2",
        ),
        (("--ep", "2", "--tp", "4"), "tensor_model_parallel_size=4 does not divide num_key_value_heads=2"),
    ],
)
def test_bad_expert_layouts_are_refused_before_any_rank(tmp_path, capsys, argv, message):
    moe = make_tiny(TinyModelConfig(arch="qwen3_moe"), tmp_path / "moe")
    assert _cli("hf-to-mcore", "--hf-dir", str(moe), "--out", str(tmp_path / "out"), *argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    dense = make_tiny(TinyModelConfig(arch="qwen3"), tmp_path / "dense")
    assert _cli("hf-to-mcore", "--hf-dir", str(dense), "--out", str(tmp_path / "out"), "--ep", "2") == 2
    assert "the model has no experts" in capsys.readouterr().err
