"""The GPU test set (marker `gpu`; skipped without CUDA, `make gpu-check` runs it on one GPU).

- every parameter, buffer and tensor attribute of the trainer's model on the rank's GPU, in the
  configured dtype, for every registered architecture;
- the embedded engine on CUDA in fp32: greedy tokens equal to HF `generate` on the same GPU (decode
  attention by the Triton paged kernel and by the gather path; the kernel's own GPU tests are in
  tests/test_rollout_triton_decode.py);
- the trainer's bf16 learner (distributed optimizer) syncing sparse patches into a bf16 engine on
  the GPU: the engine ends bit-identical to a dense export (tests/bf16_sync_worker.py, 1 rank);
- a 3-step `sparserl train` on the GPU with compressed rollouts (SnapKV), Sparse-RL correction, DGG,
  sparse sync and a checkpoint, resumed for its third step, exiting within 10 s of its last step.
Logit parity vs HF for every architecture (fp32 and bf16) is tests/test_parity.py's GPU test.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

import pytest
import torch
from e2e_support import REPO, make_assets, metrics, subprocess_env, write_config
from hf_reference import hf_greedy

from model_providers import ARCHITECTURES
from model_providers.placement import misplaced
from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.parallel.launch import launch_local, torchrun_command

pytestmark = pytest.mark.gpu
TRAIN = str(REPO / "launchers" / "train.py")


@pytest.fixture(scope="module")
def runtime():
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    rt = initialize(ParallelConfig(), seed=3)
    yield rt
    shutdown()


@pytest.mark.parametrize("params_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_trainer_model_lives_on_the_gpu(runtime, tmp_path, arch, params_dtype):
    from sparserl_mcore.trainer import learner as learner_lib

    assert runtime.device.type == "cuda"
    hf = make_tiny(TinyModelConfig(arch=arch), tmp_path / arch)
    spec, model = learner_lib.build_model(str(hf), params_dtype, runtime)
    assert misplaced(model, runtime.device, spec.params_dtype) == []


@pytest.mark.parametrize(
    ("cuda_graph", "triton_decode"),
    [(True, None), (False, None), (True, False)],
    ids=["graph", "eager", "graph-gather"],
)
def test_engine_greedy_equals_hf_generate_in_fp32_on_cuda(tmp_path, cuda_graph, triton_decode):
    """Also: decode steps replayed as CUDA graphs give HF's tokens, and survive a weight update
    (parameters are written in place, so the graphs read the new weights); decode attention by the
    Triton paged kernel (the default where triton imports) and by the gather path."""
    import transformers

    from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
    from sparserl_mcore.rollout.engine import triton_decode as triton_decode_lib
    from sparserl_mcore.rollout.protocol import GenerateRequest, SamplingParams

    path = make_tiny(TinyModelConfig(arch="qwen2", layers=2, hidden=64, vocab=160), tmp_path / "m")
    cfg = EngineConfig(
        device="cuda", dtype="float32", page_size=4, cuda_graph=cuda_graph, triton_decode=triton_decode
    )
    engine = EmbeddedEngine(path, cfg)
    assert str(engine.model.device).startswith("cuda")
    kernel = triton_decode is None and triton_decode_lib.why_unusable(torch.device("cuda")) is None
    assert engine.model_info()["decode_attention"] == ("triton" if kernel else "gather")
    assert engine.decode_graphs.endswith(" graphs") if cuda_graph else engine.decode_graphs == "off"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (5, 11, 17, 8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    requests = [GenerateRequest(input_ids=p, sampling=greedy) for p in prompts]
    for round_ in range(2):
        samples = engine.generate(requests)
        for prompt, sample in zip(prompts, samples, strict=True):
            assert list(sample.output_ids) == hf_greedy(hf, prompt, greedy.max_new_tokens, device="cuda")
        if round_ == 0:  # the same new weights into both models
            with torch.no_grad():
                for p in hf.parameters():
                    p.mul_(1.25)
            new = {n: t.detach() for n, t in hf.state_dict().items() if n in engine.model.params}
            engine.update_weights(new, version=1)
    assert (engine.scheduler._forward.static_steps > 0) == cuda_graph


def test_bf16_sync_into_a_gpu_engine_is_bit_identical(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(tmp_path, hf, "gpu_sync", train={"micro_batch_size": 4})
    worker = str(pathlib.Path(__file__).with_name("bf16_sync_worker.py"))
    launch_local(
        [worker, str(cfg), str(tmp_path), "parallel.tensor_model_parallel_size=1"],
        1,
        env=subprocess_env(),
        timeout=600,
    )
    found = json.loads((tmp_path / "result.json").read_text())
    assert all(d.startswith("cuda") for d in found["devices"]), found
    assert found["learner_dtypes"] == ["torch.bfloat16"] and found["optimizers"] == ["DistributedOptimizer"]
    assert "sync_fallback_full" not in found["events"] and all(b > 0 for b in found["patch_bytes"]), found
    assert found["mismatched"] == [] and found["changed_vs_base"] > 0, found


def _train(cfg: pathlib.Path, steps: int) -> tuple[str, float]:
    """Run `sparserl train` on 1 GPU rank; (output, seconds from the last step's line to exit)."""
    cmd = torchrun_command(
        [TRAIN, "--config", str(cfg), f"train.steps={steps}"], 1, log_dir=cfg.parent / "torchrun"
    )
    proc = subprocess.Popen(
        cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, last = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {steps} "):
            last = time.monotonic()
    proc.wait(timeout=600)
    output = "".join(lines)
    assert proc.returncode == 0 and last is not None, output[-4000:]
    return output, time.monotonic() - last


def test_three_steps_with_everything_on_then_resume(tmp_path):
    hf = make_assets(tmp_path)
    cfg = write_config(
        tmp_path,
        hf,
        "gpu3",
        model={"params_dtype": "bf16"},
        parallel={"tensor_model_parallel_size": 1},
        train={"micro_batch_size": 4},
        loss={"correction": {"mode": "sparse_rl"}},
        dgg={"enabled": True, "window": 2},  # train.reuse_epochs=2 (e2e_support)
        checkpoint={"every": 1, "save_hf": None},
        eval={"every": 1, "at_start": False},  # inside each step: only the final save follows its line
    )
    _, first_exit = _train(cfg, 2)
    _, exit_s = _train(cfg, 3)
    records = metrics(tmp_path, "gpu3")
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == 2 and resumed[0]["rng"] == "restored", resumed
    steps = {r["step"]: r for r in records if "rollout/reward_mean" in r}
    assert sorted(steps) == [1, 2, 3], sorted(steps)
    for r in steps.values():
        assert r["rollout/peak_kv_bytes"] < r["rollout/dense_kv_bytes"], r  # SnapKV compressed the KV
        assert r["train/updates"] + r["dgg/gates"] >= 1 and r["sync/patch_bytes"] > 0, r
        assert "correction/vetoed_sequences" in r, r
    assert not any(r.get("event") == "sync_fallback_full" for r in records)
    assert max(first_exit, exit_s) < 10.0, (first_exit, exit_s)


def test_runtime_is_nccl_on_the_gpu_and_takes_cpu_collectives(runtime):
    import torch.distributed as dist

    assert "cuda:nccl" in dist.get_backend() and not runtime.cpu
    assert runtime.device == torch.device("cuda", torch.cuda.current_device())
    for device in (runtime.device, torch.device("cpu")):  # the trainer's flags are CPU tensors
        flag = torch.ones(1, dtype=torch.int64, device=device)
        dist.all_reduce(flag)
        dist.broadcast(flag, 0)
        assert int(flag) == dist.get_world_size()
