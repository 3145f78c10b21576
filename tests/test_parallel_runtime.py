"""Parallel runtime: layout errors, the CPU execution mode (device rewrite, faithful RNG tracker),
single-process initialise/shutdown, and the torchrun launcher."""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core import tensor_parallel

from sparserl_mcore.parallel import ParallelConfig, cpu_mode, initialize, shutdown
from sparserl_mcore.parallel.launch import LaunchError, launch_local

cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU execution mode refuses to run on GPUs"
)


@pytest.mark.parametrize(
    ("tp", "pp", "world", "layers", "heads", "kv_heads", "message"),
    [
        (3, 1, 3, 2, 4, 4, r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"),
        (4, 1, 4, 2, 8, 2, r"tensor_model_parallel_size=4 does not divide num_key_value_heads=2"),
        (2, 2, 6, 4, 4, 2, r"world size 6 is not divisible by TP\*PP\*CP = 2\*2\*1 = 4"),
        (1, 4, 4, 2, 4, 2, r"pipeline_model_parallel_size=4 is larger than num_hidden_layers=2"),
        (1, 4, 4, 6, 4, 2, r"num_layers_in_first_pipeline_stage=1: 5 of num_hidden_layers=6 remain"),
    ],
)
def test_layout_errors_name_the_numbers(tp, pp, world, layers, heads, kv_heads, message):
    first = 1 if layers == 6 else None  # 1 + 5 layers cannot split equally over 3 later stages
    cfg = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first,
    )
    with pytest.raises(ValueError, match=message):
        cfg.validate_world(world)
        cfg.validate_model(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads)


def test_valid_layout_passes():
    cfg = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    cfg.validate_world(8)
    cfg.validate_model(num_layers=4, num_heads=4, num_kv_heads=2)
    cfg.validate_model(num_layers=3, num_heads=4, num_kv_heads=2)  # uneven stages (2, 1)


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        ({"expert_model_parallel_size": 4}, 6, r"world size 6 is not divisible by ETP\*EP\*PP = 1\*4\*1 = 4"),
        (
            {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4},
            4,
            r"world size 4 is not divisible by ETP\*EP\*PP = 2\*4\*1 = 8",
        ),
        ({"expert_model_parallel_size": 3}, 3, r"expert_model_parallel_size=3 does not divide num_experts=8"),
        (
            {"tensor_model_parallel_size": 4, "expert_tensor_parallel_size": 4},
            4,
            r"expert tensor parallel size 4 does not divide moe_intermediate_size=6",
        ),
    ],
)
def test_expert_layout_errors_name_the_numbers(kwargs, world, message):
    cfg = ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        cfg.validate_world(world)
        cfg.validate_model(num_layers=2, num_heads=4, num_kv_heads=4, num_experts=8, moe_ffn_hidden_size=6)


def test_expert_layout_fields_are_checked_when_built():
    with pytest.raises(
        ValueError, match=r"expert_tensor_parallel_size=3 does not divide tensor_model_parallel_size=2"
    ):
        ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=3)
    with pytest.raises(
        ValueError, match=r"moe_token_dispatcher_type='flex'; choose one of alltoall, allgather"
    ):
        ParallelConfig(moe_token_dispatcher_type="flex")
    cfg = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert (cfg.expert_tensor_size, cfg.expert_model_parallel_ranks, cfg.min_world_size) == (2, 4, 4)
    assert ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=3).min_world_size == 6


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match=rf"pipeline_model_parallel_size={bad!r}: must be an integer >= 1"):
        ParallelConfig(pipeline_model_parallel_size=bad)


@cpu_only
def test_cpu_mode_rewrites_cuda_devices_and_restores_on_exit():
    original = torch.cuda.current_device
    with cpu_mode.CPUExecutionMode():
        x = torch.zeros(3, device="cuda")
        y = torch.empty(2, device=torch.cuda.current_device(), pin_memory=True)
        z = torch.ones(2).to("cuda:0")
        w = torch.ones(2).to(torch.device("cuda", 0), dtype=torch.float64)
        torch.cuda.synchronize()
        assert {t.device.type for t in (x, y, z, w, x.cuda())} == {"cpu"}
        assert w.dtype == torch.float64
        # megatron's mixed-precision optimizers read dtypes from CUDA type names
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64
    assert torch.cuda.current_device is original
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


@cpu_only
def test_cpu_rng_tracker_forks_named_streams_like_megatron():
    with cpu_mode.CPUExecutionMode():
        tracker = tensor_parallel.get_cuda_rng_tracker()
        assert isinstance(tracker, cpu_mode.CpuRNGStatesTracker)

        def draws(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            torch.manual_seed(0)
            tensor_parallel.model_parallel_cuda_manual_seed(11, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
            with tracker.fork():
                first = torch.rand(4)
            default = torch.rand(4)  # the default stream is untouched by the fork
            with tracker.fork():
                second = torch.rand(4)  # the named stream advanced
            return first, second, default

        first, second, default = draws(tp_rank=0)
        torch.manual_seed(0)
        assert torch.equal(default, torch.rand(4))
        assert not torch.equal(first, second)
        again = draws(tp_rank=0)
        assert all(torch.equal(a, b) for a, b in zip((first, second, default), again, strict=True))
        other_rank = draws(tp_rank=1)
        assert not torch.equal(first, other_rank[0]) and torch.equal(default, other_rank[2])

        with tracker.fork("data-parallel-rng"), tracker.fork():  # nested forks restore in order
            pass
        assert tracker._current_state_name == "default-rng"
        with pytest.raises(KeyError, match="never added"):
            with tracker.fork("no-such-stream"):
                pass


@cpu_only
def test_single_process_initialize_and_shutdown(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")  # a batch script's own process, not an srun step
    monkeypatch.setenv("SLURM_NTASKS", "8")
    with pytest.raises(ValueError, match="world size 1 is not divisible by TP\\*PP\\*CP = 2\\*1\\*1 = 2"):
        initialize(ParallelConfig(tensor_model_parallel_size=2))
    rt = initialize(ParallelConfig(), seed=3)
    try:
        assert (rt.rank, rt.world_size, rt.tp_size, rt.pp_size, rt.dp_size) == (0, 1, 1, 1, 1)
        assert rt.cpu and rt.device.type == "cpu" and rt.is_first_stage and rt.is_last_stage
        assert rt.groups.tp.size() == 1 and cpu_mode.is_enabled()
    finally:
        shutdown()
    assert not cpu_mode.is_enabled() and not torch.distributed.is_initialized()


def test_launch_local_runs_ranks_and_reports_failures(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "env = os.environ\n"
        "print(f\"rank {env['RANK']}/{env['WORLD_SIZE']} omp={env['OMP_NUM_THREADS']}\")\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    out = launch_local([str(script), "0"], 2, timeout=120).stdout
    assert "rank 0/2 omp=1" in out and "rank 1/2 omp=1" in out
    with pytest.raises(LaunchError, match="rank 0/1 omp=3") as failure:
        launch_local([str(script), "5"], 1, env={"OMP_NUM_THREADS": "3"}, timeout=120)
    assert failure.value.returncode != 0


def test_launch_local_timeout_kills_every_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, pathlib, sys, threading\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid()))\n"
        "threading.Event().wait()  # hangs until killed\n"
    )
    with pytest.raises(LaunchError, match="timed out") as failure:
        launch_local([str(script), str(tmp_path)], 2, timeout=20)
    assert failure.value.returncode is None
    pids = [int((tmp_path / rank).read_text()) for rank in ("0", "1")]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
