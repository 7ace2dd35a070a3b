"""The tenant-facing SDK: an async client and a sync facade over it.

    from sdk import Client
    with Client.from_data_dir(".nexus") as c:      # or Client("nats://127.0.0.1:4222")
        for row in c.status().roles:
            print(row.role, row.state)

`AsyncClient` has the same methods as coroutines. Both speak only NATS: the same calls work
against the embedded cluster and a remote one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from actors.bus import DEFAULT_REQUEST_TIMEOUT_S, Bus
from actors.supervisor import ClusterState
from protocol.errors import Unavailable
from protocol.messages import (
    ClusterStatus,
    InfoRequest,
    ListReply,
    ListRequest,
    RoleInfo,
    StatusRequest,
)
from protocol.subjects import DEFAULT_PREFIX, Names

T = TypeVar("T")


def resolve_cluster(data_dir: str | Path | None, nats_url: str | None, prefix: str | None) -> tuple[str, str]:
    """Find (nats_url, prefix): an explicit URL wins, else ``<data_dir>/cluster.json``."""
    if nats_url:
        return nats_url, prefix or DEFAULT_PREFIX
    data_dir = Path(data_dir or ".nexus")
    state = ClusterState.read(data_dir)
    if state is None:
        raise Unavailable(
            f"no cluster found in {data_dir} ({data_dir / 'cluster.json'} is missing): "
            "start one with `nexus up`, or pass --nats-url / --data-dir"
        )
    return state.nats_url, prefix or state.prefix


class AsyncClient:
    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.url = url
        self.names = Names(prefix)
        self.timeout_s = timeout_s
        self._bus: Bus | None = None

    async def connect(self) -> AsyncClient:
        if self._bus is None:
            self._bus = await Bus.connect(self.url, name="sdk", reconnect_forever=False)
        return self

    async def close(self) -> None:
        if self._bus is not None:
            await self._bus.close()
            self._bus = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise Unavailable("client is not connected: use `async with AsyncClient(...)` or await connect()")
        return self._bus

    async def status(self, include_dead: bool = True) -> ClusterStatus:
        return await self.bus.request(self.names.role_op("monitor", "status"),
                                      StatusRequest(include_dead=include_dead), ClusterStatus,
                                      timeout_s=self.timeout_s)

    async def info(self, role: str, instance: str | None = None) -> RoleInfo:
        subject = (self.names.instance_op(role, instance, "info") if instance
                   else self.names.role_op(role, "info"))
        return await self.bus.request(subject, InfoRequest(), RoleInfo, timeout_s=self.timeout_s)

    async def list(self) -> ListReply:
        return await self.bus.request(self.names.master("list"), ListRequest(), ListReply,
                                      timeout_s=self.timeout_s)


class Client:
    """Blocking facade: runs an `AsyncClient` on a private event-loop thread."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nexus-sdk", daemon=True)
        self._thread.start()
        self._async = AsyncClient(url, prefix, timeout_s)
        try:
            self._run(self._async.connect())
        except BaseException:
            self._shutdown_loop()
            raise

    @classmethod
    def from_data_dir(cls, data_dir: str | Path = ".nexus", **kw: Any) -> Client:
        url, prefix = resolve_cluster(data_dir, None, None)
        return cls(url, prefix, **kw)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def status(self, include_dead: bool = True) -> ClusterStatus:
        return self._run(self._async.status(include_dead))

    def info(self, role: str, instance: str | None = None) -> RoleInfo:
        return self._run(self._async.info(role, instance))

    def list(self) -> ListReply:
        return self._run(self._async.list())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
