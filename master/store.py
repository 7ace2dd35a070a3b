"""The master's KV reads and writes: whole-bucket loads checked against the stream, retried puts."""

from __future__ import annotations

import asyncio

import structlog
from nats.js.errors import NoKeysError

from transport.bus import js_retry
from protocol.policy import KV_LOAD, KV_LOAD_ENTRY_TIMEOUT_S


async def store_put(kv, key: str, value: bytes) -> None:
    """A KV write that rides out a NATS leader election (`protocol.policy.STORE_WRITE`)."""
    await js_retry(kv.put, key, value)


async def kv_items(kv) -> list[tuple[str, bytes]]:
    """Every live (key, value) of a KV bucket, in key order, through one watcher: a restarting
    master loads thousands of records in one pass instead of a request per key.

    nats.py ends a watch's initial values on the consumer's first ``num_pending``; right after
    a NATS node came back that once said 0 for a bucket of 59 job records, the master started
    with no jobs and trained some twice. So the read is checked against the stream: the last
    message it held before the watch began is the newest of its key (a value, delete or purge
    marker), which the watch must deliver; a read that stops short is taken again
    (`KV_LOAD`), then fails loudly."""
    for attempt in range(1, KV_LOAD.attempts + 1):
        state = (await js_retry(kv.status)).stream_info.state
        items, newest = await _kv_read(kv)
        if state.messages == 0 or newest >= state.last_seq:
            return items
        structlog.get_logger().warning("short KV read; reading again", bucket=kv._name, attempt=attempt, got=len(items),
                    newest_seq=newest, stream_last_seq=state.last_seq)
        if attempt < KV_LOAD.attempts:
            await asyncio.sleep(KV_LOAD.delay(attempt))
    raise RuntimeError(f"KV bucket {kv._name}: {KV_LOAD.attempts} reads stopped short of the stream's last "
                       f"sequence {state.last_seq} (newest seen {newest}); not starting on a partial state")


async def _kv_read(kv) -> tuple[list[tuple[str, bytes]], int]:
    """(live items sorted by key, the newest revision seen, markers included)."""
    watcher = await kv.watchall()
    out: list[tuple[str, bytes]] = []
    newest = 0
    try:
        while True:
            entry = await watcher.updates(timeout=KV_LOAD_ENTRY_TIMEOUT_S)
            if entry is None:  # the end of the current values
                break
            newest = max(newest, entry.revision or 0)
            if entry.operation is None and entry.value:  # not a delete or purge marker
                out.append((entry.key, entry.value))
    finally:
        await watcher.stop()
    return sorted(out, key=lambda item: item[0]), newest


async def kv_values(kv) -> list[bytes]:
    return [value for _, value in await kv_items(kv)]


async def kv_keys(kv) -> list[str]:
    """Sorted keys of a KV bucket (empty bucket: [])."""
    try:
        return sorted(await kv.keys())
    except NoKeysError:
        return []
