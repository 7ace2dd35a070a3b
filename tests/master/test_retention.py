"""Bounded history on a real master: list ops paged past NATS's max payload, finished records
compacted after their retention with usage totals kept, usage labels capped per tenant, usage
reports split to fit, and no silent loss (an intake message that keeps failing is rejected with
an event; a lifecycle change KV refused is written once KV takes it)."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import time

from nats.js.api import StreamConfig

from actors.metering import Meter, flush
from protocol import ops
from protocol.messages import (UsageCounters, UsageEntry, UsageReport, WorkloadEvent, WorkloadsRequest)
from protocol.policy import COMPACTED_LABEL, LIST_PAGE_DEFAULT, OTHER_LABEL
from protocol.wire import decode, encode
from sdk.client import AsyncClient
from tests.conftest import nexus_cmd, python_env
from tests.master.test_workloads import sft_spec


def _client(roles) -> AsyncClient:
    return AsyncClient(roles.nats_url, roles.prefix, timeout_s=30)


async def _finished(c: AsyncClient, tenant: str, n: int) -> list[str]:
    """``n`` cancelled workloads of ``tenant`` through the master's own submit / cancel path
    (no env worker runs: each is pending until cancelled)."""
    out = []
    for _ in range(n):
        wl = await c.submit(sft_spec(tenant))
        await wl.cancel()
        out.append(wl.id)
    return out


async def _report(c: AsyncClient, seq: int, entries: list[tuple[str, str, int]], instance: str = "test-meter") -> None:
    await c.bus.call(ops.MASTER_USAGE_REPORT, UsageReport(
role="inferencer", instance=instance, seq=seq,
entries=[UsageEntry(tenant=t, workload=w, usage=UsageCounters(requests=n)) for t, w, n in entries]))


def _requests(reply, tenant: str) -> int:
    return sum(r.usage.requests for r in reply.records if r.tenant == tenant)


def test_lists_are_paged_past_the_max_payload_and_reports_split(roles):
    roles.start("master")

    async def go():
        c = await _client(roles).connect()
        try:
            ids, size = [], 0
            while size < 1.2 * c.bus.max_payload:  # the whole history no longer fits in one reply
                ids += await _finished(c, "many", 50)
                size = sum(len(encode(w)) for w in await c.workloads("many"))
            every = await c.workloads()  # the client follows the cursor
            first = await c.bus.call(ops.MASTER_WORKLOADS, WorkloadsRequest())
            # A usage report far past the bound is split, each part acknowledged on its own.
            meter = Meter()
            for i in range(6000):
                meter.add_bytes(f"tenant{i:05d}", "", 3)
            while meter.has_work():
                assert await flush(c.bus, c.names, meter, "trainer", "t-split", 10.0, _Log())
            usage = await c.usage()
            return ids, every, first, meter, usage, c.bus.max_payload
        finally:
            await c.close()

    ids, every, first, meter, usage, max_payload = asyncio.run(go())
    assert [w.workload for w in every] == ids and all(w.state == "cancelled" for w in every)
    assert len(first.workloads) == LIST_PAGE_DEFAULT and first.next_cursor  # an old caller: the default page
    assert len(encode(first)) < max_payload
    assert meter.splits >= 1 and meter.reports_acked >= 2
    stored = {r.tenant: r.usage.stored_bytes for r in usage.records if r.tenant.startswith("tenant")}
    assert len(stored) == 6000 and set(stored.values()) == {3}
    # The CLI shows every one of them (it follows the cursor too).
    out = subprocess.run(nexus_cmd("workloads", "list", "--json", "--nats-url", roles.nats_url,
                                   "--prefix", roles.prefix), env=python_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)) == len(ids)


class _Log:
    def warning(self, *a, **k):
        pass

    error = warning


def test_finished_records_compacted_with_usage_totals_kept_and_labels_capped(roles):
    roles.start("master", NEXUS_RETENTION_S="3", NEXUS_COMPACT_EVERY_S="0.5", NEXUS_USAGE_LABELS_MAX="3")

    async def go():
        c = await _client(roles).connect()
        try:
            old = await _finished(c, "keep", 3)
            await _report(c, 1, [("keep", w, 10) for w in old])
            # Five labels a client chose: three get their own record, the rest are `other`.
            await _report(c, 2, [("keep", f"label{i}", 1) for i in range(5)])
            before = await c.usage("keep")
            deadline = time.monotonic() + 60
            while {w.workload for w in await c.workloads("keep")} & set(old) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            after_wl = await c.workloads("keep")
            new = await _finished(c, "keep", 1)  # a fresh one stays until its own retention
            while any(r.workload.startswith("label") or r.workload == OTHER_LABEL
                      for r in (await c.usage("keep")).records) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            after = await c.usage("keep")
            return old, before, after_wl, new, after, await c.workloads("keep")
        finally:
            await c.close()

    old, before, after_wl, new, after, now_wl = asyncio.run(go())
    labels = sorted(r.workload for r in before.records if not r.workload.startswith("w"))
    assert labels == ["label0", "label1", "label2", OTHER_LABEL]
    assert next(r for r in before.records if r.workload == OTHER_LABEL).usage.requests == 2
    assert _requests(before, "keep") == 35
    assert not {w.workload for w in after_wl} & set(old)  # compacted from memory and KV
    assert [w.workload for w in now_wl] == new
    # Every record folded into one, the tenant's total unchanged.
    assert [r.workload for r in after.records] == [COMPACTED_LABEL]
    assert _requests(after, "keep") == 35


def _kv_stream(c: AsyncClient) -> str:
    return f"KV_{c.names.kv_workloads}"


async def _set_max_msg_size(c: AsyncClient, size: int) -> None:
    info = await c.bus.js.stream_info(_kv_stream(c))
    cfg: StreamConfig = info.config
    cfg.max_msg_size = size
    await c.bus.js.update_stream(cfg)


def test_no_silent_loss_when_the_workloads_store_refuses(roles):
    """The workloads bucket refuses every write (its max message size shrunk): an intake spec
    is rejected with an event after its last delivery; a `done` is not applied in memory
    until KV takes it, and is, once it can."""
    roles.start("master")

    async def go():
        c = await _client(roles).connect()
        events: list[WorkloadEvent] = []

        async def on_event(msg):
            events.append(decode(msg.data, WorkloadEvent))

        await c.bus.nc.subscribe(c.names.workload_events_all, cb=on_event)
        try:
            wl = await c.submit(sft_spec("solid"))
            await _set_max_msg_size(c, 64)
            try:
                spec = copy.deepcopy(sft_spec("flaky"))
                ack = await c.bus.js.publish(c.names.workloads_submit, json.dumps(spec).encode())
                intake = f"i{ack.seq:010d}"
                done = WorkloadEvent(workload=wl.id, tenant="solid", kind="done", state="completed",
                                     message="budget reached", at=time.time())
                await c.bus.publish(c.names.workload_events(wl.id), done)
                await asyncio.sleep(3)
                during = await c.workload(wl.id)
                deadline = time.monotonic() + 90
                while not any(e.workload == intake and e.kind == "rejected" for e in events):
                    assert time.monotonic() < deadline, "no rejected event for the intake message"
                    await asyncio.sleep(0.5)
            finally:
                await _set_max_msg_size(c, -1)
            deadline = time.monotonic() + 60
            while (await c.workload(wl.id)).state != "completed":
                assert time.monotonic() < deadline, "the done event was never saved"
                await asyncio.sleep(0.5)
            kv = await c.bus.js.key_value(c.names.kv_workloads)
            from protocol.messages import WorkloadRecord

            stored = decode((await kv.get(wl.id)).value, WorkloadRecord)
            return during, [e for e in events if e.workload == intake], stored
        finally:
            await c.close()

    during, intake_events, stored = asyncio.run(go())
    assert during.state == "pending"  # memory kept what KV had
    rejected = [e for e in intake_events if e.kind == "rejected"]
    assert len(rejected) == 1 and "after 5 attempts" in rejected[0].message and "max_deliver=5" in rejected[0].message
    assert rejected[0].tenant == "flaky"
    assert stored.state == "completed"


def test_tenant_delete_removes_all_of_its_state(roles):
    """Records, usage, reports, recorded datasets and the TensorBoard run; a tenant whose name
    extends the deleted one's keeps its own."""
    roles.start("master")
    data = roles.data_dir

    async def go():
        c = await _client(roles).connect()
        try:
            gone = await _finished(c, "a", 2)
            kept = await _finished(c, "a-b", 1)
            await _report(c, 1, [("a", gone[0], 4), ("a", "mylabel", 1), ("a-b", kept[0], 2)])
            # What the workflows and the monitor write for a tenant (workflows/sft.py, actors/monitor/boards.py).
            for name in (f"a-{gone[0]}", f"a-b-{kept[0]}", "tenants/a", "tenants/a-b", "published/a"):
                (data / "datasets" / name / "meta").mkdir(parents=True)
            for tenant in ("a", "a-b"):
                (data / "tensorboard" / tenant).mkdir(parents=True)
            reports_before = sorted(str(p.relative_to(data / "reports")) for p in (data / "reports").rglob("*.json"))
            deleted = await c.delete_tenant("a")
            return gone, kept, reports_before, deleted, await c.usage(), await c.workloads()
        finally:
            await c.close()

    gone, kept, reports_before, deleted, usage, workloads = asyncio.run(go())
    # A cancel writes the report, under the tenant's own reports dir.
    assert reports_before == sorted([*(f"a/{w}.json" for w in gone), *(f"a-b/{w}.json" for w in kept)])
    assert deleted.removed["workloads"] == 2 and deleted.removed["usage"] == 2
    assert deleted.removed["reports"] == 2 and deleted.removed["datasets"] == 2 and deleted.removed["boards"] == 1
    assert sorted(str(p.relative_to(data / "reports")) for p in (data / "reports").rglob("*.json")) == \
        [f"a-b/{kept[0]}.json"]
    assert sorted(p.name for p in (data / "datasets").iterdir()) == [f"a-b-{kept[0]}", "published", "tenants"]
    assert sorted(p.name for p in (data / "datasets" / "tenants").iterdir()) == ["a-b"]
    assert (data / "datasets" / "published" / "a").is_dir()  # the operator's, not tenant a's
    assert sorted(p.name for p in (data / "tensorboard").iterdir()) == ["a-b"]
    assert {r.tenant for r in usage.records} == {"a-b"} and [w.workload for w in workloads] == kept


def test_auth_store_removes_a_deleted_tenants_account(tmp_path):
    from transport.auth import AuthStore

    store = AuthStore(tmp_path)
    store.ensure()
    creds = store.add_tenant("acct")
    store.add_tenant("other")
    store.revoke_tenant("acct")
    assert not creds.exists()
    store.add_tenant("acct")  # issued again, then deleted for good
    removed = store.remove_tenant("acct")
    assert removed == {"accounts": 1, "creds": 1}
    assert not store.tenant_creds("acct").exists() and store.tenant_creds("other").exists()
    assert store.tenants() == ["other"]
    conf = store.accounts_conf.read_text()
    assert "other" in json.dumps(json.loads(store.state_path.read_text())["tenants"])
    assert "acct" not in json.loads(store.state_path.read_text())["tenants"]
    assert store.remove_tenant("acct") == {"accounts": 0, "creds": 0}
    assert conf == store.accounts_conf.read_text()
