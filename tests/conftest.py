"""Shared fixtures: a real nats-server on a free port with a temporary JetStream store.

Never a mock of NATS: every test that touches the bus talks to this server. Each test gets
its own subject prefix, so tests share one server without seeing each other's traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from protocol import ops
from pathlib import Path

import pytest

# One BLAS / torch thread per process (2 cores on CI); children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
# The dataset the lerobot library itself wrote (and the values it read back), beside the
# checkout where the project keeps it; a fresh clone has none. Only the tests whose point is
# comparing against lerobot's own bytes need it (and skip without it); the others use
# `libero_like`, a dataset of the same shape our own writer makes.
LEROBOT_FIXTURE = SHARED / "fixtures" / "lerobot" / "libero_like"
LIBERO_LIKE_TASKS = ("put the black bowl on the plate", "open the top drawer of the cabinet")
LIBERO_LIKE_EPISODES = ((0, 30), (1, 25), (0, 35))  # (task, frames): 90 frames, as the lerobot fixture


def write_libero_like(root: Path) -> Path:
    """A LeRobot v3.0 dataset shaped like the lerobot-written ``libero_like`` fixture, written
    by `envs.lerobot.LeRobotWriter` at ``root``: fps 10, robot panda, 3 episodes (30, 25, 35
    frames), 2 tasks, AV1 cameras ``observation.images.image`` and ``...wrist_image`` at 64x64,
    ``observation.state`` float32 (8,), ``action`` float32 (7,). Frames differ from their
    neighbours (a brightness ramp per frame) and values are seeded, so lookups can be checked."""
    import numpy as np

    from envs.lerobot import LeRobotWriter, WriterConfig

    cam = {"dtype": "video", "shape": [64, 64, 3]}
    features = {
        "observation.images.image": cam,
        "observation.images.wrist_image": cam,
        "observation.state": {"dtype": "float32", "shape": [8],
                              "names": ["eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "gripper_l", "gripper_r"]},
        "action": {"dtype": "float32", "shape": [7], "names": ["dx", "dy", "dz", "drx", "dry", "drz", "gripper"]},
    }
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 96, 64, dtype=np.float32)
    with LeRobotWriter(WriterConfig(root=root, fps=10, features=features, robot_type="panda")) as w:
        for task, T in LIBERO_LIKE_EPISODES:
            level = np.arange(T, dtype=np.float32)[:, None, None] * (150 / T)  # (T, 1, 1)
            base = level + ramp[None, :, None] + ramp[None, None, :]  # (T, H, W)
            image = np.stack([base, base * 0.5, 255 - base], axis=-1).clip(0, 255).astype(np.uint8)
            w.add_episode(LIBERO_LIKE_TASKS[task], {
                "observation.images.image": image,
                "observation.images.wrist_image": image[:, ::-1].copy(),
                "observation.state": rng.normal(size=(T, 8)).astype(np.float32),
                "action": rng.uniform(-1, 1, size=(T, 7)).astype(np.float32),
            })
    return root


@pytest.fixture(scope="session")
def libero_like(tmp_path_factory) -> Path:
    """A libero_like-shaped dataset this session wrote itself (`write_libero_like`): for every
    test that reads a LeRobot dataset but is not about lerobot's own bytes."""
    return write_libero_like(tmp_path_factory.mktemp("datasets") / "libero_like")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """The session's nats-server, in operator mode as `nexus up` runs it (anonymous clients
    are refused). Its platform account exports every prefix's subjects (``*``), since each
    test has its own."""
    from transport.auth import AuthStore
    from transport.broker import EmbeddedBroker, free_port

    data_dir = tmp_path_factory.mktemp("nats")
    broker = EmbeddedBroker(data_dir=data_dir, port=free_port(), auth=AuthStore(data_dir, prefix="*"))
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    """The server's URL naming the platform's credentials file (``?creds=``): roles started
    on it (and test clients) log in as the platform, as under `nexus up`."""
    return nats_server.auth.platform().url(nats_server.url)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def make_layout(nats_url: str, prefix: str):
    """Create the streams and buckets of ``prefix`` on the server; return its Names."""
    from transport.bus import Bus
    from transport.layout import ensure_layout
    from protocol.subjects import Names

    names = Names(prefix)

    async def go():
        bus = await Bus.connect(nats_url, name="test-layout", reconnect_forever=False)
        try:
            await ensure_layout(bus.js, names)
        finally:
            await bus.close()

    asyncio.run(go())
    return names


@pytest.fixture
def layout(nats_url, prefix):
    """Create the streams and buckets for this test's prefix; return its Names."""
    return make_layout(nats_url, prefix)


def module_roles(nats_server, tmp_path_factory, name: str) -> "RoleProcs":
    """Role processes on a prefix of their own, for a module-scoped deployment (one set of
    roles shared by a module's tests); the caller starts the roles and calls `stop_all`."""
    url = nats_server.auth.platform().url(nats_server.url)
    names = make_layout(url, f"t{uuid.uuid4().hex[:10]}")
    return RoleProcs(url, names.prefix, tmp_path_factory.mktemp(name))


def run_client(procs: "RoleProcs", body, timeout_s: float = 30):
    """``body(client)`` with an SDK client of ``procs``' deployment, connected for the call and
    closed after it; returns what ``body`` returns."""
    from sdk.client import AsyncClient

    async def go():
        c = await AsyncClient(procs.nats_url, procs.prefix, timeout_s=timeout_s).connect()
        try:
            return await body(c)
        finally:
            await c.close()

    return asyncio.run(go())


def python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def nexus_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sdk.cli", *args]


def nexus_run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """One `nexus` command in a child process, with NEXUS_* settings from ``env``."""
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout, env=python_env(**env))


def tenant_create(data_dir: Path, tenant: str, *flags: str) -> dict:
    """`nexus tenant create TENANT --json` on ``data_dir``'s deployment (asserted), its JSON:
    ``creds`` (the creds file), ``live`` and the account's limits."""
    import json

    out = nexus_run("tenant", "create", tenant, "--data-dir", str(data_dir), "--json", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def nexus_up(data_dir: Path, **env: str):
    """`nexus up --detach` in ``data_dir`` on a free port (operator mode), its `ClusterState`,
    and `nexus down` after; both asserted. ``env``: the deployment's NEXUS_* settings."""
    from transport.broker import free_port
    from transport.cluster import ClusterState

    up = nexus_run("up", "--detach", "--data-dir", str(data_dir), "--nats-port", str(free_port()), timeout=240, **env)
    assert up.returncode == 0, up.stdout + up.stderr
    state = ClusterState.read(data_dir)
    assert state is not None and state.ready and state.creds
    try:
        yield state
    finally:
        down = nexus_run("down", "--data-dir", str(data_dir), **env)
        assert down.returncode == 0, down.stdout + down.stderr


_ZYGOTE: list = []  # [Zygote] once started; [None] with --spawn=exec


def pytest_addoption(parser):
    parser.addoption("--spawn", choices=("fork", "exec"), default="fork",
                     help="how the `roles` fixture starts role processes: forked from a preloaded "
                          "process (tests/support/zygote.py, fast) or `python -m actors.run` (as `nexus up` does)")


def pytest_configure(config):
    _ZYGOTE_MODE.append(config.getoption("--spawn"))


def pytest_unconfigure(config):
    for z in _ZYGOTE:
        if z is not None:
            z.close()


_ZYGOTE_MODE: list[str] = []


def _zygote():
    """The session's zygote, started at the first role start (None with --spawn=exec)."""
    if not _ZYGOTE:
        if _ZYGOTE_MODE and _ZYGOTE_MODE[0] == "exec":
            _ZYGOTE.append(None)
        else:
            import tempfile

            from tests.support.zygote import Zygote

            sock = Path(tempfile.mkdtemp(prefix="nexus-zygote-")) / "z.sock"
            _ZYGOTE.append(Zygote(sock, python_env()))
    return _ZYGOTE[0]


class RoleProcs:
    """Role processes started for one test against the session's nats-server."""

    def __init__(self, nats_url: str, prefix: str, data_dir: Path) -> None:
        self.nats_url, self.prefix, self.data_dir = nats_url, prefix, data_dir
        self.procs: list[tuple[str, str, "subprocess.Popen"]] = []
        self._n = 0

    def __enter__(self) -> "RoleProcs":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_all()  # a module fixture's roles stop even when starting one of them failed

    def start(self, role: str, **env: str) -> "subprocess.Popen":
        import subprocess

        self._n += 1
        instance = f"{role}-{self._n}"
        log = open(self.data_dir / f"{instance}.log", "ab")  # noqa: SIM115 - closed with the process
        argv = [role, "--nats-url", self.nats_url, "--prefix", self.prefix, "--data-dir", str(self.data_dir),
                "--instance", instance]
        role_env = python_env(NEXUS_HEARTBEAT_INTERVAL_S="0.3", NEXUS_HEALTH_TIMEOUT_S="1.2", **env)
        zygote = _zygote()
        if zygote is not None:  # forked from the preloaded model core (tests/support/zygote.py says why)
            log.close()
            proc = zygote.spawn(argv, role_env, os.getcwd(), self.data_dir / f"{instance}.log")
        else:
            proc = subprocess.Popen([sys.executable, "-m", "actors.run", *argv], env=role_env,
                                    stdout=log, stderr=subprocess.STDOUT)
        proc.instance = instance  # type: ignore[attr-defined]
        self.procs.append((role, instance, proc))
        self.wait_ready(role, instance, proc)
        return proc

    def wait_ready(self, role: str, instance: str, proc, timeout_s: float = 60) -> None:
        import time

        from protocol.errors import NexusError
        from protocol.messages import InfoRequest
        from transport.bus import Bus

        async def ping():
            bus = await Bus.connect(self.nats_url, name="test-wait", reconnect_forever=False, prefix=self.prefix)
            try:
                deadline = time.monotonic() + timeout_s
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{instance} exited with {proc.returncode}: {self.log(instance)[-3000:]}")
                    try:
                        info = await bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=2)
                        if info.state == "ready":
                            return
                    except NexusError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{instance} not ready: {self.log(instance)[-3000:]}")
                    await asyncio.sleep(0.1)
            finally:
                await bus.close()

        asyncio.run(ping())

    def log(self, instance: str) -> str:
        path = self.data_dir / f"{instance}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        """Stop in the stages `nexus down` uses: workers (they hand work back and send their
        last usage report to the master), then the master, then health and monitor."""
        import signal

        stages = (("env", "trainer", "inferencer"), ("master",), None)
        for stage in stages:
            procs = [p for role, _, p in reversed(self.procs) if stage is None or role in stage]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except Exception:
                    proc.kill()
                    proc.wait(timeout=30)  # SIGKILL cannot be caught: this only waits for the reap


@pytest.fixture
def roles(nats_url, layout, tmp_path):
    procs = RoleProcs(nats_url, layout.prefix, tmp_path)
    yield procs
    procs.stop_all()
