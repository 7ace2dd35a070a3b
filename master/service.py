"""Master: tenant registry, workload lifecycle and scheduling (grows with issues 4 and 6).

Serves ``<prefix>.master.<op>``. Today: ``info`` (every role has it) and ``list``, which
reads the tenants and workloads KV buckets.

Run: ``python -m actors.run master --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

from actors.runtime import Role, op
from protocol.messages import ListReply, ListRequest


class Master(Role):
    name = "master"

    async def setup(self) -> None:
        assert self.bus is not None
        js = self.bus.js
        self.kv_tenants = await js.key_value(self.names.kv_tenants)
        self.kv_workloads = await js.key_value(self.names.kv_workloads)

    @op("list", ListRequest)
    async def list(self, req: ListRequest) -> ListReply:
        tenants = await _keys(self.kv_tenants)
        workloads = await _keys(self.kv_workloads)
        return ListReply(tenants=tenants, workloads=workloads)


async def _keys(kv) -> list[str]:
    from nats.js.errors import NoKeysError

    try:
        return sorted(await kv.keys())
    except NoKeysError:
        return []
