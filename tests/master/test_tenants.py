"""Tenants outlive workloads: SFT, then RL from that policy, then an eval, on one tenant; eval
pins that must exist; a tenant deleted with everything it owns."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from nats.js.errors import NotFoundError as JsNotFound

from protocol.errors import FailedPrecondition, InvalidField, NotFound
from protocol.messages import TenantConfig
from sdk.client import AsyncClient
from tests.master.test_workloads import BASE_SPEC, cluster  # noqa: F401 - the fixture


SCHEMA = {"cameras": BASE_SPEC["observation"]["cameras"], "state_dim": 4, "action_dim": 2, "action_horizon": 1,
          "instruction_template": "{instruction}"}


def spec(tenant: str, task: str, **extra) -> dict:
    if task == "eval":  # the short form: the policy (tenant + version), the env, the episodes
        return {"tenant": tenant, "task": "eval", "env": copy.deepcopy(BASE_SPEC["env"]),
                "eval": {"version": "latest", "episodes": 3}, **extra}
    s = copy.deepcopy(BASE_SPEC)
    s.update(tenant=tenant, task=task, action_module={"kind": "gaussian"})
    if task == "sft":
        s["algorithm"] = {"lr": 1e-3, "batch_size": 8, "steps": 3}
        s["env"]["demos"] = {"episodes": 4}
    else:
        s["algorithm"] = {"lr": 1e-3, "episodes_per_update": 2, "micro_batch": 64}
        s["schedule"] = {"budget": {"max_episodes": 4}}
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
            # The eval names the policy (tenant life, its latest version) and repeats nothing.
            ev = await (await c.submit(spec("life", "eval"))).wait(timeout_s=300)
            tenants = await c.tenants()
            return done, versions, ev, tenants
        finally:
            await c.close()

    (sft, rl), (v_sft, v_rl), ev, tenants = asyncio.run(go())
    assert sft.state == rl.state == ev.state == "completed", [(r.state, r.message) for r in (sft, rl, ev)]
    assert v_rl > v_sft >= 3  # RL went on from the SFT policy's version
    assert ev.eval_version == v_rl and ev.metrics["version"] == v_rl
    # The record says what was scored: the policy's sections, from its export manifest.
    assert ev.spec["base"] == "tiny-qwen3-vl-64" and ev.spec["action_module"]["kind"] == "gaussian"
    assert ev.spec["observation"]["state_dim"] == 4 and ev.spec["action"] == {"dim": 2, "horizon": 1}
    assert "clip_ratio" not in ev.spec["action_module"]["params"]  # a loss setting, not the policy
    assert tenants.history["life"] == [sft.workload, rl.workload, ev.workload]
    assert [t.name for t in tenants.tenants].count("life") == 1


def test_eval_pins_that_do_not_exist_fail_at_submit(cluster):  # noqa: F811
    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            sft = await c.submit(spec("pinned", "sft"))
            await sft.wait(timeout_s=300)
            bad = spec("pinned", "eval")
            bad["eval"]["version"] = 999
            with pytest.raises(NotFound, match="tenant 'pinned' has no policy version 999 \\(its latest is 3\\)"):
                await c.submit(bad)
            with pytest.raises(NotFound, match="tenant 'nobody' does not exist"):
                await c.submit(spec("nobody", "eval"))
            # A tenant that never exported and has no training workload: nothing to score.
            await c.create_tenant(TenantConfig(name="lonely", base="tiny-qwen3-vl-64", schema=SCHEMA, head="mlp"))
            with pytest.raises(FailedPrecondition, match="no exported policy version"):
                await c.submit(spec("lonely", "eval"))
            # A section an eval repeats must match the policy: a mismatch names its field.
            with pytest.raises(InvalidField, match="action_module.kind: 'mlp' differs from tenant pinned's policy "
                                                   "version 3: 'gaussian'"):
                await c.submit(spec("pinned", "eval", action_module={"kind": "mlp"}))
            # Another tenant's policy under this workload's own name, sections repeated and equal.
            other = spec("pinned-eval", "eval", base=BASE_SPEC["base"], observation=BASE_SPEC["observation"],
                         action_module={"kind": "gaussian"})
            other["eval"]["version"] = "tenant:pinned@3"
            ev = await (await c.submit(other)).wait(timeout_s=300)
            assert (ev.state, ev.eval_version, ev.tenant) == ("completed", 3, "pinned-eval"), ev.message
            assert "pinned-eval" not in [t.name for t in (await c.tenants()).tenants]  # an eval makes no slot
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
