"""With `train.async.mode: off` the loop is bit-identical to the loop before asynchronous RL existed.

The golden (tests/fixtures/async_off_golden.json) was recorded by `sparserl train` at 53e645a, the
main commit the async merge (01a94f9) was made on, from a `git worktree` of it with this repo's
.venv: 3 steps of the one-rank GRPO run below (embedded engine with SnapKV, Sparse-RL correction,
2 reuse epochs, DGG) on a tiny model and prompts regenerated here from fixed seeds. Recorded: every
logged per-step figure that is not a time, at full float precision, and a SHA-256 of the final HF
export's tensors. Two runs of that commit agreed bit for bit first. Today's loop, asynchronous RL off,
must reproduce them exactly; figures added since (DWD, DGG's z) are not compared. The run selects
the log-prob path of that commit (`loss.fused_logprob: false`): the fused head, today's default,
agrees with it to fp32 rounding only (tests/test_loss_fused_logprob.py).

Bits depend on the numeric stack, so the golden is compared only under the torch build and CPU
kernel level it was recorded with (skipped, saying so, elsewhere). To record it again, from a
worktree of the reference commit:
    PYTHONPATH=<worktree> .venv/bin/python tests/test_async_off_golden.py <commit>
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from e2e_support import PY, make_assets, metrics, subprocess_env, write_config

GOLDEN = Path(__file__).parent / "fixtures" / "async_off_golden.json"


def numeric_stack() -> dict[str, str]:
    """What the bits depend on besides the code."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def run_recipe(root: Path, *, code: str | None = None, async_off: bool = True) -> dict:
    """The golden run in `root`: its per-step figures without times, and the final weights' hash.
    `code`: a checkout whose sparserl_mcore runs instead of this one; `async_off`: say
    `train.async.mode: off` and `loss.fused_logprob: false` explicitly (config keys the reference
    commit does not know)."""
    hf = make_assets(root)
    train = {"steps": 3, **({"async": {"mode": "off"}} if async_off else {})}
    cfg = write_config(
        root,
        hf,
        "golden",
        parallel={"tensor_model_parallel_size": 1},
        train=train,
        **({"loss": {"policy": {"kl_coef": 0.0}, "fused_logprob": False}} if async_off else {}),
        checkpoint={"dir": None, "every": 0, "save_hf": str(root / "golden" / "hf")},
        telemetry={"plot": False, "progress": False},
    )
    env = subprocess_env()
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([code, env["PYTHONPATH"]])
    cmd = [PY, "-m", "sparserl_mcore", "train", "--config", str(cfg)]
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [
        {k: v for k, v in r.items() if k != "time" and not k.startswith("time/")}
        for r in metrics(root, "golden")
        if "rollout/reward_mean" in r
    ]
    return {"steps": steps, "weights_sha256": _weights_sha256(root / "golden" / "hf")}


def _weights_sha256(hf_dir: Path) -> str:
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.timeout(300)
def test_async_off_reproduces_the_pre_async_loop_bit_for_bit(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    if golden["numeric_stack"] != numeric_stack():
        pytest.skip(f"golden recorded under {golden['numeric_stack']}, this is {numeric_stack()}")
    now = run_recipe(tmp_path)
    assert [r["step"] for r in now["steps"]] == [r["step"] for r in golden["steps"]] == [1, 2, 3]
    for want, got in zip(golden["steps"], now["steps"], strict=True):
        differ = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
        assert not differ, f"step {want['step']}: (golden, now) {differ}"
    assert now["weights_sha256"] == golden["weights_sha256"]


def main(commit: str) -> None:
    """Record the golden with the sparserl_mcore first on PYTHONPATH (a worktree of `commit`)."""
    import sparserl_mcore

    code = str(Path(sparserl_mcore.__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        runs = [run_recipe(Path(d), code=code, async_off=False) for d in (first, second)]
    if runs[0] != runs[1]:
        raise SystemExit("two runs of the reference differ: it is not deterministic, no golden")
    record = {"commit": commit, "numeric_stack": numeric_stack(), **runs[0]}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {GOLDEN} from {code} at {commit}")


if __name__ == "__main__":
    main(sys.argv[1])
