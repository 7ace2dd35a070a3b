"""Chaos suite: four tenants at once while random role processes are killed (or drained).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.chaos --mode kill --budget full
    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.chaos --mode drain --budget full
    .venv/bin/python -m bench.chaos --budget small --interval-s 4,8 --kills 7      # the 7-kill test
    .venv/bin/python -m bench.chaos --budget tiny --interval-s 3,6 --kills 3 --nats-cluster 3  # the default suite's
    .venv/bin/python -m bench.chaos --budget full --nats-cluster 3                  # + one NATS node killed

In order:
  1. ``nexus up --detach`` on a fresh data dir and a free port (``--nats-cluster 3`` is passed
     through); pids come from ``<data-dir>/cluster.json``, which the supervisor rewrites when it
     restarts a role.
  2. Four workloads on the built-in reach task, submitted with the SDK: two RL tenants, one SFT
     tenant, one eval of the SFT tenant's policy (it starts when the SFT workload is done).
     ``--budget tiny|small|full`` sizes them (tiny: a few kills, the default suite's run;
     small: about a minute of chaos; full: 8-10 minutes).
  3. Chaos: every ``--interval-s lo,hi`` seconds one role process, chosen so that every role
     type is hit once per round (master, trainer, inferencer, env, health, monitor), is
     SIGKILLed (``--mode kill``) or drained (``--mode drain``: a ``RestartRequest(mode="drain")``
     to the supervisor, which drains and replaces it; where no supervisor answers, SIGTERM and
     the role is reported "not replaced"). With a 3-node NATS cluster, once, half-way: one node
     SIGKILLed and started again from its own command line (read from /proc before the kill).
  4. While it runs: every second, each tenant's policy version (versions KV: needs no master)
     and episodes (the master's workload record); per kill, when a replacement instance of
     the role registered ``ready`` in the services KV and when the monitor saw it alive.
  5. At the end: every job record (master ``jobs`` op), each tenant's final version and
     checkpoint (applied job ids), checked by `bench.chaos_audit` (jobs lost, steps applied
     twice, order, checkpoint), plus workloads completed, kill coverage and recovery.
  6. A table on stdout and JSON in ``bench/results/chaos-<mode>.json``; the exit status is 1
     if any invariant failed (each failed one is named), 2 if the deployment never came up.

Every process it started is stopped on the way out, on failure or Ctrl-C too: ``nexus down``,
then SIGKILL of the supervisor's process group and of every role / NATS pid it ever saw.

Beside this file: the budgets, workloads, config and records (bench/chaos_config.py), the
deployment and its processes (bench/chaos_deploy.py), the table (bench/chaos_report.py) and the
checks (bench/chaos_audit.py); this one is the harness and its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transport.cluster import pid_alive
from bench.chaos_audit import Findings, audit_jobs, percentile
from bench.chaos_config import BUDGETS, ChaosConfig, Kill, NatsKill, workload_specs
from bench.chaos_deploy import (Deployment, Poll, answers_info, listening_ports, ports_of_url, proc_cmdline,
                                stop_on_sigterm)
from bench.chaos_report import fmt, print_report

KILLABLE_ROLES = ("master", "trainer", "inferencer", "env", "health", "monitor")
TERMINAL = ("completed", "failed", "cancelled")

SAMPLE = Poll("chaos_sample", every_s=1.0, deadline_s=0.0)  # progress sampler; runs until stopped
RECOVERY = Poll("chaos_recovery", every_s=0.2, deadline_s=120.0)  # kill -> replacement ready
AUDIT = Poll("chaos_audit", every_s=1.0, deadline_s=45.0)  # final jobs listing through a master restart
# After the chaos, a run in which no tenant's version, episodes or workload state changed for
# this long is declared stalled and audited as it stands (a role drained and never replaced
# would otherwise hold the run until --timeout-s).
STALL = Poll("chaos_stall", every_s=1.0, deadline_s=150.0)
REQUEST_TIMEOUT_S = 15.0  # each request of the harness (2 busy cores: replies have taken > 5 s)
SUBMIT_ATTEMPTS = 3
DRAIN_REQUEST_TIMEOUT_S = 45.0  # the supervisor answers a drain-restart once the drain is done (a late copy: Ok)
DRAIN_REQUEST_ATTEMPTS = 3  # a request lost with its NATS node is sent again (idempotent per instance)
NATS_DOWN_S = 10.0  # a killed NATS node stays down this long before it is started again


# -- the harness ------------------------------------------------------------------------------
class Chaos:
    def __init__(self, cfg: ChaosConfig, dep: Deployment) -> None:
        self.cfg = cfg
        self.dep = dep
        self.rng = random.Random(cfg.seed)
        self.kills: list[Kill] = []
        self.nats = NatsKill()
        self.samples: list[tuple[float, dict[str, tuple[int, int, str]]]] = []
        self.workloads: dict[str, Any] = {}  # id -> last WorkloadRecord
        self.tenant_of: dict[str, str] = {}  # workload id -> tenant
        self.task_of: dict[str, str] = {}
        self.errors: list[str] = []  # harness-side observations (failed reads etc.), deduplicated
        self.skipped: list[str] = []
        self._all_done = asyncio.Event()
        self._watchers: list[asyncio.Task] = []
        self.client = None
        self.names = None
        self.timeline: dict[str, float] = {}

    def note(self, text: str) -> None:
        if text not in self.errors:
            self.errors.append(text)
            print(f"[chaos] {text}", flush=True)

    # 1-2. bring up and submit
    async def run(self) -> dict[str, Any]:
        from sdk.client import AsyncClient

        t0 = time.time()
        from transport.broker import free_port

        state = await asyncio.to_thread(self.dep.up, free_port())
        self.timeline["up_s"] = time.time() - t0
        print(f"[chaos] up in {self.timeline['up_s']:.1f} s: {state['nats_url']} ({len(state['roles'])} roles)",
              flush=True)
        self.client = AsyncClient(state["nats_url"], state["prefix"], timeout_s=REQUEST_TIMEOUT_S)
        await self.client.connect()
        self.names = self.client.names
        try:
            tag = f"{int(time.time()) % 100000}"
            for spec in workload_specs(self.cfg.budget, tag):
                wid = await self._submit(spec)
                self.tenant_of[wid], self.task_of[wid] = spec["tenant"], spec["task"]
                print(f"[chaos] submitted {spec['task']:<4} {spec['tenant']} -> {wid}", flush=True)
            self.timeline["submitted_at"] = time.time()
            sampler = asyncio.create_task(self._sample_loop())
            await self._chaos_loop()
            self.timeline["chaos_end_at"] = time.time()
            await self._wait_done()
            await asyncio.gather(*self._watchers, return_exceptions=True)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            self._attribute_progress()
            return await self._report()
        finally:
            await self.client.close()

    async def _submit(self, spec: dict[str, Any]) -> str:
        """Submit once; a submit whose reply was lost (a loaded machine) may still have been
        accepted: look the tenant's workload up before trying again."""
        from protocol.errors import RequestTimeout, Unavailable

        for _ in range(SUBMIT_ATTEMPTS):
            try:
                return (await self.client.submit(spec)).id
            except (RequestTimeout, Unavailable) as exc:
                self.note(f"submit of {spec['tenant']} unanswered ({exc.code.value}); looking it up")
                await asyncio.sleep(2.0)
                try:
                    found = await self.client.workloads(spec["tenant"])
                except (RequestTimeout, Unavailable):
                    continue
                if found:
                    return found[0].workload
        raise RuntimeError(f"submit of {spec['tenant']} failed {SUBMIT_ATTEMPTS} times")

    # 3. chaos
    async def _chaos_loop(self) -> None:
        cycle: list[str] = []
        deadline = time.monotonic() + self.cfg.timeout_s
        nats_at = max(1, self.cfg.kills // 2)
        while len(self.kills) < self.cfg.kills and not self._all_done.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self._all_done.wait(), timeout=self.rng.uniform(*self.cfg.interval_s))
                break
            except asyncio.TimeoutError:
                pass
            if not cycle:
                cycle = list(KILLABLE_ROLES)
                self.rng.shuffle(cycle)
            role = cycle.pop()
            target = self.dep.role(role)
            if target is None:
                self.skipped.append(f"{role}: no live instance in cluster.json at kill {len(self.kills) + 1}")
                self.note(f"skip {role}: no live instance (an earlier drain was not replaced?)")
                if not any(self.dep.role(r) for r in KILLABLE_ROLES):
                    self.note("no live role left to strike; chaos ends")
                    break
                continue
            await self._strike(role, target)
            if len(self.kills) == nats_at and self.cfg.nats_cluster > 1:
                await self._kill_nats_node()
        if self.cfg.nats_cluster <= 1:
            self.nats.skipped = "nats node kill skipped: single server"
        elif not self.nats.done and not self.nats.skipped:
            self.nats.skipped = "nats node kill not reached (workloads ended first)"

    async def _strike(self, role: str, target: dict[str, Any]) -> None:
        pid, instance = int(target["pid"]), target["instance"]
        cmd = proc_cmdline(pid)
        if "actors.run" not in cmd or role not in cmd:
            self.note(f"pid {pid} is not the {role} role ({cmd}); skipped")
            return
        k = Kill(n=len(self.kills) + 1, role=role, instance=instance, pid=pid, mode="kill", at=time.time())
        if self.cfg.mode == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            k.mode = "drain-request"
            self._watchers.append(asyncio.create_task(self._drain(k)))
        self.kills.append(k)
        print(f"[chaos] #{k.n} {k.mode} {role} {instance} (pid {pid})", flush=True)
        self._watchers.append(asyncio.create_task(self._watch_recovery(k)))

    async def _drain(self, k: Kill) -> None:
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        from protocol.messages import ErrorReply, RestartRequest
        from protocol.wire import decode, encode

        req = RestartRequest(role=k.role, instance=k.instance, mode="drain", reason=f"chaos drain #{k.n}")
        try:
            # A core-NATS request is lost with the node it went through (a drain sent just before
            # the NATS node kill never reached the supervisor). Sent again on no answer: the
            # supervisor serves one restart per instance, and answers Ok "already replaced" to a
            # late copy, so a second copy never drains twice.
            for attempt in range(1, DRAIN_REQUEST_ATTEMPTS + 1):
                try:
                    reply = await self.client.bus.nc.request(self.names.supervisor("restart"), encode(req),
                                                             timeout=DRAIN_REQUEST_TIMEOUT_S)
                    break
                except NatsTimeout:
                    if attempt == DRAIN_REQUEST_ATTEMPTS:
                        raise
                    print(f"[chaos] drain #{k.n}: no answer in {DRAIN_REQUEST_TIMEOUT_S:g} s; sending it again",
                          flush=True)
            msg = decode(reply.data)
            if isinstance(msg, ErrorReply):
                k.note = f"restart request refused ({msg.code}: {msg.message}); SIGTERM instead"
            else:
                k.note = f"supervisor: {getattr(msg, 'detail', type(msg).__name__)}"
                return
        except NoRespondersError:
            k.note = "no supervisor serves restart requests; SIGTERM instead"
        except NatsTimeout:
            k.note = f"restart request unanswered {DRAIN_REQUEST_ATTEMPTS} times in {DRAIN_REQUEST_TIMEOUT_S:g} s"
            return
        k.mode = "drain-sigterm"
        if pid_alive(k.pid) and proc_cmdline(k.pid) == self.dep.seen.get(k.pid):
            os.kill(k.pid, signal.SIGTERM)

    async def _watch_recovery(self, k: Kill) -> None:
        """Kill -> a new instance of the role in cluster.json -> its ServiceRecord ready ->
        the monitor lists it alive."""
        from protocol.messages import ServiceRecord
        from protocol.subjects import Names
        from protocol.wire import decode

        deadline = k.at + RECOVERY.deadline_s
        kv = None
        poll_error = ""
        while time.time() < deadline:
            await asyncio.sleep(RECOVERY.every_s)
            if not k.replaced_by:
                r = self.dep.role(k.role)
                if r is None or r["instance"] == k.instance:
                    continue
                k.replaced_by = r["instance"]
            try:
                if k.registered_s is None:
                    kv = kv or await self.client.bus.js.key_value(self.names.kv_services)
                    entry = await kv.get(Names.service_key(k.role, k.replaced_by))
                    if decode(entry.value, ServiceRecord).state == "ready":
                        k.registered_s = time.time() - k.at
                        k.replaced = True
                if k.registered_s is not None and k.monitor_alive_s is None:
                    status = await self.client.status(include_dead=False)
                    if any(r.instance == k.replaced_by and r.state == "alive" for r in status.roles):
                        k.monitor_alive_s = time.time() - k.at
                        return
            except Exception as exc:  # noqa: BLE001 - not registered yet / monitor or broker down: poll again
                poll_error = f"{type(exc).__name__}: {exc}"[:200]
        if not k.replaced:
            k.note = (k.note + (f"; last poll error: {poll_error}" if poll_error else "")).strip("; ")
            self.note(f"kill #{k.n} ({k.role}): not replaced within {RECOVERY.deadline_s:g} s "
                      f"(replacement seen: {k.replaced_by or 'none'})")

    async def _kill_nats_node(self) -> None:
        state = self.dep.state() or {}
        pids = [p for p in (state.get("broker_pids") or []) if pid_alive(p)]
        if len(pids) < 3:
            self.nats.skipped = f"nats node kill skipped: single server (cluster.json lists {len(pids)} broker_pids)"
            print(f"[chaos] {self.nats.skipped}", flush=True)
            return
        pid = self.rng.choice(pids)
        cmd = proc_cmdline(pid)
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = str(self.dep.data_dir)
        # Its client port: the one of the deployment's URLs this process listens on (the
        # port may live in a config file, so it is read from the socket table, not argv).
        url_ports = ports_of_url(str(state.get("nats_url", "")))
        ports = sorted(listening_ports(pid) & url_ports)
        port = ports[0] if ports else None
        self.nats.pid, self.nats.at = pid, time.time()
        os.kill(pid, signal.SIGKILL)
        print(f"[chaos] NATS node pid {pid} (client port {port}) SIGKILLed; back in {NATS_DOWN_S:g} s", flush=True)
        # 1. stays down NATS_DOWN_S, unless the deployment brings it back by itself first
        down_until = time.monotonic() + NATS_DOWN_S
        while time.monotonic() < down_until:
            await asyncio.sleep(0.2)
            if port is not None and await asyncio.to_thread(answers_info, port):
                self.nats.back_s, self.nats.done = time.time() - self.nats.at, True
                self.nats.note = "the deployment restarted the node itself"
                return
        # 2. started again from its own command line: same ports, same store
        log = open(self.dep.data_dir / "logs" / f"nats-restarted-{pid}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.dep.started.append(proc)
        self.dep.seen[proc.pid] = cmd
        self.nats.restarted_pid, self.nats.done = proc.pid, True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.nats.note = f"restarted node exited {proc.returncode}"
                break
            if port is None:
                self.nats.note = "its client port was not found; not probed"
                break
            if await asyncio.to_thread(answers_info, port):
                self.nats.back_s = time.time() - self.nats.at
                break
            await asyncio.sleep(0.2)
        print(f"[chaos] NATS node restarted as pid {proc.pid}; back after {fmt(self.nats.back_s)} s", flush=True)

    # 4. progress
    async def _sample_loop(self) -> None:
        from protocol.messages import WeightsRef
        from protocol.wire import decode

        kv = None
        while True:
            versions: dict[str, int] = {}
            try:
                kv = kv or await self.client.bus.js.key_value(self.names.kv_versions)
                for tenant in set(self.tenant_of.values()):
                    try:
                        versions[tenant] = decode((await kv.get(tenant)).value, WeightsRef).version
                    except Exception:  # noqa: BLE001 - KeyNotFound: nothing exported yet
                        versions[tenant] = 0
            except Exception as exc:  # noqa: BLE001 - broker node down: keep the last sample
                self.note(f"versions KV read failed at least once ({type(exc).__name__})")
            try:
                for rec in await self.client.workloads():
                    if rec.workload in self.tenant_of:
                        self.workloads[rec.workload] = rec
            except Exception as exc:  # noqa: BLE001 - master down: keep the last records
                self.note(f"workload status unavailable at least once ({type(exc).__name__})")
            last = self.samples[-1][1] if self.samples else {}
            row = {}
            for wid, tenant in self.tenant_of.items():
                rec = self.workloads.get(wid)
                prev = last.get(tenant, (0, 0, "pending"))
                row[tenant] = (versions.get(tenant, prev[0]), rec.episodes if rec else prev[1],
                               rec.state if rec else prev[2])
            self.samples.append((time.time(), row))
            if len(self.workloads) == len(self.tenant_of) and all(
                    r.state in TERMINAL for r in self.workloads.values()):
                self._all_done.set()
            await asyncio.sleep(SAMPLE.every_s)

    async def _wait_done(self) -> None:
        end = self.timeline["submitted_at"] + self.cfg.timeout_s
        changed_at, last = time.time(), None
        while not self._all_done.is_set():
            row = self.samples[-1][1] if self.samples else None
            if row != last:
                changed_at, last = time.time(), row
            if time.time() > end:
                self.note(f"workloads not all finished within --timeout-s {self.cfg.timeout_s:g}")
                return
            if time.time() - changed_at > STALL.deadline_s:
                self.note(f"stalled: no tenant progressed for {STALL.deadline_s:g} s after the chaos; audited as is")
                return
            await asyncio.sleep(STALL.every_s)

    def _at(self, t: float) -> dict[str, tuple[int, int, str]]:
        row: dict[str, tuple[int, int, str]] = {}
        for at, r in self.samples:
            if at > t:
                break
            row = r
        return row

    def _attribute_progress(self) -> None:
        end = self.samples[-1][0] if self.samples else time.time()
        for k in self.kills:
            t1 = k.at + (k.registered_s if k.registered_s is not None else (end - k.at))
            a, b = self._at(k.at), self._at(t1)
            k.progress = {t: {"version": b[t][0] - a.get(t, (0, 0))[0], "episodes": b[t][1] - a.get(t, (0, 0))[1]}
                          for t in b}

    # 5-6. audit and report
    async def _report(self) -> dict[str, Any]:
        jobs, versions, checkpoints, audit_error = await self._collect()
        findings = audit_jobs(jobs, versions, checkpoints, self.cfg.allowed_failure) if jobs is not None else Findings()
        recs = {wid: self.workloads.get(wid) for wid in self.tenant_of}
        kills = [k for k in self.kills]
        registered = [k.registered_s for k in kills if k.registered_s is not None]
        alive = [k.monitor_alive_s for k in kills if k.monitor_alive_s is not None]
        by_role: dict[str, dict[str, Any]] = {}
        for role in KILLABLE_ROLES:
            ks = [k for k in kills if k.role == role]
            rs = [k.registered_s for k in ks if k.registered_s is not None]
            by_role[role] = {"kills": len(ks), "replaced": sum(k.replaced for k in ks),
                             "recovery_p50_s": percentile(rs, 50), "recovery_max_s": max(rs) if rs else None}
        progress_while_down: dict[str, dict[str, dict[str, float]]] = {}
        for k in kills:
            per = progress_while_down.setdefault(k.role, {})
            for tenant, d in k.progress.items():
                acc = per.setdefault(tenant, {"version": 0, "episodes": 0})
                acc["version"] += d["version"]
                acc["episodes"] += d["episodes"]
        invariants: dict[str, tuple[bool, str]] = {}
        invariants["deployment_audited"] = (jobs is not None, audit_error or "job records read")
        audited = jobs is not None
        invariants["jobs_lost"] = (audited and findings.lost == 0, f"{findings.lost} lost" if audited else "not audited")
        invariants["steps_applied_twice"] = (audited and findings.twice == 0,
                                             f"{findings.twice} symptoms" if audited else "not audited")
        invariants["checkpoint_matches_jobs"] = (findings.checkpoint_mismatches == 0,
                                                 f"{findings.checkpoint_mismatches} mismatches")
        invariants["versions_in_job_order"] = (findings.out_of_order == 0, f"{findings.out_of_order} out of order")
        done = [r for r in recs.values() if r is not None and r.state == "completed"]
        invariants["workloads_completed"] = (len(done) == len(recs), f"{len(done)}/{len(recs)} completed")
        covered = {k.role for k in kills}
        if self.cfg.kills >= len(KILLABLE_ROLES):  # a baseline (--kills 0) or a short run need not cover all
            invariants["kills_cover_every_role"] = (covered >= set(KILLABLE_ROLES),
                                                    f"missing {sorted(set(KILLABLE_ROLES) - covered)}" if
                                                    covered < set(KILLABLE_ROLES) else "all six")
        invariants["kill_count"] = (len(kills) >= self.cfg.kills, f"{len(kills)} of {self.cfg.kills}")
        not_replaced = [k for k in kills if not k.replaced]
        invariants["every_kill_replaced"] = (not not_replaced,
                                             f"{len(not_replaced)} not replaced: "
                                             + ", ".join(f"#{k.n} {k.role}" for k in not_replaced) if not_replaced
                                             else f"{len(kills)} replaced")
        if self.cfg.nats_cluster > 1:
            ok = self.nats.done and self.nats.back_s is not None
            invariants["nats_node_killed_and_back"] = (ok, self.nats.skipped or self.nats.note or
                                                       f"back in {self.nats.back_s:.1f} s")
        failed = [name for name, (ok, _) in invariants.items() if not ok]
        # Observations (reported, not invariants): an SFT tenant trained past its step budget
        # means a restarted workflow did not resume its count.
        observations = []
        sft_steps = BUDGETS[self.cfg.budget]["sft"]["steps"]
        for wid, task in self.task_of.items():
            tenant = self.tenant_of[wid]
            final = versions.get(tenant)
            if task == "sft" and final is not None and final > sft_steps:
                observations.append(f"{tenant} trained {final} steps for a budget of {sft_steps} "
                                    "(a restarted SFT workflow counted its steps from 0 again?)")
        report = {
            "config": {**asdict(self.cfg), "data_dir": str(self.dep.data_dir), "out": str(self.cfg.out)},
            "invariants": {name: {"ok": ok, "detail": d} for name, (ok, d) in invariants.items()},
            "failed": failed,
            "jobs_lost": findings.lost,
            "steps_applied_twice": findings.twice,
            "workloads": {wid: {"tenant": self.tenant_of[wid], "task": self.task_of[wid],
                                "state": r.state if r else "unknown", "message": r.message if r else "",
                                "version": r.step if r else 0, "episodes": r.episodes if r else 0}
                          for wid, r in recs.items()},
            "tenants": {t: asdict(a) for t, a in findings.tenants.items()},
            "recovery": {"kills": len(kills), "registered_p50_s": percentile(registered, 50),
                         "registered_p99_s": percentile(registered, 99),
                         "monitor_alive_p50_s": percentile(alive, 50), "monitor_alive_p99_s": percentile(alive, 99),
                         "by_role": by_role},
            "progress_while_down": progress_while_down,
            "kill_log": [asdict(k) for k in kills],
            "nats_node": asdict(self.nats),
            "skipped": self.skipped,
            "observations": observations,
            "notes": self.errors,
            "timeline": {"up_s": self.timeline.get("up_s"),
                         "chaos_s": self.timeline.get("chaos_end_at", 0) - self.timeline.get("submitted_at", 0),
                         "total_s": (self.samples[-1][0] - self.timeline["submitted_at"]) if self.samples else None},
        }
        return report

    async def _kv_records(self, bucket: str, cls: type) -> list[Any]:
        from master.store import kv_keys
        from protocol.wire import decode

        from nats.js.errors import KeyNotFoundError

        kv = await self.client.bus.js.key_value(bucket)
        out = []
        for key in await kv_keys(kv):
            try:
                out.append(decode((await kv.get(key)).value, cls))
            except KeyNotFoundError:  # deleted between the listing and the read
                continue
        return out

    async def _checkpoint_object(self, tenant: str) -> str | None:
        """Name of the tenant's committed checkpoint object. Two formats are known: the
        master's checkpoint pointer (``checkpoint_get`` op -> `CheckpointRef`, fenced commits)
        and, before it, one mutable object ``<tenant>/checkpoint``."""
        import protocol.messages as m

        if hasattr(m, "CheckpointGetRequest"):
            from protocol import ops

            ref = await self.client.bus.call(ops.MASTER_CHECKPOINT_GET, m.CheckpointGetRequest(tenant=tenant),
                                             timeout_s=REQUEST_TIMEOUT_S)
            return ref.object_name or None
        from nats.js.errors import ObjectNotFoundError

        store = await self.client.bus.js.object_store(self.names.obj_checkpoints)
        try:
            await store.get_info(f"{tenant}/checkpoint")
        except ObjectNotFoundError:
            return None
        return f"{tenant}/checkpoint"

    async def _collect(self):
        """Job records (retrying through a master restart), final versions, checkpoints."""
        from protocol.codec import unpackb
        from protocol.messages import JobRecord, WeightsRef, WorkloadRecord
        from protocol.wire import decode

        jobs, err = None, ""
        deadline = time.monotonic() + AUDIT.deadline_s
        while jobs is None and time.monotonic() < deadline:
            try:
                jobs = await self.client.jobs()
            except Exception as exc:  # noqa: BLE001 - the master may be restarting: retry
                err = f"jobs listing failed: {type(exc).__name__}: {exc}"
                await asyncio.sleep(AUDIT.every_s)
        if jobs is not None:
            err = ""
        else:
            # No master: the records themselves are in the jobs KV (the master is their only
            # writer), and the workload records in the workloads KV.
            try:
                jobs = await self._kv_records(self.names.kv_jobs, JobRecord)
                for rec in await self._kv_records(self.names.kv_workloads, WorkloadRecord):
                    if rec.workload in self.tenant_of:
                        self.workloads[rec.workload] = rec
                self.note(f"master unavailable at the end ({err}); job and workload records read from KV")
                err = ""
            except Exception as exc:  # noqa: BLE001 - reported as the audit failure
                err += f"; jobs KV unreadable too: {type(exc).__name__}: {exc}"
        training = {t for w, t in self.tenant_of.items() if self.task_of[w] in ("sft", "rl")}
        jobs = [j for j in jobs if j.tenant in training] if jobs is not None else None
        versions: dict[str, int] = {}
        checkpoints: dict[str, dict[str, Any]] = {}
        from actors.trainer.slots import get_object

        try:
            kv = await self.client.bus.js.key_value(self.names.kv_versions)
            store = await self.client.bus.js.object_store(self.names.obj_checkpoints)
        except Exception as exc:  # noqa: BLE001 - reported; the audit then has no versions
            return jobs, versions, checkpoints, f"versions / checkpoints unreadable: {exc}"
        for tenant in sorted(training):
            try:
                versions[tenant] = decode((await kv.get(tenant)).value, WeightsRef).version
            except Exception:  # noqa: BLE001 - nothing exported: version 0
                versions[tenant] = 0
            try:
                name = await self._checkpoint_object(tenant)
                if name is None:
                    continue  # nothing committed yet
                blob = unpackb(await get_object(store, name))
                checkpoints[tenant] = {"object": name, "applied": list(blob.get("applied", [])),
                                       "version": blob.get("version")}
            except Exception as exc:  # noqa: BLE001 - reported: the audit counts it as a mismatch
                checkpoints[tenant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return jobs, versions, checkpoints, err


def run(cfg: ChaosConfig) -> tuple[int, dict[str, Any] | None]:
    """Run the suite; cleanup is guaranteed. Returns (exit status, report)."""
    made = cfg.data_dir is None
    data_dir = Path(cfg.data_dir or tempfile.mkdtemp(prefix="nexus-chaos-")).resolve()
    dep = Deployment(data_dir, cfg.nats_cluster)
    report = None
    code = 1
    try:
        chaos = Chaos(cfg, dep)
        try:
            report = asyncio.run(chaos.run())
        except RuntimeError as exc:
            if "nexus up" in str(exc):
                print(f"[chaos] deployment did not come up: {exc}", file=sys.stderr, flush=True)
                return 2, None
            raise
        code = 1 if report["failed"] else 0
    finally:
        notes = dep.cleanup()
        for n in notes:
            print(f"[chaos] cleanup: {n}", flush=True)
        if report is not None:
            report["cleanup"] = notes
            cfg.out.parent.mkdir(parents=True, exist_ok=True)
            cfg.out.write_text(json.dumps(report, indent=2, default=str))
            print_report(report)
            print(f"\nJSON: {cfg.out}  (logs: {data_dir / 'logs'}{' kept' if cfg.keep_data or not made else ''})")
        if made and not cfg.keep_data:
            # Keep the logs of a failed run next to the JSON; drop the JetStream store.
            if report is not None and report["failed"]:
                dest = cfg.out.with_suffix("").with_name(cfg.out.stem + "-logs")
                shutil.rmtree(dest, ignore_errors=True)
                if (data_dir / "logs").exists():
                    shutil.copytree(data_dir / "logs", dest)
                    print(f"logs of the failed run: {dest}")
            shutil.rmtree(data_dir, ignore_errors=True)
    return code, report


def _interval(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("kill", "drain"), default="kill")
    p.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    p.add_argument("--interval-s", type=_interval, default=(15.0, 30.0), help="lo,hi seconds between kills")
    p.add_argument("--kills", type=int, default=-1,
                   help="role kills (default: tiny 3, small 7, full 22; 0: a baseline without chaos)")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--keep-data", action="store_true")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/chaos-<mode>.json)")
    p.add_argument("--timeout-s", type=float, default=0.0, help="whole run (default: tiny 300, small 420, full 2400)")
    p.add_argument("--allowed-failure", help="regex: a failed job whose reason matches is not counted lost")
    args = p.parse_args(argv)
    stop_on_sigterm()  # a killed run takes its deployment down
    cfg = ChaosConfig(mode=args.mode, budget=args.budget, interval_s=args.interval_s, kills=args.kills,
                      nats_cluster=args.nats_cluster, seed=args.seed, data_dir=args.data_dir,
                      keep_data=args.keep_data, out=args.out, timeout_s=args.timeout_s,
                      allowed_failure=args.allowed_failure)

    # SIGTERM (a test timeout, a CI cancel) unwinds like Ctrl-C, so the finally cleans up.
    def _term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        code, _ = run(cfg)
    except KeyboardInterrupt:
        print("[chaos] interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
