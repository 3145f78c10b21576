"""The sbatch script of one run: a header of values from the run config and the layout, then fixed
bash that only reads those variables (so every rendered script has the same, shellcheck-clean body).

What the job does, in order:
  1. resolve the allocation's nodes: the first `LEARNER_NODES` train, the rest serve rollouts;
  2. (rollout nodes) one srun step starts the servers, several per node when the rollout TP is
     smaller than a node (`sparserl_mcore.launch.rollout` picks each task's GPUs and port), and the script
     waits until every server answers /health; for SGLang servers a second step starts
     sglang-router on the first rollout node (port `ROUTER_PORT`, `ROLLOUT_PORT - 2`) and the
     script waits until it lists every server; the learners send /generate to it
     (`rollout.router_url`) and weights to each server;
  3. one srun step runs one torchrun per learner node, rendezvous (c10d) on the first learner node,
     one log file per node under <run dir>/logs/; with DiLoCo islands (`parallel.islands`) the
     rendezvous is static and each node's rank is its place in the learner node list, so island i
     is the i-th group of (learner nodes / islands) consecutive learner nodes (the slow links run
     between groups; only the outer sync crosses them);
  4. USR1 (sent `STOP_BEFORE_S` seconds before the time limit) and TERM reaching this shell are
     passed to the learner step; the ranks checkpoint at their next step boundary and exit 0
     (trainer/preemption.py); after a USR1 stop the job requeues itself and resumes there.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from sparserl_mcore.config import RunConfig
from sparserl_mcore.sglang.launch import ROUTER_MODULE
from sparserl_mcore.slurm.layout import SlurmLayout, island_nodes

SERVE_TOKEN_ENV = "SPARSERL_SERVE_TOKEN"

# The one place for the job's network and threading environment. A value already set in the
# environment sbatch was called from wins (sbatch exports it). docs/quickstart-cluster.md explains
# when to change them.
NETWORK_ENV: dict[str, tuple[str, str]] = {
    "NCCL_DEBUG": ("WARN", "NCCL prints warnings and errors only (INFO when debugging a hang)"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("1", "megatron's TP comm overlaps compute only with in-order launch"),
}
NETWORK_NOTE = (
    "# On nodes with several network interfaces export NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME\n"
    "# (e.g. ib0 / eth0) before sbatch; the rendezvous uses the node address Slurm itself uses."
)


REMOTE_OVERRIDES = ("rollout.engine=remote", f"rollout.token_env={SERVE_TOKEN_ENV}")
# `--rollout-server` (what the job starts) -> `rollout.server` (which weight routes the trainer calls)
SERVER_API = {"sglang": "sglang", "embedded": "sparserl"}


def topology_overrides(layout: SlurmLayout, urls: Sequence[str], router_host: str = "rollout-0") -> list[str]:
    """Config overrides that point the learners at the job's own rollout servers (and, for SGLang,
    its router on `router_host` and full syncs by broadcast). Under `--rollout-server auto` the job
    decides on the node whether they are SGLang, and its script sets `rollout.server`, the router
    and the broadcast then (`_ROLLOUTS`); here only a known kind is set."""
    if layout.rollout_nodes == 0:
        return []
    server = _server(layout)
    kind = [f"rollout.server={SERVER_API[server]}"] if server in SERVER_API else []
    sglang = server == "sglang"
    router = [f"rollout.router_url=http://{router_host}:{router_port(layout)}"] if sglang else []
    full_sync = ["sync.broadcast.master_port=20001"] if sglang else []  # the job's: MASTER_PORT + 1
    return [*REMOTE_OVERRIDES, *kind, f"rollout.urls=[{','.join(urls)}]", *router, *full_sync]


def router_port(layout: SlurmLayout) -> int:
    """The router's port on the first rollout node (its metrics on the next one), below the servers'."""
    return layout.rollout_port - 2


def _server(layout: SlurmLayout) -> str:
    """The servers the job starts: `sparserl serve` on CPU nodes, else as asked (or auto)."""
    return "embedded" if layout.cpu else layout.rollout_server


def render(cfg: RunConfig, layout: SlurmLayout, *, run_dir: str, config_path: str, command: str) -> str:
    """The complete script. `config_path`: the job's config snapshot (as the job will see it);
    `command`: the `sparserl slurm` command line that produced it, quoted in the header."""
    parts = [
        _header(cfg, layout, command),
        _sbatch_lines(layout, run_dir),
        "set -euo pipefail\n",
        _values(cfg, layout, run_dir, config_path),
        _environment(),
        _COMMON,
        _rollouts() if layout.rollout_nodes else _NO_ROLLOUTS,
        _LEARNERS,
    ]
    return "\n".join(parts)


def _header(cfg: RunConfig, layout: SlurmLayout, command: str) -> str:
    par = cfg.parallel
    unit = "CPU ranks" if layout.cpu else "GPUs"
    dp = layout.learner_ranks // par.model_parallel_size
    lines = [
        "#!/bin/bash",
        "# Rendered by `sparserl slurm`: change the run config and render again rather than this file.",
        f"#   {command}",
        f"# Learners: {layout.learner_nodes} node(s) x {layout.ranks_per_node} {unit} = "
        f"{layout.learner_ranks} ranks: TP={par.tensor_model_parallel_size} x "
        f"PP={par.pipeline_model_parallel_size} x CP={par.context_parallel_size}, DP={dp}.",
    ]
    if par.uses_expert_parallelism:
        edp = layout.learner_ranks // par.expert_model_parallel_ranks
        lines.append(
            f"# Experts: EP={par.expert_model_parallel_size} x ETP={par.expert_tensor_size} x "
            f"PP={par.pipeline_model_parallel_size}, expert DP={edp}, "
            f"{par.moe_token_dispatcher_type} dispatcher."
        )
    if par.islands > 1:
        lines.append(f"# Islands: {_island_summary(par.islands, layout)}.")
    lines.append(f"# Rollouts: {_rollout_summary(cfg, layout)}.")
    lines += [
        f"# Stops: USR1 {layout.stop_before_s} s before the time limit, or TERM: the trainer "
        "checkpoints at its next",
        "# step boundary and exits 0; after USR1 the job requeues itself and resumes there.",
    ]
    return "\n".join(lines)


def _island_summary(islands: int, layout: SlurmLayout) -> str:
    k = island_nodes(islands, layout)
    if k == 0:
        per_node = islands // layout.learner_nodes
        return f"{islands} of {layout.learner_ranks // islands} ranks, {per_node} per node"
    groups = ", ".join(f"[{i * k}-{i * k + k - 1}]" if k > 1 else f"[{i}]" for i in range(islands))
    return f"{islands}, learner nodes {groups}; DiLoCo outer sync between them only"


def _rollout_summary(cfg: RunConfig, layout: SlurmLayout) -> str:
    if not layout.rollout_nodes:
        return "colocated, the embedded engine on learner rank 0"
    rtp, n = cfg.rollout.tensor_parallel_size, layout.ranks_per_node
    sglang = f"SGLang servers of TP={rtp} ({n // rtp} per node) behind sglang-router"
    embedded = f"`sparserl serve` ({n} per node)"
    kinds = {"sglang": sglang, "embedded": embedded, "auto": f"{sglang} if sglang imports, else {embedded}"}
    return f"{layout.rollout_nodes} node(s): {kinds[_server(layout)]}"


def _sbatch_lines(layout: SlurmLayout, run_dir: str) -> str:
    options: dict[str, str | None] = {
        "job-name": layout.job_name,
        "nodes": str(layout.nodes),
        "ntasks-per-node": "1",
        "gpus-per-node": None if layout.cpu else str(layout.gpus_per_node),
        "exclusive": "",
        "time": layout.time,
        "partition": layout.partition,
        "signal": f"B:USR1@{layout.stop_before_s}",
        "requeue": "",
        "open-mode": "append",
        "output": f"{run_dir}/logs/slurm-%j.out",
    }
    return "\n".join(
        f"#SBATCH --{key}" + (f"={value}" if value else "")
        for key, value in options.items()
        if value is not None
    )


def _assign(values: Mapping[str, object]) -> str:
    return "\n".join(f"{name}={shlex.quote(str(value))}" for name, value in values.items())


def _values(cfg: RunConfig, layout: SlurmLayout, run_dir: str, config_path: str) -> str:
    values: dict[str, object] = {
        "RUN_DIR": run_dir,
        "CONFIG": config_path,
        "LEARNER_NODES": layout.learner_nodes,
        "ROLLOUT_NODES": layout.rollout_nodes,
        "RANKS_PER_NODE": layout.ranks_per_node,
        "STOP_BEFORE_S": layout.stop_before_s,
        # islands: node ranks must follow the learner node list (static rendezvous, see _LEARNERS)
        "RDZV_BACKEND": "static" if cfg.parallel.islands > 1 else "c10d",
    }
    if layout.rollout_nodes:
        values |= {
            "ROLLOUT_TP": cfg.rollout.tensor_parallel_size,
            "ROLLOUT_SERVER": _server(layout),
            "ROLLOUT_DEVICE": "cpu" if layout.cpu else "cuda",
            "ROLLOUT_PORT": layout.rollout_port,
            "ROUTER_PORT": router_port(layout),
            # multi-turn episodes carry a routing key per group (`x-smg-routing-key`), which only
            # the manual policy honours: a group's turns then stay on one worker's radix cache
            "ROUTER_POLICY": "manual" if cfg.rollout.env is not None else "cache_aware",
            "SERVER_START_TIMEOUT_S": layout.server_start_timeout_s,
        }
    return _assign(values) + "\n"


def _environment() -> str:
    lines = ["# Network and threads: the one place for these settings (docs/quickstart-cluster.md)."]
    for name, (value, why) in NETWORK_ENV.items():
        lines.append(f"export {name}=${{{name}:-{value}}}  # {why}")
    lines += [
        "CPUS_PER_RANK=$(( ${SLURM_CPUS_ON_NODE:-1} / RANKS_PER_NODE ))",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_PER_RANK > 0 ? CPUS_PER_RANK : 1 ))}"
        "  # a node's cores split over its ranks",
    ]
    lines.append(NETWORK_NOTE)
    return "\n".join(lines) + "\n"


_COMMON = r"""fail() { echo "sparserl job: $*" >&2; exit 1; }
for tool in torchrun python; do
    command -v "$tool" >/dev/null || fail "$tool is not on PATH: activate the project's environment first"
done
[ -f "$CONFIG" ] || fail "$CONFIG is missing: render the job again with sparserl slurm"
LOGS=$RUN_DIR/logs
mkdir -p "$LOGS"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ "${#NODES[@]}" -eq $((LEARNER_NODES + ROLLOUT_NODES)) ] || fail "nodes: $SLURM_JOB_NODELIST"
LEARNERS=("${NODES[@]:0:LEARNER_NODES}")
# The address Slurm itself reaches a node at (its NodeAddr: the host name on most clusters).
node_addr() { scontrol show node "$1" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'; }
join() { local IFS=,; echo "$*"; }
MASTER_ADDR=$(node_addr "${LEARNERS[0]}")
MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))  # per job: jobs sharing a node do not collide

# Slurm signals this shell: USR1 ahead of the time limit, TERM on preemption or scancel. Pass it to
# the learner step (srun forwards it to every process of the step); the torchrun agents ignore
# USR1, the ranks checkpoint at their next step boundary and exit 0.
STOP_SIGNAL=""
INTERRUPTED=0
LEARNER_PID=""
# shellcheck disable=SC2317  # called from the traps below
forward() {
    STOP_SIGNAL=$1
    INTERRUPTED=1
    if [ -n "$LEARNER_PID" ]; then kill -s "$1" "$LEARNER_PID" 2>/dev/null || true; fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
# `wait` returns early when a trapped signal arrives: wait again until the step has really ended.
wait_step() {
    while :; do
        INTERRUPTED=0
        STATUS=0
        wait "$1" || STATUS=$?
        if [ "$INTERRUPTED" -eq 0 ] || [ "$STATUS" -le 128 ]; then return; fi
    done
}
"""

_NO_ROLLOUTS = r"""TOPOLOGY=()  # colocated: the config's own (embedded) rollout engine
ROLLOUT_PID=""
ROUTER_PID=""
"""

_ROLLOUTS = r"""# Rollout servers: one srun task per server, SERVERS_PER_NODE per rollout node.
ROLLOUTS=("${NODES[@]:LEARNER_NODES}")
export SPARSERL_SERVE_TOKEN=${SPARSERL_SERVE_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
if [ "$ROLLOUT_SERVER" = auto ]; then
    if python -c 'import sglang' 2>/dev/null; then ROLLOUT_SERVER=sglang; else ROLLOUT_SERVER=embedded; fi
fi
SERVERS_PER_NODE=$RANKS_PER_NODE  # the embedded engine: one per GPU
SERVER_API=sparserl  # rollout.server: which weight-update routes the learners call
FULL_SYNC=()
if [ "$ROLLOUT_SERVER" = sglang ]; then
    SERVERS_PER_NODE=$((RANKS_PER_NODE / ROLLOUT_TP))
    SERVER_API=sglang
    # full syncs: NCCL broadcast from learner rank 0 (its address found from its route to a server)
    FULL_SYNC=("sync.broadcast.master_port=$((MASTER_PORT + 1))")
fi
URLS=()
for node in "${ROLLOUTS[@]}"; do
    addr=$(node_addr "$node")
    for ((i = 0; i < SERVERS_PER_NODE; i++)); do URLS+=("http://$addr:$((ROLLOUT_PORT + i))"); done
done
echo "sparserl job: ${#URLS[@]} $ROLLOUT_SERVER rollout servers on ${ROLLOUTS[*]}"
srun --nodes="$ROLLOUT_NODES" --nodelist="$(join "${ROLLOUTS[@]}")" --ntasks-per-node="$SERVERS_PER_NODE" \
    --ntasks=$((ROLLOUT_NODES * SERVERS_PER_NODE)) --open-mode=append --output="$LOGS/rollout-%N-%t.log" \
    python -m sparserl_mcore.launch.rollout --config "$CONFIG" --server "$ROLLOUT_SERVER" \
    --device "$ROLLOUT_DEVICE" --port "$ROLLOUT_PORT" &
ROLLOUT_PID=$!
healthy() {  # GET <url>/health answers 200 (python: no curl needed on the nodes)
    python -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)' "$1/health" 2>/dev/null
}
deadline=$((SECONDS + SERVER_START_TIMEOUT_S))
for url in "${URLS[@]}"; do
    until healthy "$url"; do
        kill -0 "$ROLLOUT_PID" 2>/dev/null || fail "rollout servers exited: see $LOGS/rollout-*.log"
        if [ "$SECONDS" -ge "$deadline" ]; then
            kill "$ROLLOUT_PID" 2>/dev/null || true
            fail "$url did not answer /health within $SERVER_START_TIMEOUT_S s: see $LOGS/rollout-*.log"
        fi
        if [ -n "$STOP_SIGNAL" ]; then break 2; fi
        sleep 5
    done
done
# SGLang: the learners generate through sglang-router on the first rollout node; weight and pause
# routes still go to every server (the router does not proxy them). Ready once it lists them all.
ROUTER_PID=""
ROUTER=()
if [ "$SERVER_API" = sglang ] && [ -z "$STOP_SIGNAL" ]; then
    python -c 'import sglang_router' 2>/dev/null || fail "no sglang_router: pip install sglang-router==0.3.2"
    ROUTER_URL="http://$(node_addr "${ROLLOUTS[0]}"):$ROUTER_PORT"
    srun --overlap --nodes=1 --ntasks=1 --nodelist="${ROLLOUTS[0]}" \
        --open-mode=append --output="$LOGS/router.log" \
        python -m __ROUTER_MODULE__ --host 0.0.0.0 --port "$ROUTER_PORT" --policy "$ROUTER_POLICY" \
        --prometheus-port $((ROUTER_PORT + 1)) --worker-urls "${URLS[@]}" &
    ROUTER_PID=$!
    routes_all() {  # the router's GET /workers lists exactly the servers
        python -c 'import sys; from sparserl_mcore.sglang.client import router_workers as w
sys.exit(sorted(w(sys.argv[1])) != sorted(sys.argv[2:]))' "$ROUTER_URL" "${URLS[@]}" 2>/dev/null
    }
    until routes_all; do
        kill -0 "$ROUTER_PID" 2>/dev/null || fail "the router exited: see $LOGS/router.log"
        [ "$SECONDS" -lt "$deadline" ] || fail "$ROUTER_URL did not list every server in time"
        if [ -n "$STOP_SIGNAL" ]; then break; fi
        sleep 2
    done
    ROUTER=("rollout.router_url=$ROUTER_URL")
fi
"""


def _rollouts() -> str:
    urls = '"rollout.urls=[$(join "${URLS[@]}")]"'
    server = '"rollout.server=$SERVER_API"'
    body = _ROLLOUTS.replace("__ROUTER_MODULE__", ROUTER_MODULE)
    extra = '"${ROUTER[@]}" "${FULL_SYNC[@]}"'
    return body + f"TOPOLOGY=({' '.join(REMOTE_OVERRIDES)} {server} {urls} {extra})\n"


_LEARNERS = r"""STATUS=0
if [ -z "$STOP_SIGNAL" ]; then
    echo "sparserl job: learners on ${LEARNERS[*]}, rendezvous $MASTER_ADDR:$MASTER_PORT, logs in $LOGS"
    # Static rendezvous (DiLoCo islands): each node's rank is SLURM_NODEID, its place in the learner
    # node list, set on the node as torchrun's --node-rank (PET_NODE_RANK).
    export RDZV_BACKEND
    # shellcheck disable=SC2016  # $@, RDZV_BACKEND and SLURM_NODEID are expanded on the node
    srun --nodes="$LEARNER_NODES" --nodelist="$(join "${LEARNERS[@]}")" --ntasks-per-node=1 \
        --ntasks="$LEARNER_NODES" --kill-on-bad-exit=1 --open-mode=append --output="$LOGS/learner-%N.log" \
        bash -c 'trap "" USR1; [ "$RDZV_BACKEND" = c10d ] || export PET_NODE_RANK=$SLURM_NODEID; exec "$@"' \
        torchrun-agent \
        torchrun --nnodes="$LEARNER_NODES" --nproc-per-node="$RANKS_PER_NODE" \
        --rdzv-backend="$RDZV_BACKEND" --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
        --max-restarts=0 --shutdown-timeout="$STOP_BEFORE_S" \
        --module sparserl_mcore.launch.train --config "$CONFIG" "${TOPOLOGY[@]}" &
    LEARNER_PID=$!
    wait_step "$LEARNER_PID"
fi
for pid in $ROUTER_PID $ROLLOUT_PID; do
    kill -TERM "$pid" 2>/dev/null || true  # srun passes it to the router / the servers
    wait "$pid" 2>/dev/null || true
done
if [ "$STATUS" -eq 0 ] && [ "$STOP_SIGNAL" = USR1 ]; then
    echo "sparserl job: stopped ahead of the time limit with a checkpoint; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$STATUS"
"""
