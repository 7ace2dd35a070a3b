"""A real 3-node NATS JetStream cluster from the nats-server wheel: R3 everywhere, failover.

Covers: every stream and bucket of the layout is R3 on the cluster; a tenant's training-queue
stream is R3 with its byte limit and the dedup window; SIGKILL of a tq stream's leader loses
no acknowledged put and writes resume (the time is printed); the killed node restarts on its
store and its replica catches up; a KV put/get survives a node kill; a tenant over its byte
limit gets a clear busy error through the master; `nexus up --nats-cluster 3` runs the
services on the cluster and `nexus down` leaves no nats-server behind.

    python -m pytest tests/transport/test_nats_cluster.py -q -s     # -s shows the measured failover times
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import DiscardPolicy
from nats.js.errors import APIError

from transport.broker import EmbeddedCluster, free_port
from transport.bus import Bus
from transport.layout import (
    bucket_streams,
    kv_buckets,
    object_buckets,
    ensure_layout,
    ensure_tq_stream,
    kv_stream,
    publish_tq,
    read_deployment_settings,
    stream_configs,
)
from transport.cluster import ClusterState, pid_alive
from protocol.errors import Busy, FailedPrecondition
from protocol.messages import DeploymentSettings
from protocol.policy import DEDUP_WINDOW_S
from protocol.subjects import ROLES, Names
from sdk.client import AsyncClient
from tests.conftest import RoleProcs, nexus_cmd, python_env
from tests.support.tq_helpers import micro_batch, tenant

# Generous bounds: a 2-core machine shared with other work elects leaders in seconds, but
# these only stop a broken test from hanging; the real figures are printed.
FAILOVER_BOUND_S = 30.0
CATCH_UP_BOUND_S = 30.0
PUT_TIMEOUT_S = 2.0
POLL_S = 0.1
SMALL_LIMIT = 1024 * 1024  # the smallest per-tenant limit DeploymentSettings allows


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EmbeddedCluster(data_dir=tmp_path_factory.mktemp("nats3"))
    t0 = time.monotonic()
    c.start()
    print(f"\n3-node cluster ready in {time.monotonic() - t0:.2f} s: {c.url}")
    yield c
    c.stop()


@pytest.fixture
def healed(cluster):
    """Every node running before and after the test (a test that kills one restarts it)."""
    for i, node in enumerate(cluster.nodes):
        if not node.alive:
            cluster.restart(i)
    yield cluster
    for i, node in enumerate(cluster.nodes):
        if not node.alive:
            cluster.restart(i)


def run(coro):
    return asyncio.run(coro)


async def connect(cluster: EmbeddedCluster) -> Bus:
    # All three URLs, reconnecting forever: what a role does.
    return await Bus.connect(cluster.url, name="test-cluster", reconnect_forever=True)


async def wait_for(what: str, fn, bound_s: float):
    """Poll ``fn`` (async, returns a truthy value when done) until ``bound_s``; return (value, s)."""
    t0 = time.monotonic()
    last: BaseException | None = None
    while time.monotonic() - t0 < bound_s:
        try:
            value = await fn()
            if value:
                return value, time.monotonic() - t0
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            last = exc
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{what} not within {bound_s:g} s (last error: {last!r})")


def test_layout_and_tq_streams_are_r3(healed):
    names = Names("r3")

    async def go():
        bus = await connect(healed)
        js = bus.js
        try:
            settings = await ensure_layout(js, names, replicas=3)
            assert settings == DeploymentSettings(replicas=3)
            streams = [c.name for c in stream_configs(names)] + bucket_streams(names)
            assert len(streams) == len(stream_configs(names)) + len(kv_buckets(names)) + len(object_buckets(names))
            for stream in streams:
                info = await js.stream_info(stream)
                assert info.config.num_replicas == 3, stream
                assert info.cluster is not None and info.cluster.leader in healed.server_names, stream
                assert len(info.cluster.replicas or []) == 2, stream
            assert await read_deployment_settings(js, names) == settings
            # A layout made R1 first (and a tq stream made before settings existed) is
            # moved to R3, not refused.
            old = Names("r1then3")
            await ensure_layout(js, old, replicas=1)
            await ensure_tq_stream(js, old, "acme", DeploymentSettings(replicas=1))
            settings3 = await ensure_layout(js, old, replicas=3)
            for stream in [c.name for c in stream_configs(old)] + bucket_streams(old):
                assert (await js.stream_info(stream)).config.num_replicas == 3, stream
            await ensure_tq_stream(js, old, "acme", settings3)
            for ns, t in ((names, "acme"), (old, "acme")):
                await ensure_tq_stream(js, ns, t, await read_deployment_settings(js, ns))
                cfg = (await js.stream_info(ns.tq_stream(t))).config
                assert cfg.num_replicas == 3
                assert cfg.max_bytes == settings.tq_max_bytes
                assert cfg.discard == DiscardPolicy.NEW
                assert cfg.duplicate_window == pytest.approx(DEDUP_WINDOW_S)
        finally:
            await bus.close()

    run(go())


async def _publish_until_acked(js, subject: str, msg_id: str, data: bytes, bound_s: float):
    """One put, retried with the same Nats-Msg-Id (so a retry is deduplicated) until acked."""
    t0 = time.monotonic()
    while True:
        try:
            return await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id}, timeout=PUT_TIMEOUT_S)
        except (nats.errors.Error, asyncio.TimeoutError):
            if time.monotonic() - t0 > bound_s:
                raise
            await asyncio.sleep(POLL_S)


def test_tq_leader_kill_loses_nothing_and_the_node_catches_up(healed):
    names = Names("fo")
    settings = DeploymentSettings(replicas=3)
    n_before, n_after = 40, 40

    async def go():
        bus = await connect(healed)
        js = bus.js
        try:
            await ensure_tq_stream(js, names, "acme", settings)
            stream, subject = names.tq_stream("acme"), names.tq_job("acme", "j1")
            acked: dict[str, int] = {}
            for k in range(n_before):
                ack = await _publish_until_acked(js, subject, f"m{k}", f"item {k}".encode(), FAILOVER_BOUND_S)
                acked[f"m{k}"] = ack.seq
            leader = (await js.stream_info(stream)).cluster.leader
            victim = healed.index_of(leader)
            # 1. kill the stream's leader; 2. keep writing; the first ack after the kill is
            # the time writes took to resume.
            healed.kill(victim)
            t_kill = time.monotonic()
            resumed_s = None
            for k in range(n_before, n_before + n_after):
                ack = await _publish_until_acked(js, subject, f"m{k}", f"item {k}".encode(), FAILOVER_BOUND_S)
                assert not ack.duplicate
                acked[f"m{k}"] = ack.seq
                if resumed_s is None:
                    resumed_s = time.monotonic() - t_kill
            info = await js.stream_info(stream)
            assert info.cluster.leader != leader and info.cluster.leader in healed.server_names
            # 3. every acknowledged put is there, once, in order.
            assert info.state.messages == len(acked)
            for msg_id, seq in acked.items():
                got = await js.get_msg(stream, seq)
                assert got.headers["Nats-Msg-Id"] == msg_id
                assert got.data == f"item {msg_id[1:]}".encode()
            # 4. the killed node comes back on its store and its replica becomes current.
            t_restart = time.monotonic()
            healed.restart(victim)
            name = healed.nodes[victim].server_name

            async def caught_up():
                si = await js.stream_info(stream)
                peers = {p.name: p for p in si.cluster.replicas or []}
                me = peers.get(name)
                return (si.cluster.leader == name or (me is not None and me.current and not me.offline)) \
                    and si.state.messages == len(acked)

            _, catch_up_s = await wait_for(f"{name} catching up on {stream}", caught_up, CATCH_UP_BOUND_S)
            print(f"\nleader {leader} SIGKILLed: writes resumed after {resumed_s:.2f} s; "
                  f"{name} restarted and current after {time.monotonic() - t_restart:.2f} s "
                  f"(catch-up poll {catch_up_s:.2f} s); {len(acked)} acked puts, 0 lost")
            # 5. and a put after the restart still lands.
            ack = await _publish_until_acked(js, subject, "after", b"after", FAILOVER_BOUND_S)
            assert ack.seq == max(acked.values()) + 1
        finally:
            await bus.close()

    run(go())


def test_kv_survives_a_node_kill(healed):
    names = Names("kvfo")

    async def go():
        bus = await connect(healed)
        js = bus.js
        try:
            await ensure_layout(js, names, replicas=3)
            kv = await js.key_value(names.kv_jobs)
            await kv.put("acme.j1", b"leased")
            stream = kv_stream(names.kv_jobs)
            victim = healed.index_of((await js.stream_info(stream)).cluster.leader)
            healed.kill(victim)
            t0 = time.monotonic()

            async def put_again():
                return await kv.put("acme.j2", b"ready")

            await wait_for("a KV put after the kill", put_again, FAILOVER_BOUND_S)
            put_s = time.monotonic() - t0
            assert (await kv.get("acme.j1")).value == b"leased"
            assert (await kv.get("acme.j2")).value == b"ready"
            print(f"\nKV leader node killed: next put after {put_s:.2f} s; both keys read back")
        finally:
            await bus.close()

    run(go())


def test_tenant_over_its_byte_limit_gets_a_clear_error(healed):
    names = Names("lim")
    settings = DeploymentSettings(replicas=3, tq_max_bytes=SMALL_LIMIT)

    async def go():
        bus = await connect(healed)
        js = bus.js
        try:
            await ensure_tq_stream(js, names, "acme", settings)
            subject = names.tq_job("acme", "j1")
            chunk = b"x" * (100 * 1024)
            acked = 0
            with pytest.raises(Busy) as err:
                for k in range(20):  # 2 MB: twice the limit
                    await publish_tq(js, names, "acme", subject, chunk, {"Nats-Msg-Id": f"m{k}"}, settings)
                    acked += 1
            assert "acme" in err.value.message and str(SMALL_LIMIT) in err.value.message
            assert err.value.details["tenant"] == "acme" and err.value.details["max_bytes"] == SMALL_LIMIT
            assert err.value.details["retry_after_s"] > 0
            # discard=new: what was accepted before the limit is all still there.
            info = await js.stream_info(names.tq_stream("acme"))
            assert 0 < acked < 20 and info.state.messages == acked and info.state.first_seq == 1
            # Another tenant is not affected by acme's full queue.
            await ensure_tq_stream(js, names, "other", settings)
            await publish_tq(js, names, "other", names.tq_job("other", "j1"), chunk, {"Nats-Msg-Id": "o1"}, settings)
            # A raw JetStream error other than 'maximum bytes exceeded' is not disguised.
            with pytest.raises(APIError) as raw:
                await publish_tq(js, names, "other", names.tq_job("other", "j1"), chunk,
                                 {"Nats-Expected-Stream": "nope"}, settings)
            assert not isinstance(raw.value, Busy)
            # A limit no node can reserve is refused when the tenant's stream is made.
            with pytest.raises(FailedPrecondition) as full:
                await ensure_tq_stream(js, names, "huge", DeploymentSettings(replicas=3, tq_max_bytes=1 << 50))
            assert "'huge'" in full.value.message and str(1 << 50) in full.value.message
        finally:
            await bus.close()

    run(go())


def test_master_on_the_cluster_makes_r3_limited_queues_and_answers_busy(healed, tmp_path):
    """Through a real master process: tenant_create makes the tenant's stream from the
    recorded settings; a queue_put past the limit reaches the client as Busy."""
    names = Names("mst")

    async def layout():
        bus = await connect(healed)
        try:
            await ensure_layout(bus.js, names, replicas=3,
                                settings=DeploymentSettings(replicas=3, tq_max_bytes=SMALL_LIMIT))
        finally:
            await bus.close()

    run(layout())
    procs = RoleProcs(healed.url, names.prefix, tmp_path)
    try:
        procs.start("master")
        cfg = tenant("acme", sft_prefetch_items=64)

        async def go():
            async with AsyncClient(healed.url, prefix=names.prefix) as c:
                await c.create_tenant(cfg)
                job = await c.reserve("acme", "sft")
                with pytest.raises(Busy) as err:
                    for seq in range(64):
                        await c.queue_put(micro_batch(cfg, job.job, seq, b=64))
                bus = await connect(healed)
                try:
                    info = await bus.js.stream_info(names.tq_stream("acme"))
                finally:
                    await bus.close()
                return err.value, info, await c.job("acme", job.job)

        busy, info, rec = run(go())
        assert "'acme'" in busy.message and str(SMALL_LIMIT) in busy.message, busy.message
        assert info.config.num_replicas == 3 and info.config.max_bytes == SMALL_LIMIT
        assert rec.items == info.state.messages > 0  # the accepted puts are counted, nothing more
    finally:
        procs.stop_all()


def _nats_servers_of(data_dir: Path) -> list[int]:
    """Pids of nats-server processes whose config lives under ``data_dir``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"nats-server") and any(str(data_dir).encode() in a for a in cmd):
            found.append(int(pid))
    return found


@pytest.mark.slow  # the CLI path of the same cluster; the default suite tests it via EmbeddedCluster above
def test_nexus_up_nats_cluster_3(tmp_path):
    data_dir = tmp_path / "nexus"

    def nexus(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout, env=python_env())

    t0 = time.monotonic()
    up = nexus("up", "--nats-cluster", "3", "--detach", "--data-dir", str(data_dir), "--nats-port", str(free_port()))
    up_s = time.monotonic() - t0
    try:
        assert up.returncode == 0, up.stdout + up.stderr + _supervisor_log(data_dir)
        state = ClusterState.read(data_dir)
        assert state is not None and state.ready
        urls = state.nats_url.split(",")  # each naming the admin's creds file (docs/security.md)
        assert len(urls) == 3 and all(u.startswith("nats://127.0.0.1:") and u.endswith("/auth/admin.creds") for u in urls)
        assert len(state.broker_pids) == 3 and state.broker_pid == state.broker_pids[0]
        assert all(pid_alive(p) for p in state.broker_pids)
        assert sorted(_nats_servers_of(data_dir)) == sorted(state.broker_pids)
        status = nexus("status", "--json", "--data-dir", str(data_dir), timeout=60)
        assert status.returncode == 0, status.stderr
        alive = {r["role"] for r in json.loads(status.stdout)["roles"] if r["state"] == "alive"}
        assert alive == set(ROLES)

        async def replicas():
            bus = await Bus.connect(state.nats_url, name="test", reconnect_forever=False)
            try:
                names = Names(state.prefix)
                settings = await read_deployment_settings(bus.js, names)
                jobs = await bus.js.stream_info(kv_stream(names.kv_jobs))
                return settings, jobs.config.num_replicas
            finally:
                await bus.close()

        settings, jobs_replicas = run(replicas())
        assert settings.replicas == 3 and jobs_replicas == 3
    finally:
        down = nexus("down", "--data-dir", str(data_dir))
    print(f"\nnexus up --nats-cluster 3: ready in {up_s:.1f} s; total with down {time.monotonic() - t0:.1f} s")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (data_dir / "cluster.json").exists()
    assert _nats_servers_of(data_dir) == []
    assert not any(pid_alive(p) for p in state.broker_pids)


def _supervisor_log(data_dir: Path) -> str:
    path = data_dir / "logs" / "supervisor.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""
