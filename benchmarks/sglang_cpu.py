"""A live `sparserl sglang-serve --device cpu` on loopback, for the benchmarks that talk to SGLang."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def cpu_server(
    hf_dir: Path, log: Path, *, serve_args: Sequence[str] = (), sglang_args: Sequence[str] = ()
) -> Iterator[str]:
    """The server of `hf_dir` on a free loopback port, its output in `log`; yields its URL once it
    says it is ready. `serve_args` go to `sparserl sglang-serve`, `sglang_args` to SGLang as is."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "sparserl_mcore", "sglang-serve", "--model-path", str(hf_dir),
           "--port", str(port), "--device", "cpu", *serve_args, "--", *sglang_args]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait = threading.Event()
        while "sparserl sglang-serve: ready" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                raise RuntimeError(f"sparserl sglang-serve exited with {proc.returncode}; see {log}")
            wait.wait(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()  # the launcher stops SGLang's whole process group
        proc.wait(120)
