"""Tenants isolated by the broker, for real: `nexus up` in operator mode, `nexus tenant create`.

One deployment for the module. Tenant B (its own credentials, its own NATS account) is denied
every operation on tenant A's work: the platform's request-reply ops (each answered
`permission_denied` naming the tenant and the op, and nothing changes), the platform's
streams, KV and object buckets (not in B's account), A's subjects and A's workload events
(B's account does not see them), A's own object store. An anonymous client and credentials
signed by a foreign account are refused; a revoked tenant is disconnected at once; tenants
are added and revoked while the server runs; a tenant's storage quota is its account's
JetStream limit; A's own workload runs end to end on A's credentials (and A hears its events).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import nats.js.errors
import numpy as np
import pytest

from transport.auth import AuthStore
from transport.creds import Credentials
from transport.bus import Bus
from transport.cluster import ClusterState
from protocol import ops
from protocol.errors import NexusError, PermissionDenied, QuotaExceeded, Unauthenticated
from protocol.messages import (
    CheckpointCommitRequest,
    CreateTenantRequest,
    DrainRequest,
    EnvStepRequest,
    ExportRequest,
    GetTenantRequest,
    InfoRequest,
    JobRef,
    JobsReply,
    JobsRequest,
    LeaseReply,
    LeaseRequest,
    LoadWeightsRequest,
    Ok,
    PredictReply,
    PredictRequest,
    QueueGetReply,
    QueueGetRequest,
    QueuePutRequest,
    ReserveRequest,
    RoleInfo,
    SampleRequest,
    SubmitRequest,
    TenantConfig,
    TenantDeleteRequest,
    TenantResetRequest,
    TenantShow,
    TrainBatchReply,
    WeightsRef,
    WorkloadEvent,
    WorkloadRecord,
    WorkloadRef,
    WorkloadsReply,
    WorkloadsRequest,
    JobRecord,
    ListReply,
    ListRequest,
    TenantsReply,
    TenantDeleted,
)
from protocol.subjects import Names, pool_name
from protocol.wire import decode
from sdk.client import AsyncClient
from tests.conftest import SHARED, nexus_cmd, nexus_up, python_env, tenant_create
from tests.master.test_workloads import sft_spec

BASE = "tiny-qwen3-vl-64"


def nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env(NEXUS_INFER_BASE=BASE))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("secure")
    with nexus_up(data_dir, NEXUS_INFER_BASE=BASE) as state:
        infos = {tenant: tenant_create(data_dir, tenant) for tenant in ("alice", "bob")}
        assert all(info["live"] is True for info in infos.values())
        creds = {tenant: info["creds"] for tenant, info in infos.items()}
        yield state, creds


def _url(state: ClusterState) -> str:
    """The cluster's plain address (no credentials: each client names its own)."""
    from transport.creds import redact_url

    return redact_url(state.nats_url)


async def _tenant_bus(state: ClusterState, creds_path: str) -> Bus:
    return await Bus.connect(_url(state), name="test-tenant", reconnect_forever=False, creds=creds_path)


def _item(tenant: str, job: str) -> QueuePutRequest:
    b = 2
    return QueuePutRequest(tenant=tenant, job=job, seq=0,
                           images={"top": np.zeros((b, 64, 64, 3), np.uint8), "wrist": np.zeros((b, 64, 64, 3), np.uint8)},
                           state=np.zeros((b, 4), np.float32), instructions=["reach"] * b,
                           actions=np.zeros((b, 1, 2), np.float32))


def test_deny_matrix_own_workload_and_revocation(deployment, tmp_path):
    state, creds = deployment
    names = Names(state.prefix)

    async def go():
        # A (alice) submits its own small SFT workload and keeps a job of its own open.
        a = await AsyncClient(_url(state), state.prefix, timeout_s=30, creds=creds["alice"]).connect()
        a_events: list = []

        async def on_a_event(msg):
            a_events.append(msg)

        await a.bus.nc.subscribe(names.tenant_events_all("alice"), cb=on_a_event)
        b_heard_a_events: list = []

        async def on_b_event(msg):
            b_heard_a_events.append(msg)

        b_early = await _tenant_bus(state, creds["bob"])
        await b_early.nc.subscribe(names.tenant_events_all("alice"), cb=on_b_event)
        await b_early.nc.flush()
        await a.bus.nc.flush()
        wl = await a.submit(sft_spec("alice", steps=2))
        job = await a.reserve("alice", "sft", auto=False, key="sec-1")
        await a.queue_put(_item("alice", job.job))
        session = await a.env_create("builtin/reach-v0")

        b = await _tenant_bus(state, creds["bob"])
        m = names.master
        trainer = lambda op: names.role_op("trainer", op)  # noqa: E731
        a_cfg = (await a.tenant("alice"))
        cases = {
            "tenant_get": (m("tenant_get"), GetTenantRequest(tenant="alice"), TenantConfig),
            "tenant_create": (m("tenant_create"), CreateTenantRequest(config=a_cfg, exist_ok=True), TenantConfig),
            "tenant_delete": (m("tenant_delete"), TenantDeleteRequest(tenant="alice"), TenantDeleted),
            "tenant_reset": (m("tenant_reset"), TenantResetRequest(tenant="alice"), TenantDeleted),
            "tenant_show": (m("tenant_show"), GetTenantRequest(tenant="alice"), TenantShow),
            "tenants": (m("tenants"), WorkloadsRequest(), TenantsReply),
            "list": (m("list"), ListRequest(), ListReply),
            "reserve": (m("reserve"), ReserveRequest(tenant="alice", task="sft", auto=False), JobRecord),
            "queue_put": (m("queue_put"), _item("alice", job.job), JobRecord),
            "mark_ready": (m("mark_ready"), JobRef(tenant="alice", job=job.job), JobRecord),
            "job": (m("job"), JobRef(tenant="alice", job=job.job), JobRecord),
            "jobs": (m("jobs"), JobsRequest(tenant="alice"), JobsReply),
            "queue_get": (m("queue_get"), QueueGetRequest(tenant="alice", job=job.job), QueueGetReply),
            "queue_clear": (m("queue_clear"), JobRef(tenant="alice", job=job.job), JobRecord),
            "lease": (m("lease"), LeaseRequest(trainer="x", tenant="alice", job=job.job), LeaseReply),
            "checkpoint_commit": (m("checkpoint_commit"), CheckpointCommitRequest(
                tenant="alice", object_name="alice/x", base_checkpoint="", trainer="x"), Ok),
            "workload": (m("workload"), WorkloadRef(workload=wl.id), WorkloadRecord),
            "workload_report": (m("workload_report"), WorkloadRef(workload=wl.id), WorkloadRecord),
            "workloads": (m("workloads"), WorkloadsRequest(tenant="alice"), WorkloadsReply),
            "cancel": (m("cancel"), WorkloadRef(workload=wl.id), WorkloadRecord),
            "submit": (m("submit"), SubmitRequest(spec=sft_spec("alice")), WorkloadRecord),
            "train_batch": (trainer("train_batch"), JobRef(tenant="alice", job=job.job), TrainBatchReply),
            "export_params": (trainer("export_params"), ExportRequest(tenant="alice"), WeightsRef),
            "load_weights into A": (trainer("load_weights"), LoadWeightsRequest(tenant="alice", object_name="bob/v00000001"), Ok),
            "load_weights from A": (trainer("load_weights"), LoadWeightsRequest(tenant="bob", object_name="alice/v00000001"), Ok),
            "master drain": (m("drain"), DrainRequest(reason="b"), Ok),
            "trainer info": (trainer("info"), InfoRequest(), RoleInfo),
            "env step of A's session": (ops.ENV_STEP.instance_subject(names, session.worker),
                                        EnvStepRequest(session=session.session, action=np.zeros(2, np.float32)), Ok),
            "sample outside the data roots": (ops.ENV_SAMPLE.subject(names), SampleRequest(root="/etc", n=1), Ok),
            "sample relative path": (ops.ENV_SAMPLE.subject(names), SampleRequest(root="../../etc", n=1), Ok),
        }
        denied = {}
        for what, (subject, msg, expect) in cases.items():
            try:
                await b.request(subject, msg, expect, timeout_s=30)
                denied[what] = "ALLOWED"
            except NexusError as exc:  # asserted to be PermissionDenied below
                denied[what] = exc
        # predict on A's heads, on A's pool
        try:
            await b.request(names.infer(pool_name(BASE)), PredictRequest(
                tenant="alice", images={"top": np.zeros((64, 64, 3), np.uint8), "wrist": np.zeros((64, 64, 3), np.uint8)},
                state=np.zeros(4, np.float32), instruction="reach", timeout_s=20), PredictReply, timeout_s=30)
            denied["predict"] = "ALLOWED"
        except NexusError as exc:
            denied["predict"] = exc

        # No JetStream at all in B's account: A's stream, the KV buckets, the object store.
        js_denied = {}
        for what, call in {
            "stream_info tq": lambda: b.js.stream_info(names.tq_stream("alice")),
            "stream msg get tq": lambda: b.js.get_msg(names.tq_stream("alice"), 1),
            "consumer on tq": lambda: b.js.pull_subscribe(names.tq_tenant_all("alice"), durable="steal",
                                                          stream=names.tq_stream("alice")),
            "kv tenants": lambda: b.js.key_value(names.kv_tenants),
            "kv versions": lambda: b.js.key_value(names.kv_versions),
            "object weights": lambda: b.js.object_store(names.obj_weights),
            "stream intake": lambda: b.js.stream_info(names.stream_intake),
        }.items():
            try:
                await call()
                js_denied[what] = "ALLOWED"
            except Exception as exc:  # nats.js errors: JetStream not enabled for account
                js_denied[what] = exc
        # A's own object store (in A's account, under A's quota): B's account has none of it.
        await a.put_own_object("alice-data", "x", b"alice's")
        try:
            await b.js.object_store("alice-data")
            js_denied["A's own object store"] = "ALLOWED"
        except Exception as exc:  # nats.js errors: bucket not found (in B's account)
            js_denied["A's own object store"] = exc
        # B's download of A's policy (a tenant downloads through the master): refused.
        bc = await AsyncClient(_url(state), state.prefix, timeout_s=10, creds=creds["bob"]).connect()
        try:
            await bc.download_policy("alice", out_dir=tmp_path)
            denied["download_policy"] = "ALLOWED"
        except NexusError as exc:
            denied["download_policy"] = exc
        await bc.close()

        # A's subjects are not in B's account: B hears nothing of A's puts, and B's publish
        # to the intake subject reaches no platform stream.
        heard = []

        async def hear(msg):
            heard.append(msg)

        sub = await b.nc.subscribe(names.tq_tenant_all("alice"), cb=hear)
        await b.nc.subscribe(">", cb=hear)
        await b.nc.flush()
        admin = await Bus.connect(state.nats_url, name="test-admin", reconnect_forever=False)
        intake_before = (await admin.js.stream_info(names.stream_intake)).state.messages
        second = _item("alice", job.job)
        second.seq = 1
        await a.queue_put(second)
        await b.nc.publish(names.workloads_submit, json.dumps(sft_spec("alice")).encode())
        await b.nc.flush()
        await asyncio.sleep(1.0)
        intake_after = (await admin.js.stream_info(names.stream_intake)).state.messages
        await sub.unsubscribe()

        # Nothing changed for A: its job still filling, its workload not cancelled.
        job_now = await a.job("alice", job.job)
        wl_now = await a.workload(wl.id)
        try:  # B's listing of "every tenant" means B's own (and B has no tenant config yet)
            own_jobs = await b.request(m("jobs"), JobsRequest(), JobsReply, timeout_s=10)
        except NexusError as exc:
            own_jobs = exc
        # A's own workload runs to the end on A's credentials.
        done = await wl.wait(timeout_s=240)
        weights, manifest = await wl.download_policy(out_dir=tmp_path / "alice")
        policy = (weights.stat().st_size, json.loads(manifest.read_text()))
        await asyncio.sleep(0.5)  # the last event's delivery
        js_denied["A's workload events"] = "ALLOWED" if b_heard_a_events else PermissionError("heard none")
        a_heard = {(e.kind, e.state) for e in (decode(m.data, WorkloadEvent) for m in a_events) if e.workload == wl.id}
        await b_early.close()
        await admin.close()
        await b.close()
        await a.close()
        return denied, js_denied, heard, intake_before, intake_after, job_now, wl_now, own_jobs, done, policy, a_heard

    denied, js_denied, heard, ib, ia, job_now, wl_now, own_jobs, done, policy, a_heard = asyncio.run(go())
    allowed = [w for w, e in denied.items() if e == "ALLOWED"]
    assert not allowed, f"tenant B was allowed: {allowed}"
    wrong = {w: e for w, e in denied.items() if not isinstance(e, PermissionDenied)}
    assert not wrong, wrong
    for what, exc in denied.items():
        assert exc.details["caller"] == "bob", (what, exc.details)
    # The message names the op and the tenant touched.
    assert "queue_clear" in denied["queue_clear"].message and "'alice'" in denied["queue_clear"].message
    assert "outside the data roots" in denied["sample outside the data roots"].message
    js_allowed = [w for w, e in js_denied.items() if e == "ALLOWED"]
    assert not js_allowed, f"tenant B reached JetStream: {js_allowed}"
    # B's account has a JetStream of its own: A's and the platform's are simply not in it.
    assert isinstance(js_denied["kv tenants"], nats.js.errors.BucketNotFoundError), js_denied["kv tenants"]
    assert isinstance(js_denied["stream_info tq"], nats.js.errors.NotFoundError), js_denied["stream_info tq"]
    assert len(denied) + len(js_denied) >= 20 + 10
    # A hears its own workload's events, from acceptance to completion.
    assert {k for k, _ in a_heard} >= {"accepted", "state"} and ("state", "completed") in a_heard, a_heard
    # B hears only its own traffic (its publishes, its requests and their replies), never A's puts.
    assert not [m for m in heard if ".tq." in m.subject or ".tenant_events.alice." in m.subject], \
        [m.subject for m in heard]
    assert any(m.subject.endswith("workloads.submit") for m in heard)  # the subscription did work
    assert ia == ib
    assert job_now.state in ("reserved", "filling") and job_now.items == 2
    assert wl_now.state != "cancelled"
    assert "'bob'" in str(own_jobs)  # an empty filter from B means B's own
    assert done.state == "completed", done
    assert policy[0] > 0 and policy[1]  # A downloads its own policy (through the master)


def _foreign_creds(user: str) -> Credentials:
    """A well-formed user JWT named ``user``, signed by an account no operator of ours signed."""
    from transport import nats_jwt

    account, seed = nats_jwt.new_key("account"), nats_jwt.new_key("user")
    token = nats_jwt.encode(account, nats_jwt.public(seed), user, nats_jwt.user_claims([f"nexus-tenant:{user}"]))
    return Credentials(text=nats_jwt.creds_text(token, seed))


def test_anonymous_and_wrong_credentials_are_refused(deployment, tmp_path):
    state, _ = deployment

    async def go():
        errors = []
        for creds in (None, _foreign_creds("bob")):
            try:
                await Bus.connect(_url(state), name="test-anon", reconnect_forever=False, creds=creds)
                errors.append("CONNECTED")
            except Unauthenticated as exc:
                errors.append(exc)
        return errors

    anon, wrong = asyncio.run(go())
    assert isinstance(anon, Unauthenticated) and "Authorization Violation" in anon.message
    assert isinstance(wrong, Unauthenticated) and "user 'bob'" in wrong.message
    bad = _foreign_creds("bob").write(tmp_path / "bad.creds")
    out = nexus("--creds", str(bad), "workloads", "--data-dir", state.data_dir, timeout=60)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "refused the connection" in lines[0] and "Authorization Violation" in lines[0], out.stderr


def test_revoked_tenant_is_disconnected_at_once(deployment):
    state, _ = deployment
    out = nexus("tenant", "create", "carol", "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stderr
    path = json.loads(out.stdout)["creds"]
    creds = Credentials.read(path)

    async def connect():
        return await Bus.connect(_url(state), name="test-carol", reconnect_forever=False, creds=creds,
                                 prefix=state.prefix)

    async def go():
        bus = await connect()
        await bus.call(ops.MASTER_WORKLOADS, WorkloadsRequest(), timeout_s=10)  # works now
        revoke = await asyncio.to_thread(nexus, "tenant", "revoke", "carol", "--data-dir", state.data_dir)
        assert revoke.returncode == 0, revoke.stderr
        deadline = time.monotonic() + 5
        while bus.nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        still = bus.nc.is_connected
        try:
            await connect()
            again = "CONNECTED"
        except Unauthenticated as exc:
            again = exc
        await bus.nc.close()
        gone = "carol" not in AuthStore(state.data_dir).tenants() and not os.path.exists(path)
        # Issued again while the server runs: the new credentials work, the old stay refused.
        out = await asyncio.to_thread(nexus, "tenant", "create", "carol", "--data-dir", state.data_dir, "--json")
        assert out.returncode == 0, out.stderr
        new = await Bus.connect(_url(state), name="test-carol", reconnect_forever=False,
                                creds=Path(json.loads(out.stdout)["creds"]), prefix=state.prefix)
        reply = await new.call(ops.MASTER_WORKLOADS, WorkloadsRequest(), timeout_s=10)
        await new.close()
        try:
            await connect()
            old_again = "CONNECTED"
        except Unauthenticated as exc:
            old_again = exc
        return still, again, gone, reply, old_again

    still, again, gone, reply, old_again = asyncio.run(go())
    assert not still, "the revoked tenant's connection stayed open"
    assert isinstance(again, Unauthenticated) and "Authorization Violation" in again.message
    assert gone
    assert reply.workloads == []
    assert isinstance(old_again, Unauthenticated)


def test_expired_credentials_are_refused_and_their_connection_closed(deployment, tmp_path):
    state, _ = deployment
    ttl_s = 3
    out = nexus("tenant", "create", "erin", "--expires-in", f"{ttl_s}s", "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    creds = Credentials.read(info["creds"])
    assert info["expires_at"] == creds.expires_at and creds.expires_at - time.time() <= ttl_s + 1

    async def go():
        import nats

        bus = await Bus.connect(_url(state), name="test-erin", reconnect_forever=False, creds=creds,
                                prefix=state.prefix)
        await bus.call(ops.MASTER_WORKLOADS, WorkloadsRequest(), timeout_s=10)  # works now
        deadline = creds.expires_at + 5
        while bus.nc.is_connected and time.time() < deadline:
            await asyncio.sleep(0.05)
        closed_at, still = time.time(), bus.nc.is_connected
        await bus.nc.close()
        # nats-server refuses a JWT once `exp` < now in whole seconds: a login within the
        # expiry's own second is still let in, so ask from the next one.
        await asyncio.sleep(max(0.0, creds.expires_at + 1.2 - time.time()))
        # The server itself refuses them now (not only this client's check of the file).
        try:
            nc = await nats.connect(_url(state), allow_reconnect=False, connect_timeout=3,
                                    **creds.connect_options())
            await nc.close()
            server = "CONNECTED"
        except Exception as exc:  # nats.py raises the server's -ERR as it is
            server = str(exc)
        try:
            await Bus.connect(_url(state), name="test-erin", reconnect_forever=False, creds=creds)
            client = "CONNECTED"
        except Unauthenticated as exc:
            client = exc
        return still, closed_at, server, client

    still, closed_at, server, client = asyncio.run(go())
    assert not still, "the connection outlived its credentials"
    assert closed_at >= creds.expires_at - 1  # closed by the expiry, not before it
    assert "Authorization Violation" in server, server
    assert isinstance(client, Unauthenticated) and "expired at" in client.message and "erin" in client.message
    cli = nexus("--creds", info["creds"], "workloads", "--data-dir", state.data_dir, timeout=60)
    lines = [ln for ln in cli.stderr.splitlines() if ln.strip()]
    assert cli.returncode == 1 and len(lines) == 1 and "expired at" in lines[0], cli.stderr
    bad = nexus("tenant", "create", "erin", "--expires-in", "soon", "--data-dir", state.data_dir)
    assert bad.returncode == 2 and "--expires-in" in bad.stderr and "'soon'" in bad.stderr, bad.stderr


def test_tenants_beyond_any_pool_are_added_while_the_server_runs(deployment):
    """70 accounts (the old fixed pool held 64) pushed to the running server one by one; the
    last one's user calls the platform at once, as itself."""
    state, _ = deployment
    store = AuthStore(Path(state.data_dir))

    async def go():
        path = None
        for i in range(70):
            path = store.add_tenant(f"many{i}")
            await store.push(_url(state), f"many{i}")
        bus = await Bus.connect(_url(state), name="test-many", reconnect_forever=False, creds=path,
                                prefix=state.prefix)
        try:
            await bus.call(ops.MASTER_JOBS, JobsRequest(tenant="many0"), timeout_s=10)
            return "ALLOWED"
        except PermissionDenied as exc:
            return exc
        finally:
            await bus.close()

    denied = asyncio.run(go())
    # The server routed the request and asserted the caller: many69 on many0's jobs is denied.
    assert isinstance(denied, PermissionDenied) and denied.details["caller"] == "many69", denied
    assert len([t for t in store.tenants() if t.startswith("many")]) == 70


def test_storage_quota_is_the_tenant_accounts_jetstream_limit(deployment):
    """`nexus tenant create --storage-mb 1`: the tenant's own object store takes 600 KB, and
    the next 600 KB are refused naming the quota and its value; the tenant's requests to the
    platform, and what it stored, are untouched."""
    state, _ = deployment
    out = nexus("tenant", "create", "dora", "--storage-mb", "1", "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["storage_bytes"] == 2**20

    async def go():
        async with AsyncClient(_url(state), state.prefix, timeout_s=30, creds=info["creds"]) as c:
            size = await c.put_own_object("dora-data", "a", b"a" * 600_000)
            try:
                await c.put_own_object("dora-data", "b", b"b" * 600_000)
                over = "STORED"
            except QuotaExceeded as exc:
                over = exc
            kept = await c.get_own_object("dora-data", "a")
            listing = await c.workloads()
            return size, over, kept, listing

    size, over, kept, listing = asyncio.run(go())
    assert size == 600_000
    assert isinstance(over, QuotaExceeded), over
    assert over.details["quota"] == "storage_bytes" and over.details["limit"] == 2**20
    assert "quota storage_bytes=1048576 exceeded" in over.message, over.message
    assert kept == b"a" * 600_000 and listing == []


def test_access_rules_and_path_confinement(tmp_path):
    """The runtime's rules on their own (the server-asserted caller as the header gives it)."""
    from actors.identity import PLATFORM, authorize, caller_from_headers
    from actors.paths import confine
    from transport.datasets import data_roots

    bob = caller_from_headers({"Nats-Request-Info": json.dumps(
        {"acc": "ABOBACCOUNTKEY", "user": "UBOBUSERKEY", "name_tag": "bob", "tags": ["nexus-tenant:bob"]})})
    assert bob.tenant == "bob" and not bob.is_platform and bob.user == "bob"
    # The tenant is the user JWT's tag, never its bare name: a user without it is nobody's.
    untagged = caller_from_headers({"Nats-Request-Info": json.dumps({"acc": "AX", "name_tag": "bob"})})
    assert untagged.tenant is None and not untagged.is_platform
    # A header claiming the platform's own sentinel is no platform caller.
    assert not caller_from_headers({"Nats-Request-Info": json.dumps({"acc": "PLATFORM"})}).is_platform
    assert caller_from_headers(None) is PLATFORM
    assert caller_from_headers({"Nats-Request-Info": "not json"}).tenant is None  # unreadable: nobody
    stranger = caller_from_headers({"Nats-Request-Info": json.dumps({"acc": "OTHER", "user": "bob"})})
    assert stranger.tenant is None and not stranger.is_platform
    assert authorize(bob, "jobs", "tenant", JobsRequest()).tenant == "bob"  # "all" means its own
    assert authorize(bob, "jobs", "tenant", JobsRequest(tenant="bob")).tenant == "bob"
    for access, req in (("tenant", JobsRequest(tenant="alice")), ("admin", JobsRequest(tenant="bob")),
                        ("tenant", InfoRequest())):
        with pytest.raises(PermissionDenied, match="permission denied: tenant 'bob' may not list the jobs"):
            authorize(bob, "jobs", access, req)
    with pytest.raises(PermissionDenied):
        authorize(stranger, "jobs", "tenant", JobsRequest(tenant="bob"))
    assert authorize(PLATFORM, "jobs", "admin", JobsRequest(tenant="alice")).tenant == "alice"

    roots = data_roots(tmp_path, "bob")
    mine = tmp_path / "datasets" / "tenants" / "bob"
    (mine / "mine").mkdir(parents=True)
    (mine / "escape").symlink_to("/etc")
    assert confine(str(mine / "mine"), "root", roots, bob)
    assert confine(str(SHARED / "fixtures" / "lerobot"), "root", roots, bob)
    for bad in ("/etc", str(mine / "escape"), str(mine / ".." / "x"), "datasets/mine"):
        with pytest.raises(PermissionDenied, match="root: "):
            confine(bad, "root", roots, bob)
    assert confine("/etc", "root", roots, PLATFORM) == "/etc"  # the platform is not confined


def test_tenant_delete_removes_its_account_and_credentials(deployment):
    """`nexus tenant delete`: the tenant's user is revoked on the running server (its next
    login refused), and its account and creds file leave the auth store; others stay."""
    state, creds = deployment
    out = nexus("tenant", "create", "fleeting", "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stderr
    path = json.loads(out.stdout)["creds"]
    held = Credentials.read(path)  # a copy the tenant kept
    gone = nexus("tenant", "delete", "fleeting", "--yes", "--json", "--data-dir", state.data_dir)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    removed = json.loads(gone.stdout)["removed"]

    async def login():
        try:
            bus = await Bus.connect(_url(state), name="test-fleeting", reconnect_forever=False, creds=held)
            await bus.close()
            return "CONNECTED"
        except Unauthenticated as exc:
            return exc

    refused = asyncio.run(login())
    store = AuthStore(Path(state.data_dir))
    assert removed.get("accounts") == 1 and removed.get("creds") == 1, removed
    assert isinstance(refused, Unauthenticated), refused
    assert "fleeting" not in store.tenants() and not os.path.exists(path)
    assert "alice" in store.tenants() and os.path.exists(creds["alice"])
