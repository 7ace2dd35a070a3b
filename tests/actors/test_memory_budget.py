"""Memory budgets (issue 18): a trainer's tenant slots under NEXUS_TRAINER_SLOT_BUDGET_MB and an
inferencer's serving heads under NEXUS_INFER_HEAD_BUDGET_MB.

Past the budget the least recently used idle slots are dropped and come back from the
tenant's committed checkpoint at its next job, bit-exactly (compared with an in-process run
of every micro-batch once, in order); heads are dropped and reloaded from the weights store at
the next request, answering the same actions. A slot or head larger than the whole budget is
refused naming the setting, its value and the size, and nothing else is touched.

One deployment for the module (master, trainer, inferencer); the LRU choice itself is tested
in-process first.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from actors.budget import lru_victims
from protocol import ops
from protocol.errors import CapacityExceeded
from protocol.messages import CheckpointGetRequest
from sdk.client import AsyncClient
from tests.conftest import module_roles
from tests.actors.test_inference import predict
from tests.support.tq_helpers import BASE, exactly_once, queue_job, role_info, tenant

MIB = 2**20
# An mlp head on the tiny base holds 2.4 MiB of params: a trained slot (params, grads, two
# AdamW moments) 9.7 MiB, so two fit in 25 MiB and a third does not; a flow head's slot needs
# 46.5 MiB, more than the whole budget. Serving heads hold params only: two mlp heads fit in 5 MiB.
SLOT_BUDGET_MB = 25
HEAD_BUDGET_MB = 5


# -- the LRU choice, in-process -------------------------------------------------------------
def test_lru_victims_oldest_idle_first_until_it_fits():
    entries = [("a", 4, 1.0, True), ("b", 4, 0.5, False), ("c", 4, 2.0, True), ("d", 4, 3.0, True)]
    assert lru_victims(entries, 16) == []  # fits
    assert lru_victims(entries, 0) == []  # no budget
    # 16 bytes over 9: b is the oldest but in use, so a then c go (d, the newest, stays).
    assert lru_victims(entries, 9) == ["a", "c"]
    assert lru_victims(entries, 12) == ["a"]
    # Everything in use: nothing goes, whatever the total.
    assert lru_victims([(k, s, t, False) for k, s, t, _ in entries], 1) == []


@pytest.fixture(scope="module")
def new_slot():
    """Real tenant slots on the tiny base (in this process): ``new_slot(name, seed)``."""
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot

    base = BaseModel.load(BaseConfig(source=BASE))

    def make(name: str, seed: int = 0):
        cfg = tenant(name, seed=seed)
        return cfg, TenantSlot.create(name, TenantSchema.from_dict(cfg.schema), base, optim=OptimConfig(**cfg.optim))

    return make


def test_slot_store_drops_only_idle_committed_slots(new_slot):
    """SlotStore.enforce_budget on real slots: a slot in use, pinned, or trained past its
    committed state stays; the oldest idle committed one goes, and is counted."""
    from actors.trainer.slots import Resident, SlotStore
    from protocol.subjects import Names

    busy = {"s-running"}
    store = SlotStore(None, Names("tunit"), in_use=lambda t: t in busy)
    for i, name in enumerate(("s-running", "s-dirty", "s-pinned", "s-old", "s-new")):
        cfg, slot = new_slot(name, i)
        store.resident[name] = Resident(config=cfg, slot=slot, clean=(0, 0), last_used=float(i))
    store.resident["s-dirty"].slot.step_count = 1  # trained, not committed yet
    size = store.resident["s-old"].footprint
    assert size == 4 * sum(p.numel() * p.element_size() for _, p in store.resident["s-old"].slot.named_trainable())
    store.budget_bytes = 3 * size  # five resident: two must go
    with store.pinned("s-pinned"):
        dropped = store.enforce_budget(keep={"s-new"})
    # Oldest first: running, dirty and pinned are skipped, s-old goes; s-new is kept: over by one.
    assert dropped == ["s-old"] and store.over_budget
    assert store.enforce_budget() == ["s-pinned"]  # unpinned now; s-new is newer and stays
    assert not store.over_budget and sorted(store.resident) == ["s-dirty", "s-new", "s-running"]
    assert (store.evictions, store.evicted_bytes) == (2, 2 * size)


def test_serving_heads_never_drop_a_held_head(new_slot):
    """ServingHeads under a budget of two heads: the oldest head no request holds goes; held
    heads stay even over the budget, and the first one released past it goes then."""
    from actors.inferencer.serving import ServingHeads, head_bytes
    from protocol.subjects import Names

    slots = {name: new_slot(name, i)[1] for i, name in enumerate("abcde")}
    size = head_bytes(slots["a"])
    heads = ServingHeads(None, Names("tunit"), None, BASE, budget_bytes=2 * size)
    for name in "abc":
        heads._put((name, 1), slots[name])
    heads._holds[("a", 1)] = 1  # a request holds a (as `get(hold=True)` leaves it)
    heads._evict(keep={("c", 1)})
    assert list(heads.cache) == [("a", 1), ("c", 1)] and heads.loaded_bytes() == 2 * size  # b went, not a
    heads._put(("d", 1), slots["d"])
    heads._holds[("d", 1)] = 1
    heads._evict(keep={("d", 1)})
    assert list(heads.cache) == [("a", 1), ("d", 1)]  # c went
    heads._put(("e", 1), slots["e"])
    heads._evict(keep={("e", 1)})
    assert len(heads.cache) == 3 and heads.loaded_bytes() == 3 * size  # all held or just asked for: over
    heads.release("d", 1)  # d is answered: the oldest free head now, and over the budget
    assert list(heads.cache) == [("a", 1), ("e", 1)] and heads.evictions == 3


# -- through real processes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(nats_server, tmp_path_factory):
    roles = module_roles(nats_server, tmp_path_factory, "budget")
    try:
        roles.start("master")
        trainer = roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="2", NEXUS_TRAINER_SLOT_BUDGET_MB=str(SLOT_BUDGET_MB))
        inferencer = roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_HEAD_BUDGET_MB=str(HEAD_BUDGET_MB))
        yield roles, trainer.instance, inferencer.instance
    finally:
        roles.stop_all()


def run(deployment, body):
    roles, trainer, inferencer = deployment

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            return await body(c, trainer, inferencer)
        finally:
            await c.close()

    return asyncio.run(go())


async def _info(c: AsyncClient, role: str, instance: str) -> dict:
    return (await role_info(c, role, instance)).extra


async def _create(c: AsyncClient, *cfgs) -> None:
    for cfg in cfgs:
        await c.create_tenant(cfg)


async def _train(c: AsyncClient, cfg, n_items: int, seed: int):
    """One SFT job of ``n_items`` micro-batches, to its end; (record, items)."""
    job, items = await queue_job(c, cfg, n_items, seed=seed)
    return await c.wait_job(cfg.name, job.job, timeout_s=120), items


def test_trainer_evicts_idle_slots_and_restores_one_exactly(deployment):
    """Four tenants through a budget of two slots: the least recently used go; the first
    tenant's next job restores its slot from the committed checkpoint and continues exactly
    (step, version, and weights bit-identical to one uninterrupted run)."""
    a = tenant("ev-a", seed=31, max_inflight_jobs=2)
    others = [tenant(f"ev-{x}", seed=32 + i) for i, x in enumerate("bcd")]

    async def body(c, trainer, _inf):
        await _create(c, a, *others)
        before = (await _info(c, "trainer", trainer))["slot_budget"]
        first, items1 = await _train(c, a, 2, seed=1)
        for i, cfg in enumerate(others):
            rec, _ = await _train(c, cfg, 1, seed=10 + i)
            assert rec.state == "cleared", rec
        mid = await _info(c, "trainer", trainer)
        ckpt = await c.bus.call(ops.MASTER_CHECKPOINT_GET, CheckpointGetRequest(tenant=a.name), timeout_s=10)
        second, items2 = await _train(c, a, 2, seed=2)
        after = await _info(c, "trainer", trainer)
        payload = (await c.download_weights(await c.latest_weights(a.name)))[0]
        return before, first, mid, ckpt, second, after, items1 + items2, payload

    before, first, mid, ckpt, second, after, items, payload = run(deployment, body)
    roles, trainer, _ = deployment
    assert first.state == second.state == "cleared", (first, second)
    # Mid-way: ev-a and ev-b (least recently used) were dropped; the two newest stay, within budget.
    budget = mid["slot_budget"]
    assert budget["budget_bytes"] == SLOT_BUDGET_MB * MIB
    assert budget["evictions"] - before["evictions"] == 2, budget
    assert sorted(mid["slots"]) == ["ev-c", "ev-d"], sorted(mid["slots"])
    assert budget["resident_bytes"] <= SLOT_BUDGET_MB * MIB
    log = roles.log(trainer)
    assert any("slot evicted under the memory budget" in line and "ev-a" in line and "bytes" in line
               for line in log.splitlines()), log[-3000:]
    # What was dropped is in the object store: the committed checkpoint of its first job.
    assert ckpt.object_name and ckpt.job == first.job and ckpt.version == 2
    # The next job restored it and went on from there: steps 3 and 4, weights as if never dropped.
    assert after["slot_budget"]["restores"] - before["restores"] == 1
    assert second.trained_version == 4 and after["slots"]["ev-a"]["step"] == 4
    assert exactly_once(a, items, payload)
    assert after["slot_budget"]["resident_bytes"] <= SLOT_BUDGET_MB * MIB


def test_a_slot_larger_than_the_budget_fails_its_job_only(deployment):
    big = tenant("ev-big", head="flow", seed=41)
    small = tenant("ev-small", seed=42)

    async def body(c, trainer, _inf):
        await _create(c, big, small)
        refused, _ = await _train(c, big, 1, seed=3)
        fine, _ = await _train(c, small, 1, seed=4)
        return refused, fine, await _info(c, "trainer", trainer)

    refused, fine, info = run(deployment, body)
    assert refused.state == "failed", refused
    why = refused.reason
    assert "CapacityExceeded" in why and "NEXUS_TRAINER_SLOT_BUDGET_MB" in why, why
    assert f"slot_budget_mb={SLOT_BUDGET_MB}" in why and "46.5 MiB" in why and "at least 47" in why, why
    assert fine.state == "cleared" and fine.trained_version == 1  # the next tenant trains as ever
    assert "ev-big" not in info["slots"]


def test_inferencer_evicts_heads_and_reloads_them_exactly(deployment):
    """Three trained tenants through a head budget of two: every request is answered, the
    least recently used head goes, and a request for it reloads it from the weights store and
    gets the same actions at the same version."""
    cfgs = [tenant(f"hv-{x}", seed=51 + i) for i, x in enumerate("abc")]

    async def body(c, _trainer, inferencer):
        for i, cfg in enumerate(cfgs):
            await c.create_tenant(cfg)
            rec, _ = await _train(c, cfg, 1, seed=20 + i)
            assert rec.state == "cleared", rec
        for _ in range(200):  # the announcements reached the inferencer
            versions = (await _info(c, "inferencer", inferencer))["versions"]
            if all(versions.get(cfg.name) == 1 for cfg in cfgs):
                break
            await asyncio.sleep(0.05)
        before = (await _info(c, "inferencer", inferencer))["head_budget"]
        first = await predict(c, cfgs[0], seed=5)
        rest = [await predict(c, cfg, seed=5) for cfg in cfgs[1:]]  # hv-a is the oldest now
        mid = (await _info(c, "inferencer", inferencer))["head_budget"]
        again = await predict(c, cfgs[0], seed=5)
        after = (await _info(c, "inferencer", inferencer))["head_budget"]
        return before, first, rest, mid, again, after

    before, first, rest, mid, again, after = run(deployment, body)
    assert first.version == again.version == 1 and all(r.version == 1 for r in rest)
    assert mid["evictions"] > before["evictions"] and mid["loaded"] == 2, mid
    assert mid["loaded_bytes"] <= HEAD_BUDGET_MB * MIB and mid["held"] == 0
    assert after["reloads"] > before["reloads"], (before, after)
    np.testing.assert_array_equal(np.asarray(again.actions), np.asarray(first.actions))


def test_a_head_larger_than_the_budget_is_refused_and_others_are_served(deployment):
    big = tenant("hv-big", head="flow", seed=61)
    small = tenant("hv-small", seed=62)

    async def body(c, _trainer, inferencer):
        await _create(c, big, small)
        with pytest.raises(CapacityExceeded) as err:
            await predict(c, big)
        ok = await predict(c, small)
        with pytest.raises(CapacityExceeded):
            await predict(c, big)  # remembered: refused again without loading it
        return err.value, ok, await _info(c, "inferencer", inferencer)

    err, ok, info = run(deployment, body)
    assert err.setting == "NEXUS_INFER_HEAD_BUDGET_MB" and err.limit == "head_budget_mb"
    assert err.details["value"] == HEAD_BUDGET_MB and err.details["head_bytes"] > HEAD_BUDGET_MB * MIB
    assert "hv-big" in err.message and "11.6 MiB" in err.message, err.message
    assert ok.version == 0 and len(ok.actions) == small.schema["action_horizon"]
    assert "hv-big/v0" in info["refused"]
