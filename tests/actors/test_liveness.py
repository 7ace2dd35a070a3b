"""No silent death, and the in-place restart (issue #11 items 4 and 5), on real processes.

(a) a critical loop that raises once is restarted and the role keeps serving; one that keeps
raising takes its process down with a non-zero status; (b) a stalled loop is named in the
heartbeats and the health manager declares the role down, naming the loop; (c) under
`nexus up`, a SIGSTOPped (hung) role is killed and replaced through the health manager's
restart request, and the new instance registers ready (recovery time printed); (d) a
``drain`` restart request replaces an instance cleanly; (e) an unknown instance is refused
with an error naming it; (f) a master out of restarts brings one global restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from transport.broker import free_port
from transport.bus import Bus
from actors.runtime import EXIT_LOOP_FAILED
from transport.cluster import ClusterState, pid_alive
from protocol import ops
from protocol.errors import NexusError, NotFound
from protocol.messages import HealthEvent, Heartbeat, InfoRequest, Ok, RestartRequest
from protocol.subjects import Names
from protocol.wire import decode
from tests.conftest import nexus_cmd, python_env
from tests.support.loopy_role import LOOP, LOOPY_FAIL, LOOPY_LOOP_INFO, LOOPY_STALL, FailRequest, LoopInfo, LoopInfoRequest, StallRequest


async def _connect(url: str, prefix: str) -> Bus:
    return await Bus.connect(url, name="test-liveness", reconnect_forever=False, prefix=prefix)


async def _until(fn, timeout_s: float, what: str, every_s: float = 0.1):
    """Poll ``fn`` (async) until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = await fn()
        except NexusError:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


@pytest.fixture
def loopy(nats_url, layout, tmp_path):
    log = open(tmp_path / "loopy.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.loopy_role", "--nats-url", nats_url, "--prefix", layout.prefix,
         "--instance", "l1", "--data-dir", str(tmp_path)],
        env=python_env(), stdout=log, stderr=subprocess.STDOUT)
    yield proc, layout, tmp_path / "loopy.log"
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    log.close()


def _into(queue: asyncio.Queue, kind: type):
    """A subscription callback that decodes each message as ``kind`` into ``queue``."""

    async def cb(msg) -> None:
        queue.put_nowait(decode(msg.data, kind))

    return cb


async def _loop_info(bus: Bus, names: Names) -> LoopInfo:
    return await bus.request(LOOPY_LOOP_INFO.subject(names), LoopInfoRequest(), LoopInfo, timeout_s=2)


def test_failed_loop_restarts_then_exhausted_budget_exits_nonzero(loopy, nats_url):
    proc, names, log_path = loopy

    async def go():
        bus = await _connect(nats_url, names.prefix)
        try:
            await _until(lambda: _loop_info(bus, names), 30, "loopy ready")
            await bus.request(LOOPY_FAIL.subject(names), FailRequest(times=1), Ok, timeout_s=2)
            info = await _until(lambda: _ok_if(_loop_info(bus, names), lambda i: i.starts == 2), 10,
                                "the loop started a second time")
            # Restarted and still serving: the loop iterates again, the role answers.
            await _until(lambda: _ok_if(_loop_info(bus, names), lambda i: i.iterations > info.iterations + 3),
                         10, "the restarted loop iterating")
            role = await bus.call(ops.INFO.of("loopy"), InfoRequest(), timeout_s=2)
            assert role.state == "ready"
            await bus.request(LOOPY_FAIL.subject(names), FailRequest(times=1000), Ok, timeout_s=2)
        finally:
            await bus.close()

    asyncio.run(go())
    assert proc.wait(timeout=30) == EXIT_LOOP_FAILED
    log = log_path.read_text()
    assert "critical loop out of restarts" in log and f"'{LOOP}'" in log, log[-2000:]


async def _ok_if(coro, pred):
    got = await coro
    return got if pred(got) else None


def test_stalled_loop_is_in_heartbeats_and_yields_role_down(loopy, roles, nats_url):
    proc, names, log_path = loopy
    roles.start("health")

    async def go():
        bus = await _connect(nats_url, names.prefix)
        beats: asyncio.Queue = asyncio.Queue(maxsize=1000)
        events: asyncio.Queue = asyncio.Queue(maxsize=100)
        try:
            await bus.nc.subscribe(names.heartbeat("loopy", "l1"),
                                   cb=_into(beats, Heartbeat))
            await bus.nc.subscribe(names.health_event("loopy", "l1"),
                                   cb=_into(events, HealthEvent))
            await _until(lambda: _loop_info(bus, names), 30, "loopy ready")
            hb = await asyncio.wait_for(beats.get(), timeout=5)
            assert LOOP in hb.loops and hb.loops[LOOP] < 1.0 and hb.stalled == []
            await bus.request(LOOPY_STALL.subject(names), StallRequest(), Ok, timeout_s=2)
            while not hb.stalled:
                hb = await asyncio.wait_for(beats.get(), timeout=5)
            assert hb.stalled == [LOOP] and hb.loops[LOOP] > hb.loop_limits_s[LOOP] == 1.0
            ev = await asyncio.wait_for(events.get(), timeout=5)
            # Still beating, still answering: only the loop is dead, and it is named.
            role = await bus.call(ops.INFO.of("loopy"), InfoRequest(), timeout_s=2)
            return ev, role
        finally:
            await bus.close()

    ev, role = asyncio.run(go())
    assert ev.event == "role_down" and ev.instance == "l1"
    assert f"critical loop '{LOOP}' quiet for" in ev.reason, ev.reason
    assert role.state == "ready" and proc.poll() is None


# -- under the supervisor ----------------------------------------------------------------------
def _nexus(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout, env=python_env())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("liveness-cluster")
    up = _nexus("up", "--detach", "--data-dir", str(data_dir), "--nats-port", str(free_port()))
    assert up.returncode == 0, up.stdout + up.stderr
    state = ClusterState.read(data_dir)
    assert state is not None and state.ready
    yield data_dir, state
    down = _nexus("down", "--data-dir", str(data_dir))
    assert down.returncode == 0, down.stdout + down.stderr


async def _successor(data_dir, role: str, old_instance: str) -> str | None:
    state = ClusterState.read(data_dir)
    rec = next((r for r in state.roles if r.role == role), None) if state else None
    return rec.instance if rec and rec.instance != old_instance else None


async def _ready(bus: Bus, names: Names, role: str, instance: str) -> bool:
    info = await bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=2)
    return info.state == "ready"


def test_hung_role_is_killed_and_replaced_in_place(cluster):
    data_dir, state = cluster
    names = Names(state.prefix)
    victim = next(r for r in ClusterState.read(data_dir).roles if r.role == "env")

    async def go():
        bus = await _connect(state.nats_url, state.prefix)
        events: asyncio.Queue = asyncio.Queue(maxsize=100)
        try:
            await bus.nc.subscribe(names.health_event("env", victim.instance),
                                   cb=_into(events, HealthEvent))
            await bus.nc.flush()
            os.kill(victim.pid, signal.SIGSTOP)  # hung: alive, but its heartbeats stop
            stopped = time.monotonic()
            ev = await asyncio.wait_for(events.get(), timeout=10)
            detected = time.monotonic() - stopped
            new = await _until(lambda: _successor(data_dir, "env", victim.instance), 20, "a new env instance")
            await _until(lambda: _ready(bus, names, "env", new), 60, f"{new} ready", every_s=0.05)
            return ev, new, detected, time.monotonic() - stopped
        finally:
            await bus.close()

    try:
        ev, new, detected, recovered = asyncio.run(go())
    finally:
        if pid_alive(victim.pid):
            os.kill(victim.pid, signal.SIGCONT)
    print(f"\nhung env worker: role_down after {detected:.2f} s, new instance ready after {recovered:.2f} s")
    assert ev.event == "role_down" and "no heartbeat" in ev.reason
    assert not pid_alive(victim.pid), "the hung process was not killed"
    log = (data_dir / "logs" / "supervisor.log").read_text()
    assert f"restart request: kill env ({victim.instance})" in log, log[-2000:]


def test_drain_restart_request_replaces_an_instance_cleanly(cluster):
    data_dir, state = cluster
    names = Names(state.prefix)
    old = next(r for r in ClusterState.read(data_dir).roles if r.role == "trainer")

    async def go():
        bus = await _connect(state.nats_url, state.prefix)
        try:
            ok = await bus.request(names.supervisor("restart"),
                                   RestartRequest(role="trainer", instance=old.instance, mode="drain",
                                                  reason="test"), Ok, timeout_s=90)
            new = await _until(lambda: _successor(data_dir, "trainer", old.instance), 5, "a new trainer")
            await _until(lambda: _ready(bus, names, "trainer", new), 90, f"{new} ready")
            return ok, new
        finally:
            await bus.close()

    ok, new = asyncio.run(go())
    assert f"{old.instance} stopped by drain (exit 0)" in ok.detail and new in ok.detail, ok.detail
    assert not pid_alive(old.pid)
    log = (data_dir / "logs" / "trainer.log").read_text()
    assert '"event": "stopped"' in log  # the old instance drained, it was not killed


def test_restart_request_for_unknown_instance_or_role_is_a_clear_error(cluster):
    data_dir, state = cluster
    names = Names(state.prefix)
    live = next(r for r in ClusterState.read(data_dir).roles if r.role == "monitor")

    async def go():
        bus = await _connect(state.nats_url, state.prefix)
        try:
            with pytest.raises(NotFound) as unknown:
                await bus.request(names.supervisor("restart"), RestartRequest(role="monitor", instance="monitor-nope"),
                                  Ok, timeout_s=10)
            with pytest.raises(NotFound) as no_role:
                await bus.request(names.supervisor("restart"), RestartRequest(role="nosuchrole"), Ok, timeout_s=10)
            return unknown.value, no_role.value
        finally:
            await bus.close()

    unknown, no_role = asyncio.run(go())
    assert "unknown instance 'monitor-nope'" in unknown.message and live.instance in unknown.message
    assert "'nosuchrole' is not supervised" in no_role.message
    assert pid_alive(live.pid)  # nothing was restarted


@pytest.mark.slow  # the default suite has the global restart through the master's exhausted budget
def test_global_restart_replaces_every_role(cluster):
    # Last on the module's cluster: every role comes back under a new instance, all ready.
    data_dir, state = cluster
    names = Names(state.prefix)
    before = {r.role: r for r in ClusterState.read(data_dir).roles}

    async def fresh() -> dict[str, str] | None:
        now = {r.role: r.instance for r in ClusterState.read(data_dir).roles}
        return now if set(now) == set(before) and all(now[k] != before[k].instance for k in now) else None

    async def go():
        bus = await _connect(state.nats_url, state.prefix)
        try:
            ok = await bus.request(names.supervisor("restart"), RestartRequest(role="master", mode="global",
                                                                              reason="test"), Ok, timeout_s=10)
            started = time.monotonic()
            now = await _until(fresh, 120, "every role replaced")
            for role, inst in now.items():
                await _until(lambda: _ready(bus, names, role, inst), 120, f"{inst} ready")
            return ok, time.monotonic() - started
        finally:
            await bus.close()

    ok, took = asyncio.run(go())
    print(f"\nglobal restart: every role ready again after {took:.2f} s")
    assert ok.detail == "global restart started"
    assert not any(pid_alive(r.pid) for r in before.values())


# -- small pieces, in process ------------------------------------------------------------------
def test_restart_budget_counts_within_its_window():
    from collections import deque

    from protocol.policy import RestartBudget

    budget, history = RestartBudget("t", max_restarts=2, window_s=10.0), deque()
    assert budget.spend(history, 0.0) and budget.spend(history, 1.0)
    assert not budget.spend(history, 2.0)  # spent: 2 in 10 s
    assert budget.spend(history, 11.5)  # the first one left the window


def test_heartbeat_from_an_older_sender_decodes_with_no_loops():
    from protocol.codec import packb

    body = {"role": "x", "instance": "i", "pid": 1, "host": "h", "started_at": 0.0, "sent_at": 0.0, "seq": 1,
            "state": "ready", "in_flight": 0, "interval_s": 1.0}
    hb = decode(packb({"kind": "heartbeat", "v": 1, "body": body}), Heartbeat)
    assert hb.loops == {} and hb.stalled == [] and hb.loop_limits_s == {}


def test_critical_spawn_needs_a_factory(tmp_path):
    from actors.runtime import RoleConfig
    from tests.support.loopy_role import LoopyRole

    async def go():
        role = LoopyRole(RoleConfig(data_dir=tmp_path, instance="u1"))
        coro = role._loop()
        try:
            with pytest.raises(TypeError, match="needs a factory"):
                role.spawn(coro, "x", critical=True)
        finally:
            coro.close()
        with pytest.raises(KeyError, match="no critical loop"):
            role.tick("nope")

    asyncio.run(go())


def test_master_out_of_restarts_triggers_one_global_restart(nats_url, prefix, tmp_path):
    # In process, on the session's nats-server: a supervisor whose master may not be restarted
    # at all (budget 0), so its first crash means "the master cannot come back".
    import io

    from actors.supervisor.supervisor import Supervisor
    from transport.cluster import SupervisorConfig
    from protocol.policy import RestartBudget

    out = io.StringIO()
    cfg = SupervisorConfig(data_dir=tmp_path, nats_url=nats_url, prefix=prefix, roles=("health", "monitor", "master"),
                           restart=RestartBudget("test_none", max_restarts=0, window_s=60.0),
                           global_restart=RestartBudget("test_global", max_restarts=1, window_s=600.0, backoff_s=0.1))
    sup = Supervisor(cfg, out=out)

    async def go():
        run = asyncio.ensure_future(sup.run())
        try:
            await _until(lambda: _ok_if(asyncio.sleep(0, sup.state), lambda s: s is not None and s.ready),
                         90, "the supervisor ready")
            before = {r: c.instance for r, c in sup.children.items()}
            os.kill(sup.children["master"].proc.pid, signal.SIGKILL)
            await _until(lambda: _ok_if(asyncio.sleep(0, out.getvalue()), lambda t: "global restart done" in t),
                         120, "the global restart")
            after = {r: c.instance for r, c in sup.children.items()}
            return before, after
        finally:
            sup._stopping.set()
            await asyncio.wait_for(run, timeout=90)

    before, after = asyncio.run(go())
    text = out.getvalue()
    assert "global restart: master cannot come back" in text, text
    assert set(after) == set(before) and all(after[r] != before[r] for r in before), (before, after)


def test_a_registration_the_broker_refused_is_written_again_with_the_heartbeats(nats_url, layout, tmp_path):
    """The services bucket is gone when the role comes up, so its one registration at `ready`
    fails; once the bucket is back the heartbeat loop writes the record. (A replacement
    inferencer whose only write fell into a NATS node's loss stayed unregistered for good, so
    nothing saw it ready: the default suite's chaos run, CI of stop 35.)"""
    from protocol.messages import ServiceRecord

    names = layout

    async def drop_bucket():
        bus = await _connect(nats_url, names.prefix)
        try:
            await bus.js.delete_key_value(names.kv_services)
        finally:
            await bus.close()

    asyncio.run(drop_bucket())
    log_path = tmp_path / "loopy.log"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.loopy_role", "--nats-url", nats_url, "--prefix", names.prefix,
             "--instance", "l1", "--data-dir", str(tmp_path)],
            env=python_env(NEXUS_HEARTBEAT_INTERVAL_S="0.3"), stdout=log, stderr=subprocess.STDOUT)
        try:
            async def go():
                bus = await _connect(nats_url, names.prefix)
                try:
                    await _until(lambda: _loop_info(bus, names), 30, "loopy ready")
                    await _until(_async(lambda: "service registration failed" in log_path.read_text()), 10,
                                 "the failed registration in the role's log")
                    kv = await bus.js.create_key_value(bucket=names.kv_services, history=1)

                    async def registered():
                        try:
                            entry = await kv.get(Names.service_key("loopy", "l1"))
                        except Exception:  # noqa: BLE001 - not written yet
                            return None
                        return decode(entry.value, ServiceRecord)

                    return await _until(registered, 15, "the record written by the heartbeat loop")
                finally:
                    await bus.close()

            rec = asyncio.run(go())
        finally:
            proc.kill()
            proc.wait(timeout=10)
    assert rec.state == "ready" and rec.instance == "l1"
    assert "service registered after retry" in log_path.read_text()


def _async(fn):
    async def call():
        return fn()

    return call
