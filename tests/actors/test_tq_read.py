"""Reading a job's partition back by index: paging returns every item once, in order, and
costs one stream read per item (the reader remembers where item i sits in the stream)."""

from __future__ import annotations

import asyncio

from actors.tq_read import PartitionReader, read_job_items
from sdk.client import AsyncClient
from tests.support.tq_helpers import micro_batch, tenant

N_ITEMS, PAGE = 40, 5


def test_paging_forty_items_five_at_a_time(roles):
    roles.start("master")
    cfg = tenant("pages", sft_prefetch_items=64)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            job = await c.reserve(cfg.name, "sft")
            noise = await c.reserve(cfg.name, "sft")  # another job's items interleaved in the stream
            for seq in range(N_ITEMS):
                await c.queue_put(micro_batch(cfg, job.job, seq, b=1))
                if seq % 3 == 0:
                    await c.queue_put(micro_batch(cfg, noise.job, seq, b=1))
            rec = await c.job(cfg.name, job.job)
            # Through the master's queue_get, page by page.
            pages, start = [], 0
            while True:
                back = await c.queue_get(cfg.name, job.job, start=start, max_items=PAGE)
                if not back.items:
                    break
                assert back.total == N_ITEMS and len(back.items) <= PAGE
                pages.append([i.seq for i in back.items])
                start += len(back.items)
            # The reader itself, in this process: count the stream reads paging costs.
            reader = PartitionReader(c.bus, c.names)
            direct = []
            for start in range(0, N_ITEMS, PAGE):
                direct += [i.seq for i in await reader.read(rec, start, PAGE)]
            linear_gets = reader.gets
            tail = await reader.read(rec, N_ITEMS, PAGE)  # past the end: empty
            # Out of order: a page far ahead first, then one already passed (remembered).
            fresh = PartitionReader(c.bus, c.names)
            ahead = [i.seq for i in await fresh.read(rec, 30, PAGE)]
            behind = [i.seq for i in await fresh.read(rec, 10, PAGE)]
            whole = [i.seq for i in await read_job_items(c.bus, c.names, rec, 0, rec.items)]
            return rec, pages, direct, linear_gets, tail, ahead, behind, whole
        finally:
            await c.close()

    rec, pages, direct, linear_gets, tail, ahead, behind, whole = asyncio.run(go())
    assert rec.items == N_ITEMS
    assert [s for page in pages for s in page] == list(range(N_ITEMS))
    assert all(len(p) == PAGE for p in pages)
    assert direct == whole == list(range(N_ITEMS))
    # One get per item (each page starts at its remembered first item), not a walk from the
    # partition's start per page (which would be 5 + 10 + ... + 40 = 220 gets).
    assert linear_gets == N_ITEMS, linear_gets
    assert tail == []
    assert ahead == list(range(30, 35)) and behind == list(range(10, 15))
