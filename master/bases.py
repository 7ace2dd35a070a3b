"""The bases a tenant may name: presets, and the directories the operator registered.

A base is a directory of weights on the master's (and the trainers' and inferencers') host. A
tenant never names a host path: it names a preset or ``registered:<name>``, a name the
operator gave a directory with ``nexus base add NAME PATH`` (op ``base_add``, admin only; the
name -> path map is the ``<prefix>_bases`` KV bucket, written by the master alone).
``nexus base list`` (op ``bases``) shows every caller the names; only the platform sees paths.

`resolve_base` turns what a spec or a `TenantConfig` names into what the backend loads (a
preset, or the directory's resolved absolute path: the identity `protocol.subjects.pool_name`
derives the inference pool from), so trainers and inferencers never see ``registered:``.
The platform's own callers may still name any local directory (tests, examples, operators).
"""

from __future__ import annotations

import os
import time

from transport.bus import js_retry
from actors.identity import Caller, current_caller
from actors.runtime import op
from protocol import ops
from protocol.errors import CapacityExceeded, InvalidField, NexusError
from protocol.messages import BaseAddRequest, BasesReply, BasesRequest, RegisteredBase
from protocol.policy import MAX_REGISTERED_BASES
from protocol.subjects import canonical_base, check_token
from protocol.wire import decode, encode
from master.state import MasterState
from master.store import kv_items, kv_keys, store_put


def _registered_prefix() -> str:
    from master.spec import REGISTERED_BASE_PREFIX

    return REGISTERED_BASE_PREFIX


# Asking each registered inferencer which base it serves, at submit: a short bound per
# instance (a busy one still answers info at once: control ops skip the concurrency slots).
INFERENCER_INFO_TIMEOUT_S = 2.0


class BaseOps:
    """The master's part that registers bases (``base_add``, ``bases``) and resolves a
    tenant's base name."""

    def __init__(self, st: MasterState) -> None:
        self.st = st
        self.bases: dict[str, RegisteredBase] = {}

    async def setup_bases(self) -> None:
        self.kv_bases = await js_retry(self.st.bus.js.key_value, self.st.names.kv_bases)
        self.bases = {}
        for key, value in await kv_items(self.kv_bases):
            try:
                self.bases[key] = decode(value, RegisteredBase)
            except Exception as exc:  # a record of another version: skip it, say so
                self.st.log.warning("unreadable base record", key=key, error=str(exc))

    @op(ops.MASTER_BASE_ADD)
    async def base_add(self, req: BaseAddRequest) -> RegisteredBase:
        """Register (or move) ``req.name`` -> the directory ``req.path`` on the master's host."""
        check_token("name", req.name)
        path = os.path.realpath(os.path.expanduser(req.path)) if req.path else ""
        if not path or not os.path.isdir(path):
            raise InvalidField("path", f"{req.path!r} is no directory on the master's host; allowed: a base's "
                                       "save_pretrained directory")
        if req.name not in self.bases and len(self.bases) >= MAX_REGISTERED_BASES:
            raise CapacityExceeded(f"capacity registered_bases={MAX_REGISTERED_BASES} reached: {len(self.bases)} "
                                   "bases are registered; `nexus base add` an existing name to point it elsewhere",
                                   details={"limit": "registered_bases", "value": MAX_REGISTERED_BASES})
        rec = RegisteredBase(name=req.name, path=path, added_at=time.time())
        await store_put(self.kv_bases, req.name, encode(rec))
        self.bases[req.name] = rec
        self.st.log.info("base registered", name=req.name, path=path)
        return rec

    @op(ops.MASTER_BASES)
    async def list_bases(self, req: BasesRequest) -> BasesReply:
        from master.spec import known_presets

        names = sorted(self.bases)
        platform = current_caller().is_platform
        return BasesReply(presets=list(known_presets()), names=[f"{_registered_prefix()}{n}" for n in names],
                          bases=[self.bases[n] for n in names] if platform else [])

    async def _registered(self, name: str) -> RegisteredBase | None:
        rec = self.bases.get(name)
        if rec is None:  # registered through another master since this one loaded
            try:
                rec = decode((await self.kv_bases.get(name)).value, RegisteredBase)
            except Exception:
                return None
            self.bases[name] = rec
        return rec

    def _allowed_bases(self) -> str:
        from master.spec import known_presets

        registered = ", ".join(f"{_registered_prefix()}{n}" for n in sorted(self.bases)) or "none registered yet"
        return f"a preset ({', '.join(known_presets())}) or a base the operator registered ({registered})"

    async def resolve_base(self, base: str, field: str, caller: Caller | None = None) -> str:
        """What the backend loads for ``base``: a preset unchanged, ``registered:<name>`` its
        directory, a path (the platform's callers only: a tenant never names one, not even a
        registered directory's) its resolved absolute path. InvalidField naming ``field`` and
        what is allowed."""
        from master.spec import known_presets

        caller = caller or current_caller()
        prefix = _registered_prefix()
        if base.startswith(prefix):
            name = base.removeprefix(prefix)
            rec = await self._registered(name) if name else None
            if rec is None:
                raise InvalidField(field, f"{base!r} is not registered; allowed: {self._allowed_bases()}",
                                   details={"value": base})
            return rec.path
        if base in known_presets() or caller.is_platform:
            return base if base in known_presets() else canonical_base(base)
        raise InvalidField(field, f"{base!r} is not allowed: a tenant names no host path; allowed: "
                                  f"{self._allowed_bases()}", details={"value": base})

    def base_label(self, base: str, caller: Caller | None = None) -> str:
        """``base`` as the caller may see it: a preset, ``registered:<name>`` for a registered
        directory, and for a tenant never an unregistered host path."""
        caller = caller or current_caller()
        for name, rec in sorted(self.bases.items()):
            if rec.path == base:
                return f"{_registered_prefix()}{name}"
        if caller.is_platform or "/" not in base:
            return base
        return "an operator's local base"

    async def check_base_served(self, tenant: str, base: str) -> str:
        """An rl / eval workload needs an inferencer serving its base. Rejected (naming the
        pools that exist) when inferencers are registered and none serves it; accepted with a
        note when none is registered at all (they may start later; tests without inference)."""
        from master.spec import SpecError
        from protocol.messages import InfoRequest, ServiceRecord
        from protocol.subjects import pool_name

        kv = await js_retry(self.st.bus.js.key_value, self.st.names.kv_services)
        pools: dict[str, str] = {}  # pool -> base
        registered = 0
        for key in await kv_keys(kv):
            if not key.startswith("inferencer."):
                continue
            try:
                svc = decode((await kv.get(key)).value, ServiceRecord)
            except Exception as exc:  # a record of another version: skip it, say so
                self.st.log.warning("unreadable service record", key=key, error=str(exc))
                continue
            if svc.state == "stopped":
                continue
            registered += 1
            try:
                info = await self.st.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=svc.instance,
                                           timeout_s=INFERENCER_INFO_TIMEOUT_S)
            except NexusError as exc:
                self.st.log.info("inferencer did not answer info at submit", instance=svc.instance, error=exc.message)
                continue
            if info.extra.get("pool"):
                pools[str(info.extra["pool"])] = str(info.extra.get("base", ""))
        if not registered:
            self.st.log.info("no inferencer registered: base check skipped", tenant=tenant, base=base)
            return (f"; note: no inferencer is registered yet, so nothing serves base {self.base_label(base)!r} "
                    "until one starts")
        if not pools:
            return f"; note: no inferencer answered, base {self.base_label(base)!r} not checked"
        if base in pools.values() or pool_name(base) in pools:
            return ""
        # Bases as the caller may name them: a registered one by its name, no host path to a tenant.
        known = ", ".join(f"{p} (base {self.base_label(b)})" for p, b in sorted(pools.items()))
        shown = self.base_label(base)
        raise SpecError([("base", f"no inferencer serves {shown!r}; allowed: a base one of the inference "
                                  f"pools serves: {known}", shown)])
