"""The blocking SDK: `Client` runs an `AsyncClient` (sdk/client.py) on a private event-loop
thread, and `Workload` is the blocking twin of `AsyncWorkload`.

    from sdk import Client
    with Client.from_data_dir(".nexus") as c:
        w = c.submit("examples/sft_reach.yaml")
        w.wait(progress=True)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from transport.bus import DEFAULT_REQUEST_TIMEOUT_S
from protocol.messages import ClusterStatus, ListReply, RoleInfo, WorkloadRecord
from protocol.subjects import DEFAULT_PREFIX

from sdk.client import AsyncClient, AsyncWorkload, resolve_cluster

T = TypeVar("T")


class Workload:
    """Blocking twin of `AsyncWorkload` (what `Client.submit` returns)."""

    def __init__(self, client: Client, handle: AsyncWorkload) -> None:
        self._client, self._h = client, handle
        self.id, self.tenant = handle.id, handle.tenant

    def __repr__(self) -> str:
        return repr(self._h)

    def status(self) -> WorkloadRecord:
        return self._client._run(self._h.status())

    def metrics(self) -> dict[str, float]:
        return self._client._run(self._h.metrics())

    def cancel(self) -> WorkloadRecord:
        return self._client._run(self._h.cancel())

    def wait(self, progress: bool = False, timeout_s: float = 3600.0) -> WorkloadRecord:
        return self._client._run(self._h.wait(progress=progress, timeout_s=timeout_s))

    def download_policy(self, version: int | None = None, out_dir: str | Path = ".") -> tuple[Path, Path]:
        return self._client._run(self._h.download_policy(version, out_dir))


class Client:
    """Blocking facade: runs an `AsyncClient` on a private event-loop thread."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, creds: str | Path | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nexus-sdk", daemon=True)
        self._thread.start()
        self._async = AsyncClient(url, prefix, timeout_s, creds=creds)
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

    def submit(self, spec: dict[str, Any] | str | bytes | Path) -> Workload:
        return Workload(self, self._run(self._async.submit(spec)))

    def workload_handle(self, workload: str, tenant: str = "") -> Workload:
        return Workload(self, self._async.workload_handle(workload, tenant))

    def __getattr__(self, name: str) -> Any:
        # Every other AsyncClient coroutine method, run to completion on the client's loop.
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._async, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(attr(*args, **kwargs))

        call.__doc__ = attr.__doc__
        return call

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
