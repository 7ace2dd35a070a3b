"""Capacity limits: past NEXUS_MAX_TENANTS / NEXUS_MAX_ACTIVE_WORKLOADS a new tenant or
workload is refused with `CapacityExceeded` naming the limit, its value and the setting; what
was admitted before keeps working. One master (no env worker: submitted workloads stay
``pending``, which counts as active), shared by the module's cases."""

from __future__ import annotations

import pytest

from protocol.errors import CapacityExceeded
from tests.conftest import module_roles, run_client
from tests.master.test_workloads import sft_spec
from tests.support.tq_helpers import micro_batch, tenant

MAX_TENANTS = 4
MAX_ACTIVE = 2


@pytest.fixture(scope="module")
def master(nats_server, tmp_path_factory):
    with module_roles(nats_server, tmp_path_factory, "capacity") as procs:
        procs.start("master", NEXUS_MAX_TENANTS=str(MAX_TENANTS), NEXUS_MAX_ACTIVE_WORKLOADS=str(MAX_ACTIVE))
        yield procs


def test_active_workloads_past_the_cap_are_refused_and_admitted_ones_stay(master):
    async def go(c):
        first = [await c.submit(sft_spec(f"cap-w{i}")) for i in range(MAX_ACTIVE)]
        with pytest.raises(CapacityExceeded) as err:
            await c.submit(sft_spec("cap-w-extra"))
        tenants = (await c.tenants()).tenants
        recs = [await w.status() for w in first]
        return err.value, [t.name for t in tenants], recs

    err, tenants, recs = run_client(master, go)
    assert err.limit == "max_active_workloads" and err.setting == "NEXUS_MAX_ACTIVE_WORKLOADS"
    assert err.details["value"] == MAX_ACTIVE and err.details["active"] == MAX_ACTIVE
    assert f"max_active_workloads={MAX_ACTIVE}" in err.message and "NEXUS_MAX_ACTIVE_WORKLOADS" in err.message
    assert "cap-w-extra" not in tenants  # refused before anything of it was created
    assert [r.state for r in recs] == ["pending"] * MAX_ACTIVE  # the admitted ones are untouched


def test_tenants_past_the_cap_are_refused_and_existing_ones_keep_training(master):
    async def go(c):
        have = len((await c.tenants()).tenants)
        cfgs = [tenant(f"cap-t{i}") for i in range(MAX_TENANTS - have)]
        for cfg in cfgs:
            await c.create_tenant(cfg)
        with pytest.raises(CapacityExceeded) as direct:
            await c.create_tenant(tenant("cap-t-extra"))
        # A tenant that exists still reserves and fills a job after the refusal.
        job = await c.reserve(cfgs[0].name, "sft")
        put = await c.queue_put(micro_batch(cfgs[0], job.job, 0, b=1))
        ready = await c.mark_ready(cfgs[0].name, job.job)
        again = await c.create_tenant(cfgs[0], exist_ok=True)  # an existing tenant is no new one
        return direct.value, put, ready, again, [t.name for t in (await c.tenants()).tenants]

    direct, put, ready, again, names = run_client(master, go)
    assert direct.limit == "max_tenants" and direct.setting == "NEXUS_MAX_TENANTS"
    assert direct.details["value"] == MAX_TENANTS and direct.details["tenants"] == MAX_TENANTS
    assert "raise NEXUS_MAX_TENANTS" in direct.message
    assert put.items == 1 and ready.state == "ready" and again.name == "cap-t0"
    assert len(names) == MAX_TENANTS and "cap-t-extra" not in names
