"""Budgets that mean what they say, from the user's side, on real roles: ``algorithm.steps``
is this workload's steps (a tenant outlives its workloads, so the same spec submitted again
trains its steps again, from where the last one ended); ``algorithm.until_version`` is the
total to reach, refused at submit when it is already reached; a workflow resumed on another
env worker after a kill trains exactly the rest of its budget."""

from __future__ import annotations

import asyncio
import re
import subprocess

import pytest
import yaml

from master.spec import SpecError
from protocol.errors import InvalidField
from protocol.messages import workload_steps
from sdk.client import AsyncClient
from tests.conftest import ROOT, nexus_cmd, python_env
from tests.system.test_reliability import _wait_workload
from tests.master.test_workloads import sft_spec


@pytest.fixture
def cluster(roles):
    for role in ("health", "master", "trainer", "env"):
        roles.start(role)
    return roles


def test_steps_count_this_workload_and_until_version_is_a_total(cluster, tmp_path):
    tenant = "budget-sft"
    flags = ["--nats-url", cluster.nats_url, "--prefix", cluster.prefix]

    async def first_and_refusals(after_second: bool):
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            if not after_second:
                wl = await c.submit(sft_spec(tenant, steps=3))
                return await wl.wait(timeout_s=300), await c.latest_weights(tenant)
            # until_version already reached: refused at submit, naming the field and both numbers.
            spec = sft_spec(tenant)
            spec["algorithm"] = {**{k: v for k, v in spec["algorithm"].items() if k != "steps"}, "until_version": 2}
            before = await c.workloads(tenant)
            with pytest.raises((SpecError, InvalidField)) as info:
                await c.submit(spec)
            refused = info.value
            assert len(await c.workloads(tenant)) == len(before)  # a refusal changes nothing
            # until_version ahead: trains the difference, 6 -> 8.
            spec["algorithm"]["until_version"] = 8
            wl = await c.submit(spec)
            accepted = await c.workload(wl.id)
            return refused, accepted, await wl.wait(timeout_s=300), await c.latest_weights(tenant)
        finally:
            await c.close()

    first, ref = asyncio.run(first_and_refusals(False))
    assert first.state == "completed", first.message
    assert (first.start_version, first.budget_steps, first.step, workload_steps(first)) == (0, 3, 3, 3)
    assert ref.version == 3

    # The very same spec again, through the CLI: 3 more steps (3 -> 6), and it says so.
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(sft_spec(tenant, steps=3)))
    out = subprocess.run(nexus_cmd("submit", str(path), "--wait", *flags), capture_output=True, text=True,
                         env=python_env(), timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"submitted \S+ \(tenant budget-sft\): from version 3, 3 more steps \(to version 6\)",
                     out.stdout), out.stdout
    final = [ln for ln in out.stdout.splitlines() if ln.startswith("w") and ": completed" in ln]
    assert final and "trained 3/3 steps (version 3 -> 6)" in final[-1], out.stdout
    progress = [ln for ln in out.stderr.splitlines() if tenant in ln]
    assert progress and "3/3 steps" in progress[-1] and "6/3" not in out.stderr, out.stderr
    listed = subprocess.run(nexus_cmd("workloads", "--json", "--tenant", tenant, *flags), capture_output=True,
                            text=True, env=python_env(), timeout=120, cwd=ROOT)
    rows = yaml.safe_load(listed.stdout)
    assert [(r["version"], r["steps"], r["budget_steps"]) for r in rows] == [(3, 3, 3), (6, 3, 3)], listed.stdout
    # Its LR schedule is its own: it starts at version 3 at the full LR and decays over its 3
    # steps (it ran the whole budget at the first run's floor, 1e-4, before optim.schedule_start).
    second = rows[-1]["workload"]

    async def lrs():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            return [j.metrics.get("lr") for j in await c.jobs(tenant) if j.workload == second and j.state == "cleared"]
        finally:
            await c.close()

    second_lrs = asyncio.run(lrs())
    assert second_lrs and max(second_lrs) > 5e-4, second_lrs

    refused, accepted, third, ref = asyncio.run(first_and_refusals(True))
    (err,) = refused.details["errors"]
    assert err["field"] == "algorithm.until_version"
    assert "2 is already reached (the tenant is at version 6)" in err["message"], err
    assert (accepted.start_version, accepted.budget_steps) == (6, 2)
    assert third.state == "completed", third.message
    assert (third.step, workload_steps(third)) == (8, 2) and ref.version == 8


def test_a_workflow_resumed_after_a_kill_trains_exactly_its_budget(cluster):
    """The env worker running an SFT of a tenant already at version 2 is SIGKILLed mid-run;
    the workload resumes on another worker and trains exactly its 24 steps (2 -> 26): the
    steps trained, the jobs still queued and the half-filled ones sealed at the kill all
    count, none twice."""
    tenant = "budget-resume"
    first_env = next(p for role, _, p in cluster.procs if role == "env")

    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            await (await c.submit(sft_spec(tenant, steps=2))).wait(timeout_s=300)
            spec = sft_spec(tenant, steps=24)
            spec["algorithm"]["items_per_job"] = 4
            wl = await c.submit(spec)
            await _wait_workload(c, wl.id, lambda r: r.state == "running" and r.step >= 6)
            second = await asyncio.get_running_loop().run_in_executor(None, cluster.start, "env")
            first_env.kill()
            await asyncio.get_running_loop().run_in_executor(None, first_env.wait, 60)
            done = await wl.wait(timeout_s=300)
            return done, second, await c.latest_weights(tenant), await c.jobs(tenant)
        finally:
            await c.close()

    done, second, ref, jobs = asyncio.run(go())
    assert done.state == "completed", done.message
    assert done.worker == second.instance  # it did resume elsewhere
    assert not [j for j in jobs if j.state in ("reserved", "filling", "ready", "leased")], jobs
    assert (done.start_version, done.budget_steps) == (2, 24)
    assert ref.version == 26 and done.step == 26 and workload_steps(done) == 24, (ref.version, done.message)
