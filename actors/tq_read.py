"""Read a job's partition of the training queue back by item index, without consuming it.

    reader = PartitionReader(bus, names)
    page = await reader.read(job, start=0, max_items=5)    # items 0..4
    page = await reader.read(job, start=5, max_items=5)    # items 5..9: starts where 0..4 ended
    items = await read_job_items(bus, names, job, 0, job.items)   # one-shot (the trainer)

A partition is the job's subject in its tenant's stream; item i is the i-th message on that
subject in stream order. JetStream answers "the next message on this subject at or after
sequence s" (``get_msg(next=True)``), not "the i-th": so the reader remembers the stream
sequence of every item it has passed, per job, and a page that starts at item i starts at
that item's sequence. Reading a partition page by page then costs one get per item, not a
walk from the stream's first message for every page.

A partition only grows (new messages get higher sequences) until its job is cleared and the
subject purged; a remembered sequence that no longer holds the item it held (purged, refilled)
is noticed on the next read, which then forgets the job's sequences and walks afresh.

Shared by the master (``queue_get``) and the trainer (a leased job's data): a helper two roles
use, below both, so neither imports the other (STYLE.md practice 14).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from nats.js.errors import NotFoundError

from actors.bus import js_retry

from protocol.messages import JobRecord, QueuePutRequest
from protocol.subjects import Names
from protocol.wire import decode

# Jobs whose item sequences are remembered: a job's list is one int per item (a few KB for
# thousands of items); 256 covers every job a master pages at once, least recently read go.
MAX_JOBS_REMEMBERED = 256


class PartitionReader:
    def __init__(self, bus: Any, names: Names, max_jobs: int = MAX_JOBS_REMEMBERED) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs={max_jobs}: must be >= 1")
        self.bus, self.names, self.max_jobs = bus, names, max_jobs
        self._seqs: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self.gets = 0  # get_msg calls made (a test checks paging costs one per item)

    def _known(self, job: JobRecord) -> list[int]:
        key = (job.tenant, job.job)
        seqs = self._seqs.pop(key, [])
        self._seqs[key] = seqs  # most recently read last
        while len(self._seqs) > self.max_jobs:
            self._seqs.popitem(last=False)
        return seqs

    async def read(self, job: JobRecord, start: int, max_items: int) -> list[QueuePutRequest]:
        """Items ``start .. start + max_items - 1`` of the job's partition (fewer at its end)."""
        if start < 0 or max_items < 0:
            raise ValueError(f"start={start}, max_items={max_items}: must be >= 0")
        stream, subject = self.names.tq_stream(job.tenant), self.names.tq_job(job.tenant, job.job)
        seqs = self._known(job)
        items: list[QueuePutRequest] = []
        # Begin at item `start` if its sequence is known, else after the last known item.
        index = min(start, len(seqs))
        seq = seqs[index] if index < len(seqs) else (seqs[-1] + 1 if seqs else 1)
        while len(items) < max_items:
            self.gets += 1
            try:
                # Rides out the stream's leader election (a node lost): the read is idempotent.
                raw = await js_retry(self.bus.js.get_msg, stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            if index < len(seqs) and raw.seq != seqs[index]:
                # The partition changed under a remembered sequence: forget it, walk afresh.
                seqs.clear()
                items.clear()
                index, seq = 0, 1
                continue
            if index == len(seqs):
                seqs.append(raw.seq)
            if index >= start:
                items.append(decode(raw.data, QueuePutRequest))
            index += 1
            seq = raw.seq + 1
        return items


async def read_job_items(bus: Any, names: Names, job: JobRecord, start: int, max_items: int) -> list[QueuePutRequest]:
    """One read of a job's items, remembering nothing (a trainer reads a job once)."""
    return await PartitionReader(bus, names, max_jobs=1).read(job, start, max_items)
