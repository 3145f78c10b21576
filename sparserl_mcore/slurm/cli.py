"""`sparserl slurm --config X.yaml --learner-nodes M [--rollout-nodes R] ... [key=value ...]`.

Validates the config and the layout (one line and exit 2 for anything that cannot work), writes
`<telemetry.dir>/job-config.yaml` (the resolved config the job runs, so edits to X.yaml cannot
change a queued or requeued job) and `<telemetry.dir>/job.sbatch`, both via temp file + rename,
creates `<telemetry.dir>/logs/`, and submits the script with sbatch unless --dry-run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sparserl_mcore.cli_args import non_negative_int, positive_int

if TYPE_CHECKING:
    from sparserl_mcore.config import RunConfig
    from sparserl_mcore.slurm.layout import RolloutServer

SCRIPT_NAME, CONFIG_NAME = "job.sbatch", "job-config.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (see examples/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    parser.add_argument("--learner-nodes", type=positive_int, required=True, help="nodes running the learner")
    parser.add_argument(
        "--rollout-nodes",
        type=non_negative_int,
        default=0,
        help="nodes running rollout servers (0: colocated)",
    )
    parser.add_argument(
        "--gpus-per-node", type=non_negative_int, default=8, help="GPUs per node (0: CPU nodes)"
    )
    parser.add_argument(
        "--ranks-per-node", type=positive_int, default=None, help="CPU nodes only: ranks/servers per node"
    )
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default="24:00:00", help="time limit, Slurm format (default 24:00:00)")
    parser.add_argument(
        "--stop-before",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="signal the trainer this long before the time limit to checkpoint and requeue (900)",
    )
    parser.add_argument("--job-name", default=None, help="default: sparserl-<run directory name>")
    parser.add_argument(
        "--rollout-server",
        choices=["auto", "sglang", "embedded"],
        default="auto",
        help="auto: SGLang when it imports on the nodes, else the embedded engine",
    )
    parser.add_argument(
        "--rollout-port", type=positive_int, default=30000, help="port of each node's first server"
    )
    parser.add_argument("--out", default=None, help=f"script path (default: <telemetry.dir>/{SCRIPT_NAME})")
    parser.add_argument("--dry-run", action="store_true", help="write the script, do not submit it")


@dataclasses.dataclass(frozen=True)
class Job:
    """A rendered job: the script, the config snapshot it runs, and where both go."""

    script: str
    config_yaml: str
    script_path: Path
    config_path: Path


def _rollout_server(asked: RolloutServer, cfg: RunConfig) -> RolloutServer:
    """SGLang's KV plugin runs snapkv, rkv and streamingllm (docs/sglang.md); a run with another
    rollout.kv.method (h2o) gets the embedded servers under `auto`, and is refused under `sglang`."""
    from sparserl_mcore.sglang.kv_hooks import SGLANG_METHODS
    from sparserl_mcore.slurm.layout import LayoutError

    kv = cfg.rollout.kv
    if not kv.enabled or kv.method in SGLANG_METHODS or asked == "embedded":
        return asked
    if asked == "sglang":
        raise LayoutError(
            f"--rollout-server sglang with rollout.kv.method={kv.method}: this method does not work "
            f"inside SGLang (it runs {', '.join(SGLANG_METHODS)}; docs/sglang.md); use "
            "--rollout-server embedded or another method"
        )
    return "embedded"


def build_job(args: argparse.Namespace) -> Job:
    """Validate and render without writing anything. Raises ConfigError / LayoutError."""
    from sparserl_mcore.ckpt.atomic import output_problem
    from sparserl_mcore.config import load_config, to_yaml
    from sparserl_mcore.slurm.layout import LayoutError, SlurmLayout, check_job, check_layout
    from sparserl_mcore.slurm.render import render, topology_overrides

    cfg = load_config(args.config, args.overrides)
    run_dir = cfg.telemetry.dir.rstrip("/")
    if any(c.isspace() for c in run_dir):
        raise LayoutError(f"telemetry.dir={run_dir!r}: the job's #SBATCH --output cannot hold whitespace")
    ranks = args.ranks_per_node if args.ranks_per_node is not None else max(args.gpus_per_node, 1)
    layout = SlurmLayout(
        learner_nodes=args.learner_nodes,
        rollout_nodes=args.rollout_nodes,
        gpus_per_node=args.gpus_per_node,
        ranks_per_node=ranks,
        partition=args.partition,
        time=args.time,
        stop_before_s=args.stop_before,
        job_name=args.job_name or f"sparserl-{Path(run_dir).name}",
        rollout_server=_rollout_server(args.rollout_server, cfg),
        rollout_port=args.rollout_port,
    )
    check_job(layout)  # the job's own flags first: what the config below is built from
    # What the learners will run: the config plus the job's own servers (placeholder addresses).
    slots = layout.rollout_nodes * layout.ranks_per_node
    urls = [f"http://rollout-{i}:{layout.rollout_port}" for i in range(slots)]
    job_cfg = load_config(args.config, [*args.overrides, *topology_overrides(layout, urls)])
    hf_config = Path(cfg.model.hf_path) / "config.json"
    check_layout(job_cfg, layout, hf_config if hf_config.is_file() else None)
    config_path = Path(run_dir) / CONFIG_NAME
    script = render(job_cfg, layout, run_dir=run_dir, config_path=str(config_path), command=_command(args))
    script_path = Path(args.out) if args.out else Path(run_dir) / SCRIPT_NAME
    for flag, path in (("telemetry.dir", config_path), ("--out", script_path)):
        problem = output_problem(path, directory=False)
        if problem:
            raise LayoutError(f"{flag}: {problem}")
    return Job(script, to_yaml(cfg), script_path, config_path)


def _command(args: argparse.Namespace) -> str:
    """The command line in canonical form, options at their defaults left out (deterministic: the
    checked-in examples compare equal)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["sparserl", "slurm", "--config", args.config, "--learner-nodes", str(args.learner_nodes)]
    for name, value in vars(args).items():
        if name not in ("config", "learner_nodes", "overrides", "out", "dry_run"):
            if value != parser.get_default(name):
                words += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join([*words, *args.overrides])


def write_job(job: Job) -> None:
    from sparserl_mcore.ckpt.atomic import file_mode
    from sparserl_mcore.sync.transport_dir import atomic_write_bytes

    atomic_write_bytes(job.config_path, job.config_yaml.encode())
    (job.config_path.parent / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(job.script_path, job.script.encode())
    job.script_path.chmod(file_mode(directory=True))  # executable, as far as the umask allows


def run(args: argparse.Namespace) -> int:
    from sparserl_mcore.config import ConfigError
    from sparserl_mcore.slurm.layout import LayoutError

    try:
        job = build_job(args)
    except (ConfigError, LayoutError) as exc:
        print(f"sparserl slurm: {exc}", file=sys.stderr)
        return 2
    sbatch = shutil.which("sbatch")
    if not args.dry_run and sbatch is None:
        print(
            "sparserl slurm: sbatch not found: run on a Slurm login node, or pass --dry-run", file=sys.stderr
        )
        return 2
    write_job(job)
    print(f"sparserl slurm: wrote {job.script_path} (runs {job.config_path})")
    if args.dry_run or sbatch is None:
        print(f"submit with: sbatch {shlex.quote(str(job.script_path))}")
        return 0
    proc = subprocess.run([sbatch, "--parsable", str(job.script_path)], capture_output=True, text=True)
    if proc.returncode:
        print(f"sparserl slurm: sbatch failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return 1
    job_id = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; logs in {job.config_path.parent / 'logs'}")
    return 0
