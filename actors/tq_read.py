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

    steps = join_parts(items)   # the trainer: one micro-batch (one optimizer step) per put item

A micro-batch over the max payload is stored as parts (`sdk.client.AsyncClient.queue_put`,
seqs from `protocol.messages.chunk_seq`); `join_parts` concatenates them back, so the trainer
takes one optimizer step on exactly the rows the workflow put, as if it had fit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np
from nats.js.errors import NotFoundError

from transport.bus import js_retry
from protocol.messages import MAX_STEP_ROWS, JobRecord, QueuePutRequest, chunk_parts
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


def join_parts(items: list[QueuePutRequest]) -> list[QueuePutRequest]:
    """The micro-batches ``items`` hold, in order: the parts of one split item (same item seq,
    same part count) joined back into that item, rows in part order.

    Why join, not accumulate per part: the joined item is the very micro-batch the workflow put
    (bit-equal arrays), so its step is the unsplit step by construction (the loss is the mean
    over all its rows, RL statistics are over the whole micro-batch), it counts once in the
    tenant's version and the workload's step budget, and nothing downstream of the queue needs
    to know that a split ever happened. The parts are already in the trainer's memory (it reads
    a job whole), so joining costs one copy of one micro-batch.

    Exactly-once is unchanged: each part is deduplicated on its own seq when it is put. A part
    that is missing (its workflow died half-way through a split and the job was sealed) leaves
    a smaller micro-batch of the parts that were stored; it still trains as one step, as
    `JobRecord.steps` counted it."""
    groups: dict[object, list[QueuePutRequest]] = {}
    for k, item in enumerate(items):
        parts = chunk_parts(item.seq)
        # An ordinary item is a group of its own (keyed by its position: equal seqs of
        # ordinary items are distinct micro-batches, dedup refused true repeats at the put).
        groups.setdefault(("item", k) if parts is None else ("parts", parts[0], parts[1]), []).append(item)
    out = []
    for group in groups.values():  # dicts keep insertion order: a step sits where its first part was
        if len(group) == 1:
            out.append(group[0])
            continue
        group.sort(key=lambda it: chunk_parts(it.seq)[2])  # type: ignore[index]
        first = group[0]
        rows = sum(len(it.instructions) for it in group)
        if rows > MAX_STEP_ROWS:  # counted before anything is copied
            raise ValueError(f"micro-batch {chunk_parts(first.seq)[0]} is stored as {len(group)} parts "  # type: ignore[index]
                             f"of {rows} rows in all; one optimizer step takes at most {MAX_STEP_ROWS}")

        def cat(get, group=group):
            xs = [get(it) for it in group]
            return None if any(x is None for x in xs) else np.concatenate(xs)

        # `replace`: a field added to QueuePutRequest later keeps the first part's value.
        out.append(msgspec.structs.replace(
            first, seq=chunk_parts(first.seq)[0],  # type: ignore[index]
            images={c: np.concatenate([it.images[c] for it in group]) for c in first.images},
            state=cat(lambda it: it.state), instructions=[s for it in group for s in it.instructions],
            actions=cat(lambda it: it.actions), old_log_prob=cat(lambda it: it.old_log_prob),
            advantages=cat(lambda it: it.advantages), returns=cat(lambda it: it.returns),
            behaviour_version=min(it.behaviour_version for it in group),
        ))
    return out
