"""What the GPU benchmarks share: the machine report, device-synchronised wall clocks, the model
shapes, FLOP accounting for MFU, and the result records `python -m benchmarks.gpu` writes.

Every time here is wall clock between two `torch.cuda.synchronize()` calls (a no-op on CPU), so
queued kernels are inside the interval. `--smoke` shapes exist so the code paths run on a CPU box
in seconds; their numbers mean nothing and are labelled so.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparserl_mcore.sync.bench import QWEN25_05B

# The smoke shape: the same architecture (GQA, tied embeddings, qkv bias), tiny.
SMOKE: dict[str, Any] = {
    **QWEN25_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def model_shape(smoke: bool) -> dict[str, Any]:
    """The HF config (dict) every GPU benchmark uses: Qwen2.5-0.5B, or the smoke shape."""
    return SMOKE if smoke else dict(QWEN25_05B)


# Dense BF16 tensor-core peaks (no sparsity), FLOP/s, by a substring of the device name. Override
# with --peak-tflops for other parts or clocks.
PEAK_BF16_FLOPS = {
    "H100 SXM": 989.4e12,
    "H100 80GB HBM3": 989.4e12,  # the SXM part's name in torch.cuda.get_device_name
    "H100 NVL": 835.0e12,
    "H100 PCIe": 756.0e12,
    "H200": 989.4e12,
    "A100": 312.0e12,
}

PACKAGES = ("torch", "megatron-core", "transformers", "triton", "safetensors", "zstandard", "nvidia-ml-py")


def device_for(smoke: bool) -> torch.device:
    """CUDA (the benchmarks' subject); CPU only for --smoke runs on a box without a GPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if smoke:
        return torch.device("cpu")
    raise SystemExit("this benchmark measures a GPU and none is visible; --smoke runs it on CPU (no figures)")


def environment(device: torch.device) -> dict[str, str]:
    """Device, driver, CUDA and package versions: the record every result carries."""
    env = {"python": platform.python_version(), "host": platform.node(), "cpu_count": str(_cpu_count())}
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = "absent"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=torch.cuda.get_device_name(device),
            device_memory_gib=f"{props.total_memory / 2**30:.1f}",
            cuda_runtime=str(torch.version.cuda),
            driver=_driver_version(),
        )
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()})", driver="n/a")
    return env


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as exc:  # NVML missing or refusing: say so rather than fail the benchmark
        return f"unknown ({type(exc).__name__})"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of `fn`, each between two device synchronisations, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def peak_bf16_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def train_flops_per_token(hf: dict[str, Any], seq_len: int) -> float:
    """Model FLOPs of one token's forward + backward (PaLM's accounting: 6 x matmul parameters,
    lm_head included, plus 12 x layers x attention width x sequence for QK^T and AV; causal
    masking is not discounted). Embedding lookups, norms and the optimizer are not counted."""
    h, ffn, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or h // heads
    per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * ffn
    matmul_params = layers * per_layer + hf["vocab_size"] * h
    return 6.0 * matmul_params + 12.0 * layers * heads * head_dim * seq_len


def write_record(out_dir: Path, name: str, env: dict[str, str], rows: list[dict], notes: list[str]) -> Path:
    """OUT/<name>.json with the environment, the rows and notes; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(
        json.dumps({"benchmark": name, "environment": env, "rows": rows, "notes": notes}, indent=2)
    )
    return path


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """A plain table (header from `columns`: (key, label)); floats get 4 significant digits."""
    print(f"\n{title}")
    labels = [label for _, label in columns]
    cells = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(label), *(len(c[i]) for c in cells)) for i, label in enumerate(labels)]
    print("  ".join(label.ljust(w) for label, w in zip(labels, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return "" if value is None else str(value)
