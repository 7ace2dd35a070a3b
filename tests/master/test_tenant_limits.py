"""A tenant's limits are the operator's, and each shared role bounds what one tenant holds.

One `nexus up --detach` deployment in operator mode for the module (one env worker, one
inferencer), with small per-tenant bounds so they are reached in a test. Checked for real:

- a tenant's own ``tenant_create`` cannot carry quotas, nor a priority or caps above the
  operator's ceilings (each refusal names the field and what is allowed, and stores nothing:
  no tenant record, no queue stream); a submitted spec is bounded the same way; the
  operator sets quotas with `nexus tenant quotas` and a tenant's re-create keeps them;
- a tenant account's connection, subscription and message-size limits (its account JWT,
  `nexus tenant create --max-conns / --max-subs / --max-payload-kb`) are enforced by
  nats-server, and other tenants' accounts are unaffected;
- an env worker holds at most NEXUS_ENV_MAX_SESSIONS_PER_TENANT sessions of one tenant, an
  inferencer at most NEXUS_INFER_MAX_QUEUED_PER_TENANT requests of one tenant, and a dataset
  ``sample`` reads at most SAMPLE_MAX_FRAMES frames.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import nats
import pytest

from transport.auth import AuthStore
from transport.creds import redact_url
from transport.bus import Bus
from transport.cluster import ClusterState
from protocol import ops
from protocol.errors import InvalidField, NotFound, PermissionDenied, QuotaExceeded
from protocol.messages import (
    CreateTenantRequest,
    DatasetBatch,
    ErrorReply,
    PredictReply,
    PredictRequest,
    SampleRequest,
    TenantQuotas,
    TenantQuotasRequest,
)
from protocol.policy import SAMPLE_MAX_FRAMES
from protocol.subjects import Names
from protocol.wire import decode, encode, packb
from sdk.client import AsyncClient
from tests.conftest import nexus_cmd, nexus_up, python_env
from tests.actors.test_usage import obs
from tests.master.test_workloads import sft_spec
from tests.support.tq_helpers import BASE, tenant

SESSIONS_PER_TENANT = 2
QUEUED_PER_TENANT = 2


def nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env(NEXUS_INFER_BASE=BASE,
                                         NEXUS_ENV_MAX_SESSIONS_PER_TENANT=str(SESSIONS_PER_TENANT),
                                         NEXUS_INFER_MAX_QUEUED_PER_TENANT=str(QUEUED_PER_TENANT)))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with nexus_up(tmp_path_factory.mktemp("limits"), NEXUS_INFER_BASE=BASE,
                  NEXUS_ENV_MAX_SESSIONS_PER_TENANT=str(SESSIONS_PER_TENANT),
                  NEXUS_INFER_MAX_QUEUED_PER_TENANT=str(QUEUED_PER_TENANT)) as state:
        yield state


def creds_for(state: ClusterState, name: str, *flags: str) -> dict:
    out = nexus("tenant", "create", name, "--data-dir", state.data_dir, "--json", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout)
    assert info["live"] is True
    return info


def _url(state: ClusterState) -> str:
    return redact_url(state.nats_url)


async def _stream_exists(admin: AsyncClient, name: str) -> bool:
    try:
        await admin.bus.js.stream_info(admin.names.tq_stream(name))
        return True
    except nats.js.errors.NotFoundError:
        return False


def test_quotas_and_ceilings_are_the_operators(deployment):
    state = deployment
    info = creds_for(state, "alice")
    cfg = tenant("alice")

    async def attempt(c: AsyncClient, **changes) -> InvalidField:
        bad = tenant("alice", **changes)
        with pytest.raises(InvalidField) as err:
            await c.create_tenant(bad)
        return err.value

    async def go():
        admin = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        a = await AsyncClient(_url(state), state.prefix, timeout_s=30, creds=info["creds"]).connect()
        try:
            refused = {
                "quotas": await attempt(a, quotas=TenantQuotas(max_inflight_jobs=10_000, max_priority=10)),
                "priority": await attempt(a, priority=11),
                "inflight": await attempt(a, max_inflight_jobs=9),  # the default quota is 8
                "prefetch": await attempt(a, sft_prefetch_items=5000),
                "staleness": await attempt(a, staleness_bound=10**6),
            }
            # Nothing of alice exists after the refusals: no record, no queue stream.
            with pytest.raises(NotFound):
                await admin.tenant("alice")
            assert not await _stream_exists(admin, "alice")
            created = await a.create_tenant(cfg)
            assert created.quotas is None and await _stream_exists(admin, "alice")
            return refused, created
        finally:
            await a.close()
            await admin.close()

    refused, created = asyncio.run(go())
    assert refused["quotas"].field == "config.quotas"
    assert "set by the operator" in refused["quotas"].message
    assert refused["priority"].field == "config.priority" and "-10..10" in refused["priority"].message
    assert refused["inflight"].field == "config.max_inflight_jobs" and "1..8" in refused["inflight"].message
    assert refused["prefetch"].field == "config.sft_prefetch_items" and "1..4096" in refused["prefetch"].message
    assert refused["staleness"].field == "config.staleness_bound" and "1..100000" in refused["staleness"].message

    # The operator sets them (`nexus tenant quotas`, the admin's credentials), some at a time.
    out = nexus("tenant", "quotas", "alice", "--max-priority", "2", "--max-inflight-jobs", "3",
                "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    quotas = json.loads(out.stdout)["quotas"]
    assert (quotas["max_priority"], quotas["max_inflight_jobs"], quotas["predict_burst"]) == (2, 3, 256)
    out = nexus("tenant", "quotas", "alice", "--predict-burst", "7", "--data-dir", state.data_dir, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    quotas = json.loads(out.stdout)["quotas"]
    assert (quotas["max_priority"], quotas["max_inflight_jobs"], quotas["predict_burst"]) == (2, 3, 7)
    # ...never the tenant: its credentials are refused by the op and by the CLI.
    out = nexus("--creds", info["creds"], "tenant", "quotas", "alice", "--max-priority", "10",
                "--data-dir", state.data_dir)
    assert out.returncode != 0 and "permission" in (out.stdout + out.stderr).lower(), out.stdout + out.stderr

    async def after():
        admin = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        a = await AsyncClient(_url(state), state.prefix, timeout_s=30, creds=info["creds"]).connect()
        try:
            before = encode(await admin.tenant("alice"))
            with pytest.raises(PermissionDenied):
                await a.bus.call(ops.MASTER_TENANT_QUOTAS,
                                 TenantQuotasRequest(tenant="alice", changes={"max_priority": 10}), timeout_s=10)
            # The same config again: accepted as it is, the operator's quotas kept.
            again = await a.bus.call(ops.MASTER_TENANT_CREATE,
                                     CreateTenantRequest(config=tenant("alice"), exist_ok=True), timeout_s=30)
            own = await attempt(a, quotas=TenantQuotas(max_priority=10))
            prio = await attempt(a, priority=3)  # above its max_priority quota now
            # A spec is bounded by the same quotas; nothing of it is accepted.
            spec_errors = []
            for schedule in ({"priority": 5}, {"max_inflight_jobs": 4}):
                spec = sft_spec("alice", steps=2)
                spec["schedule"] = {**spec.get("schedule", {}), **schedule}
                with pytest.raises(InvalidField) as err:
                    await a.submit(spec)
                spec_errors.append(err.value)
            workloads = await admin.workloads("alice")
            return before, encode(await admin.tenant("alice")), again, own, prio, spec_errors, workloads
        finally:
            await a.close()
            await admin.close()

    before, stored, again, own, prio, spec_errors, workloads = asyncio.run(after())
    assert stored == before, "a refused request changed the tenant"
    assert again.quotas == TenantQuotas(max_inflight_jobs=3, max_priority=2, predict_burst=7)
    assert own.field == "config.quotas"
    assert prio.field == "config.priority" and "max_priority=2" in prio.message
    assert spec_errors[0].field == "schedule.priority" and "-10..2" in spec_errors[0].message
    assert spec_errors[1].field == "schedule.max_inflight_jobs" and "1..3" in spec_errors[1].message
    assert workloads == []


def test_account_limits_are_enforced_by_the_server(deployment):
    """carol: 2 connections, 4 subscriptions each, 4 KiB messages; dave: the defaults."""
    state = deployment
    carol = creds_for(state, "carol", "--max-conns", "2", "--max-subs", "4", "--max-payload-kb", "4")
    assert (carol["max_conns"], carol["max_subs"], carol["max_payload"]) == (2, 4, 4096)
    dave = creds_for(state, "dave")
    assert (dave["max_conns"], dave["max_subs"], dave["max_payload"]) == (16, 256, 2**20)
    url = _url(state)

    async def connect(creds: str, errors: list | None = None):
        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        return await nats.connect(url, user_credentials=creds, allow_reconnect=False, max_reconnect_attempts=0,
                                  connect_timeout=5, error_cb=on_error)

    async def go():
        out = {}
        held = [await connect(carol["creds"]), await connect(carol["creds"])]
        try:
            await connect(carol["creds"])
            out["third"] = "CONNECTED"
        except Exception as exc:  # nats.py raises the server's -ERR as its own error
            out["third"] = str(exc)
        # Another tenant's account: its own limit (16), carol's two do not count.
        others = [await connect(dave["creds"]) for _ in range(3)]
        out["dave_connected"] = sum(nc.is_connected for nc in others)
        # A message over carol's 4 KiB: the server refuses it and closes that connection;
        # one under it goes through; dave's 8 KiB message is fine.
        small = await held[0].request(ops.MASTER_LIST.subject(Names(state.prefix)), b"x" * 1000, timeout=10)
        out["small_reply"] = len(small.data) > 0
        await held[1].close()  # room for the next one
        big_errors: list = []
        big = await connect(carol["creds"], big_errors)
        await big.publish("carol.big", b"y" * 8192)
        for _ in range(100):
            if big.is_closed or any("payload" in e.lower() for e in big_errors):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        out["big"] = (big.is_closed or not big.is_connected, list(big_errors))
        # Just under the limit: the connection stays.
        if not big.is_closed:
            await big.close()
        under = await connect(carol["creds"])
        await dave_publish(under, 4000)
        out["under_still_connected"] = under.is_connected
        await under.close()
        await dave_publish(others[0], 8192)
        out["dave_still_connected"] = others[0].is_connected
        # carol's subscriptions past 4 on one connection are refused.
        await held[0].close()
        sub_errors: list = []
        subber = await connect(carol["creds"], sub_errors)
        got: list = []

        async def heard(msg) -> None:
            got.append(msg.subject)

        for i in range(4):
            await subber.subscribe(f"carol.sub.{i}", cb=heard)
        await subber.flush()
        pub = await connect(carol["creds"])
        for i in range(4):
            await pub.publish(f"carol.sub.{i}", b"m")
        await pub.flush()
        await asyncio.sleep(0.5)
        await pub.close()
        await subber.subscribe("carol.sub.4", cb=heard)  # the 5th: the server refuses it
        for _ in range(100):
            if subber.is_closed or subber.last_error is not None:
                break
            await asyncio.sleep(0.05)
        out["subs"] = (sorted(got), str(subber.last_error or ""), list(sub_errors))
        for nc in [*others, subber]:
            if not nc.is_closed:
                await nc.close()
        return out

    async def dave_publish(nc, size: int) -> None:
        await nc.publish("limits.msg", b"z" * size)
        await nc.flush(timeout=5)
        await asyncio.sleep(0.2)

    out = asyncio.run(go())
    assert "maximum account active connections exceeded" in out["third"].lower(), out["third"]
    assert out["dave_connected"] == 3
    assert out["small_reply"]
    closed, errors = out["big"]
    # The server answers -ERR 'Maximum Payload Violation' and closes the connection (the
    # client may see the reset before it reads the error).
    assert closed and all("payload" in e.lower() or "reset" in e.lower() or "closed" in e.lower()
                          for e in errors), out["big"]
    assert out["under_still_connected"] and out["dave_still_connected"]
    # 4 subscriptions hear their messages; the 5th is refused by the server (-ERR, on which
    # nats.py closes the connection).
    assert out["subs"][0] == [f"carol.sub.{i}" for i in range(4)], out["subs"]
    assert "maximum subscriptions exceeded" in out["subs"][1].lower(), out["subs"]

    # The operator raises carol's connections (created again: re-signed and pushed); the
    # other limits are kept as they were, and kept in auth/state.json.
    again = creds_for(state, "carol", "--max-conns", "3")
    assert (again["max_conns"], again["max_subs"], again["max_payload"]) == (3, 4, 4096)
    store = AuthStore(state.data_dir)
    assert store.account_limits("carol") == {"max_conns": 3, "max_subs": 4, "max_payload": 4096}

    async def three():
        ncs = [await connect(again["creds"]) for _ in range(3)]
        n = sum(nc.is_connected for nc in ncs)
        for nc in ncs:
            await nc.close()
        return n

    assert asyncio.run(three()) == 3


def test_env_sessions_per_tenant(deployment):
    state = deployment
    erin, fred = creds_for(state, "erin"), creds_for(state, "fred")

    async def go():
        e = await AsyncClient(_url(state), state.prefix, timeout_s=30, creds=erin["creds"]).connect()
        f = await AsyncClient(_url(state), state.prefix, timeout_s=30, creds=fred["creds"]).connect()
        admin = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        try:
            mine = [await e.env_create("builtin/reach-v0") for _ in range(SESSIONS_PER_TENANT)]
            with pytest.raises(QuotaExceeded) as err:
                await e.env_create("builtin/reach-v0")
            held = (await admin.info("env")).extra["sessions"]
            other = await f.env_create("builtin/reach-v0")  # another tenant: its own bound
            await e.env_close(mine.pop())
            mine.append(await e.env_create("builtin/reach-v0"))  # room again
            for s in mine:
                await e.env_close(s)
            await f.env_close(other)
            return err.value, held
        finally:
            for c in (e, f, admin):
                await c.close()

    exc, held = asyncio.run(go())
    assert (exc.quota, exc.limit) == ("env_sessions_per_tenant", SESSIONS_PER_TENANT)
    assert "NEXUS_ENV_MAX_SESSIONS_PER_TENANT" in exc.message and "tenant 'erin'" in exc.message
    assert held == SESSIONS_PER_TENANT  # the refused create opened nothing


def test_inferencer_holds_a_bounded_share_per_tenant(deployment):
    state = deployment
    flood, calm = tenant("gina"), tenant("hank", seed=1)

    async def go():
        admin = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        try:
            for cfg in (flood, calm):
                await admin.create_tenant(cfg)
            subject = admin.names.infer((await admin.info("inferencer")).extra["pool"])
            images, st = obs(flood.schema, 0)

            async def raw(name: str, i: int):
                data = encode(PredictRequest(tenant=name, images=images, state=st, instruction="pick",
                                             request_id=f"{name}-{i}"))
                return decode((await admin.bus.nc.request(subject, data, timeout=60)).data)

            # Warm both heads first (a first request loads one), then the flood and one calm request at once.
            await raw(flood.name, -1)
            await raw(calm.name, -1)
            replies = await asyncio.gather(*[raw(flood.name, i) for i in range(12)], raw(calm.name, 0))
            info = (await admin.info("inferencer")).extra
            return replies, info
        finally:
            await admin.close()

    replies, info = asyncio.run(go())
    *flooded, calm_reply = replies
    refused = [r for r in flooded if isinstance(r, ErrorReply)]
    served = [r for r in flooded if isinstance(r, PredictReply)]
    assert isinstance(calm_reply, PredictReply), calm_reply  # the other tenant is served
    assert served and refused, flooded
    for r in refused:
        assert r.code == "quota_exceeded", r
        assert r.details["quota"] == "max_queued_per_tenant" and r.details["limit"] == QUEUED_PER_TENANT
        assert "NEXUS_INFER_MAX_QUEUED_PER_TENANT" in r.message and r.details["retry_after_s"] > 0
    assert info["max_queued_per_tenant"] == QUEUED_PER_TENANT and info["tenant_refused"] >= len(refused)
    assert info["held"] == 0


def test_sample_is_bounded_at_decode(deployment):
    state = deployment
    ivy = creds_for(state, "ivy")
    with pytest.raises(InvalidField) as n_err:
        SampleRequest(root="x", n=SAMPLE_MAX_FRAMES + 1)
    with pytest.raises(InvalidField) as idx_err:
        SampleRequest(root="x", n=1, indices=list(range(SAMPLE_MAX_FRAMES + 1)))
    SampleRequest(root="x", n=1, indices=list(range(SAMPLE_MAX_FRAMES)))  # the bound itself is fine

    async def go():
        bus = await Bus.connect(_url(state), name="test-ivy", reconnect_forever=False, creds=ivy["creds"])
        try:
            # Sent raw, as a hostile client would (its own code skips the check).
            body = {"root": "/nowhere", "n": 1, "seed": None, "indices": list(range(10_000))}
            data = packb({"kind": SampleRequest.KIND, "v": SampleRequest.VERSION, "body": body})
            reply = await bus.nc.request(ops.ENV_SAMPLE.subject(Names(state.prefix)), data, timeout=30)
            return decode(reply.data)
        finally:
            await bus.close()

    reply = asyncio.run(go())
    assert n_err.value.field == "n" and str(SAMPLE_MAX_FRAMES) in n_err.value.message
    assert idx_err.value.field == "indices" and "at most 32" in idx_err.value.message
    assert not isinstance(reply, DatasetBatch)
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_field", reply
    assert reply.details["field"] == "indices" and "10000 frames" in reply.message and "at most 32" in reply.message
