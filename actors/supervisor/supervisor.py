"""Supervisor behind `nexus up`: embedded broker, layout, and every role as a child process.

    python -m actors.supervisor --data-dir .nexus --nats-port 4222     # what --detach runs
    python -m actors.supervisor --data-dir .nexus --nats-cluster 3     # 3 nats-servers, R3

In order it: 1. starts nats-server, or a cluster of them (unless given --nats-url);
2. creates streams and buckets (replicated on a cluster) and records the deployment
settings; 3. starts the roles (health and monitor first, so they see everyone's first beat);
4. writes ``<data-dir>/cluster.json`` so client commands find the cluster; 5. waits until
every role has registered ready; 6. restarts a role that dies (`ROLE_RESTART` budget) until
SIGTERM/SIGINT; 7. stops: roles drain in reverse start order, then the broker stops and
cluster.json is removed.

It also answers `RestartRequest`s on ``<prefix>.supervisor.restart`` (the health manager sends
them for a dead, hung or stalled role): ``kill`` SIGKILLs the named instance and starts a new
one, ``drain`` SIGTERMs it, waits for its drain, then starts a new one, ``global`` restarts
every role. Each role has one lock, so a crash the supervisor noticed itself and a restart
request for the same instance give one restart, not two. When the master's budget is spent,
the supervisor restarts every role once (`GLOBAL_RESTART`); tenants resume from checkpoints.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path

from transport.bus import Bus
from transport.auth import AuthStore
from protocol import ops
from transport.creds import ENV_CREDS, creds_from_env
from transport.permissions import SUPERVISOR
from transport.broker import EmbeddedBroker, EmbeddedCluster
from transport.layout import ensure_layout, read_deployment_settings
from protocol.errors import Draining, FailedPrecondition, InternalError, NexusError, NotFound, Unavailable
from protocol.messages import (
    DeploymentSettings,
    ErrorReply,
    Ok,
    RestartRequest,
    ScaleRequest,
    ServiceRecord,
    StatusRequest,
)
from protocol.scaling import MAX_INSTANCES
from protocol.subjects import Names, pool_name
from protocol.wire import decode, encode
from transport.cluster import STATE_FILE, ChildRecord, ClusterState, SupervisorConfig
from actors.supervisor.children import (
    POOLED, ROLE_WRITES, Child, chown_tree, die_with_parent, resolve_role_users, slot_key, slot_of,
)
from actors.supervisor.scaling import Scaling


# `nexus down` drains the roles in these stages (any role not named goes in the last one).
STOP_STAGES: tuple[tuple[str, ...], ...] = (("env", "inferencer", "trainer"), ("master",), ("monitor", "health"))
# Roles every tenant depends on: when one of them cannot come back, every role is restarted.
COORDINATORS: tuple[str, ...] = ("master",)
# A SIGKILLed child is gone within milliseconds; past this the kill is reported as failed.
KILL_WAIT_S = 10.0
# Old instance ids remembered as "already replaced" (a late restart request for one is Ok).
REPLACED_KEPT = 256


class Supervisor(Scaling):
    def __init__(self, cfg: SupervisorConfig, out=sys.stdout) -> None:
        self.cfg = cfg
        self.names = Names(cfg.prefix)
        self.out = out
        self.broker: EmbeddedBroker | EmbeddedCluster | None = None
        self.nats_url = cfg.nats_url or ""
        # Accounts and credentials, when we start the broker; on --nats-url the operator's
        # server decides (and NEXUS_CREDS, if set, is what we and the roles log in with).
        self.auth: AuthStore | None = None
        self.creds: Path | None = creds_from_env()
        # slot key (`slot_key`: "env", "env.1", ...) -> the live instance in that slot
        self.children: dict[str, Child] = {}
        self.counts: dict[str, int] = dict(cfg.counts)  # instances wanted per role
        # slot key -> the base an inferencer in it serves ("": the default), kept across restarts.
        self._bases: dict[str, str] = {}
        # role -> (uid, gid) it runs as; empty: roles run as this process's user.
        self.role_users: dict[str, tuple[int, int]] = {}
        self.state: ClusterState | None = None
        self._stopping = asyncio.Event()
        self._control: Bus | None = None  # serves restart requests
        self._locks: dict[str, asyncio.Lock] = {}
        self._replaced: OrderedDict[str, str] = OrderedDict()  # old instance -> its successor
        self._requests: set[asyncio.Task] = set()
        self._global: asyncio.Task | None = None
        self._global_history: deque = deque()

    @property
    def logs_dir(self) -> Path:
        return self.cfg.data_dir / "logs"

    @property
    def traces_dir(self) -> Path:
        return self.cfg.data_dir / "traces"

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # -- start ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        self.traces_dir.mkdir(exist_ok=True)
        # 1. broker
        if not self.cfg.nats_url:
            self.auth = AuthStore(self.cfg.data_dir, prefix=self.cfg.prefix)
            self.auth.ensure()
            self.creds = self.auth.role_creds(SUPERVISOR)
        # On --nats-url the roles log in with the operator's NEXUS_CREDS file as given (not
        # ours to hand over to another user): they run as this process's user.
        self.role_users = resolve_role_users(self.cfg.roles) if self.auth is not None else {}
        if self.role_users:
            self._fence_roles()
        if self.cfg.nats_cluster > 1:
            self.broker = EmbeddedCluster(data_dir=self.cfg.data_dir, size=self.cfg.nats_cluster,
                                          client_ports=[self.cfg.nats_port], auth=self.auth)
            self.broker.start()
            self.nats_url = self.broker.url
            self.say(f"nats-server  {self.cfg.nats_cluster}-node JetStream cluster {self.nats_url} "
                     f"(stores {self.cfg.data_dir / 'jetstream'}/n<i>, logs {self.logs_dir}/nats-n<i>.log)")
        elif not self.cfg.nats_url:
            self.broker = EmbeddedBroker(data_dir=self.cfg.data_dir, port=self.cfg.nats_port, auth=self.auth)
            self.broker.start()
            self.nats_url = self.broker.url
            self.say(f"nats-server  {self.nats_url} (JetStream store {self.cfg.data_dir / 'jetstream'})")
        # 2. layout, at the replica count of the servers we started; on a server we did not
        # start, at the count its layout already records (so `up` never shrinks an R3 layout).
        bus = await Bus.connect(self.nats_url, name="supervisor", reconnect_forever=False, creds=self.creds)
        try:
            if self.broker is None:
                replicas = (await read_deployment_settings(bus.js, self.names)).replicas
            else:
                replicas = self.cfg.nats_cluster
            settings = DeploymentSettings(replicas=replicas, tq_max_bytes=self.cfg.tq_max_bytes)
            await ensure_layout(bus.js, self.names, replicas=replicas, settings=settings)
        finally:
            await bus.close()
        # 2b. restart requests: served before the roles start, so health can reach us at once
        await self._serve_restarts()
        # 3. roles, each as many times as counted
        for role in self.cfg.roles:
            for slot in range(self.counts[role]):
                self._spawn(role, slot_key(role, slot))
        # 4. state file
        self.state = ClusterState(
            nats_url=self.auth.admin().url(self.nats_url) if self.auth else self.nats_url,
            creds=str(self.auth.admin_creds) if self.auth else "",
            prefix=self.cfg.prefix,
            data_dir=str(self.cfg.data_dir),
            supervisor_pid=os.getpid(),
            broker_pid=self._broker_pids()[0] if self._broker_pids() else None,
            broker_pids=self._broker_pids(),
            logs_dir=str(self.logs_dir),
            traces_dir=str(self.traces_dir),
            started_at=time.time(),
        )
        self._write_state()
        self.say(f"logs         {self.logs_dir}/<role>.log (JSON lines)")
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            self.say(f"traces       OTLP -> {os.environ['OTEL_EXPORTER_OTLP_ENDPOINT']}")
        else:
            self.say(f"traces       {self.traces_dir}/<role>-<instance>.jsonl (set OTEL_EXPORTER_OTLP_ENDPOINT for a collector)")
        # 5. ready
        await self._wait_ready()
        self.state.ready = True
        self._write_state()
        self.say(f"ready        {len(self.children)} role instances live: "
                 f"{', '.join(f'{r}={self.counts[r]}' for r in self.cfg.roles)}")

    def _broker_pids(self) -> list[int]:
        if isinstance(self.broker, EmbeddedCluster):
            return self.broker.pids
        if self.broker is not None and self.broker.proc is not None:
            return [self.broker.proc.pid]
        return []

    def role_creds(self, role: str) -> Path | None:
        """What ``role`` logs in with: its own user's file when we run the broker (never the
        seeds, never another role's); on --nats-url, NEXUS_CREDS as given."""
        return self.auth.role_creds(role) if self.auth is not None else self.creds

    def _fence_roles(self) -> None:
        """Running as root with role users (`resolve_role_users`): each role's creds file
        becomes readable by its user only, and the directories roles write are theirs.
        ``auth/`` (every seed) stays 0700 root's: a role process cannot read it."""
        data = self.cfg.data_dir
        for path in [data, *data.parents]:
            st = path.stat()
            for role, (uid, gid) in self.role_users.items():
                if not (st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100)
                        or (st.st_gid == gid and st.st_mode & 0o010)):
                    raise FailedPrecondition(
                        f"the role user of {role} (uid {uid}) cannot enter {path} (mode {st.st_mode & 0o777:o}): "
                        f"put the data dir where it can, or set NEXUS_ROLE_USER=- to run roles as this user",
                        details={"path": str(path), "uid": uid})
        if self.auth is not None:
            os.chmod(self.auth.root, 0o700)
            for role, (uid, gid) in self.role_users.items():
                creds = self.auth.role_creds(role)
                os.chown(creds, uid, gid)
                os.chmod(creds, 0o400)
        uids = {ids for ids in self.role_users.values()}
        for sub, writers in ROLE_WRITES.items():
            path = data / sub
            path.mkdir(parents=True, exist_ok=True)
            owners = {self.role_users[r] for r in writers if r in self.role_users}
            if len(owners) == 1:
                uid, gid = owners.pop()
                chown_tree(path, uid, gid)
                os.chmod(path, 0o755)
            elif owners:  # several role users write here: each its own files (sticky)
                os.chmod(path, 0o1777)
        for uid, gid in uids:
            home = data / "home" / str(uid)
            home.mkdir(parents=True, exist_ok=True)
            chown_tree(home, uid, gid)

    @staticmethod
    def default_base() -> str:
        """The base an inferencer started without a pool serves (NEXUS_INFER_BASE, as it reads it)."""
        from protocol.settings import InferencerSettings

        return InferencerSettings.from_env().base

    def _spawn(self, role: str, key: str | None = None, base: str | None = None) -> Child:
        """Start ``role`` in slot ``key``; an inferencer serves ``base`` ("" the default; None:
        the one its slot served, so a restart keeps the pool)."""
        key = key or role
        instance = f"{role}-{uuid.uuid4().hex[:6]}"
        base = self._bases.get(key, "") if base is None else base
        if role == POOLED:
            self._bases[key] = base
        log_path = self.logs_dir / f"{role}.log"
        env = dict(os.environ)
        creds = self.role_creds(role)
        env.pop(ENV_CREDS, None)
        env.update(
            NEXUS_NATS_URL=self.nats_url,
            NEXUS_PREFIX=self.cfg.prefix,
            NEXUS_DATA_DIR=str(self.cfg.data_dir),
            **({ENV_CREDS: str(creds)} if creds else {}),
            OMP_NUM_THREADS="1",  # one BLAS thread per process: 2 cores are shared by all roles
            PYTHONUNBUFFERED="1",
        )
        if role == POOLED and base:
            env["NEXUS_INFER_BASE"] = base  # another pool than the default
        device = self.cfg.placement.device_for(role, slot_of(key))
        if device is not None:
            # Its device, seen as cuda:0 (a restart keeps it); a trainer of N ranks its N devices.
            env["CUDA_VISIBLE_DEVICES"] = device
        ids = self.role_users.get(role)
        if ids is not None:
            env["HOME"] = str(self.cfg.data_dir / "home" / str(ids[0]))  # root's is not theirs
        with open(log_path, "ab") as log:
            try:
                proc = self._popen(role, instance, log, env, ids)
            except PermissionError as exc:  # the role user cannot run this interpreter / code
                raise FailedPrecondition(
                    f"role {role} cannot start as uid {ids[0] if ids else os.getuid()}: {exc}; the role user needs "
                    f"to read and run {sys.executable} and the code (or set NEXUS_ROLE_USER=-)",
                    details={"role": role}) from None
        old = self.children.get(key)
        child = Child(role, instance, proc, log_path, old.restarts if old else deque(), key=key, base=base,
                       pool=pool_name(base or self.default_base()) if role == POOLED else "")
        self.children[key] = child
        return child

    @staticmethod
    def _popen(role: str, instance: str, log, env: dict, ids: tuple[int, int] | None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.run", role, "--instance", instance],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # Own process group: a Ctrl-C reaches the supervisor only, which then stops
            # the roles in order.
            start_new_session=True,
            preexec_fn=die_with_parent,
            # As root with a role user: the role runs as it (no supplementary groups).
            **({"user": ids[0], "group": ids[1], "extra_groups": []} if ids is not None else {}),
        )

    def _write_state(self) -> None:
        assert self.state is not None
        self.state.roles = [
            ChildRecord(c.role, c.instance, c.proc.pid, str(c.log_path)) for c in self.children.values()
        ]
        self.state.counts = dict(self.counts)
        self.state.bounds = {r: b.text() for r, b in self.cfg.bounds.items() if r in self.cfg.roles}
        pools: dict[str, int] = {}
        for c in self._slots(POOLED):
            pools[c.pool] = pools.get(c.pool, 0) + 1
        self.state.pools = dict(sorted(pools.items()))
        self.state.write(self.cfg.data_dir)

    async def _wait_ready(self, keys: list[str] | None = None) -> None:
        """Until the children in ``keys`` (default: all) registered ready and the monitor saw them."""
        bus = await Bus.connect(self.nats_url, name="supervisor", reconnect_forever=False, creds=self.creds,
                                prefix=self.names.prefix)
        try:
            kv = await bus.js.key_value(self.names.kv_services)
            deadline = time.monotonic() + self.cfg.ready_timeout_s
            pending = set(self.children if keys is None else keys)
            want = {self.children[k].instance for k in pending if k in self.children}
            while pending:
                for key in list(pending):
                    child = self.children.get(key)
                    if child is None:  # drained meanwhile (scaled back in): nothing to wait for
                        pending.discard(key)
                        continue
                    if child.proc.poll() is not None:
                        raise Unavailable(
                            f"role {child.role} ({child.instance}) exited with status {child.proc.returncode} "
                            f"during start; see {child.log_path}"
                        )
                    try:
                        entry = await kv.get(Names.service_key(child.role, child.instance))
                    except Exception:  # not registered yet
                        continue
                    if decode(entry.value, ServiceRecord).state == "ready":
                        pending.discard(key)
                if pending and time.monotonic() > deadline:
                    raise Unavailable(
                        f"roles not ready after {self.cfg.ready_timeout_s:g} s: {sorted(pending)}; "
                        f"see {self.logs_dir}"
                    )
                await asyncio.sleep(0.1)
            # Live means the monitor has seen each role's heartbeat, so the first
            # `nexus status` after `up` already lists every role.
            if "monitor" in self.children:
                await self._wait_monitor_sees_all(bus, deadline, want)
        finally:
            await bus.close()

    async def _wait_monitor_sees_all(self, bus: Bus, deadline: float, want: set[str]) -> None:
        while True:
            try:
                status = await bus.call(ops.MONITOR_STATUS, StatusRequest(include_dead=False), timeout_s=2)
                seen = {r.instance for r in status.roles if r.state == "alive"}
            except NexusError:
                seen = set()
            if want <= seen:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"the monitor has not seen heartbeats from {sorted(want - seen)}; see {self.logs_dir}")
            await asyncio.sleep(0.2)

    # -- run -----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start()
            while not self._stopping.is_set():
                await self._reap()
                try:
                    await asyncio.wait_for(self._stopping.wait(), timeout=0.2)
                except asyncio.TimeoutError:
                    pass
            return 0
        except NexusError as exc:
            self.say(f"error: {exc.message}")
            return 1
        finally:
            await self.stop()

    async def _reap(self) -> None:
        if self._global is not None and not self._global.done():
            return  # the global restart owns every child until it is done
        for key, child in list(self.children.items()):
            if child.proc.poll() is None:
                continue
            lock = self._lock(key)
            if lock.locked():
                continue  # a restart or scale request is replacing or draining this child right now
            async with lock:
                if self.children.get(key) is child:
                    await self._after_exit(child)

    async def _after_exit(self, child: Child) -> None:
        role, code = child.role, child.proc.returncode
        if code == 0:
            # A clean exit means someone drained it on purpose (elastic scale-in, `nexus down`).
            self.say(f"role {role} ({child.instance}) drained and exited")
            del self.children[child.key]
            self._bases.pop(child.key, None)
            self._write_state()
            return
        policy = self.cfg.restart
        if not policy.spend(child.restarts, time.monotonic()):
            self.say(
                f"role {role} died (status {code}) {policy.max_restarts} times in "
                f"{policy.window_s:g} s; not restarting. See {child.log_path}"
            )
            if role in COORDINATORS and self._start_global(f"{role} cannot come back"):
                return
            del self.children[child.key]
            self._write_state()
            return
        self.say(f"role {role} ({child.instance}) died with status {code}; restarting in {policy.backoff_s:g} s")
        await asyncio.sleep(policy.backoff_s)
        self._replace(child, f"role {role} restarted")

    def _lock(self, key: str) -> asyncio.Lock:
        """One lock per slot key (and ``scale:<role>`` per role's scale requests)."""
        return self._locks.setdefault(key, asyncio.Lock())

    def _slots(self, role: str) -> list[Child]:
        """``role``'s live children, first slot first."""
        kids = [c for c in self.children.values() if c.role == role]
        return sorted(kids, key=lambda c: slot_of(c.key))

    def _replace(self, old: Child, why: str) -> Child:
        new = self._spawn(old.role, old.key)  # keeps old.restarts: the budget spans instances
        self._replaced[old.instance] = new.instance
        while len(self._replaced) > REPLACED_KEPT:
            self._replaced.popitem(last=False)
        self.say(f"{why} as {new.instance} (pid {new.proc.pid})")
        self._write_state()
        return new

    async def _stop_child(self, child: Child, mode: str, *, signalled: bool = False) -> int:
        """SIGKILL (``kill``) or SIGTERM and wait for the drain (``drain``); return the exit status.

        ``signalled``: the SIGTERM went out already (a second one would skip the drain).
        """
        if child.proc.poll() is None and not signalled:
            child.proc.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        deadline = time.monotonic() + (self.cfg.drain_timeout_s if mode == "drain" else KILL_WAIT_S)
        while child.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if child.proc.poll() is None:
            self.say(f"role {child.role} ({child.instance}) did not exit after {mode}; killing it")
            child.proc.kill()
            await asyncio.to_thread(child.proc.wait, KILL_WAIT_S)
        return child.proc.returncode

    # -- restart requests ----------------------------------------------------------------
    async def _serve_restarts(self) -> None:
        self._control = await Bus.connect(self.nats_url, name="supervisor-control", creds=self.creds,
                                          prefix=self.names.prefix)
        await self._control.nc.subscribe(self.names.supervisor("restart"), cb=self._on_restart)
        await self._control.nc.subscribe(self.names.supervisor("scale"), cb=self._on_restart)

    async def _close_control(self) -> None:
        for task in [*self._requests, *([self._global] if self._global else [])]:
            task.cancel()
        await asyncio.gather(*self._requests, *([self._global] if self._global else []), return_exceptions=True)
        if self._control is not None:
            await self._control.close()
            self._control = None

    async def _on_restart(self, msg) -> None:
        # Its own task: a drain takes seconds, and the next request must not wait behind it.
        task = asyncio.ensure_future(self._answer_restart(msg))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _answer_restart(self, msg) -> None:
        try:
            if msg.subject == self.names.supervisor("scale"):
                reply = await self.scale(decode(msg.data, ScaleRequest))
            else:
                reply = await self.restart(decode(msg.data, RestartRequest))
        except NexusError as exc:
            reply = ErrorReply.from_exception(exc)
        except Exception as exc:  # a bug here must still answer the caller, and be seen
            self.say(f"restart request failed: {type(exc).__name__}: {exc}")
            reply = ErrorReply.from_exception(InternalError(f"supervisor failed on restart: {exc}"))
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except Exception as exc:  # the requester may be gone (a global restart took it)
                self.say(f"restart reply failed: {exc}")

    async def restart(self, req: RestartRequest) -> Ok:
        """Restart one instance in place (``kill`` / ``drain``) or every role (``global``)."""
        if self._stopping.is_set():
            raise Draining("the supervisor is stopping; no restarts now")
        if self._global is not None and not self._global.done():
            raise Unavailable("a global restart is in progress; every role is being restarted")
        why = f": {req.reason}" if req.reason else ""
        if req.mode == "global":
            if not self._start_global(f"requested for {req.role or 'all'}{why}"):
                raise FailedPrecondition(self._global_spent())
            return Ok(detail="global restart started")
        if req.role not in self.cfg.roles:
            raise NotFound(f"role {req.role!r} is not supervised here; roles: {list(self.cfg.roles)}",
                           details={"role": req.role})
        slots = self._slots(req.role)
        key = next((c.key for c in slots if c.instance == req.instance),
                   slots[0].key if slots and not req.instance else slot_key(req.role, 0))
        async with self._lock(key):
            child = self.children.get(key)
            if req.instance and (child is None or child.instance != req.instance):
                if req.instance in self._replaced:
                    return Ok(detail=f"{req.instance} was already replaced by {self._replaced[req.instance]}")
                current = ", ".join(c.instance for c in self._slots(req.role)) or "none"
                raise NotFound(f"unknown instance {req.instance!r} of role {req.role}; the live one is {current}",
                               details={"role": req.role, "instance": req.instance, "current": current})
            if child is None:
                raise NotFound(f"role {req.role} is not running (drained, or out of restart budget)",
                               details={"role": req.role})
            policy = self.cfg.restart
            if not policy.spend(child.restarts, time.monotonic()):
                if req.role in COORDINATORS and self._start_global(f"{req.role} cannot come back{why}"):
                    return Ok(detail=f"{req.role} restart budget spent; global restart started")
                raise FailedPrecondition(
                    f"restart budget of role {req.role} spent: {policy.max_restarts} restarts in "
                    f"{policy.window_s:g} s", details={"role": req.role, "budget": policy.name})
            self.say(f"restart request: {req.mode} {req.role} ({child.instance}){why}")
            code = await self._stop_child(child, req.mode)
            new = self._replace(child, f"role {req.role} restarted ({req.mode}, old exit {code})")
            return Ok(detail=f"{req.role} {child.instance} stopped by {req.mode} (exit {code}); "
                             f"new instance {new.instance} (pid {new.proc.pid})")

    def _global_spent(self) -> str:
        b = self.cfg.global_restart
        return f"global restart budget spent: {b.max_restarts} in {b.window_s:g} s"

    def _start_global(self, reason: str) -> bool:
        if not self.cfg.global_restart.spend(self._global_history, time.monotonic()):
            self.say(f"{self._global_spent()}; not restarting ({reason})")
            return False
        self._global = asyncio.ensure_future(self._global_restart(reason))
        return True

    async def _global_restart(self, reason: str) -> None:
        """Stop every role (reverse start order, each drains), then start all in ROLES order."""
        self.say(f"global restart: {reason}")
        await asyncio.sleep(self.cfg.global_restart.backoff_s)
        # The slots started again: per role its live ones (up to the wanted count: a drained
        # slot between them, and an inferencer's pool, stay as they are), then the lowest free
        # ones up to the count. Stopped: those and every live one, in ROLES order.
        wanted: list[str] = []
        for r in self.cfg.roles:
            live = [c.key for c in self._slots(r)][:self.counts[r]]
            free = [k for k in (slot_key(r, i) for i in range(MAX_INSTANCES)) if k not in self.children]
            wanted += live + free[:max(self.counts[r] - len(live), 0)]
        keys = list(dict.fromkeys([*wanted, *(c.key for r in self.cfg.roles for c in self._slots(r))]))
        locks = [self._lock(k) for k in keys]
        for lock in locks:  # always in ROLES order: no deadlock with one-role restarts
            await lock.acquire()
        try:
            for key in reversed(keys):
                child = self.children.get(key)
                if child and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for key in reversed(keys):
                child = self.children.get(key)
                if child:
                    await self._stop_child(child, "drain", signalled=True)
            for key in keys:
                old = self.children.pop(key, None)
                role = old.role if old else key.partition(".")[0]
                if key not in wanted:
                    continue  # a slot past the wanted count (scaled in meanwhile) stays empty
                # A fresh restart budget (the past ones are spent); an inferencer: its slot's pool.
                new = self._spawn(role, key)
                if old:
                    self._replaced[old.instance] = new.instance
            self._write_state()
            await self._wait_ready()
            self.say(f"global restart done: {len(self.children)} roles live")
        except NexusError as exc:
            self.say(f"global restart failed: {exc.message}")
        finally:
            for lock in locks:
                lock.release()

    # -- stop ----------------------------------------------------------------------------
    async def stop(self) -> None:
        await self._close_control()  # no restarts while the roles are stopped on purpose
        # In stages, so each drain can still talk to the roles it reports to: the workers
        # first (a trainer releases its round, an env worker hands its workloads back to the
        # master), then the master, then health and monitor, which record it all.
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        named = {r for stage in STOP_STAGES for r in stage}
        stages = (*STOP_STAGES, tuple(r for r in self.children if r not in named))
        for stage in stages:
            children = [c for c in self.children.values() if c.role in stage]
            for child in children:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in children:
                while child.proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if child.proc.poll() is None:
                    self.say(f"role {child.role} did not drain in {self.cfg.drain_timeout_s:g} s; killing it")
                    child.proc.kill()
                    child.proc.wait()
        self.children.clear()
        if self.broker is not None:
            self.broker.stop()
        state_path = self.cfg.data_dir / STATE_FILE
        if self.state is not None and state_path.exists():
            state_path.unlink()
        self.say("stopped")
