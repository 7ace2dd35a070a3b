"""The inference service for real: group batching over request-reply, bad input, weight sync,
pinned versions, dropped requests, and elastic instances under load."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from protocol import ops
from protocol.errors import InvalidField, MissingField, NotFound, RequestTimeout
from protocol.messages import DrainRequest, InfoRequest
from sdk.client import AsyncClient
from tests.support.tq_helpers import BASE, CALVIN_SCHEMA, micro_batch, tenant

THREE_CAMERAS = {
    "cameras": [{"name": n, "height": 16, "width": 16} for n in ("left", "right", "wrist")],
    "state_dim": 8, "action_dim": 7, "action_horizon": 4, "instruction_template": "{instruction}",
}


def obs(schema: dict, seed: int = 0) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8) for c in schema["cameras"]}
    return images, rng.standard_normal(schema["state_dim"]).astype(np.float32)


async def predict(c: AsyncClient, cfg, seed: int = 0, **kw):
    images, state = obs(cfg.schema, seed)
    return await c.predict(cfg.name, images, state, "pick up the block", **kw)


def test_grouping_keeps_keys_apart_and_isolates_bad_requests(roles):
    roles.start("master")
    # A long wait window so concurrent requests certainly meet in one group.
    roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="0.3", NEXUS_INFER_MAX_BATCH_SIZE="64")
    a, b = tenant("ga", seed=1), tenant("gb", schema=CALVIN_SCHEMA, head="gaussian", seed=2)
    wide = tenant("gwide", schema=THREE_CAMERAS, seed=3)  # 3 camera slots: another compatibility key

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            for cfg in (a, b, wide):
                await c.create_tenant(cfg)
            bad_images, bad_state = obs(a.schema, 99)
            bad_images["agentview"] = bad_images["agentview"][:8]
            calls = [predict(c, a, i) for i in range(4)] + [predict(c, b, i) for i in range(4)]
            calls += [predict(c, wide, i) for i in range(3)]
            calls.append(c.predict(a.name, bad_images, bad_state, "pick up the block"))
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await c.close()

    replies = asyncio.run(go())
    good_a, good_b, good_wide, bad = replies[:4], replies[4:8], replies[8:11], replies[11]
    assert isinstance(bad, InvalidField) and "images[agentview]" in str(bad) and "shape" in str(bad)
    for r in good_a + good_b:
        assert not isinstance(r, Exception), r
        # a and b share a key (2 camera slots): one forward for their 8 good rows; the bad
        # request failed alone and took no row.
        assert r.batch_size == 8 and r.version == 0
    for r in good_wide:
        assert r.batch_size == 3  # never merged with the 2-slot key
    assert good_a[0].actions.shape == (4, 7) and good_a[0].log_prob is None
    assert good_b[0].log_prob is not None and good_b[0].value is not None  # RL head
    assert all(r.queue_wait_s >= 0 and r.forward_s > 0 for r in good_a)


def test_errors_name_the_problem(roles):
    roles.start("master")
    roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    a = tenant("err-a")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=10).connect()
        try:
            await c.create_tenant(a)
            images, state = obs(a.schema)
            with pytest.raises(NotFound, match="unknown tenant 'ghost'"):
                c._pools["ghost"] = "tiny-qwen3-vl"
                await c.predict("ghost", images, state, "x")
            with pytest.raises(NotFound, match="no version 7"):
                await c.predict(a.name, images, state, "x", version=7)
            missing = dict(images)
            del missing["wrist"]
            with pytest.raises((MissingField, InvalidField), match="wrist"):
                await c.predict(a.name, missing, state, "x")
            with pytest.raises(InvalidField, match="uint8"):
                await c.predict(a.name, {k: v.astype(np.float32) for k, v in images.items()}, state, "x")
            with pytest.raises(InvalidField, match="state"):
                await c.predict(a.name, images, state[:3], "x")
            # A caller that has already given up: dropped without work, no reply.
            with pytest.raises(RequestTimeout):
                await c.predict(a.name, images, state, "x", timeout_s=0.000001)
            await asyncio.sleep(0.5)
            info = await c.info("inferencer")
            ok = await c.predict(a.name, images, state, "x")
            return info, ok
        finally:
            await c.close()

    info, ok = asyncio.run(go())
    assert info.extra["dropped"] >= 1
    assert ok.actions.shape == (4, 7)


def test_weight_sync_and_pinned_versions(roles):
    roles.start("master")
    roles.start("trainer")
    inf = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfg, other = tenant("sync", seed=5), tenant("sync2", seed=6)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            await c.create_tenant(other)
            v0 = await predict(c, cfg, 1)
            # Two tenants' jobs at once: their announcements load side by side (one task each).
            jobs = []
            for t in (cfg, other):
                job = await c.reserve(t.name, "sft")
                await c.queue_put(micro_batch(t, job.job, 0))
                await c.mark_ready(t.name, job.job)
                jobs.append((t.name, job.job))
            for name, job in jobs:
                await c.wait_job(name, job, timeout_s=120)
            deadline = time.monotonic() + 20
            while True:
                v1 = await predict(c, cfg, 1)
                w1 = await predict(c, other, 1)
                if (v1.version, w1.version) == (1, 1) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            # A second version loads into the slot built in the background after the first swap.
            job = await c.reserve(cfg.name, "sft")
            await c.queue_put(micro_batch(cfg, job.job, 1))
            await c.mark_ready(cfg.name, job.job)
            await c.wait_job(cfg.name, job.job, timeout_s=120)
            deadline = time.monotonic() + 20
            while (v2 := await predict(c, cfg, 1)).version != 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            pinned = await predict(c, cfg, 1, version=0)
            info = await c.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=inf.instance, timeout_s=10)
            return v0, v1, w1, v2, pinned, info
        finally:
            await c.close()

    v0, v1, w1, v2, pinned, info = asyncio.run(go())
    assert v0.version == 0 and v1.version == 1 and w1.version == 1 and v2.version == 2
    assert not np.allclose(v0.actions, v1.actions)  # the new weights are really served
    assert not np.allclose(v1.actions, v2.actions)
    assert info.extra["weight_sync_spares_used"] >= 1
    assert pinned.version == 0 and np.array_equal(pinned.actions, v0.actions)  # the pin is exact
    assert info.extra["versions"]["sync"] == 2 and info.extra["versions"]["sync2"] == 1
    # export -> servable, per stage, for both announced versions (issue 27 item 5's breakdown)
    stages = info.extra["weight_sync"]
    assert {"transport", "create", "fetch", "load", "total"} <= set(stages), stages
    assert stages["total"]["n"] == 3 and stages["total"]["p95"] >= stages["load"]["p50"] > 0
    assert "weights synced" in roles.log(inf.instance) and "export_to_servable_s" in roles.log(inf.instance)


def test_add_and_remove_an_instance_under_load_without_failures(roles):
    roles.start("master")
    first = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfgs = [tenant(f"el{i}", seed=i) for i in range(2)]
    results = {"ok": 0, "failed": []}

    async def load(c: AsyncClient, stop: asyncio.Event, k: int):
        i = 0
        while not stop.is_set():
            try:
                await predict(c, cfgs[k % 2], i, timeout_s=20)
                results["ok"] += 1
            except Exception as exc:  # counted: the assertion is that there are none
                results["failed"].append(repr(exc))
            i += 1

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            for cfg in cfgs:
                await c.create_tenant(cfg)
            stop = asyncio.Event()
            clients = [asyncio.ensure_future(load(c, stop, k)) for k in range(4)]
            await asyncio.sleep(1.0)
            loop = asyncio.get_running_loop()
            second = await loop.run_in_executor(None, lambda: roles.start("inferencer", NEXUS_INFER_BASE=BASE))  # scale out
            await asyncio.sleep(1.5)
            before = results["ok"]
            reply = await c.bus.call(ops.DRAIN.of("inferencer"), DrainRequest(reason="scale in"),
                                     instance=first.instance, timeout_s=10)  # scale in
            assert "draining" in reply.detail
            await loop.run_in_executor(None, first.wait, 30)
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*clients)
            info = await c.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=second.instance, timeout_s=10)
            return before, info
        finally:
            await c.close()

    before, info = asyncio.run(go())
    assert results["failed"] == []
    assert first.returncode == 0  # drained cleanly
    assert results["ok"] > before > 0
    assert info.extra["served"] > 0  # the new instance took traffic


def test_engine_defaults_and_warmup_per_layout(roles):
    """Unset NEXUS_INFER_FAST / COMPILE / WARMUP mean auto: off on a CPU. With the fast engine
    (forced here; on CPU it runs without graphs) every registered tenant's layout runs every
    capture size up to the largest group before the inferencer is ready, unmetered, and so does
    the adapted variant of a layout a LoRA tenant uses (its first request then warms nothing);
    a layout first seen later warms before its first group."""
    roles.start("master")
    plain = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    a, wide = tenant("wa", seed=1), tenant("wwide", schema=THREE_CAMERAS, seed=3)
    lora = tenant("wlora", seed=2, base_adapter={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    four = tenant("wfour", schema={**THREE_CAMERAS, "cameras": THREE_CAMERAS["cameras"] + [
        {"name": "top", "height": 16, "width": 16}]}, seed=4)  # 4 camera slots: a third layout

    async def info(c, inst):
        return (await c.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=inst.instance, timeout_s=10)).extra

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=60).connect()
        try:
            await c.create_tenant(a)
            await c.create_tenant(wide)
            await c.create_tenant(lora)
            return await info(c, plain)
        finally:
            await c.close()

    before = asyncio.run(go())
    assert before["engine"] == {"fast": False, "compile": False, "warmup": False, "euler": "fp32", "image_size": 224,
                                "warmed_layouts": 0,
                                "warmed_variants": 0, "heads_in_forward": 0, "warmup_s": 0.0, "warm_sizes": []}
    plain.terminate()  # one inferencer in the pool: the fast one below serves the requests
    plain.wait(timeout=30)
    # NEXUS_BASE_IMAGE_SIZE: frames canonicalised at 32 px instead of the preset's 224 (fewer tokens).
    fast = roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_FAST="1", NEXUS_INFER_MAX_BATCH_SIZE="3",
                       NEXUS_INFER_EULER="compile", NEXUS_BASE_IMAGE_SIZE="32")

    async def go2():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=60).connect()
        try:
            ready = await info(c, fast)
            r1 = await predict(c, a, 1)
            r2 = await predict(c, wide, 1)
            r4 = await predict(c, lora, 1)
            served = await info(c, fast)
            await c.create_tenant(four)
            r3 = await predict(c, four, 1)
            late = await info(c, fast)
            return (r1, r2, r3, r4), ready, served, late
        finally:
            await c.close()

    replies, ready, served, late = asyncio.run(go2())
    assert [r.version for r in replies] == [0, 0, 0, 0]
    e1, e2, e3 = ready["engine"], served["engine"], late["engine"]
    assert e1["fast"] is True and e1["compile"] is False and e1["warmup"] is True  # no CUDA: no compile
    assert e1["euler"] == "compile"  # as set (no expert tenant here: nothing compiles)
    assert e1["image_size"] == 32
    assert e1["warm_sizes"] == [1, 2, 4]  # 3 rows pad to the 4-row capture size
    assert e1["warmed_layouts"] == 2 and e1["warmup_s"] > 0  # both registered layouts, before ready
    assert e1["warmed_variants"] == 3  # and the LoRA tenant's adapted forward of its layout
    assert ready["usage"]["busy_s"]["infer"] == 0  # warm-up forwards are nobody's: not metered
    assert e2["warmed_layouts"] == 2 and e2["warmup_s"] == e1["warmup_s"]  # requests warmed nothing more
    assert e2["warmed_variants"] == 3
    # The tenants' plain mlp heads ran inside the forward (models.heads.pool): one group each.
    assert e2["heads_in_forward"] == 3 and e3["heads_in_forward"] == 4
    assert e3["warmed_layouts"] == 3 and e3["warmup_s"] > e2["warmup_s"]  # a new layout, at its first group
    assert "warmed a layout" in roles.log(fast.instance)
