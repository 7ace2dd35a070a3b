"""Shared fixtures: a real nats-server on a free port with a temporary JetStream store.

Never a mock of NATS: every test that touches the bus talks to this server. Each test gets
its own subject prefix, so tests share one server without seeing each other's traffic.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest

# One BLAS / torch thread per process (2 cores on CI); children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    from actors.broker import EmbeddedBroker, free_port

    broker = EmbeddedBroker(data_dir=tmp_path_factory.mktemp("nats"), port=free_port())
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def layout(nats_url, prefix):
    """Create the streams and buckets for this test's prefix; return its Names."""
    from actors.bus import Bus
    from actors.layout import ensure_layout
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


def python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def nexus_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sdk.cli", *args]
