"""Spec fields that reach running roles: export_every_steps (versions announced), report_path
(the master's report, downloadable), budget.target (an SFT loss target ends the workload),
the SFT prefetch cap (a Busy put is retried, never fails the workload) and the base check at
submit (a base no inferencer serves is rejected naming the pools)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from master.spec import SpecError
from protocol.errors import NexusError
from protocol.messages import WeightsRef
from protocol.wire import decode
from sdk.client import AsyncClient
from sdk.report import workload_events
from tests.master.test_workloads import BASE_SPEC, rl_spec


def sft(tenant: str, steps: int, **extra) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(tenant=tenant, task="sft", action_module={"kind": "mlp"},
                algorithm={"lr": 1e-3, "batch_size": 4, "steps": steps})
    spec["env"]["demos"] = {"episodes": 2}
    for key, value in extra.items():
        spec[key] = value
    return spec


@pytest.fixture
def training(roles):
    for role in ("master", "trainer", "env"):
        roles.start(role)
    return roles


def test_export_every_steps_announces_every_n_and_the_last_and_writes_the_report(training, tmp_path):
    async def go():
        c = await AsyncClient(training.nats_url, training.prefix, timeout_s=30).connect()
        announced: list[int] = []

        async def on_weights(msg):
            announced.append(decode(msg.data, WeightsRef).version)

        try:
            await c.bus.nc.subscribe(c.names.weights("ex-every"), cb=on_weights)
            h = await c.submit(sft("ex-every", steps=5, outputs={"export_every_steps": 2,
                                                                 "report_path": "out/ex.json"}))
            rec = await h.wait(timeout_s=240)
            await asyncio.sleep(0.5)  # the last announcement's delivery
            jobs = await c.jobs("ex-every")
            path = await c.download_report(h.id, tmp_path / "dl")
            # The tenant's next workload exports as its own spec says (default 0: every job),
            # not as the first one did (every 2 would announce only its last version, 7).
            first = [v for v in announced if v > 0]
            again = await (await c.submit(sft("ex-every", steps=2))).wait(timeout_s=240)
            await asyncio.sleep(0.5)
            return rec, first, again, [v for v in announced if v > 5], jobs, path
        finally:
            await c.close()

    rec, announced, again, later, jobs, downloaded = asyncio.run(go())
    assert rec.state == "completed", rec.message
    # One job per step (items_per_job 1); exports at 2 and 4, and the workload's last step 5.
    assert announced == [2, 4, 5]
    assert again.state == "completed" and later == [6, 7], (again.message, later)
    assert all(j.state == "cleared" for j in jobs) and len(jobs) == 5  # skipped exports still clear
    report = json.loads((tmp_path / "reports" / "ex-every" / "out" / "ex.json").read_text())  # the roles' data dir
    assert report["workload"] == rec.workload and report["state"] == "completed"
    assert report["spec"]["outputs"]["export_every_steps"] == 2
    assert json.loads(downloaded.read_text()) == report


def test_loss_target_ends_sft_with_a_full_prefetch_cap(training):
    # items_per_job == sft_prefetch_items: the largest job the cap allows; the next job waits
    # (Busy, retried) until the trainer has taken the ready one, and the workload never fails.
    spec = sft("loss-target", steps=400, schedule={
        "sft_prefetch_items": 3, "budget": {"target": {"metric": "loss", "at_most": 1e9, "window": 2}}})
    spec["algorithm"]["items_per_job"] = 3

    async def go():
        c = await AsyncClient(training.nats_url, training.prefix, timeout_s=30).connect()
        try:
            h = await c.submit(spec)
            return await h.wait(timeout_s=240)
        finally:
            await c.close()

    rec = asyncio.run(go())
    assert rec.state == "completed", rec.message
    assert rec.message.startswith("target reached: loss"), rec.message
    assert rec.step < 400


def test_items_per_job_above_the_prefetch_cap_is_rejected_at_submit():
    from master.spec import parse_spec

    spec = sft("too-big", steps=10, schedule={"sft_prefetch_items": 4})
    spec["algorithm"]["items_per_job"] = 8
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    (err,) = info.value.details["errors"]
    assert err["field"] == "algorithm.items_per_job" and err["value"] == 8
    assert "sft_prefetch_items=4" in err["message"] and "8 exceeds" in err["message"]


def test_base_no_inferencer_serves_is_rejected_naming_the_pools(roles):
    roles.start("master")

    async def submit(spec):
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            h = await c.submit(spec)
            return h, [e.message for e in await workload_events(c, h.id)]
        finally:
            await c.close()

    # No inferencer registered at all: accepted, and the accepted event says so.
    _, messages = asyncio.run(submit(rl_spec("no-infer")))
    assert any("no inferencer is registered" in m for m in messages), messages

    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")
    other = rl_spec("wrong-base")
    other["base"] = "tiny-paligemma"
    with pytest.raises(NexusError) as info:
        asyncio.run(submit(other))
    errors = info.value.details.get("errors") or []
    assert [e["field"] for e in errors] == ["base"], info.value.message
    assert "tiny-qwen3-vl-64" in errors[0]["message"] and "tiny-paligemma" in errors[0]["message"]
    served, messages = asyncio.run(submit(rl_spec("right-base")))
    assert not any("no inferencer" in m for m in messages)
