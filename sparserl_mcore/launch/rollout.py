"""srun entry of one rollout server in a Slurm job: pick this task's port and GPUs, then exec it.

    srun --ntasks-per-node=K python -m sparserl_mcore.launch.rollout --config C --server sglang|embedded \
        --device cuda|cpu --port BASE

Task i of a node (SLURM_LOCALID) serves on BASE + i, on GPUs from i x (its tensor-parallel size);
`sparserl_mcore/slurm/servers.py` builds the command. The server replaces this process, so the
signals srun passes to the task reach it directly.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    prog = "python -m sparserl_mcore.launch.rollout"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the job's run config")
    parser.add_argument("--server", required=True, choices=["sglang", "embedded"])
    parser.add_argument("--device", required=True, choices=["cuda", "cpu"])
    parser.add_argument("--port", type=int, required=True, help="port of the node's first server")
    args = parser.parse_args(argv)

    from sparserl_mcore.config import ConfigError, load_config
    from sparserl_mcore.slurm.servers import task_server

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"launchers.rollout: {exc}", file=sys.stderr)
        return 2
    local = int(os.environ.get("SLURM_LOCALID", "0"))
    cmd = task_server(args.server, cfg, local_task=local, base_port=args.port, gpus=args.device == "cuda")
    print(f"launchers.rollout: task {local}: {shlex.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
