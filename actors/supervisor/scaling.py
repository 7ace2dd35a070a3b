"""The supervisor's answer to `ScaleRequest`s: start the missing instances of a role (of an
inferencer pool) or drain the surplus. A mixin of `Supervisor` (`supervisor.py`), which holds the
children, locks and the control connection it works on; what the mixin uses of it is
`ScalingHost`, and nothing else (tests/actors/test_mixin_hosts.py checks)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from protocol import ops
from protocol.base_names import REGISTERED_BASE_PREFIX, known_presets
from protocol.errors import Draining, FailedPrecondition, InvalidField, NexusError, NotFound, Unavailable
from protocol.messages import JobsRequest, Ok, ScaleRequest
from protocol.scaling import MAX_INSTANCES, check_count
from protocol.subjects import pool_name
from protocol.wire import decode
from actors.supervisor.children import POOLED, slot_key

if TYPE_CHECKING:
    from actors.supervisor.children import Child
    from protocol.subjects import Names
    from transport.bus import Bus
    from transport.cluster import SupervisorConfig

# Job states that still need a trainer: scaling trainers to zero while one exists is refused.
JOBS_WAITING = ["reserved", "filling", "ready", "leased"]
# The master's answer to "do jobs wait?" before trainers go to zero.
JOBS_CHECK_TIMEOUT_S = 5.0
# Reading the registered bases (the bases KV bucket) to resolve a scale request's pool.
BASES_READ_TIMEOUT_S = 5.0


class ScalingHost(Protocol):
    """What `Scaling` uses of the supervisor it is mixed into, and nothing more (`Supervisor` is
    the host): its config, its children by slot and what it wants of each role, starting,
    stopping and awaiting a child, and its control connection."""

    cfg: SupervisorConfig  # the supervised roles and their bounds
    names: Names
    children: dict[str, Child]  # slot key -> its live child
    counts: dict[str, int]  # instances wanted per role
    _bases: dict[str, str]  # slot key -> the base its next inferencer serves ("" the default)
    _control: Bus | None  # the control connection: the master's jobs, the bases bucket
    _stopping: asyncio.Event  # the supervisor is stopping: no scaling now
    _global: asyncio.Task | None  # a global restart, while one runs

    def say(self, text: str) -> None:
        """One line to the operator's output."""
        ...

    def default_base(self) -> str:
        """The base an inferencer started without a pool serves."""
        ...

    def _lock(self, key: str) -> asyncio.Lock:
        """One lock per slot key (and ``scale:<role>`` per role's scale requests)."""
        ...

    def _slots(self, role: str) -> list[Child]:
        """``role``'s live children, first slot first."""
        ...

    def _spawn(self, role: str, key: str | None = None, base: str | None = None) -> Child:
        """Start ``role`` in slot ``key``; an inferencer serves ``base``."""
        ...

    async def _stop_child(self, child: Child, mode: str, *, signalled: bool = False) -> int:
        """SIGKILL (``kill``) or SIGTERM and wait for the drain (``drain``); the exit status."""
        ...

    async def _wait_ready(self, keys: list[str] | None = None) -> None:
        """Until the children in ``keys`` registered ready and the monitor saw them."""
        ...

    def _write_state(self) -> None:
        """The cluster state file, from the children and counts now."""
        ...


# To a type checker the mixin is its host (`self.children` has ScalingHost's type); at run time
# a plain class, so no stub of the protocol sits in `Supervisor`'s MRO.
if TYPE_CHECKING:
    _Host = ScalingHost
else:
    _Host = object


class Scaling(_Host):
    async def scale(self, req: ScaleRequest) -> Ok:
        """Run ``req.count`` instances of ``req.role``: start the missing ones (answered once
        they registered ready) or drain the surplus, highest slot first (answered once they
        exited). With ``req.pool`` (inferencers) the started ones serve that pool's base and the
        surplus drains from that pool. Refused past the role's bounds (the total), for a pool
        that is neither registered nor served, and for zero trainers while jobs wait."""
        if self._stopping.is_set():
            raise Draining("the supervisor is stopping; no scaling now")
        if self._global is not None and not self._global.done():
            raise Unavailable("a global restart is in progress; scale again once it is done")
        check_count(req.role, req.count, self.cfg.bounds)
        if req.role not in self.cfg.roles:
            raise NotFound(f"role {req.role!r} is not supervised here; roles: {list(self.cfg.roles)}",
                           details={"role": req.role})
        if req.pool and req.role != POOLED:
            raise InvalidField("pool", f"role {req.role} has no pools: only inferencers serve one (a base each)",
                               details={"role": req.role, "pool": req.pool})
        why = f" ({req.reason})" if req.reason else ""
        async with self._lock(f"scale:{req.role}"):
            base, pool = await self._resolve_pool(req.pool) if req.pool else ("", "")
            of = f" of pool {pool}" if pool else ""
            live = self._slots(req.role)
            have = len(live)
            # The instances the surplus drains from: the named pool's, or any.
            mine = [c for c in live if not pool or c.pool == pool]
            if req.count == 0 and req.role == "trainer":
                await self._refuse_if_jobs_wait()
            # Every check before anything changes: a refused request leaves the deployment as it was.
            if len(set(req.drain)) > max(have - req.count, 0):
                raise InvalidField("drain", f"names {len(set(req.drain))} instances but {req.role} {have} -> "
                                            f"{req.count} drains {max(have - req.count, 0)}")
            unknown = [i for i in req.drain if i not in {c.instance for c in mine}]
            if unknown:
                raise NotFound(f"drain: {unknown} are not live instances of {req.role}{of}; live: "
                               f"{', '.join(c.instance for c in mine) or 'none'}", details={"drain": unknown})
            if have - req.count > len(mine):
                raise InvalidField("count", f"{req.role} {have} -> {req.count} drains {have - req.count}{of}, which "
                                            f"has {len(mine)}; pools: {self._pools_text()}",
                                   details={"role": req.role, "pool": pool})
            self.counts[req.role] = req.count
            if req.count == have:
                self._write_state()
                return Ok(detail=f"{req.role}: {have} already; nothing to do")
            if req.count > have:
                free = [slot_key(req.role, i) for i in range(MAX_INSTANCES) if slot_key(req.role, i) not in self.children]
                new = [self._spawn(req.role, key, base) for key in free[:req.count - have]]
                self.say(f"scale {req.role} {have} -> {req.count}{of}{why}: started "
                         f"{', '.join(f'{c.instance} (pid {c.proc.pid})' for c in new)}")
                self._write_state()
                await self._wait_ready([c.key for c in new])
                return Ok(detail=f"{req.role}: {have} -> {req.count}{of}; ready: {', '.join(c.instance for c in new)}")
            first = [c for c in mine if c.instance in req.drain]
            surplus = (first + [c for c in reversed(mine) if c not in first])[:have - req.count]
            self.say(f"scale {req.role} {have} -> {req.count}{of}{why}: draining "
                     f"{', '.join(c.instance for c in surplus)}")
            codes = await asyncio.gather(*(self._retire(c.key) for c in surplus))
            self._write_state()
            done = ", ".join(f"{c.instance} (exit {code})" for c, code in zip(surplus, codes))
            return Ok(detail=f"{req.role}: {have} -> {req.count}{of}; drained: {done}")

    def _pools_text(self) -> str:
        pools: dict[str, int] = {}
        for c in self._slots(POOLED):
            pools[c.pool] = pools.get(c.pool, 0) + 1
        return ", ".join(f"{p} {n}" for p, n in sorted(pools.items())) or "none"

    async def _resolve_pool(self, name: str) -> tuple[str, str]:
        """A scale request's ``pool`` -> (the base an instance of it is started with, "" for
        the default; its pool name): a registered base (``NAME`` or ``registered:NAME``), a
        preset, or a pool a live inferencer (or the default base) serves. InvalidField naming
        the registered bases otherwise."""
        registered = await self._registered_bases()
        default = self.default_base()
        if name.removeprefix(REGISTERED_BASE_PREFIX) in registered:
            base = registered[name.removeprefix(REGISTERED_BASE_PREFIX)]
        elif name in known_presets():
            base = name
        else:
            served = {pool_name(default): "", **{pool_name(p): p for p in registered.values()},
                      **{c.pool: c.base for c in self._slots(POOLED)}}
            if name not in served:
                names = ", ".join(f"{REGISTERED_BASE_PREFIX}{n}" for n in sorted(registered)) or "none registered"
                raise InvalidField("pool", f"{name!r} is no registered base, preset or served pool; allowed: a "
                                           f"registered base ({names}; `nexus base add NAME PATH`), a preset "
                                           f"({', '.join(known_presets())}) or a pool served now "
                                           f"({', '.join(sorted(served))})",
                                   details={"pool": name, "registered": sorted(registered)})
            base = served[name]
        pool = pool_name(base or default)
        return ("" if pool == pool_name(default) else base), pool

    async def _registered_bases(self) -> dict[str, str]:
        """name -> directory of each base the operator registered (`nexus base add`)."""
        from nats.js.errors import NoKeysError

        from protocol.messages import RegisteredBase
        from protocol.policy import MAX_REGISTERED_BASES

        assert self._control is not None

        async def read() -> dict[str, str]:
            kv = await self._control.js.key_value(self.names.kv_bases)
            try:
                keys = await kv.keys()
            except NoKeysError:
                return {}
            out = {}
            for key in sorted(keys)[:MAX_REGISTERED_BASES]:
                try:
                    out[key] = decode((await kv.get(key)).value, RegisteredBase).path
                except Exception:  # deleted meanwhile, or a record of another version: not a pool
                    continue
            return out

        try:
            return await asyncio.wait_for(read(), BASES_READ_TIMEOUT_S)
        except Exception as exc:
            raise Unavailable(f"pool: the registered bases could not be read: {type(exc).__name__}: {exc}",
                              details={"bucket": self.names.kv_bases}) from None

    async def _retire(self, key: str) -> int | None:
        """Drain the child in slot ``key`` (SIGTERM, its drain, bounded by drain_timeout_s)
        and leave the slot empty. None: the slot was empty already."""
        async with self._lock(key):
            child = self.children.get(key)
            if child is None:
                return None
            code = await self._stop_child(child, "drain")
            self.children.pop(key, None)
            self._bases.pop(key, None)  # the slot's next instance serves what it is started for
            self.say(f"role {child.role} ({child.instance}) scaled in: drained, exit {code}")
            return code

    async def _refuse_if_jobs_wait(self) -> None:
        """Zero trainers while the master holds a job that still needs one would strand it."""
        assert self._control is not None
        try:
            reply = await self._control.call(ops.MASTER_JOBS, JobsRequest(states=JOBS_WAITING, limit=1),
                                             timeout_s=JOBS_CHECK_TIMEOUT_S)
        except NexusError as exc:
            raise Unavailable(f"trainer=0 needs the master to say no job waits, and it did not answer: {exc.message}",
                              details={"role": "trainer"}) from None
        if reply.jobs:
            j = reply.jobs[0]
            raise FailedPrecondition(
                f"trainer=0 refused: jobs wait for a trainer (e.g. {j.tenant}/{j.job}, {j.state}); "
                f"keep at least 1 until the queue is empty",
                details={"role": "trainer", "count": 0, "job": f"{j.tenant}/{j.job}"})

