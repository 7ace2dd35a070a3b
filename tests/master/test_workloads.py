"""Workload specs end to end: submit (SDK, CLI, plain NATS intake), lifecycle events, status,
cancel, download, bad specs, and a master killed and restarted mid-run."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import subprocess

import nats
import pytest
import yaml

from protocol.errors import Conflict, NotFound
from protocol.messages import WorkloadEvent
from protocol.wire import decode
from sdk.client import AsyncClient
from tests.conftest import ROOT, nexus_cmd, python_env

BASE_SPEC = {
    "base": "tiny-qwen3-vl-64",
    "observation": {"cameras": [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}],
                    "state_dim": 4},
    "action": {"dim": 2, "horizon": 1},
    "env": {"id": "builtin/reach-v0"},
}


def sft_spec(tenant: str, steps: int = 3) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(tenant=tenant, task="sft", action_module={"kind": "mlp"},
                algorithm={"lr": 1e-3, "batch_size": 8, "steps": steps})
    spec["env"]["demos"] = {"episodes": 4}
    return spec


def rl_spec(tenant: str) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(tenant=tenant, task="rl", action_module={"kind": "gaussian"},
                algorithm={"episodes_per_update": 2, "micro_batch": 64},
                schedule={"budget": {"max_episodes": 4}})
    return spec


def eval_spec(tenant: str, episodes: int = 3) -> dict:
    """An eval names the policy (tenant + version) and takes base, head and schema from it."""
    return {"tenant": tenant, "task": "eval", "env": copy.deepcopy(BASE_SPEC["env"]),
            "eval": {"version": "latest", "episodes": episodes}}


@pytest.fixture
def cluster(roles):
    for role in ("health", "master", "trainer", "env"):
        roles.start(role)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")
    return roles


def test_sft_rl_and_eval_workloads_through_the_sdk(cluster, tmp_path):
    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            sft = await c.submit(sft_spec("w-sft"))
            rl = await c.submit(yaml.safe_dump(rl_spec("w-rl")))  # YAML text works too
            # Submitted while w-sft trains: accepted, it waits and scores the trained result.
            ev = await c.submit(json.dumps(eval_spec("w-sft")))
            with pytest.raises(Conflict, match="one workload at a time"):
                await c.submit(sft_spec("w-sft"))
            with pytest.raises(NotFound, match="unknown workload"):
                await c.cancel("w-nope")
            recs = await asyncio.gather(*(h.wait(timeout_s=300) for h in (sft, rl, ev)))
            files = await sft.download_policy(out_dir=tmp_path)
            listed = await c.workloads()
            return recs, files, listed
        finally:
            await c.close()

    (sft, rl, ev), (weights, manifest), listed = asyncio.run(go())
    assert [r.state for r in (sft, rl, ev)] == ["completed"] * 3, [(r.state, r.message) for r in (sft, rl, ev)]
    assert sft.step == 3 and "loss" in sft.metrics
    assert rl.episodes >= 4 and "success_rate" in rl.metrics
    assert ev.eval_version == 3 and ev.metrics["episodes"] == 3  # pinned to the SFT tenant's final version
    # builtin reach reports its target as the task index: the per-task table covers every episode.
    assert sum(r.episodes for r in ev.per_task) == 3 and all(r.instruction for r in ev.per_task), ev.per_task
    assert weights.stat().st_size > 0 and json.loads(manifest.read_text())["version"] == 3
    assert len(listed) == 3


def test_cli_submit_status_and_invalid_spec(cluster, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(sft_spec("cli-sft", steps=2)))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**sft_spec("cli-bad"), "colour": "red", "task": "dance"}))
    flags = ["--nats-url", cluster.nats_url, "--prefix", cluster.prefix]

    def nexus(*args):
        return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, env=python_env(), timeout=300, cwd=ROOT)

    out = nexus("submit", str(bad), *flags)
    assert out.returncode == 2
    assert "colour: unknown field" in out.stderr and "task: 'dance' is not allowed" in out.stderr
    out = nexus("submit", str(good), "--wait", *flags)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "completed" in out.stdout and "cli-sft" in out.stderr  # progress lines on stderr
    status = nexus("status", "--json", *flags)
    rows = json.loads(status.stdout)["workloads"]
    assert rows[0]["tenant"] == "cli-sft" and rows[0]["version"] == 2 and rows[0]["state"] == "completed"
    table = nexus("status", *flags).stdout
    assert "WORKLOAD" in table and "QUEUE" in table and "cli-sft" in table
    assert "cli-sft" in nexus("tenants", *flags).stdout


def test_plain_nats_intake_accepts_and_rejects_with_events(cluster):
    async def go():
        # No SDK: any NATS client with the platform's credentials file can submit.
        from transport.creds import redact_url, url_creds

        nc = await nats.connect(redact_url(cluster.nats_url), user_credentials=str(url_creds(cluster.nats_url)))
        js = nc.jetstream()
        events: asyncio.Queue = asyncio.Queue()

        async def on_event(msg):
            await events.put(decode(msg.data, WorkloadEvent))

        await nc.subscribe(f"{cluster.prefix}.workloads.events.>", cb=on_event)
        await js.publish(f"{cluster.prefix}.workloads.submit", yaml.safe_dump(sft_spec("intake-ok", steps=2)).encode())
        await js.publish(f"{cluster.prefix}.workloads.submit", b"tenant: intake-bad\ntask: sft\nwat: 1\n")
        seen = []
        while not any(e.kind == "state" and e.state == "completed" for e in seen) or not any(e.kind == "rejected" for e in seen):
            seen.append(await asyncio.wait_for(events.get(), timeout=240))
        await nc.close()
        return seen

    seen = asyncio.run(go())
    rejected = next(e for e in seen if e.kind == "rejected")
    assert rejected.tenant == "intake-bad" and any(e["field"] == "wat" for e in rejected.errors)
    accepted = next(e for e in seen if e.kind == "accepted")
    assert accepted.tenant == "intake-ok" and accepted.workload.startswith("i")
    assert [e.state for e in seen if e.kind == "state" and e.tenant == "intake-ok"][-1] == "completed"


def test_master_killed_mid_run_continues_and_submits_nothing_twice(cluster):
    master = next(p for role, _, p in cluster.procs if role == "master")

    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=30).connect()
        try:
            h = await c.submit(sft_spec("restart-sft", steps=6))
            while (await h.status()).step < 2:
                await asyncio.sleep(0.2)
            master.send_signal(signal.SIGKILL)
            master.wait(10)
            await asyncio.sleep(1.0)
            await asyncio.get_running_loop().run_in_executor(None, cluster.start, "master")
            rec = await h.wait(timeout_s=300)
            return rec, await c.workloads(), await c.jobs("restart-sft")
        finally:
            await c.close()

    rec, workloads, jobs = asyncio.run(go())
    assert rec.state == "completed" and rec.step == 6, (rec.state, rec.message, rec.step)
    assert [w.workload for w in workloads] == [rec.workload]
    assert len([j for j in jobs if j.state == "cleared"]) == 6


def test_a_workload_whose_every_job_fails_fails_naming_why(roles):
    """A trainer whose slot budget no slot fits fails every job of the workload: the workload
    ends `failed` naming the first job's reason (it once said `completed, trained 0/3 steps`)."""
    for role in ("health", "master", "env"):
        roles.start(role)
    roles.start("trainer", NEXUS_TRAINER_SLOT_BUDGET_MB="1")

    async def go():
        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            return await (await c.submit(sft_spec("no-room", steps=3))).wait(timeout_s=240)

    rec = asyncio.run(go())
    assert rec.state == "failed", (rec.state, rec.message)
    assert "JobsNotTrained: none of its" in rec.message and "CapacityExceeded" in rec.message, rec.message
    assert "NEXUS_TRAINER_SLOT_BUDGET_MB" in rec.message, rec.message
