"""A restarting master reads each KV bucket whole (`master.store.kv_items`), on a real
nats-server: every live key, none of the deleted or purged ones, and a read that stops short
of the stream's last sequence is taken again, then refused (issue 24: a master once loaded 0 of
59 job records just after a NATS node came back, and trained steps twice)."""

from __future__ import annotations

import asyncio

import pytest

import master.store as store
from transport.bus import Bus


def _run(nats_url, layout, body):
    async def go():
        bus = await Bus.connect(nats_url, name="test-kv-load", reconnect_forever=False)
        try:
            kv = await bus.js.key_value(layout.kv_jobs)
            return await body(kv)
        finally:
            await bus.close()

    return asyncio.run(go())


def test_reads_every_live_key_and_no_deleted_one(nats_url, layout):
    async def body(kv):
        for i in range(40):
            await kv.put(f"t.j{i:02d}", f"v{i}".encode())
        await kv.put("t.j05", b"v5-again")  # a second revision: the newest wins
        await kv.delete("t.j10")
        await kv.purge("t.j39")  # the stream's last message is a purge marker
        return await store.kv_items(kv)

    items = _run(nats_url, layout, body)
    keys = [k for k, _ in items]
    assert len(items) == 38 and "t.j10" not in keys and "t.j39" not in keys
    assert keys == sorted(keys) and dict(items)["t.j05"] == b"v5-again"


def test_an_empty_bucket_reads_empty(nats_url, layout):
    assert _run(nats_url, layout, store.kv_items) == []


def test_a_short_read_is_read_again_then_refused(nats_url, layout, monkeypatch):
    real = store._kv_read
    calls = []

    async def short_once(kv):
        calls.append(1)
        items, newest = await real(kv)
        return ([], 0) if len(calls) == 1 else (items, newest)  # the first read saw nothing

    async def fill(kv):
        for i in range(5):
            await kv.put(f"t.j{i}", b"x")
        return await store.kv_items(kv)

    monkeypatch.setattr(store, "_kv_read", short_once)
    assert len(_run(nats_url, layout, fill)) == 5 and len(calls) == 2

    async def always_short(kv):
        calls.append(1)
        return [], 0

    monkeypatch.setattr(store, "_kv_read", always_short)
    monkeypatch.setattr(store, "KV_LOAD", store.KV_LOAD.__class__("kv_load", attempts=3, backoff_s=0.01,
                                                                  max_backoff_s=0.01))
    calls.clear()
    with pytest.raises(RuntimeError, match="3 reads stopped short of the stream's last sequence"):
        _run(nats_url, layout, store.kv_items)
    assert len(calls) == 3
