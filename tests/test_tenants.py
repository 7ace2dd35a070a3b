"""Tenants outlive workloads: SFT, then RL from that policy, then an eval, on one tenant; eval
pins that must exist; a tenant deleted with everything it owns."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from nats.js.errors import NotFoundError as JsNotFound

from protocol.errors import FailedPrecondition, InvalidField, NotFound
from sdk.client import AsyncClient
from tests.test_workloads import BASE_SPEC, cluster  # noqa: F401 - the fixture


def spec(tenant: str, task: str, **extra) -> dict:
    s = copy.deepcopy(BASE_SPEC)
    s.update(tenant=tenant, task=task, action_module={"kind": "gaussian"})
    if task == "sft":
        s["algorithm"] = {"lr": 1e-3, "batch_size": 8, "steps": 3}
        s["env"]["demos"] = {"episodes": 4}
    elif task == "rl":
        s["algorithm"] = {"lr": 1e-3, "episodes_per_update": 2, "micro_batch": 64}
        s["schedule"] = {"budget": {"max_episodes": 4}}
    else:
        s["eval"] = {"version": f"tenant:{tenant}@latest", "episodes": 3}
    s.update(extra)
    return s


def test_sft_then_rl_then_eval_on_one_tenant(cluster):  # noqa: F811
    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            done, versions = [], []
            for task in ("sft", "rl"):
                wl = await c.submit(spec("life", task))
                done.append(await wl.wait(timeout_s=300))
                versions.append((await c.latest_weights("life")).version)
            # The eval scores the tenant's own latest version (its own slot: nothing repeated).
            ev_spec = spec("life-eval", "eval")
            ev_spec["eval"]["version"] = "tenant:life@latest"
            ev = await (await c.submit(ev_spec)).wait(timeout_s=300)
            tenants = await c.tenants()
            return done, versions, ev, tenants
        finally:
            await c.close()

    (sft, rl), (v_sft, v_rl), ev, tenants = asyncio.run(go())
    assert sft.state == rl.state == ev.state == "completed", [(r.state, r.message) for r in (sft, rl, ev)]
    assert v_rl > v_sft >= 3  # RL went on from the SFT policy's version
    assert ev.eval_version == v_rl
    assert tenants.history["life"] == [sft.workload, rl.workload]
    assert [t.name for t in tenants.tenants].count("life") == 1


def test_eval_pins_that_do_not_exist_fail_at_submit(cluster):  # noqa: F811
    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            sft = await c.submit(spec("pinned", "sft"))
            await sft.wait(timeout_s=300)
            bad = spec("pinned-eval", "eval")
            bad["eval"]["version"] = "tenant:pinned@999"
            with pytest.raises(NotFound, match="no policy version 999 \\(its latest is 3\\)"):
                await c.submit(bad)
            # A tenant that never trained and has no training workload: nothing to score.
            with pytest.raises(FailedPrecondition, match="no exported policy version"):
                await c.submit(spec("lonely", "eval"))
            # A later workload must train the same slot: a different head is refused by field.
            with pytest.raises(InvalidField, match="action_module.kind: 'mlp', but this tenant's existing slot"):
                await c.submit({**spec("pinned", "sft"), "action_module": {"kind": "mlp"}})
        finally:
            await c.close()

    asyncio.run(go())


def test_tenant_delete_removes_everything_and_frees_the_name(cluster):  # noqa: F811
    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            wl = await c.submit(spec("gone", "sft", algorithm={"lr": 1e-3, "batch_size": 8, "steps": 200}))
            with pytest.raises(FailedPrecondition, match="cancel it first"):
                await c.delete_tenant("gone")
            while (await wl.status()).step < 1:  # it has jobs and a version by now
                await asyncio.sleep(0.2)
            await wl.cancel()
            deleted = await c.delete_tenant("gone")
            with pytest.raises(NotFound):
                await c.tenant("gone")
            assert await c.latest_weights("gone") is None
            with pytest.raises(JsNotFound):
                await c.bus.js.stream_info(c.names.tq_stream("gone"))
            # A trainer that was mid-round when the job was cancelled deletes the checkpoint it
            # wrote once its commit is refused: nothing of the tenant stays behind.
            deadline = time.monotonic() + 30
            while True:
                leftovers = []
                for bucket in (c.names.obj_weights, c.names.obj_checkpoints):
                    store = await c.bus.js.object_store(bucket)
                    try:
                        infos = await store.list(ignore_deletes=True)
                    except JsNotFound:  # an empty bucket lists nothing
                        infos = []
                    leftovers += [i.name for i in infos if i.name.startswith("gone/")]
                if not leftovers or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            # The name is free: a new tenant starts from scratch.
            again = await (await c.submit(spec("gone", "sft"))).wait(timeout_s=300)
            return deleted, leftovers, again, (await c.latest_weights("gone")).version
        finally:
            await c.close()

    deleted, leftovers, again, version = asyncio.run(go())
    assert deleted.removed["workloads"] == 1 and deleted.removed["jobs"] >= 1
    assert leftovers == []
    assert again.state == "completed" and version == 3
