"""`InferencerConfig`: what one inferencer batches and holds at once. Every default comes from
the NEXUS_INFER_* variables' settings (`protocol.settings.InferencerSettings`, with its reason
there); `from_env` reads them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from protocol.settings import InferencerSettings

_ENV_DEFAULTS = InferencerSettings()


@dataclass
class InferencerConfig:
    """Batching, and the bounds of what one inferencer holds at once and remembers.

    A group fires when it holds ``max_batch_size`` requests or its oldest has waited
    ``batch_wait_timeout_s``. Past either queue bound a request is answered `Busy` at once with a
    retry hint: a caller retrying elsewhere (or a moment later) is served sooner than one waiting
    behind a queue that cannot drain before its timeout, and the process never holds unbounded
    memory."""

    max_batch_size: int = _ENV_DEFAULTS.max_batch_size
    batch_wait_timeout_s: float = _ENV_DEFAULTS.batch_wait_timeout_s
    # Per key and in all (being admitted + queued, all keys).
    max_queue_per_key: int = _ENV_DEFAULTS.max_queue_per_key
    max_queued: int = _ENV_DEFAULTS.max_queued
    # The smallest Busy hint grows with the groups queued ahead of the caller, up to the largest.
    busy_retry_after_s: float = _ENV_DEFAULTS.busy_retry_after_s
    busy_max_retry_after_s: float = _ENV_DEFAULTS.busy_max_retry_after_s
    # Replies kept for replay: ~4096 x a few KB.
    reply_cache_size: int = _ENV_DEFAULTS.reply_cache_size
    reply_cache_ttl_s: float = _ENV_DEFAULTS.reply_cache_ttl_s
    # Copies of one request held at once; more is a flood, answered Busy.
    max_joined_per_request: int = _ENV_DEFAULTS.max_joined_per_request
    # One tenant's requests held at once (queued + in a forward): its flood leaves room for
    # the others' (the predict rate quota bounds how fast it sends, this how much it holds).
    max_queued_per_tenant: int = _ENV_DEFAULTS.max_queued_per_tenant

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 1024:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be in 1..1024")
        if not 0 <= self.batch_wait_timeout_s <= 10:
            raise ValueError(f"batch_wait_timeout_s={self.batch_wait_timeout_s}: must be in [0, 10]")
        if self.max_queue_per_key < 1:
            raise ValueError(f"max_queue_per_key={self.max_queue_per_key}: must be >= 1")
        if self.max_queued < self.max_queue_per_key:
            raise ValueError(f"max_queued={self.max_queued}: must be >= max_queue_per_key ({self.max_queue_per_key})")
        if not 0 < self.busy_retry_after_s <= self.busy_max_retry_after_s <= 60:
            raise ValueError(f"busy_retry_after_s={self.busy_retry_after_s}, busy_max_retry_after_s="
                             f"{self.busy_max_retry_after_s}: need 0 < busy_retry_after_s <= busy_max_retry_after_s <= 60")
        if self.reply_cache_size < 1:
            raise ValueError(f"reply_cache_size={self.reply_cache_size}: must be >= 1")
        if self.reply_cache_ttl_s <= 0:
            raise ValueError(f"reply_cache_ttl_s={self.reply_cache_ttl_s}: must be > 0")
        if self.max_joined_per_request < 1:
            raise ValueError(f"max_joined_per_request={self.max_joined_per_request}: must be >= 1")
        if self.max_queued_per_tenant < 1:
            raise ValueError(f"max_queued_per_tenant={self.max_queued_per_tenant}: must be >= 1")

    @classmethod
    def from_env(cls) -> InferencerConfig:
        env = InferencerSettings.from_env()
        return cls(**{f.name: getattr(env, f.name) for f in fields(cls)})
