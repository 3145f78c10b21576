"""A real Slurm on this machine for the job tests: munged, slurmctld and one slurmd per node.

Everything lives under one private directory (config, state, spool, logs, munge socket and key) and
uses free ports, so nothing in /etc is touched and the system's own daemons (if any) are left
alone. The nodes are CPU nodes on this host: slurmd runs once per node (`slurmd -N <node>`, each
on its own port, NodeAddr 127.0.0.1), which is how one host can hold a learner node and a rollout
node. The daemons run in the foreground as children of the test process and are stopped in
`stop()`, after every job has been cancelled.

Needs root (slurmd launches jobs as the submitting user; munged runs with --force) and Debian's
slurm-wlm and munge packages (`make slurm-test` installs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from e2e_support import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch")


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


class LocalSlurm:
    """Start with `start()`, use `env` for every Slurm command, end with `stop()`."""

    def __init__(self, root: Path, *, nodes: int = 2, cpus_per_node: int = 2) -> None:
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus_per_node
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    # -- daemons ------------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        r = self.root
        munged = ["munged", "--foreground", "--force", f"--socket={self._socket}", f"--key-file={key}"]
        files = [
            f"--pid-file={r}/munged.pid",
            f"--seed-file={r}/munged.seed",
            f"--log-file={r}/log/munged.log",
        ]
        self._spawn("munged", munged + files)
        self._wait_for(self._socket.exists, timeout, "munged socket")
        self.conf.write_text(self._config())
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(self._nodes_idle, timeout, f"nodes {self.nodes} idle")

    def stop(self) -> None:
        """Cancel every job, wait for them to end, then stop the daemons (slurmd first)."""
        if self._procs:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
            try:
                self._wait_for(lambda: not self.squeue(), 90, "jobs to end")
            except (TimeoutError, RuntimeError):
                pass  # a daemon already gone: stop the others all the same
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()

    @property
    def _socket(self) -> Path:
        return self.root / "munge.sock"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("w")
        self._procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _config(self) -> str:
        host, r = socket.gethostname(), self.root
        lines = [
            "ClusterName=sparserl-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self._socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",  # signals reach every process of a step
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",  # nodes declare CPUs the host may not have
            "ReturnToService=2",
            "MpiDefault=none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "PlugStackConfig=/dev/null",
            "KillWait=30",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
            )
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    # -- queries ------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=False)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def squeue(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return sorted(states) == self.nodes and all(s == "idle" for s in states.values())

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited; logs in {self.root / 'log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}; logs in {self.root / 'log'}")
            time.sleep(0.2)
