"""Resume checks the model before any rank starts (issue 36).

`sparserl train` whose checkpoint.dir holds a training checkpoint of another architecture or shape
is refused in one line naming the first tensor that differs and both shapes (megatron's KeyError or
"Global shape mismatch" came about 20 s after launch before); one whose checkpoint.dir holds a
converted model, an HF checkpoint or a single step's checkpoint is refused saying what it is and
what to do (the run used to write its own checkpoints into it). Real inputs, made side by side: a
1-step training checkpoint of a tiny MoE model (`sparserl train`) and a `sparserl convert
hf-to-mcore` output. The refusals run `sparserl_mcore.cli.main` in-process, as
tests/test_cli_errors.py does, with `--nproc 2`: nothing is launched and nothing is written.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from e2e_support import PY, make_assets, subprocess_env, write_config

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.cli import main
from sparserl_mcore.config import load_config
from sparserl_mcore.trainer.preflight import check_run

MOE = TinyModelConfig(arch="qwen2_moe", layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny dense and a tiny MoE model, a real training checkpoint of the MoE one at step 1, and
    the dense one converted to megatron."""
    root = tmp_path_factory.mktemp("resume_model")
    dense = make_assets(root)  # also train.jsonl
    moe = make_tiny(MOE, root / "moe")
    cfg = write_config(
        root,
        moe,
        "saved",
        parallel={"tensor_model_parallel_size": 1},
        train={"steps": 1},
        checkpoint={"dir": str(root / "saved" / "ckpt"), "every": 1, "save_hf": None},
        telemetry={"plot": False, "progress": False},
    )
    env = subprocess_env()
    jobs = [
        subprocess.Popen([PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)], env=env, cwd=root),
        subprocess.Popen(
            [
                PY,
                "-m",
                "sparserl_mcore",
                "convert",
                "hf-to-mcore",
                "--hf-dir",
                str(dense),
                "--out",
                str(root / "mcore"),
            ],
            env=env,
            cwd=root,
        ),
    ]
    assert [job.wait(timeout=300) for job in jobs] == [0, 0]
    return {"root": root, "dense": dense, "moe": moe, "ckpt": root / "saved" / "ckpt"}


def _config(saved: dict[str, Path], name: str, hf: Path, ckpt: Path, **sections) -> str:
    return str(
        write_config(
            saved["root"],
            hf,
            name,
            train={"steps": 3},
            checkpoint={"dir": str(ckpt), "every": 1, "save_hf": None},
            **sections,
        )
    )


def _refused(saved: dict[str, Path], capsys, cfg: str) -> str:
    """The one line `sparserl train --nproc 2` answers with; nothing launched, nothing written."""
    before = sorted(saved["root"].rglob("*"))
    assert main(["train", "--config", cfg, "--nproc", "2"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    assert sorted(saved["root"].rglob("*")) == before
    return lines[0]


def test_a_checkpoint_of_another_shape_names_the_first_differing_tensor(saved, capsys):
    wider = make_tiny(TinyModelConfig(**{**vars(MOE), "expert_ffn": 48}), saved["root"] / "wider")
    line = _refused(saved, capsys, _config(saved, "wider", wider, saved["ckpt"]))
    assert line.startswith(
        f"sparserl train: checkpoint.dir: cannot resume {saved['ckpt'] / 'step_00000001'}: "
    )
    assert (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight: (2, 4, 64, 64) in the checkpoint, "
        "(2, 4, 96, 64) in this run's model" in line
    )
    assert "give this run its own checkpoint.dir, or set checkpoint.resume=false" in line


def test_a_checkpoint_of_another_architecture_names_the_first_differing_tensor(saved, capsys):
    line = _refused(saved, capsys, _config(saved, "dense", saved["dense"], saved["ckpt"]))
    assert f"saved from another model than model.hf_path={saved['dense']}" in line
    assert (
        "decoder.layers.mlp.linear_fc1.weight: not in the checkpoint, (2, 256, 64) in this run's model"
        in line
    )


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("mcore", r"holds a converted model \(`sparserl convert hf-to-mcore`.*sparserl convert mcore-to-hf"),
        (
            "dense",
            r"holds an HF model checkpoint, not training checkpoints; to train from it set model.hf_path=",
        ),
        (
            "step",
            r"is one training checkpoint \(step_00000001\), not the directory .* set checkpoint.dir=.*ckpt",
        ),
    ],
)
def test_a_checkpoint_dir_that_holds_no_training_checkpoints_says_what_it_holds(saved, capsys, where, said):
    ckpt = {
        "mcore": saved["root"] / "mcore",
        "dense": saved["dense"],
        "step": saved["ckpt"] / "step_00000001",
    }
    line = _refused(saved, capsys, _config(saved, f"into_{where}", saved["dense"], ckpt[where]))
    assert re.search(f"sparserl train: checkpoint.dir={re.escape(str(ckpt[where]))} {said}", line), line
    assert "give checkpoint.dir a directory of its own" in line or where == "step"


@pytest.mark.parametrize("tp", [1, 2])
def test_the_same_model_resumes_at_any_tensor_parallel_size(saved, tp):
    cfg = _config(
        saved, f"same_tp{tp}", saved["moe"], saved["ckpt"], parallel={"tensor_model_parallel_size": tp}
    )
    plan = check_run(load_config(cfg), world_size=tp)
    assert plan.resumes and plan.notes[0].startswith(f"resuming from {saved['ckpt'] / 'step_00000001'}")
