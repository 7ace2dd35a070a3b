"""Splitting a training-queue put that is over the max payload into power-of-two row slices
(docs/training_queue.md): each part is its own stored message, its seq from `chunk_seq`.
`AsyncClient.queue_put` (sdk/client.py) calls `split_item`."""

from __future__ import annotations

import msgspec

from protocol.errors import PayloadTooLarge
from protocol.wire import encode
from protocol.messages import MAX_CHUNK_PARTS_LOG2, QueuePutRequest, chunk_seq


def split_item(item: QueuePutRequest, max_bytes: int) -> list[QueuePutRequest]:
    """The fewest power-of-two parts of ``item`` whose every encoding fits ``max_bytes``."""
    b = len(item.instructions)
    for log2 in range(1, MAX_CHUNK_PARTS_LOG2 + 1):
        parts = 1 << log2
        size = -(-b // parts)
        # Always exactly ``parts`` slices (the last ones may be empty when b < parts: skipped).
        bounds = [(k * size, min((k + 1) * size, b)) for k in range(parts)]
        chunks = [_slice_item(item, lo, hi, chunk_seq(item.seq, log2, k)) for k, (lo, hi) in enumerate(bounds)
                  if lo < hi]
        if all(len(encode(c)) <= max_bytes for c in chunks):
            return chunks
        if size <= 1:
            break
    raise PayloadTooLarge(f"one row of item seq={item.seq} of job {item.job} is over the max payload "
                          f"({max_bytes} bytes with headroom); shrink the images or send fewer cameras",
                          details={"max_bytes": max_bytes})


def _slice_item(item: QueuePutRequest, lo: int, hi: int, seq: int) -> QueuePutRequest:
    def cut(x):
        return None if x is None else x[lo:hi]

    # `replace`: the per-row fields are sliced, every other field (behaviour_version, the KL
    # term's kl_coef and anchor_version, one added later) is the item's own in every part.
    return msgspec.structs.replace(
        item, seq=seq,
        images={k: v[lo:hi] for k, v in item.images.items()}, state=item.state[lo:hi],
        instructions=item.instructions[lo:hi], actions=item.actions[lo:hi],
        old_log_prob=cut(item.old_log_prob), advantages=cut(item.advantages), returns=cut(item.returns),
    )
