"""Per-tenant token buckets: the inferencer's predict rate quota.

    buckets = TenantBuckets()
    wait_s = buckets.take("acme", rate_per_s=100.0, burst=20, now=time.monotonic())
    if wait_s > 0: ...   # refused: a token is back in wait_s seconds

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; a request takes one. The
rate and burst are read at every take, so a tenant whose quota changed gets the new one at
once (the tokens it holds are capped at the new burst).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    tokens: float
    at: float  # monotonic time of the last refill

    def take(self, rate_per_s: float, burst: int, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is there."""
        self.tokens = min(float(burst), self.tokens + max(0.0, now - self.at) * rate_per_s)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate_per_s


class TenantBuckets:
    """One bucket per tenant; a bucket is made full on the tenant's first request. Bounded by
    the tenants of the pool (a deleted tenant's bucket goes with `forget`)."""

    def __init__(self) -> None:
        self.buckets: dict[str, TokenBucket] = {}
        self.refused: dict[str, int] = {}

    def take(self, tenant: str, rate_per_s: float, burst: int, now: float) -> float:
        bucket = self.buckets.get(tenant)
        if bucket is None:
            bucket = self.buckets[tenant] = TokenBucket(tokens=float(burst), at=now)
        wait_s = bucket.take(rate_per_s, burst, now)
        if wait_s > 0:
            self.refused[tenant] = self.refused.get(tenant, 0) + 1
        return wait_s

    def forget(self, tenant: str) -> None:
        self.buckets.pop(tenant, None)
        self.refused.pop(tenant, None)
