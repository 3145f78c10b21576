"""Conversion time and peak RSS for a Qwen2.5-0.5B-shaped random bf16 checkpoint, HF -> Megatron -> HF.

    python -m benchmarks bench_conversion            # TP=1 and TP=2, tied embeddings, bf16
    python -m benchmarks.bench_conversion --tp 1 --keep /tmp/bench_conv

Each conversion runs in its own child process (the `sparserl convert` CLI, which launches the
torchrun ranks), so `getrusage(RUSAGE_CHILDREN).ru_maxrss` there is the peak RSS of the largest
single process of that conversion: one rank, since every rank reads or writes only its own shard.
The round trip is checked bit for bit at the end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

# Qwen/Qwen2.5-0.5B config.json shape (494M parameters, tied embeddings).
QWEN25_05B = dict(arch="qwen2", layers=24, hidden=896, heads=14, kv_heads=2, ffn=4864, vocab=151936)


def _measure(argv: list[str]) -> dict:
    """Run one CLI command in a child process; return its wall time and peak child RSS."""
    code = (
        "import json, resource, sys, time\n"
        "from sparserl_mcore.cli import main\n"
        "t = time.perf_counter(); rc = main(sys.argv[1:]); dt = time.perf_counter() - t\n"
        "peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "print('BENCH ' + json.dumps({'rc': rc, 'seconds': dt, 'peak_rss_kib': peak}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    if proc.returncode or not lines or json.loads(lines[-1][6:])["rc"]:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def _bit_exact(a: pathlib.Path, b: pathlib.Path) -> bool:
    import torch
    from safetensors import safe_open

    def tensors(path: pathlib.Path) -> dict[str, pathlib.Path]:
        out = {}
        for file in path.glob("*.safetensors"):
            with safe_open(file, framework="pt") as f:
                out.update(dict.fromkeys(f.keys(), file))
        return out

    left, right = tensors(a), tensors(b)
    if sorted(left) != sorted(right):
        return False
    for name, file in left.items():  # one tensor at a time: the check must not hold two models
        with safe_open(file, framework="pt") as f, safe_open(right[name], framework="pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_conversion", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes to measure")
    parser.add_argument("--keep", default=None, help="work directory to keep (default: a temp dir)")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="bench_conversion-"))
    hf = work / "hf"
    try:
        if not hf.exists():
            t = time.perf_counter()
            flags = [f"--{k.replace('_', '-')}={v}" for k, v in QWEN25_05B.items()]
            _measure(["model", "make-tiny", *flags, "--tie-embeddings", "--dtype=bfloat16", f"--out={hf}"])
            print(f"made Qwen2.5-0.5B-shaped bf16 checkpoint in {time.perf_counter() - t:.0f} s")
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        print(f"checkpoint: {size / 2**20:.0f} MiB safetensors; cpu ranks: 1 thread each")
        print(f"{'direction':<12} {'TP':>3} {'seconds':>8} {'peak RSS MiB':>13} {'RSS / ckpt':>10}")
        for tp in [int(x) for x in args.tp.split(",")]:
            mcore, back = work / f"mcore_tp{tp}", work / f"hf_tp{tp}"
            rows = [
                ("hf-to-mcore", mcore, ["convert", "hf-to-mcore", f"--hf-dir={hf}", f"--tp={tp}"]),
                (
                    "mcore-to-hf",
                    back,
                    ["convert", "mcore-to-hf", f"--mcore-dir={mcore}", "--max-shard-size=500MB"],
                ),
            ]
            for direction, out, cmd in rows:
                shutil.rmtree(out, ignore_errors=True)
                result = _measure([*cmd, f"--out={out}"])
                rss, seconds = result["peak_rss_kib"] / 1024, result["seconds"]
                print(f"{direction:<12} {tp:>3} {seconds:>8.1f} {rss:>13.0f} {rss * 2**20 / size:>10.2f}")
            print(f"round trip TP={tp} bit-exact: {_bit_exact(hf, back)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
