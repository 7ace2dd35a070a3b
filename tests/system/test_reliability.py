"""Nothing stranded, nothing trained twice: drains, lease renewal and the commit fence,
idempotent reserves, orphan expiry, workloads handed back, compaction.

Every test runs real role processes on a real nats-server (tests/conftest.py). Exactly-once is
checked the strict way: the tenant's exported weights are bit-identical to an in-process run
that applies each micro-batch once, in order (a lost or a repeated step would change them).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from protocol import ops
from protocol.errors import Busy, Conflict, FailedPrecondition
from protocol.messages import (
    CheckpointCommitRequest,
    CheckpointGetRequest,
    JobRecord,
    JobRef,
    JobUpdate,
    LeaseRenewRequest,
    LeaseRequest,
)
from sdk.client import AsyncClient
from tests.master.test_workloads import sft_spec
from tests.support.tq_helpers import exactly_once, micro_batch, queue_job, role_info, tenant


async def _client(roles) -> AsyncClient:
    return await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()


async def _wait_state(c: AsyncClient, cfg, job: str, states: tuple[str, ...], timeout_s: float = 120) -> JobRecord:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await c.job(cfg.name, job)
        if rec.state in states:
            return rec
        assert time.monotonic() < deadline, f"job {job} still {rec.state}, wanted {states}"
        await asyncio.sleep(0.02)


async def _wait_exit(proc, timeout_s: float = 90) -> int:
    return await asyncio.get_running_loop().run_in_executor(None, proc.wait, timeout_s)


# -- the master's fence --------------------------------------------------------------------
def test_a_lost_lease_can_neither_renew_nor_commit(roles):
    """Lease epochs fence reports; the checkpoint pointer moves only by compare-and-set."""
    roles.start("master")
    cfg = tenant("fence")

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            job, _ = await queue_job(c, cfg, 1)
            lease = lambda who, s: c.bus.call(ops.MASTER_LEASE, LeaseRequest(  # noqa: E731
      trainer=who, job=job.job, tenant=cfg.name, lease_s=s))
            first = (await lease("trainer-a", 0.2)).jobs[0]
            rec = await _wait_state(c, cfg, job.job, ("ready",), timeout_s=10)  # expired, back to ready
            assert "lease expired" in rec.reason
            second = (await lease("trainer-b", 60)).jobs[0]
            assert second.lease_epoch == first.lease_epoch + 1
            renew = await c.bus.call(ops.MASTER_LEASE_RENEW, LeaseRenewRequest(
      trainer="trainer-a", jobs=[JobRef(cfg.name, job.job)], epochs=[first.lease_epoch]))
            assert renew.lost == [job.job] and renew.held == []
            stale = JobUpdate(tenant=cfg.name, job=job.job, state="trained", trainer="trainer-a",
                              lease_epoch=first.lease_epoch, checkpoint="fence/ckpt/a", trained_version=1)
            with pytest.raises(Conflict, match="lease was lost"):
                await c.bus.call(ops.MASTER_JOB_UPDATE, stale)
            # The same trainer name with the old epoch is refused too (a restarted process).
            stale.trainer = "trainer-b"
            with pytest.raises(Conflict, match="lease was lost"):
                await c.bus.call(ops.MASTER_JOB_UPDATE, stale)
            ok = JobUpdate(tenant=cfg.name, job=job.job, state="trained", trainer="trainer-b",
                           lease_epoch=second.lease_epoch, checkpoint="fence/ckpt/b", trained_version=1)
            assert (await c.bus.call(ops.MASTER_JOB_UPDATE, ok)).state == "trained"
            ptr = await c.bus.call(ops.MASTER_CHECKPOINT_GET, CheckpointGetRequest(cfg.name))
            assert ptr.object_name == "fence/ckpt/b" and ptr.job == job.job
            # A writer whose state was built on an older checkpoint cannot move the pointer.
            with pytest.raises(Conflict, match="checkpoint moved"):
                await c.bus.call(ops.MASTER_CHECKPOINT_COMMIT, CheckpointCommitRequest(
          tenant=cfg.name, object_name="fence/ckpt/c", base_checkpoint="", trainer="trainer-a"))
            ptr = await c.bus.call(ops.MASTER_CHECKPOINT_GET, CheckpointGetRequest(cfg.name))
            assert ptr.object_name == "fence/ckpt/b"
        finally:
            await c.close()

    asyncio.run(go())


def test_reserve_is_idempotent_and_orphans_expire(roles):
    """A retried reserve returns the same job; jobs their workflow abandoned leave the
    in-flight cap after the TTL: an empty one fails with a reason, one holding micro-batches is
    sealed (ready with what it has)."""
    roles.start("master", NEXUS_ORPHAN_TTL_S="1.5")
    cfg = tenant("orphan", max_inflight_jobs=2)

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            a = await c.reserve(cfg.name, "sft", key="p1.1")
            again = await c.reserve(cfg.name, "sft", key="p1.1")
            assert again.job == a.job
            b = await c.reserve(cfg.name, "sft", key="p1.2")
            await c.queue_put(micro_batch(cfg, b.job, 0))  # b holds one acknowledged micro-batch
            with pytest.raises(Busy, match="the cap is 2"):
                await c.reserve(cfg.name, "sft", key="p1.3")
            empty = await _wait_state(c, cfg, a.job, ("failed",), timeout_s=15)
            assert "workflow is gone" in empty.reason and "held no data" in empty.reason, empty.reason
            # What was acknowledged is not dropped: b is sealed as it is, and will be trained.
            sealed = await _wait_state(c, cfg, b.job, ("ready",), timeout_s=15)
            assert "sealed with its 1 micro-batches" in sealed.reason and sealed.items == 1, sealed
            await c.queue_clear(cfg.name, b.job)
            third = await c.reserve(cfg.name, "sft", key="p1.3")  # the cap is free again
            assert third.job not in (a.job, b.job)
        finally:
            await c.close()

    asyncio.run(go())


# -- trainer drains --------------------------------------------------------------------------
@pytest.mark.parametrize("finish_s", ["30", "0"])
def test_trainer_drained_mid_round_leaves_nothing_leased(roles, finish_s):
    """SIGTERM mid-round: with time to finish, the trainer completes its round and exits 0;
    without it, it releases the round at the next step and another trainer trains it. Either
    way the job is trained exactly once and nothing stays leased by the stopped trainer."""
    roles.start("master")
    doomed = roles.start("trainer", NEXUS_TRAINER_DRAIN_FINISH_S=finish_s)
    cfg = tenant(f"drain-{finish_s}", seed=4, sft_prefetch_items=64)

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            job, items = await queue_job(c, cfg, 24, seed=4)
            await _wait_state(c, cfg, job.job, ("leased",))
            doomed.send_signal(signal.SIGTERM)
            assert await _wait_exit(doomed) == 0
            rec = await c.job(cfg.name, job.job)
            if finish_s == "0":
                assert rec.state == "ready" and rec.lease_owner == "" and rec.attempts == 0, rec
                assert "released by" in rec.reason
                await asyncio.get_running_loop().run_in_executor(None, roles.start, "trainer")
            else:
                assert rec.state == "cleared", rec
            rec = await c.wait_job(cfg.name, job.job, timeout_s=120)
            payload, _ = await c.download_weights(await c.latest_weights(cfg.name))
            return rec, items, payload
        finally:
            await c.close()

    rec, items, payload = asyncio.run(go())
    assert rec.state == "cleared" and rec.trained_version == len(items)
    assert exactly_once(cfg, items, payload)


# -- renewal and the fence with two trainers -------------------------------------------------
async def _infos_once_done(c, trainers, done: int, timeout_s: float = 30.0):
    """The trainers' infos once ``done`` jobs are counted among them: a client can see a job
    cleared before its trainer has read the master's reply to that update."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [await role_info(c, "trainer", p.instance) for p in trainers]
        if sum(i.extra["jobs_done"] for i in infos) >= done or time.monotonic() > deadline:
            return infos
        await asyncio.sleep(0.1)


def test_a_round_longer_than_its_lease_is_renewed_not_re_leased(roles):
    """Two trainers, a 5 s lease, a round of many seconds: renewals keep the job with the
    first trainer; the job is leased once and trained once. (5 s, not less: on a loaded
    2-core host a renewal can wait seconds for the CPU, and a lost lease is then correct.)"""
    roles.start("master")
    env = {"NEXUS_TRAINER_LEASE_S": "5", "NEXUS_LEASE_RENEW_EVERY_S": "0.25"}
    a = roles.start("trainer", **env)
    cfg = tenant("renew", seed=5, sft_prefetch_items=64)

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            job, items = await queue_job(c, cfg, 90, seed=5)
            await _wait_state(c, cfg, job.job, ("leased",))
            b = await asyncio.get_running_loop().run_in_executor(None, lambda: roles.start("trainer", **env))
            rec = await c.wait_job(cfg.name, job.job, timeout_s=180)
            infos = await _infos_once_done(c, (a, b), 1)
            payload, _ = await c.download_weights(await c.latest_weights(cfg.name))
            return rec, items, payload, infos
        finally:
            await c.close()

    rec, items, payload, infos = asyncio.run(go())
    assert rec.state == "cleared" and rec.attempts == 1 and rec.lease_epoch == 1, rec
    assert [i.extra["leases_lost"] for i in infos] == [0, 0]
    assert [i.extra["jobs_done"] for i in infos] == [1, 0]
    assert exactly_once(cfg, items, payload)


def test_a_trainer_that_lost_its_lease_commits_nothing(roles):
    """Trainer A is frozen (SIGSTOP) mid-round past its lease; B takes the job over and
    commits; A, resumed, learns it lost the lease and commits nothing: the weights are those
    of one application of the job."""
    roles.start("master")
    env = {"NEXUS_TRAINER_LEASE_S": "1", "NEXUS_LEASE_RENEW_EVERY_S": "0.2"}
    a = roles.start("trainer", **env)
    cfg = tenant("stale", seed=6, sft_prefetch_items=64)

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            job, items = await queue_job(c, cfg, 30, seed=6)
            deadline = time.monotonic() + 60
            while job.job not in (await role_info(c, "trainer", a.instance)).extra["round"]:  # A is working on it
                assert time.monotonic() < deadline, "trainer A never started the round"
                await asyncio.sleep(0.02)
            a.send_signal(signal.SIGSTOP)
            try:
                b = await asyncio.get_running_loop().run_in_executor(None, lambda: roles.start("trainer", **env))
                rec = await c.wait_job(cfg.name, job.job, timeout_s=180)
            finally:
                a.send_signal(signal.SIGCONT)
            # A resumes: its next renewal (or its commit) is refused.
            deadline = time.monotonic() + 60
            while (await role_info(c, "trainer", a.instance)).extra["leases_lost"] < 1:
                assert time.monotonic() < deadline, "trainer A never noticed its lost lease"
                await asyncio.sleep(0.2)
            infos = await _infos_once_done(c, (a, b), 1)
            ptr = await c.bus.call(ops.MASTER_CHECKPOINT_GET, CheckpointGetRequest(cfg.name))
            payload, _ = await c.download_weights(await c.latest_weights(cfg.name))
            return rec, items, payload, infos, ptr, await c.job(cfg.name, job.job)
        finally:
            await c.close()

    rec, items, payload, infos, ptr, final = asyncio.run(go())
    assert rec.state == "cleared" and rec.lease_epoch == 2, rec
    assert [i.extra["jobs_done"] for i in infos] == [0, 1]
    assert ptr.object_name.endswith(f"{rec.job}-e2"), ptr  # B's checkpoint, not A's
    assert final.state == "cleared" and final.trained_version == len(items)
    assert exactly_once(cfg, items, payload)


# -- env workers hand their workloads back ---------------------------------------------------
@pytest.fixture
def services(roles):
    for role in ("health", "master", "trainer"):
        roles.start(role)
    return roles


async def _wait_workload(c: AsyncClient, workload: str, pred, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await c.workload(workload)
        if pred(rec):
            return rec
        assert time.monotonic() < deadline, f"workload {workload}: {rec.state} on {rec.worker!r}"
        await asyncio.sleep(0.1)


# master_restart: slow (test_workloads' master-killed test and the chaos kills restart the master too).
@pytest.mark.parametrize("how", ["drain", "kill", pytest.param("master_restart", marks=pytest.mark.slow)])
def test_workload_resumes_on_another_env_worker(services, how):
    """drain: SIGTERM the env worker running an SFT workload: it hands the workload back and
    another worker finishes it. kill: SIGKILL it; the health manager's role_down re-pends it.
    master_restart: the worker and the master are SIGKILLed while no health manager watches;
    the next master finds the worker gone and re-pends."""
    roles = services
    first = roles.start("env")
    spec = sft_spec(f"handback-{how}", steps=40)
    spec["algorithm"]["items_per_job"] = 4

    async def go():
        c = await _client(roles)
        try:
            wl = await c.submit(spec)
            rec = await _wait_workload(c, wl.id, lambda r: r.state == "running" and r.step >= 4)
            assert rec.worker == first.instance
            if how in ("drain", "kill"):
                second = await asyncio.get_running_loop().run_in_executor(None, roles.start, "env")
                if how == "drain":
                    first.send_signal(signal.SIGTERM)
                    assert await _wait_exit(first) == 0
                else:
                    first.kill()
                    await _wait_exit(first)
            else:
                for role, _, proc in roles.procs:
                    if role == "health":
                        proc.send_signal(signal.SIGTERM)
                        await _wait_exit(proc)
                master = next(p for r, _, p in roles.procs if r == "master")
                first.kill(), master.kill()
                await _wait_exit(first), await _wait_exit(master)
                second = await asyncio.get_running_loop().run_in_executor(None, roles.start, "env")
                await asyncio.get_running_loop().run_in_executor(None, roles.start, "master")
            done = await wl.wait(timeout_s=300)
            jobs = await c.jobs(spec["tenant"])
            return done, second, jobs
        finally:
            await c.close()

    done, second, jobs = asyncio.run(go())
    assert done.state == "completed", (done.state, done.message)
    assert done.worker == second.instance
    assert not [j for j in jobs if j.state in ("reserved", "filling", "ready", "leased")], jobs
    # Whatever the first workflow left half-filled was sealed and trained; only empty ones failed.
    assert all(j.state == "cleared" or (j.state == "failed" and j.items == 0) for j in jobs), jobs
    assert done.step >= 40


def test_cancel_fails_the_workloads_unfinished_jobs(services):
    roles = services
    roles.start("env")
    spec = sft_spec("cancel-jobs", steps=400)

    async def go():
        c = await _client(roles)
        try:
            wl = await c.submit(spec)
            await _wait_workload(c, wl.id, lambda r: r.state == "running" and r.step >= 2)
            await wl.cancel()
            # A workflow that has not stopped yet (inside a step) may still ask for a job: the
            # master refuses it, so nothing is left reserved behind the cancel.
            with pytest.raises(FailedPrecondition, match="cancelled; it takes no new jobs"):
                await c.reserve(spec["tenant"], "sft", workload=wl.id, key="late")
            await asyncio.sleep(1.0)
            return await c.jobs(spec["tenant"])
        finally:
            await c.close()

    jobs = asyncio.run(go())
    assert jobs
    assert not [j for j in jobs if j.state in ("reserved", "filling", "ready")], [(j.job, j.state) for j in jobs]


# -- compaction ------------------------------------------------------------------------------
def test_finished_records_and_old_versions_are_compacted(roles):
    roles.start("master", NEXUS_JOB_RETENTION_S="0.5", NEXUS_COMPACT_EVERY_S="0.5", NEXUS_VERSIONS_KEPT="2")
    roles.start("trainer")
    cfg = tenant("compact", max_inflight_jobs=8)

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            jobs = []
            for i in range(4):
                job, _ = await queue_job(c, cfg, 1, seed=i)
                jobs.append(await c.wait_job(cfg.name, job.job, timeout_s=120))
            deadline = time.monotonic() + 30
            while await c.jobs(cfg.name):
                assert time.monotonic() < deadline, "finished job records were never compacted"
                await asyncio.sleep(0.2)
            store = await c.bus.js.object_store(c.names.obj_weights)
            # A version 0 export is a start the tenant uploaded (master/uploads.py): kept always.
            await store.put("compact/v00000000", b"start")
            await store.put("compact/v00000000.manifest.json", b"{}")
            while True:
                names = sorted(i.name for i in await store.list(ignore_deletes=True) if i.name.startswith("compact/"))
                if len(names) <= 6 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            latest = await c.latest_weights(cfg.name)
            payload, _ = await c.download_weights(latest)
            return jobs, names, latest, payload
        finally:
            await c.close()

    jobs, names, latest, payload = asyncio.run(go())
    assert [j.state for j in jobs] == ["cleared"] * 4
    assert latest.version == 4 and payload
    # v3 and v4 (payload + manifest each) remain, and the start (v0); v1 and v2 are gone.
    assert names == ["compact/v00000000", "compact/v00000000.manifest.json", "compact/v00000003", "compact/v00000003.manifest.json",
                     "compact/v00000004", "compact/v00000004.manifest.json"], names


def test_a_failed_workload_releases_its_reserved_jobs_at_once(roles):
    """A workload whose workflow reports `done` (failed) holds no reserved job: it used to stay
    `reserved`, counting against the tenant's in-flight cap, until the orphan sweep minutes
    later (issue 26)."""
    import time as _time
    from types import SimpleNamespace

    from protocol.messages import WorkloadEvent

    roles.start("master")  # no env worker: the workload stays pending; its "workflow" is this test
    spec = sft_spec("fail-frees", steps=400)

    async def go():
        c = await _client(roles)
        try:
            wl = await c.submit(spec)
            job = await c.reserve(spec["tenant"], "sft", workload=wl.id, key="k1")
            assert job.state == "reserved"
            done = WorkloadEvent(workload=wl.id, tenant=spec["tenant"], kind="done", state="failed",
                                 message="simulated workflow failure", at=_time.time())
            await c.bus.publish(c.names.workload_events(wl.id), done)
            await _wait_workload(c, wl.id, lambda r: r.state == "failed", timeout_s=30)
            return await _wait_state(c, SimpleNamespace(name=spec["tenant"]), job.job, ("failed",), timeout_s=5)
        finally:
            await c.close()

    job = asyncio.run(go())
    assert job.state == "failed" and "its workload failed" in job.reason, job
