"""`sparserl model make-tiny` output loads with transformers; its tokenizer round-trips the text the
demo feeds it; atomic output directories leave nothing behind on error, and what they leave follows
the user's umask."""

from __future__ import annotations

import argparse
import json
import os
import stat

import pytest
import torch
import transformers

from sparserl_mcore.ckpt import model_cli
from sparserl_mcore.ckpt.atomic import atomic_output_dir
from sparserl_mcore.ckpt.tiny import TOKENIZER_SIZE, TinyModelConfig, make_tiny

TEXT = "Q: 12+(34*5)=?\nA: 182. Hello, World! x_y/z-1 [a] {b} <c> ~`'\"#$%&;:|\\^@\t end"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_checkpoint_loads_and_tokenizer_round_trips(tmp_path, arch):
    out = make_tiny(TinyModelConfig(arch=arch, tie_embeddings=arch == "llama", seed=3), tmp_path / arch)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == 128
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) == len(TEXT) and max(ids) < TOKENIZER_SIZE <= config["vocab_size"]
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token_id == config["eos_token_id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(not torch.all(p == 1) for p in norms)  # randomised, so layout bugs show
    if arch == "qwen2":
        assert not torch.all(model.model.layers[0].self_attn.q_proj.bias == 0)


def test_same_seed_same_weights_and_cli(tmp_path, capsys):
    make_tiny(TinyModelConfig(arch="qwen3", seed=7), tmp_path / "a")
    parser = argparse.ArgumentParser()
    model_cli.add_arguments(parser)
    assert (
        model_cli.run(
            parser.parse_args(["make-tiny", "--arch", "qwen3", "--seed", "7", "--out", str(tmp_path / "b")])
        )
        == 0
    )
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2' is not supported; choose from \\['llama', 'qwen2', 'qwen2_moe'"),
        ({"vocab": 50}, "vocab=50 is smaller than the tokenizer"),
        ({"heads": 4, "kv_heads": 3}, "heads=4 must be a multiple of kv_heads=3"),
    ],
)
def test_bad_tiny_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TinyModelConfig(**fields)


def test_atomic_output_dir_is_all_or_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(target) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(target) as tmp:
        (tmp / "v1").write_text("1")
    with pytest.raises(ValueError, match="not empty; pass --overwrite"), atomic_output_dir(target):
        pass
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "v2").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["v2"]


def test_a_dead_writers_temp_goes_at_the_next_start_a_live_ones_stays(tmp_path):
    import os
    import subprocess
    import sys

    from sparserl_mcore.ckpt.atomic import _host

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)  # exited and reaped: no such process now
    stale = tmp_path / f".out.tmp-{_host()}-{dead_pid}-abc123"
    live = tmp_path / f".out.tmp-{_host()}-{os.getpid()}-def456"  # a writer still running (this one)
    other = tmp_path / f".other.tmp-{_host()}-{dead_pid}-ghi789"  # another target's temp: not ours
    for d in (stale, live, other):
        d.mkdir()
        (d / "half.bin").write_bytes(b"x")
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "v1").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "out"])


def test_outputs_get_the_modes_of_the_users_umask(tmp_path):
    """What the writers leave (make-tiny's atomic directory, whose safetensors file safetensors
    writes 0600; an atomic file from mkstemp; a patched HF directory from mkdtemp) has the modes
    open() / mkdir() give under the umask, not the private 0600 / 0700."""
    from sparserl_mcore.sync.hf_files import load_state, save_state_like
    from sparserl_mcore.sync.transport_dir import atomic_write_bytes

    previous = os.umask(0o022)
    try:
        for umask, files, dirs in ((0o022, 0o644, 0o755), (0o027, 0o640, 0o750)):
            os.umask(umask)
            tiny = make_tiny(TinyModelConfig(seed=umask), tmp_path / f"tiny-{umask:o}")
            copy = tmp_path / f"copy-{umask:o}"
            save_state_like(load_state(tiny), copy, like=tiny)
            atomic_write_bytes(tmp_path / f"p-{umask:o}.patch", b"patch")
            written = [tiny, *tiny.rglob("*"), copy, *copy.rglob("*"), tmp_path / f"p-{umask:o}.patch"]
            modes = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
            assert modes == {str(p): oct(dirs if p.is_dir() else files) for p in written}
    finally:
        os.umask(previous)
