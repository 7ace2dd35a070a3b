"""Soak: many short jobs of several tenants through real master + trainer processes, under
glibc's heap checker (issue 24 item 3).

A trainer once died of heap corruption (``free(): corrupted unsorted chunks``, exit -6) in a
plain one-tenant SFT; the lease design recovered the job, so only a dead role shows it. Here
every role process runs with glibc's checks on (``MALLOC_CHECK_=3``, freed and new memory
filled with ``MALLOC_PERTURB_``; since glibc 2.34 ``MALLOC_CHECK_`` needs
``libc_malloc_debug.so`` preloaded, which is done where it exists) and the test fails if any
role process died or restarted, or if a role's log names a heap error or PyTorch's
non-writable-array warning (tests/protocol/test_writable_arrays.py says why that one matters).

The roles are started with ``python -m actors.run`` (not forked from the test zygote): a forked
child keeps its parent's allocator settings, and the checker must be on from the process's
first allocation. Several tenants train at once, so the trainer's grouped steps, its background
commit / export of a job that left the group, and the next job's slot preparation overlap.

Each tenant's exported weights must also be bit-identical to an in-process run of its
micro-batches once each, in order (the exactly-once check of tests/support/tq_helpers.py): corruption
that does not crash still fails here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RoleProcs, python_env, run_client
from tests.support.tq_helpers import exactly_once, queue_job, role_info, tenant

MALLOC_DEBUG_SO = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0")
# glibc's own words for a corrupt heap, and the abort; PyTorch's warning for a read-only array.
BAD_LOG_WORDS = ("corrupted", "double free", "free(): invalid", "malloc(): ", "Aborted",
                 "Fatal Python error", "Segmentation fault", "not writable")


def malloc_check_env() -> dict[str, str]:
    env = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    if MALLOC_DEBUG_SO.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, (os.environ.get("LD_PRELOAD", ""), str(MALLOC_DEBUG_SO))))
    return env


def _heap_checked(pid: int) -> bool:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    if b"MALLOC_CHECK_=3" not in environ:
        return False
    return not MALLOC_DEBUG_SO.exists() or "libc_malloc_debug" in Path(f"/proc/{pid}/maps").read_text()


class CheckedRoles(RoleProcs):
    """`RoleProcs` whose roles are exec'd (never forked from the zygote) with the heap checker on."""

    def start(self, role: str, **env: str) -> subprocess.Popen:
        self._n += 1
        instance = f"{role}-{self._n}"
        role_env = python_env(NEXUS_HEARTBEAT_INTERVAL_S="0.3", NEXUS_HEALTH_TIMEOUT_S="1.2",
                              **malloc_check_env(), **env)
        argv = [sys.executable, "-m", "actors.run", role, "--nats-url", self.nats_url, "--prefix", self.prefix,
                "--data-dir", str(self.data_dir), "--instance", instance]
        with open(self.data_dir / f"{instance}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=role_env, stdout=log, stderr=subprocess.STDOUT)
        proc.instance = instance  # type: ignore[attr-defined]
        self.procs.append((role, instance, proc))
        self.wait_ready(role, instance, proc)
        return proc


def _soak(nats_url: str, prefix: str, data_dir: Path, tenants: int, jobs: int, items: int) -> None:
    # Up to 4 jobs of a tenant queued at once (the default quota allows 8): a longer soak's
    # later reserves wait for earlier jobs to clear (queue_job waits out the back-pressure).
    cfgs = [tenant(f"soak-{i}", seed=40 + i, max_inflight_jobs=min(jobs, 4)) for i in range(tenants)]
    with CheckedRoles(nats_url, prefix, data_dir) as roles:
        roles.start("master")
        trainer = roles.start("trainer", NEXUS_TRAINER_GROUP_MAX=str(tenants))
        for _, inst, p in roles.procs:  # the checker is really on in each role process
            assert _heap_checked(p.pid), f"{inst} (pid {p.pid}) runs without glibc's heap checker"

        async def one_tenant(c, cfg):
            await c.create_tenant(cfg)
            queued = [await queue_job(c, cfg, items, seed=cfg.seed * 100 + k) for k in range(jobs)]
            recs = [await c.wait_job(cfg.name, job.job, timeout_s=240) for job, _ in queued]
            # The tenant's micro-batches in the order its jobs trained (their versions).
            order = sorted(range(jobs), key=lambda k: recs[k].trained_version)
            all_items = [item for k in order for item in queued[k][1]]
            payload, _ = await c.download_weights(await c.latest_weights(cfg.name))
            return recs, all_items, payload

        async def body(c):
            out = await asyncio.gather(*(one_tenant(c, cfg) for cfg in cfgs))
            return out, (await role_info(c, "trainer", trainer.instance)).extra

        results, info = run_client(roles, body, timeout_s=60)
        # Every role is the process it started as: none died, none was replaced.
        dead = {inst: p.returncode for _, inst, p in roles.procs if p.poll() is not None}
        logs = {inst: roles.log(inst) for _, inst, _ in roles.procs}
    assert not dead, f"role processes exited: {dead}\n" + "\n".join(logs[i][-3000:] for i in dead)
    for inst, text in logs.items():
        bad = [w for w in BAD_LOG_WORDS if w in text]
        assert not bad, f"{inst} log names {bad}:\n{text[-3000:]}"
    for cfg, (recs, all_items, payload) in zip(cfgs, results):
        assert [r.state for r in recs] == ["cleared"] * jobs, [(r.state, r.reason) for r in recs]
        assert [r.attempts for r in recs] == [1] * jobs, "a job was retried: its trainer lost it"
        assert sorted(r.trained_version for r in recs) == [items * (k + 1) for k in range(jobs)]
        assert exactly_once(cfg, all_items, payload), f"{cfg.name}: weights differ from one application per item"
    assert info["steps"] < tenants * jobs * items, "no grouped step: tenants never trained together"


@pytest.mark.timeout(240)
def test_soak_short_jobs_of_three_tenants_under_the_heap_checker(nats_url, layout, tmp_path):
    """3 tenants x 4 jobs x 2 micro-batches: about a minute on 2 cores."""
    _soak(nats_url, layout.prefix, tmp_path, tenants=3, jobs=4, items=2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_long_under_the_heap_checker(nats_url, layout, tmp_path):
    """3 tenants x 25 jobs x 3 micro-batches."""
    _soak(nats_url, layout.prefix, tmp_path, tenants=3, jobs=25, items=3)
