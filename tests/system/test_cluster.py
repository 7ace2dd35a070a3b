"""The whole foundation for real: `nexus up --detach` starts nats-server and six role processes.

Covers: every role live in `nexus status`; info from every role; bad input to every role's
request subjects gets an error envelope and the role keeps serving; a SIGKILLed role is
reported by the health manager within 5 s (and restarted by the supervisor); W3C trace
context crosses a request into another process; `nexus down` stops everything.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from transport.broker import free_port
from transport.bus import Bus
from transport.cluster import ClusterState, pid_alive
from protocol import ops
from protocol.codec import packb
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, HealthEvent, InfoRequest
from protocol.subjects import ROLES, Names
from protocol.wire import decode, encode
from tests.conftest import nexus_cmd, python_env


def run_nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("cluster")
    port = free_port()
    up = run_nexus("up", "--detach", "--data-dir", str(data_dir), "--nats-port", str(port))
    assert up.returncode == 0, up.stdout + up.stderr
    state = ClusterState.read(data_dir)
    assert state is not None and state.ready
    yield state
    down = run_nexus("down", "--data-dir", str(data_dir))
    assert down.returncode == 0, down.stdout + down.stderr


def status_json(state: ClusterState) -> dict:
    out = run_nexus("status", "--json", "--data-dir", state.data_dir, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_up_prints_where_logs_and_traces_go(cluster):
    assert (Path(cluster.logs_dir) / "supervisor.log").exists()
    assert sorted(r.role for r in cluster.roles) == sorted(ROLES)
    for r in cluster.roles:
        assert pid_alive(r.pid), r


def test_status_shows_all_six_roles_alive(cluster):
    deadline = time.monotonic() + 10
    while True:
        rows = status_json(cluster)["roles"]
        alive = {r["role"] for r in rows if r["state"] == "alive"}
        if alive == set(ROLES) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == set(ROLES)
    for row in rows:
        assert set(row) >= {"role", "instance", "pid", "state", "uptime_s", "last_heartbeat_at"}
        assert row["last_heartbeat_age_s"] < 5
    table = run_nexus("status", "--data-dir", cluster.data_dir, timeout=30).stdout
    assert "ROLE" in table and "LAST HEARTBEAT" in table
    for role in ROLES:
        assert role in table


async def _with_bus(url: str, fn, tracer=None, prefix: str | None = None):
    bus = await Bus.connect(url, name="test", reconnect_forever=False, tracer=tracer, prefix=prefix)
    try:
        return await fn(bus)
    finally:
        await bus.close()


def test_every_role_answers_info(cluster):
    async def go(bus):
        out = {}
        for role in ROLES:
            out[role] = await bus.call(ops.INFO.of(role), InfoRequest(), timeout_s=5)
        return out

    infos = asyncio.run(_with_bus(cluster.nats_url, go, prefix=cluster.prefix))
    by_role = {r.role: r for r in cluster.roles}
    for role, info in infos.items():
        assert info.role == role and info.state == "ready" and "info" in info.ops
        assert info.pid == by_role[role].pid


def _bad_bodies() -> dict[str, tuple[bytes, str]]:
    return {
        "malformed msgpack": (b"\xc1\xff not msgpack", ErrorCode.MALFORMED),
        "truncated": (encode(InfoRequest())[:-3], ErrorCode.MALFORMED),
        "unknown kind": (packb({"kind": "no.such.kind", "v": 1, "body": {}}), ErrorCode.UNKNOWN_KIND),
        "wrong kind for op": (encode(ErrorReply("x", "y")), ErrorCode.UNKNOWN_KIND),
        "missing field": (packb({"kind": "info.request", "v": 1}), ErrorCode.MISSING_FIELD),
        "unknown field": (packb({"kind": "info.request", "v": 1, "body": {"zzz": 1}}), ErrorCode.UNKNOWN_FIELD),
        "not a map": (msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED),
    }


@pytest.mark.parametrize("role", ROLES)
def test_bad_input_gets_error_envelope_and_role_keeps_serving(cluster, role):
    names = Names(cluster.prefix)

    async def go(bus):
        results = {}
        subjects = [ops.INFO.of(role).subject(names)]
        inst = next(r.instance for r in cluster.roles if r.role == role)
        subjects.append(ops.INFO.of(role).instance_subject(names, inst))
        for subject in subjects:
            for label, (data, code) in _bad_bodies().items():
                reply = await bus.nc.request(subject, data, timeout=5)
                err = decode(reply.data)
                assert isinstance(err, ErrorReply), (subject, label)
                assert err.code == code, (subject, label, err)
                assert err.message
                results[(subject, label)] = err
        # An op the role does not have: an error naming the op, not silence.
        reply = await bus.nc.request(names.role_op(role, "submitx"), encode(InfoRequest()), timeout=5)
        err = decode(reply.data)
        assert err.code == ErrorCode.UNKNOWN_OP and "submitx" in err.message
        # And the role still serves.
        info = await bus.call(ops.INFO.of(role), InfoRequest(), timeout_s=5)
        assert info.role == role
        return results

    results = asyncio.run(_with_bus(cluster.nats_url, go, prefix=cluster.prefix))
    missing = results[(ops.INFO.of(role).subject(names), "missing field")]
    assert missing.details.get("field") == "body"


def test_master_submit_subject_rejects_bad_input(cluster):
    # The master's subjects are <prefix>.master.<op>; bad bytes there get an error envelope.
    names = Names(cluster.prefix)

    async def go(bus):
        reply = await bus.nc.request(ops.MASTER_SUBMIT.subject(names), b"\x00garbage", timeout=5)
        return decode(reply.data)

    err = asyncio.run(_with_bus(cluster.nats_url, go))
    assert isinstance(err, ErrorReply) and err.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_OP)


def test_trace_context_crosses_processes(cluster):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    master = next(r for r in cluster.roles if r.role == "master")

    async def go(bus):
        with tracer.start_as_current_span("test-root") as root:
            await bus.call(ops.INFO.of("master"), InfoRequest(), timeout_s=5)
            return format(root.get_span_context().trace_id, "032x")

    trace_id = asyncio.run(_with_bus(cluster.nats_url, go, tracer=tracer, prefix=cluster.prefix))
    client_spans = [s for s in exporter.get_finished_spans() if s.name.startswith("request ")]
    assert client_spans and format(client_spans[0].context.trace_id, "032x") == trace_id
    trace_file = Path(cluster.traces_dir) / f"master-{master.instance}.jsonl"
    deadline = time.monotonic() + 10
    server_span = None
    while server_span is None and time.monotonic() < deadline:
        if trace_file.exists():
            for line in trace_file.read_text().splitlines():
                span = json.loads(line)
                if span["context"]["trace_id"] == "0x" + trace_id:
                    server_span = span
        time.sleep(0.2)
    assert server_span is not None, f"no span of trace {trace_id} in {trace_file}"
    assert server_span["name"] == "master.info"
    assert server_span["kind"] == "SpanKind.SERVER"
    # Its parent is the client's request span, from the other process.
    assert server_span["parent_id"] == "0x" + format(client_spans[0].context.span_id, "016x")


def test_sigkilled_role_is_reported_within_5s_and_restarted(cluster):
    names = Names(cluster.prefix)
    victim = next(r for r in cluster.roles if r.role == "trainer")

    async def go(bus):
        events: asyncio.Queue = asyncio.Queue()

        async def on_event(msg):
            await events.put(decode(msg.data, HealthEvent))

        await bus.nc.subscribe(names.health_event("trainer", victim.instance), cb=on_event)
        await bus.nc.flush()
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        ev = await asyncio.wait_for(events.get(), timeout=10)
        return ev, time.monotonic() - killed

    ev, latency = asyncio.run(_with_bus(cluster.nats_url, go))
    assert ev.event == "role_down" and ev.instance == victim.instance and ev.pid == victim.pid
    assert latency < 5.0, f"health manager took {latency:.2f} s"
    # The supervisor restarts the role under a new instance id; status shows both.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rows = status_json(cluster)["roles"]
        trainers = {r["instance"]: r["state"] for r in rows if r["role"] == "trainer"}
        if trainers.get(victim.instance) == "dead" and "alive" in trainers.values():
            break
        time.sleep(0.5)
    assert trainers.get(victim.instance) == "dead" and "alive" in trainers.values(), trainers


def test_port_taken_names_port_and_flag(cluster, tmp_path):
    from urllib.parse import urlsplit

    port = urlsplit(cluster.nats_url).port  # the URL names the admin's creds file after the port
    out = run_nexus("up", "--detach", "--data-dir", str(tmp_path / "other"), "--nats-port", str(port), timeout=30)
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "--nats-port" in out.stderr


def test_second_up_on_same_data_dir_refused(cluster):
    out = run_nexus("up", "--detach", "--data-dir", cluster.data_dir, "--nats-port", str(free_port()), timeout=30)
    assert out.returncode == 1 and "already running" in out.stderr


def test_status_without_cluster_is_a_clear_error(tmp_path):
    out = run_nexus("status", "--data-dir", str(tmp_path), timeout=30)
    assert out.returncode == 1 and "no cluster found" in out.stderr and "nexus up" in out.stderr


def test_down_stops_everything(tmp_path):
    port = free_port()
    up = run_nexus("up", "--detach", "--data-dir", str(tmp_path), "--nats-port", str(port))
    assert up.returncode == 0, up.stderr
    state = ClusterState.read(tmp_path)
    pids = [r.pid for r in state.roles] + [state.supervisor_pid, state.broker_pid]
    down = run_nexus("down", "--data-dir", str(tmp_path))
    assert down.returncode == 0, down.stderr
    for pid in pids:
        assert not pid_alive(pid), pid
    assert ClusterState.read(tmp_path) is None
    # Every role drained (exit 0), so each logged a clean stop.
    for role in ROLES:
        log = (tmp_path / "logs" / f"{role}.log").read_text()
        assert '"event": "stopped"' in log, role
    again = run_nexus("down", "--data-dir", str(tmp_path))
    assert again.returncode == 0 and "no cluster running" in again.stdout
