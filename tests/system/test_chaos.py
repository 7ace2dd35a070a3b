"""Chaos, short: four tenants (two RL, one SFT, one eval) while role processes are killed.

The suite itself is bench/chaos.py (run here as a subprocess, as a user would, so its cleanup
path is the one exercised); the benchmark is ``python -m bench.chaos --budget full`` (22 kills,
one NATS node of three). Here, in the default suite: a tiny budget with 3 SIGKILLs 3-6 s apart
and one NATS node of three SIGKILLed and started again (the deployment's URL carries
``?creds=`` since tenant auth: the harness once crashed parsing it, so only a run that kills a
node guards it), and a small budget with 7 SIGKILLs 4-8 s apart, every role type at least once;
the invariants: no job lost, no optimizer step applied twice, every workload completed, every
kill replaced. A drain-mode run (4 drains through the supervisor's restart request) is marked
slow.

The checker comes first: it is fed made-up job histories with each fault it must catch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.chaos_deploy import ports_of_url
from bench.chaos_audit import audit_jobs, percentile
from tests.conftest import ROOT, python_env


@dataclass
class J:  # the JobRecord fields the audit reads
    tenant: str
    job: str
    state: str
    items: int = 2
    trained_version: int = -1
    reason: str = ""
    attempts: int = 1
    lease_owner: str = ""


def _clean(n: int = 3) -> list[J]:
    return [J("t", f"j{i}", "cleared", items=2, trained_version=2 * (i + 1)) for i in range(n)]


def test_audit_passes_a_clean_history():
    jobs = _clean() + [J("t", "j9", "dropped_stale")]
    f = audit_jobs(jobs, {"t": 6}, {"t": {"applied": ["j0", "j1", "j2"], "version": 6}})
    assert (f.lost, f.twice, f.out_of_order, f.checkpoint_mismatches) == (0, 0, 0, 0)
    assert f.tenants["t"].items_trained == 6 and f.tenants["t"].dropped_stale == 1


def test_audit_catches_a_job_trained_twice():
    jobs = _clean()
    jobs[1].trained_version = 6  # j1's two items applied twice: 2 -> 6
    jobs[2].trained_version = 8
    f = audit_jobs(jobs, {"t": 8}, {"t": {"applied": ["j0", "j1", "j1", "j2"], "version": 8}})
    assert f.twice >= 2  # the gap, and the final version past the items
    assert any("applied twice" in line for line in f.tenants["t"].twice)
    assert f.checkpoint_mismatches >= 1  # j1 listed twice


def test_audit_counts_stranded_and_failed_jobs_as_lost():
    jobs = _clean(1) + [J("t", "j5", "leased", lease_owner="trainer-x"), J("t", "j6", "reserved"),
                        J("t", "j7", "failed", reason="lease expired 3 times")]
    f = audit_jobs(jobs, {"t": 2})
    assert f.lost == 3
    assert {x["kind"] for x in f.tenants["t"].lost} == {"stranded", "failed"}
    # A data error can be allowed by pattern; a lease failure still counts.
    assert audit_jobs(jobs, {"t": 2}, allowed_failure="^bad data").lost == 3
    assert audit_jobs(jobs, {"t": 2}, allowed_failure="lease expired").lost == 2


def test_audit_catches_reordering_and_checkpoint_drift():
    jobs = _clean()
    jobs[0].trained_version, jobs[1].trained_version = 4, 2  # j1 trained before the older j0
    f = audit_jobs(jobs, {"t": 6}, {"t": {"applied": ["j0", "j1"], "version": 4}})
    assert f.out_of_order == 1 and f.twice == 0
    assert f.checkpoint_mismatches == 2  # j2 missing from the applied ids; version 4 != 6


def test_audit_counts_a_missing_or_unreadable_checkpoint():
    f = audit_jobs(_clean(), {"t": 6}, {})
    assert f.checkpoint_mismatches == 1  # jobs cleared, nothing committed
    f = audit_jobs(_clean(), {"t": 6}, {"t": {"error": "TypeError: bad format"}})
    assert f.checkpoint_mismatches == 1 and "unreadable" in f.tenants["t"].checkpoint[0]


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_url_ports_read_each_servers_port_past_its_credentials():
    """cluster.json's URL names the admin's credentials on every server (``?creds=PATH``, a
    path that may hold a colon); a ``user:pass@`` may precede the host."""
    url = ("nats://127.0.0.1:55627?creds=/tmp/x/admin.creds,nats://u:p@127.0.0.1:55628?creds=/a:1/b.creds,"
           " nats://127.0.0.1:4222")
    assert ports_of_url(url) == {55627, 55628, 4222}
    assert ports_of_url("") == set()


CLEANUP_S = 60  # the harness's own teardown after a SIGTERM (it drains every role it started)


def _run_chaos(tmp_path: Path, *args: str, timeout_s: float, budget: str = "small") -> dict:
    out = tmp_path / "chaos.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--budget", budget, "--out", str(out), *args],
                            cwd=ROOT, env=python_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            # Timed out (here or pytest-timeout's): SIGTERM, not SIGKILL, so the harness stops
            # the deployment it started (a SIGKILLed one left its supervisor, NATS node and
            # roles running for the rest of the suite).
            proc.terminate()
            try:
                proc.communicate(timeout=CLEANUP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    tail = stdout[-6000:]
    assert out.exists(), f"no report (exit {proc.returncode}):\n{tail}"
    rep = json.loads(out.read_text())
    rep["_output"] = tail
    rep["_code"] = proc.returncode
    return rep


def _assert_invariants(rep: dict) -> None:
    inv = rep["invariants"]
    out = rep["_output"]
    lost = {t: a["lost"] for t, a in rep["tenants"].items() if a["lost"]}
    twice = {t: a["twice"] for t, a in rep["tenants"].items() if a["twice"]}
    assert inv["deployment_audited"]["ok"], inv["deployment_audited"]["detail"]
    assert rep["jobs_lost"] == 0, f"jobs lost: {lost}\n{out}"
    assert rep["steps_applied_twice"] == 0, f"steps applied twice: {twice}\n{out}"
    assert inv["checkpoint_matches_jobs"]["ok"], out
    not_done = {w["tenant"]: (w["state"], w["message"]) for w in rep["workloads"].values() if w["state"] != "completed"}
    assert not not_done, f"workloads not completed: {not_done}\n{out}"
    assert inv["every_kill_replaced"]["ok"], f"{inv['every_kill_replaced']['detail']}\n{out}"
    assert rep["_code"] == 0, f"failed: {rep['failed']}\n{out}"


@pytest.mark.slow  # the default suite's run below kills a NATS node of three as well
@pytest.mark.timeout(420)  # 340 s of run, then CLEANUP_S for the harness to stop
def test_kills_and_a_nats_node_of_three_lose_nothing_and_apply_nothing_twice(tmp_path):
    """A few role kills and one NATS node of three killed half-way (after the first kill) and
    started again, on a deployment with tenant auth, at the tiny budget."""
    rep = _run_chaos(tmp_path, "--mode", "kill", "--interval-s", "3,6", "--kills", "3", "--nats-cluster", "3",
                     "--seed", "3", budget="tiny", timeout_s=340)
    assert len(rep["kill_log"]) == 3, rep["_output"]
    node = rep["nats_node"]
    assert node["done"] and node["back_s"] is not None and not node["skipped"], (node, rep["_output"])
    assert rep["invariants"]["nats_node_killed_and_back"]["ok"], rep["_output"]
    _assert_invariants(rep)


@pytest.mark.timeout(480)  # 400 s of run, then CLEANUP_S for the harness to stop
def test_kills_of_every_role_and_a_nats_node_lose_nothing_and_apply_nothing_twice(tmp_path):
    """The default suite's chaos run: seven kills that reach every role, and one NATS node of
    three killed half-way (after the first kill) and started again, on a deployment with
    tenant auth. (One run for both: two runs cost the suite ~2.5 minutes more.)"""
    rep = _run_chaos(tmp_path, "--mode", "kill", "--interval-s", "4,8", "--kills", "7", "--nats-cluster", "3",
                     "--seed", "1", timeout_s=400)
    kills = rep["kill_log"]
    assert len(kills) == 7, rep["_output"]
    assert {k["role"] for k in kills} == {"master", "trainer", "inferencer", "env", "health", "monitor"}
    node = rep["nats_node"]
    assert node["done"] and node["back_s"] is not None and not node["skipped"], (node, rep["_output"])
    assert rep["invariants"]["nats_node_killed_and_back"]["ok"], rep["_output"]
    assert rep["cleanup"] == [] or all("leftover" not in n for n in rep["cleanup"]), rep["cleanup"]
    _assert_invariants(rep)


@pytest.mark.slow
@pytest.mark.timeout(480)  # 400 s of run, then CLEANUP_S for the harness to stop
def test_drains_of_roles_lose_nothing_and_every_drained_role_is_replaced(tmp_path):
    rep = _run_chaos(tmp_path, "--mode", "drain", "--interval-s", "5,8", "--kills", "4", "--seed", "2",
                     timeout_s=400)
    assert len(rep["kill_log"]) == 4, rep["_output"]
    _assert_invariants(rep)
