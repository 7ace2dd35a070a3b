"""Inference failover and bounded work, with real processes: predict rides out an inferencer
SIGKILL + restart and a drain, a retried request id is answered once, the inferencer's queues
and the runtime's pending requests are bounded (Busy with a retry hint, nothing hangs), and an
eval workload survives its inferencer being killed and restarted mid-run. Also the chunk seqs
of a split queue_put, which must never collide with ordinary seqs."""

from __future__ import annotations

import asyncio
import copy
import itertools
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from transport.bus import Bus
from protocol import ops
from protocol.errors import Busy, NexusError
from protocol.messages import (
    CHUNK_SEQ_FLAG,
    MAX_CHUNK_PARTS_LOG2,
    MAX_ITEM_SEQ,
    InfoRequest,
    Ok,
    PredictReply,
    PredictRequest,
    RoleInfo,
    chunk_seq,
    is_chunk_seq,
)
from protocol.wire import decode, encode
from sdk.client import AsyncClient
from tests.conftest import python_env
from tests.support.slow_role import SLOW_SLEEP, SleepRequest
from tests.actors.test_inference import obs
from tests.support.tq_helpers import BASE, micro_batch, tenant


async def _info(c: AsyncClient, instance: str) -> RoleInfo:
    return await c.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=instance, timeout_s=10)


def _request(cfg, seed: int = 0, request_id: str = "", timeout_s: float = 30.0, sample: bool = True) -> PredictRequest:
    images, state = obs(cfg.schema, seed)
    return PredictRequest(tenant=cfg.name, images=images, state=state, instruction="pick up the block",
                          sample=sample, timeout_s=timeout_s, request_id=request_id)


class Load:
    """Callers predicting in a loop through the SDK, each call with the workflows' signature."""

    def __init__(self, c: AsyncClient, cfg, callers: int = 3, timeout_s: float = 90.0) -> None:
        self.c, self.cfg, self.timeout_s = c, cfg, timeout_s
        self.ok, self.failed = 0, []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._caller(k)) for k in range(callers)]

    async def _caller(self, k: int) -> None:
        for i in itertools.count():
            if self.stop.is_set():
                return
            images, state = obs(self.cfg.schema, k * 100_000 + i)
            try:
                await self.c.predict(self.cfg.name, images, state, "pick up the block", timeout_s=self.timeout_s)
                self.ok += 1
            except Exception as exc:  # counted: the assertion is that there are none
                self.failed.append(repr(exc))

    async def until_ok(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ok < n:
            assert time.monotonic() < deadline, f"only {self.ok} predicts completed; failed: {self.failed[:3]}"
            await asyncio.sleep(0.1)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


def _start(roles, *args, **env):
    return asyncio.get_running_loop().run_in_executor(None, lambda: roles.start(*args, **env))


def test_sigkill_the_only_inferencer_then_restart_no_predict_fails(roles):
    roles.start("master")
    first = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfg = tenant("fo-kill", seed=1)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            load = Load(c, cfg)
            await load.until_ok(5)
            first.send_signal(signal.SIGKILL)  # calls in flight now lose their replies
            await asyncio.get_running_loop().run_in_executor(None, first.wait, 10)
            at_kill = load.ok
            await asyncio.sleep(1.0)  # a real outage: no instance at all
            second = await _start(roles, "inferencer", NEXUS_INFER_BASE=BASE)
            await load.until_ok(at_kill + 10)
            await load.finish()
            return load, at_kill, await _info(c, second.instance)
        finally:
            await c.close()

    load, at_kill, info = asyncio.run(go())
    assert load.failed == []
    assert first.returncode == -signal.SIGKILL
    assert load.ok >= at_kill + 10 and info.extra["served"] >= 10  # the new instance took over


def test_a_first_predict_rides_out_a_master_restart(roles):
    """A client's first predict of a tenant reads the tenant's base from the master (its
    inference pool): with the master killed then, the call waits for the restarted one within
    its deadline instead of failing (CI: an eval workload failed on `no role is serving
    nexus.master.tenant_get` when the chaos run killed the master at its first episode)."""
    master = roles.start("master")
    roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfg = tenant("fo-master", seed=1)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        fresh = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            master.send_signal(signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, master.wait, 10)
            images, state = obs(cfg.schema, 0)
            call = asyncio.ensure_future(fresh.predict(cfg.name, images, state, "pick up the block", timeout_s=60))
            await asyncio.sleep(1.5)  # a real outage: no master at all
            assert not call.done(), call.result() if not call.exception() else call.exception()
            await _start(roles, "master")
            return await asyncio.wait_for(call, 60)
        finally:
            await fresh.close()
            await c.close()

    reply = asyncio.run(go())
    assert master.returncode == -signal.SIGKILL
    assert len(reply.actions) > 0


def test_drain_under_load_with_a_second_instance_fails_nothing(roles):
    roles.start("master")
    first = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    second = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfg = tenant("fo-drain", seed=2)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            load = Load(c, cfg, callers=4)
            await load.until_ok(10)
            first.send_signal(signal.SIGTERM)
            code = await asyncio.get_running_loop().run_in_executor(None, first.wait, 60)
            at_exit = load.ok
            await load.until_ok(at_exit + 10)
            await load.finish()
            return load, code, await _info(c, second.instance)
        finally:
            await c.close()

    load, code, info = asyncio.run(go())
    assert load.failed == []
    assert code == 0  # drained cleanly
    assert info.extra["served"] > 0
    log = roles.log(first.instance)
    assert '"event": "draining"' in log and '"event": "stopped"' in log


def test_a_retried_request_id_is_answered_once(roles):
    roles.start("master")
    # A wide batching window: two copies of one request sent together are certainly both held.
    inf = roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="0.5")
    # A sampling (gaussian) head: a second forward of the same observation would give other actions.
    cfg = tenant("fo-once", head="gaussian", seed=3)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            subject = c.names.infer("tiny-qwen3-vl")
            raw = encode(_request(cfg, 7, request_id="retry-1"))
            # 1. Sequential: the retry comes after the reply (the caller lost it).
            a = (await c.bus.nc.request(subject, raw, timeout=30)).data
            b = (await c.bus.nc.request(subject, raw, timeout=30)).data
            after_sequential = (await _info(c, inf.instance)).extra
            # 2. Concurrent: the retry arrives while the first is still queued.
            raw2 = encode(_request(cfg, 7, request_id="retry-2"))
            d, e = await asyncio.gather(c.bus.nc.request(subject, raw2, timeout=30),
                                        c.bus.nc.request(subject, raw2, timeout=30))
            after_concurrent = (await _info(c, inf.instance)).extra
            # 3. The same observation under a fresh id is worked afresh (and samples anew).
            f = (await c.bus.nc.request(subject, encode(_request(cfg, 7, request_id="fresh")), timeout=30)).data
            return a, b, after_sequential, d.data, e.data, after_concurrent, f
        finally:
            await c.close()

    a, b, seq_info, d, e, conc_info, f = asyncio.run(go())
    first, fresh = decode(a, PredictReply), decode(f, PredictReply)
    assert first.request_id == "retry-1" and first.log_prob is not None
    assert b == a  # the retry's reply is the first reply, byte for byte
    assert seq_info["served"] == 1 and seq_info["replayed"] == 1  # one forward for two requests
    assert d == e and decode(d, PredictReply).request_id == "retry-2"
    assert conc_info["served"] == 2 and conc_info["joined"] == 1
    assert not np.allclose(fresh.actions, first.actions)  # sampling: only dedup made b equal a


def test_flooding_one_instance_gets_busy_with_a_hint_and_nothing_hangs(roles):
    roles.start("master")
    # Small bounds and a 2 s window: a burst fills the queues long before a group fires.
    inf = roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="2.0",
                      NEXUS_INFER_MAX_QUEUED="8", NEXUS_INFER_MAX_QUEUE_PER_KEY="4")
    cfg = tenant("fo-flood", seed=4)
    n = 40

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            await c.predict(cfg.name, *obs(cfg.schema), "pick up the block")  # the slot is loaded
            subject = c.names.infer("tiny-qwen3-vl")
            raws = [_request(cfg, i, request_id=f"flood-{i}") for i in range(n)]
            results = await asyncio.gather(*(c.bus.request(subject, r, PredictReply, timeout_s=30) for r in raws),
                                           return_exceptions=True)
            mid = (await _info(c, inf.instance)).extra
            # Through the SDK, Busy is retried on its hint: every call completes.
            sdk = await asyncio.gather(*(c.predict(cfg.name, *obs(cfg.schema, i), "pick up the block", timeout_s=60)
                                         for i in range(12)))
            return results, mid, sdk, await _info(c, inf.instance)
        finally:
            await c.close()

    results, mid, sdk, info = asyncio.run(go())
    busy = [r for r in results if isinstance(r, Busy)]
    ok = [r for r in results if isinstance(r, PredictReply)]
    assert len(busy) + len(ok) == n, [r for r in results if not isinstance(r, (Busy, PredictReply))]
    # At most max_queued are held at once and one group fires per 2 s window.
    assert len(busy) >= n - 8 and 1 <= len(ok) <= 8
    assert all(float(r.details["retry_after_s"]) > 0 for r in busy)
    assert "max_queued=8" in " ".join(str(r) for r in busy)
    assert mid["queued"] <= 4 and mid["held"] <= 8
    assert len(sdk) == 12 and all(r.actions.shape == (4, 7) for r in sdk)
    assert info.state == "ready" and info.extra["held"] == 0 and info.extra["busy"] >= len(busy)


def test_runtime_max_pending_answers_busy_before_making_a_task(nats_url, layout, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.slow_role", "--nats-url", nats_url, "--prefix", layout.prefix,
         "--instance", "s1", "--data-dir", str(tmp_path), "--max-concurrency", "1", "--max-pending", "2"],
        env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )

    async def go():
        bus = await Bus.connect(nats_url, name="test", reconnect_forever=False, prefix=layout.prefix)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await bus.call(ops.INFO.of("slow"), InfoRequest(), timeout_s=1)
                    break
                except NexusError:
                    assert time.monotonic() < deadline, "slow role never came up"
                    await asyncio.sleep(0.1)
            sleeps = [asyncio.ensure_future(bus.request(SLOW_SLEEP.subject(layout), SleepRequest(2.5), Ok,
                                                        timeout_s=20)) for _ in range(6)]
            await asyncio.sleep(0.3)
            # Saturated, yet an operator can still look at it at once (control ops have
            # headroom and skip the concurrency slot), before the first sleep ends.
            info = await bus.call(ops.INFO.of("slow"), InfoRequest(), timeout_s=5)
            assert not any(s.done() for s in sleeps[:2])
            results = await asyncio.gather(*sleeps, return_exceptions=True)
            after = await bus.request(SLOW_SLEEP.subject(layout), SleepRequest(0.01), Ok, timeout_s=10)
            return info, results, after
        finally:
            await bus.close()

    try:
        info, results, after = asyncio.run(go())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    ok = [r for r in results if isinstance(r, Ok)]
    busy = [r for r in results if isinstance(r, Busy)]
    # One running, one waiting for the concurrency slot; the other four refused at once.
    assert len(ok) == 2 and len(busy) == 4, results
    assert all(r.details["retry_after_s"] > 0 and r.details["max_pending"] == 2 for r in busy)
    assert info.in_flight == 3 and info.state == "ready"  # the two sleeps and the info itself
    assert after.detail == "slept 0.01"  # the bound released: serving again


def test_chunk_seqs_are_disjoint_from_item_seqs_and_from_each_other():
    edges = [0, 1, 2, 999, 1000, 1001, 65535, 65536, MAX_ITEM_SEQ - 1, MAX_ITEM_SEQ]
    seen = {}
    for seq in edges:
        for log2 in range(MAX_CHUNK_PARTS_LOG2 + 1):
            parts = 1 << log2
            for k in sorted({0, 1, parts // 2, parts - 1} & set(range(parts))):
                c = chunk_seq(seq, log2, k)
                assert c > MAX_ITEM_SEQ and is_chunk_seq(c) and c < 2**63  # int64 on the wire
                assert seen.setdefault(c, (seq, log2, k)) == (seq, log2, k)  # injective
    assert not any(is_chunk_seq(s) for s in edges)
    # The old scheme (seq * 1000 + part) gave part 0 of item 1 the seq of item 1000.
    assert chunk_seq(1, 1, 0) != 1000 and chunk_seq(1, 1, 0) & ~CHUNK_SEQ_FLAG != 1000
    for bad in ((-1, 1, 0), (MAX_ITEM_SEQ + 1, 1, 0), (1, MAX_CHUNK_PARTS_LOG2 + 1, 0), (1, 1, 2)):
        with pytest.raises(ValueError):
            chunk_seq(*bad)


def test_a_split_put_never_swallows_a_later_item(roles):
    """Item 1 is over the max payload and split; items 1000 and 1001 (the seqs its parts had
    under the old scheme) must be stored, and a retry of item 1 must store nothing new."""
    roles.start("master")
    big_schema = {"cameras": [{"name": n, "height": 128, "width": 128} for n in ("agentview", "wrist")],
                  "state_dim": 8, "action_dim": 7, "action_horizon": 4, "instruction_template": "{instruction}"}
    cfg = tenant("fo-chunk", schema=big_schema)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            job = (await c.reserve(cfg.name, "sft")).job
            big = micro_batch(cfg, job, 1, b=16)  # 16 x 2 x 48 KB: over the 1 MB max payload
            assert len(encode(big)) > c.bus.max_payload
            first = await c.queue_put(big)
            retried = await c.queue_put(big)
            later = [await c.queue_put(micro_batch(cfg, job, s, b=2)) for s in (1000, 1001)]
            rec = await c.job(cfg.name, job)
            # One item per read: the parts together are over the max payload.
            got = [(await c.queue_get(cfg.name, job, i, max_items=1)).items[0] for i in range(rec.items)]
            return first, retried, later, got, rec
        finally:
            await c.close()

    first, retried, later, got, rec = asyncio.run(go())
    parts = first.items
    assert parts >= 2 and retried.items == parts and retried.duplicate
    assert [r.duplicate for r in later] == [False, False] and later[-1].items == parts + 2
    assert rec.samples == 16 + 2 + 2
    seqs = [item.seq for item in got]
    assert sorted(seqs[-2:]) == [1000, 1001] and all(is_chunk_seq(s) for s in seqs[:-2])
    assert sum(len(item.instructions) for item in got) == 20


EVAL_SPEC = {
    "tenant": "fo-eval", "task": "eval", "base": "tiny-qwen3-vl-64",
    "action_module": {"kind": "mlp"},
    "observation": {"cameras": [{"name": "top", "height": 64, "width": 64},
                                {"name": "wrist", "height": 64, "width": 64}], "state_dim": 4},
    "action": {"dim": 2, "horizon": 1},
    "env": {"id": "builtin/reach-v0", "options": {"cameras": ["top", "wrist"], "image_size": 64}},
    # A policy one SFT step old (an eval needs an exported version: never a silent version 0).
    "eval": {"version": "tenant:fo-sft@latest", "episodes": 6, "seed": 10000, "sample": False},
}
SFT_SPEC = {**{k: v for k, v in EVAL_SPEC.items() if k != "eval"}, "tenant": "fo-sft", "task": "sft",
            "env": {**EVAL_SPEC["env"], "demos": {"episodes": 2}}, "algorithm": {"batch_size": 4, "steps": 1}}


def test_an_eval_workload_survives_an_inferencer_kill_and_restart(roles):
    """examples/eval_reach.yaml, smaller: master + env + inferencer; the workflow's predicts
    go through the SDK's predict, so a killed and restarted inferencer costs time, not the run."""
    for role in ("master", "trainer", "env"):
        roles.start(role)
    first = roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            sft = await (await c.submit(copy.deepcopy(SFT_SPEC))).wait(timeout_s=180)
            assert sft.state == "completed", (sft.state, sft.message)
            h = await c.submit(copy.deepcopy(EVAL_SPEC))
            deadline = time.monotonic() + 180
            while (await _info(c, first.instance)).extra["served"] < 20:  # mid-eval: well into it
                assert time.monotonic() < deadline, await h.status()
                await asyncio.sleep(0.2)
            first.send_signal(signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, first.wait, 10)
            killed_at = await h.status()
            await asyncio.sleep(1.0)
            second = await _start(roles, "inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")
            rec = await h.wait(timeout_s=300)
            return rec, killed_at, await _info(c, second.instance)
        finally:
            await c.close()

    rec, killed_at, info = asyncio.run(go())
    assert rec.state == "completed", (rec.state, rec.message)
    assert killed_at.state == "running" and rec.metrics["episodes"] == 6
    assert info.extra["served"] > 0  # the episodes after the kill ran on the new instance


def test_reply_cache_is_bounded_by_count_and_age():
    from actors.inferencer.reply_cache import ReplyCache

    cache = ReplyCache(max_entries=3, ttl_s=10.0)
    for i in range(5):
        cache.put(("t", f"r{i}"), b"%d" % i, now=float(i))
    assert len(cache) == 3 and cache.get(("t", "r0"), 5.0) is None  # least recently stored went first
    assert cache.get(("t", "r4"), 5.0) == b"4"
    assert cache.get(("other", "r4"), 5.0) is None  # ids are per tenant
    assert cache.get(("t", "r2"), 12.5) is None  # older than the TTL: never replayed
    cache.put(("t", "r9"), b"9", now=100.0)  # storing expires the stale ones
    assert len(cache) == 1
