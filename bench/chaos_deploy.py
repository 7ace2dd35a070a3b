"""The chaos bench's deployment and its processes: `Deployment` (`nexus up` / `nexus down` on one
data dir, every pid seen in it, for cleanup), reading a pid's command line and listening ports, and
`Poll`, how a harness waits on it. Shared by the other benches (bench/multitenant.py, bench/scale.py, ...)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from transport.cluster import pid_alive

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Poll:
    """How the harness waits on the deployment (policy data, not scattered sleeps).
    Candidates for protocol/policy.py: CHAOS_SAMPLE, CHAOS_RECOVERY, CHAOS_AUDIT."""

    name: str
    every_s: float
    deadline_s: float


def stop_on_sigterm() -> None:
    """A bench stopped with SIGTERM (`pkill -f bench.maniskill_rl`) unwinds as Ctrl-C does, so
    its `finally:` takes its deployment down (`nexus down`, `Deployment.cleanup`); before, it
    died at once and left its deployments running. Main thread only (Python's rule)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# -- the deployment and its processes ---------------------------------------------------------
def proc_cmdline(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


class Deployment:
    """`nexus up` / `nexus down` on one data dir, and every pid seen in it (for cleanup)."""

    def __init__(self, data_dir: Path, nats_cluster: int) -> None:
        self.data_dir = data_dir
        self.nats_cluster = nats_cluster
        self.seen: dict[int, list[str]] = {}  # pid -> its cmdline when first seen
        self.started: list[subprocess.Popen] = []  # NATS nodes this harness restarted
        self.supervisor_pid = 0
        self.up_output = ""

    def nexus(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run([sys.executable, "-m", "sdk.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)

    def up(self, port: int) -> dict[str, Any]:
        args = ["up", "--detach", "--data-dir", str(self.data_dir), "--nats-port", str(port),
                "--ready-timeout-s", "120"]
        if self.nats_cluster > 1:
            args += ["--nats-cluster", str(self.nats_cluster)]
        return self.up_args(args, timeout=240)

    def up_args(self, args: list[str], timeout: float) -> dict[str, Any]:
        """`nexus <args>` (an ``up --detach``); cluster.json once it says ready."""
        res = self.nexus(*args, timeout=timeout)
        self.up_output = res.stdout + res.stderr
        state = self.state()
        if state:
            self.supervisor_pid = int(state["supervisor_pid"])
        if res.returncode != 0 or not state or not state.get("ready"):
            raise RuntimeError(f"`nexus {' '.join(args)}` failed ({res.returncode}): {self.up_output[-2000:]}")
        return state

    def state(self) -> dict[str, Any] | None:
        """cluster.json as a dict (raw, so fields other helpers add, such as broker_pids, pass)."""
        try:
            state = orjson.loads((self.data_dir / "cluster.json").read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None
        pids = [r["pid"] for r in state.get("roles", [])] + list(state.get("broker_pids") or [])
        if state.get("broker_pid"):
            pids.append(state["broker_pid"])
        for pid in pids:
            if pid not in self.seen:
                self.seen[pid] = proc_cmdline(pid)
        return state

    def role(self, role: str) -> dict[str, Any] | None:
        state = self.state() or {}
        for r in state.get("roles", []):
            if r["role"] == role and pid_alive(r["pid"]):
                return r
        return None

    def cleanup(self) -> list[str]:
        """Stop everything; return what had to be killed by force."""
        notes = []
        if self.supervisor_pid and pid_alive(self.supervisor_pid):
            try:
                res = self.nexus("down", "--data-dir", str(self.data_dir), "--timeout-s", "60", timeout=90)
                if res.returncode != 0:
                    notes.append(f"nexus down exited {res.returncode}: {res.stderr.strip()[-300:]}")
            except subprocess.TimeoutExpired:
                notes.append("nexus down timed out")
        if self.supervisor_pid and pid_alive(self.supervisor_pid):
            try:
                if os.getpgid(self.supervisor_pid) == self.supervisor_pid:  # its own group (start_new_session)
                    os.killpg(self.supervisor_pid, signal.SIGKILL)
                    notes.append(f"killed the supervisor's process group {self.supervisor_pid}")
            except ProcessLookupError:
                pass
        for proc in self.started:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid, cmd in self.seen.items():
            # Only a process that is still the one we saw (pids get reused).
            if cmd and pid_alive(pid) and proc_cmdline(pid) == cmd:
                os.kill(pid, signal.SIGKILL)
                notes.append(f"killed leftover pid {pid} ({' '.join(cmd[-3:])})")
        return notes


def ports_of_url(url: str) -> set[int]:
    """The client ports of a deployment's URL (comma-separated servers). Since tenant auth each
    server carries ``?creds=PATH`` (and may carry ``user:pass@``): read the port from the
    plain address, never by splitting the raw text at its last colon."""
    from urllib.parse import urlsplit

    from transport.creds import strip_userinfo

    ports = set()
    for one in url.split(","):
        if one.strip():
            port = urlsplit(strip_userinfo(one.strip())).port
            if port is not None:
                ports.add(port)
    return ports


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on (Linux: its socket inodes against /proc/net/tcp*)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def answers_info(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False
