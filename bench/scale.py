"""Scale bench: N tenants registered, M of them active at once on the tiny base, against N.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.scale --tenants 16,64 --active 8
    .venv/bin/python -m bench.scale --sched-only --tenants 16,64,256,1000     # the scheduler alone
    .venv/bin/python -m bench.scale --tenants 16 --active 4 --baseline-root /work/main   # + main's scheduler

Two parts, both written to ``bench/results/scale.json`` (``--out``) with a PNG of every curve
beside it (``scale.png``) and a table on stdout:

1. **The scheduler alone** (in-process, pure logic, `master.scheduler.Scheduler`): N tenants with
   one ready job each and F finished records each (F = 0 and ``--finished``), the steady state
   of ``--picks`` lease decisions of 4 jobs (each leased job is cleared and the tenant gets a
   new ready one). p50 / p99 per decision against N and F; with ``--baseline-root`` the same
   for the scheduler module of another checkout (before / after a change).
2. **A deployment per N** (skipped with ``--sched-only``): a nats-server of the bench's own,
   with its monitoring port (``-m``, 127.0.0.1), and ``nexus up --detach --nats-url`` on it
   (every role, supervised). Then, in order:
     1. register N tenants with the SDK (`AsyncClient.create_tenant`; M of them through their
        workload's submit): time per registration;
     2. idle snapshot: RSS of each role process, NATS streams / consumers / subscriptions /
        connections and the server's memory (/varz, /jsz, /subsz);
     3. M workloads submitted at once (half SFT, half RL, tiny budgets): submit-to-running
        latency (from the master's ``running`` event), time to finish, peaks of RSS and NATS
        while they run; every workload must end ``completed``;
     4. predicts on the trained tenants (``--predicts`` each, one at a time): p50 / p99;
     5. the master's lease decisions over the run (p50 / p99, timed inside the master: its
        ``info`` ``scale.lease_decision_ms``);
     6. master start-up with every record present: SIGKILL the master, the supervisor starts a
        new one; wall time until it answers, and its own ``startup_s`` (records load);
     7. throughput per tenant-unit of work, from the roles' ``info`` over steps 3-4: the
        trainer's tenant micro-batches (a grouped step of 4 jobs is 4) per second of device time
        and of wall time, and tenants per grouped step; the inferencer's predicts per second of
        device time and rows per forward. With ``--slot-budget-mb`` / ``--head-budget-mb`` the
        roles run under those memory budgets (docs/scale.md), and the row has their evictions
        and restores and the trainer's peak RSS.
   Tenant accounts: the bench's server runs without accounts (roles and the bench log in
   anonymously), so per-tenant NATS accounts are not in these figures (docs/scale.md).

Every process it started is stopped on the way out (``nexus down``, then what is left of the
pids it saw, by pid).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos_deploy import Deployment, stop_on_sigterm
from bench.chaos_audit import percentile
from protocol import ops

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BASE = "tiny-qwen3-vl-64"
CAMERAS = [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}]
SCHEMA = {"cameras": CAMERAS, "state_dim": 4, "action_dim": 2, "action_horizon": 1,
          "instruction_template": "{instruction}"}
MONITOR_TIMEOUT_S = 5.0
ROLE_NAMES = ("master", "trainer", "inferencer", "env", "health", "monitor")


# -- 1. the scheduler alone -------------------------------------------------------------------
def load_scheduler(root: Path | None):
    """`master.scheduler.Scheduler` of this checkout, or of the checkout at ``root``."""
    if root is None:
        from master.scheduler import Scheduler

        return Scheduler
    spec = importlib.util.spec_from_file_location("baseline_scheduler", root / "master" / "scheduler.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.Scheduler


def sched_decisions(scheduler_cls, n_tenants: int, finished_per_tenant: int, picks: int) -> dict[str, float]:
    """p50 / p99 (CPU ms) of ``picks`` steady-state lease decisions of 4 jobs."""
    from protocol.messages import JobRecord, TenantConfig

    s = scheduler_cls()
    seq = 0

    def add(tenant: str, state: str, now: float) -> None:
        nonlocal seq
        seq += 1
        s.put(JobRecord(tenant=tenant, job=f"j{seq:09d}", task="sft", state=state, created_at=now,
                        updated_at=now, ready_at=now, items=1))

    for i in range(n_tenants):
        name = f"t{i:05d}"
        s.tenants[name] = TenantConfig(name=name, base=BASE, schema={})
        for _ in range(finished_per_tenant):
            add(name, "cleared", 0.0)
        add(name, "ready", 1.0)
    times = []
    now = 10.0
    for _ in range(picks):
        now += 0.001
        # CPU time of this thread: the decision's own cost, not other processes' share of a
        # loaded host (GC pauses count: the master pays them too).
        t0 = time.thread_time()
        leased, _ = s.pick("bench", 4, 60.0, now)
        times.append(time.thread_time() - t0)
        for job in leased:
            job.state, job.lease_owner = "cleared", ""
            if hasattr(s, "touch"):  # as the master's save does (a baseline may predate it)
                s.touch(job)
            add(job.tenant, "ready", now)
    ms = [t * 1000 for t in times]
    return {"tenants": n_tenants, "finished_per_tenant": finished_per_tenant, "job_records": len(s.jobs),
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def sched_part(tenants: list[int], finished: int, picks: int, baseline_root: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"this": [], "baseline": []}
    variants = [("this", load_scheduler(None))]
    if baseline_root is not None:
        variants.append(("baseline", load_scheduler(baseline_root)))
    for label, cls in variants:
        for n in tenants:
            for f in sorted({0, finished}):
                row = sched_decisions(cls, n, f, picks)
                out[label].append(row)
                print(f"scheduler {label:8s} tenants {n:5d} finished/tenant {f:4d}: "
                      f"p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms", flush=True)
    return out


# -- 2. a deployment per N --------------------------------------------------------------------
def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _http_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=MONITOR_TIMEOUT_S) as resp:
        return json.loads(resp.read())


class ScaleDeployment(Deployment):
    """A nats-server of the bench's own (monitoring on), `nexus up --nats-url` on it."""

    def __init__(self, data_dir: Path, tq_max_bytes: int) -> None:
        super().__init__(data_dir, nats_cluster=1)
        self.tq_max_bytes = tq_max_bytes
        from transport.broker import free_port

        self.client_port, self.monitor_port = free_port(), free_port()
        self.nats: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def start_nats(self) -> None:
        from transport.broker import nats_server_binary

        store = self.data_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        self.nats = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.client_port), "-m", str(self.monitor_port),
             "-js", "-sd", str(store), "-l", str(self.data_dir / "nats.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.started.append(self.nats)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                _http_json(self.monitor_port, "/healthz?js-enabled-only=true")
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"nats-server on {self.url} did not come up (log: {self.data_dir / 'nats.log'})")

    def up_roles(self) -> None:
        args = ["up", "--detach", "--data-dir", str(self.data_dir), "--nats-url", self.url,
                "--ready-timeout-s", "240", "--tq-max-bytes", str(self.tq_max_bytes)]
        self.up_args(args, timeout=360)

    def role_pids(self) -> dict[str, int]:
        return {r["role"]: r["pid"] for r in (self.state() or {}).get("roles", [])}

    def snapshot(self) -> dict[str, Any]:
        """RSS per role and of nats-server; the server's JetStream and subscription counts."""
        rss = {role: _rss_bytes(pid) for role, pid in self.role_pids().items()}
        if self.nats is not None:
            rss["nats-server"] = _rss_bytes(self.nats.pid)
        varz = _http_json(self.monitor_port, "/varz")
        jsz = _http_json(self.monitor_port, "/jsz")
        subsz = _http_json(self.monitor_port, "/subsz")
        return {"rss_bytes": rss,
                "nats": {"mem_bytes": varz.get("mem", 0), "connections": varz.get("connections", 0),
                         "subscriptions": subsz.get("num_subscriptions", varz.get("subscriptions", 0)),
                         "streams": jsz.get("streams", 0), "consumers": jsz.get("consumers", 0),
                         "js_memory_bytes": jsz.get("memory", 0), "js_storage_bytes": jsz.get("storage", 0)}}


def sft_spec(tenant: str, steps: int) -> dict[str, Any]:
    return {"tenant": tenant, "task": "sft", "base": BASE, "seed": 0,
            "observation": {"cameras": CAMERAS, "state_dim": 4}, "action": {"dim": 2, "horizon": 1},
            "env": {"id": "builtin/reach-v0", "demos": {"episodes": 2}},
            "action_module": {"kind": "mlp"},
            "algorithm": {"lr": 1e-3, "batch_size": 8, "steps": steps, "items_per_job": steps}}


def rl_spec(tenant: str, episodes: int) -> dict[str, Any]:
    return {"tenant": tenant, "task": "rl", "base": BASE, "seed": 0,
            "observation": {"cameras": CAMERAS, "state_dim": 4}, "action": {"dim": 2, "horizon": 1},
            "env": {"id": "builtin/reach-v0"}, "action_module": {"kind": "gaussian"},
            "algorithm": {"episodes_per_update": 2, "micro_batch": 64},
            "schedule": {"budget": {"max_episodes": episodes}}}


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


async def drive(dep: ScaleDeployment, n: int, active: int, args: argparse.Namespace) -> dict[str, Any]:
    from protocol.errors import NexusError
    from protocol.messages import InfoRequest, TenantConfig, WorkloadEvent
    from protocol.wire import decode
    from sdk.client import AsyncClient

    row: dict[str, Any] = {"tenants": n, "active": active}
    c = await AsyncClient(dep.url, "nexus", timeout_s=60).connect()
    try:
        # 1. registration: idle tenants now, the active ones through their submit below
        reg = []
        for i in range(n - active):
            t0 = time.perf_counter()
            await c.create_tenant(TenantConfig(name=f"idle-{i:04d}", base=BASE, schema=SCHEMA, head="mlp",
                                               optim={"lr": 1e-3}))
            reg.append((time.perf_counter() - t0) * 1000)
        row["register_ms"] = _summary(reg)
        # 2. idle
        row["idle"] = dep.snapshot()
        row["budgets_mb"] = {"slot": args.slot_budget_mb, "head": args.head_budget_mb}
        work_before = {role: (await c.info(role)).extra for role in ("trainer", "inferencer")}
        # 3. M workloads at once
        running_at: dict[str, float] = {}
        ended: dict[str, tuple[str, float]] = {}

        async def on_event(msg) -> None:
            ev = decode(msg.data, WorkloadEvent)
            if ev.kind == "state" and ev.state == "running":
                running_at.setdefault(ev.workload, ev.at or time.time())
            if ev.state in ("completed", "failed", "cancelled"):
                ended.setdefault(ev.workload, (ev.state, ev.at or time.time()))

        sub = await c.bus.nc.subscribe(c.names.workload_events_all, cb=on_event)
        specs = [sft_spec(f"act-{i:04d}", args.sft_steps) if i % 2 == 0 else rl_spec(f"act-{i:04d}", args.rl_episodes)
                 for i in range(active)]
        t_submit = time.time()

        async def submit(spec):
            t0 = time.time()
            handle = await c.submit(spec)
            return handle.id, t0

        submitted = await asyncio.gather(*(submit(s) for s in specs))
        peaks: dict[str, Any] = {}
        deadline = time.monotonic() + args.run_timeout_s
        while len(ended) < active and time.monotonic() < deadline:
            _peak(peaks, dep.snapshot())
            await asyncio.sleep(2.0)
        await sub.unsubscribe()
        states = {w: (await c.workload(w)).state for w, _ in submitted}
        row["workloads"] = {"completed": sum(s == "completed" for s in states.values()),
                            "not_completed": {w: s for w, s in states.items() if s != "completed"},
                            "wall_s": (max((t for _, t in ended.values()), default=time.time()) - t_submit)}
        row["submit_to_running_ms"] = _summary([(running_at[w] - t0) * 1000 for w, t0 in submitted if w in running_at])
        row["active_peak"] = peaks
        # 4. predicts on trained tenants
        lat = []
        rng = np.random.default_rng(0)
        trained = [s["tenant"] for s, (w, _) in zip(specs, submitted) if states[w] == "completed"][: args.predict_tenants]
        for tenant in trained:
            for _ in range(args.predicts):
                images = {cam["name"]: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for cam in CAMERAS}
                t0 = time.perf_counter()
                await c.predict(tenant, images, rng.standard_normal(4).astype(np.float32), "reach the red target",
                                timeout_s=60)
                lat.append((time.perf_counter() - t0) * 1000)
        row["predict_ms"] = _summary(lat)
        # 7. throughput per tenant-unit of work (over the workloads and the predicts)
        work_after = {role: (await c.info(role)).extra for role in ("trainer", "inferencer")}
        row["throughput"] = throughput(work_before, work_after, row["workloads"]["wall_s"])
        # 5. lease decisions, timed in the master
        info = await c.info("master")
        row["master_scale"] = info.extra.get("scale", {})
        row["master_jobs"] = info.extra.get("jobs", {})
        # 6. master start-up with every record present
        old = info.instance
        pid = dep.role_pids().get("master")
        if pid:
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while time.monotonic() - t0 < args.restart_timeout_s:
                try:
                    info = await c.bus.call(ops.INFO.of("master"), InfoRequest(), timeout_s=2)
                    if info.instance != old:
                        break
                except NexusError:  # not up yet: no responder (Unavailable) or a timeout
                    pass
                await asyncio.sleep(0.2)
            row["master_restart"] = {"wall_s": time.monotonic() - t0,
                                     "startup_s": info.extra.get("scale", {}).get("startup_s", {}),
                                     "answered": info.instance != old}
        row["after"] = dep.snapshot()
    finally:
        await c.close()
    return row


def throughput(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Work done between two ``info`` of the trainer and the inferencer, per tenant-unit: a
    tenant micro-batch trained, a predict answered."""
    def delta(role: str, *path: str) -> float:
        def get(d: dict[str, Any]) -> float:
            for key in path:
                d = d.get(key, {}) if isinstance(d, dict) else {}
            return float(d) if isinstance(d, (int, float)) else 0.0
        return get(after[role]) - get(before[role])

    mbs, steps, train_s = (delta("trainer", "micro_batches"), delta("trainer", "steps"),
                           delta("trainer", "usage", "busy_s", "train"))
    served, groups, infer_s = (delta("inferencer", "served"), delta("inferencer", "groups"),
                               delta("inferencer", "usage", "busy_s", "infer"))
    return {"trainer": {"micro_batches": mbs, "steps": steps, "device_s": train_s,
                        "micro_batches_per_device_s": mbs / train_s if train_s else 0.0,
                        "micro_batches_per_wall_s": mbs / wall_s if wall_s else 0.0,
                        "tenants_per_step": mbs / steps if steps else 0.0,
                        "slot_budget": after["trainer"].get("slot_budget", {})},
            "inferencer": {"predicts": served, "groups": groups, "device_s": infer_s,
                           "predicts_per_device_s": served / infer_s if infer_s else 0.0,
                           "rows_per_forward": served / groups if groups else 0.0,
                           "head_budget": after["inferencer"].get("head_budget", {})}}


def _peak(peaks: dict[str, Any], snap: dict[str, Any]) -> None:
    for section in ("rss_bytes", "nats"):
        into = peaks.setdefault(section, {})
        for key, value in snap[section].items():
            into[key] = max(into.get(key, 0), value)


def deployment_part(n: int, active: int, args: argparse.Namespace) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"nexus-scale-{n}-"))
    dep = ScaleDeployment(data_dir, args.tq_max_bytes)
    env_before = dict(os.environ)
    # The deployment's caps sized for the run: every active tenant may roll out at once.
    os.environ.update({"NEXUS_MAX_ACTIVE_ROLLOUTS": str(max(3, active)), "NEXUS_MAX_TENANTS": str(max(1000, n)),
                       "NEXUS_MAX_ACTIVE_WORKLOADS": str(max(256, active)), "NEXUS_TRAINER_GROUP_MAX": "8",
                       "NEXUS_ENV_MAX_SESSIONS": str(max(64, 4 * active)),
                       "NEXUS_TRAINER_SLOT_BUDGET_MB": str(args.slot_budget_mb),
                       "NEXUS_INFER_HEAD_BUDGET_MB": str(args.head_budget_mb),
                       "OMP_NUM_THREADS": "1"})
    try:
        t0 = time.monotonic()
        dep.start_nats()
        dep.up_roles()
        up_s = time.monotonic() - t0
        print(f"[{n} tenants] deployment up in {up_s:.1f} s ({data_dir})", flush=True)
        row = asyncio.run(drive(dep, n, active, args))
        row["up_s"], row["tq_max_bytes"] = up_s, args.tq_max_bytes
        return row
    finally:
        notes = dep.cleanup()
        os.environ.clear()
        os.environ.update(env_before)
        for note in notes:
            print(f"[{n} tenants] cleanup: {note}", flush=True)


# -- report -----------------------------------------------------------------------------------
def per_tenant_costs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Slope of each role's idle RSS over the tenant count (bytes per idle tenant), and the
    extra of the active peak over idle divided by the active count (bytes per active tenant)."""
    rows = [r for r in rows if "idle" in r]
    out: dict[str, Any] = {"idle_bytes_per_tenant": {}, "active_bytes_per_tenant": {}}
    if len(rows) >= 2:
        # The idle snapshot holds the idle tenants only (the active ones register at submit).
        a, b = rows[0], max(rows, key=lambda r: r["tenants"] - r["active"])
        for role in b["idle"]["rss_bytes"]:
            d = b["idle"]["rss_bytes"][role] - a["idle"]["rss_bytes"].get(role, 0)
            out["idle_bytes_per_tenant"][role] = d / max(1, (b["tenants"] - b["active"]) - (a["tenants"] - a["active"]))
    for r in rows:
        per = {role: (r["active_peak"].get("rss_bytes", {}).get(role, 0) - v) / max(1, r["active"])
               for role, v in r["idle"]["rss_bytes"].items()}
        out["active_bytes_per_tenant"][str(r["tenants"])] = per
    return out


def print_table(rep: dict[str, Any]) -> None:
    sched = rep.get("scheduler", {})
    for label in ("this", "baseline"):
        rows = sched.get(label) or []
        if rows:
            print(f"\nscheduler ({label}): lease decision of 4 jobs, ms")
            print(f"{'tenants':>8} {'finished/t':>10} {'records':>8} {'p50':>9} {'p99':>9}")
            for r in rows:
                print(f"{r['tenants']:>8} {r['finished_per_tenant']:>10} {r['job_records']:>8} "
                      f"{r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f}")
    rows = rep.get("deployments") or []
    if not rows:
        return
    mb = 1 / 2**20
    print("\ndeployment per tenant count")
    head = ("tenants", "active", "done", "reg p50", "s2run p50", "s2run p99", "lease p50", "lease p99", "pred p50",
            "pred p99", "restart s", "load s", "streams", "consum", "subs", "nats MB", "master MB", "trainer MB",
            "infer MB")
    print(" ".join(f"{h:>9}" for h in head))
    for r in rows:
        if "error" in r:
            print(f"{r['tenants']:>9} {r.get('active', 0):>9}  error: {r['error'][:160]}")
            continue
        ld = r.get("master_scale", {}).get("lease_decision_ms", {})
        mr = r.get("master_restart", {})
        idle = r["idle"]
        vals = (r["tenants"], r["active"], r["workloads"]["completed"], r["register_ms"].get("p50", 0),
                r["submit_to_running_ms"].get("p50", 0), r["submit_to_running_ms"].get("p99", 0), ld.get("p50", 0),
                ld.get("p99", 0), r["predict_ms"].get("p50", 0), r["predict_ms"].get("p99", 0), mr.get("wall_s", 0),
                sum(mr.get("startup_s", {}).values()), idle["nats"]["streams"], idle["nats"]["consumers"],
                idle["nats"]["subscriptions"], idle["nats"]["mem_bytes"] * mb,
                idle["rss_bytes"].get("master", 0) * mb, idle["rss_bytes"].get("trainer", 0) * mb,
                idle["rss_bytes"].get("inferencer", 0) * mb)
        print(" ".join(f"{v:>9.3f}" if isinstance(v, float) else f"{v:>9}" for v in vals))
    print("\nthroughput per tenant-unit of work, memory budgets")
    head = ("tenants", "active", "slot MB", "head MB", "mb/dev s", "mb/wall s", "ten/step", "pred/dev s",
            "rows/fwd", "evicted", "restored", "h evict", "h reload", "trainerpk")
    print(" ".join(f"{h:>9}" for h in head))
    for r in rows:
        if "throughput" not in r:
            continue
        tr, inf = r["throughput"]["trainer"], r["throughput"]["inferencer"]
        sb, hb = tr.get("slot_budget", {}), inf.get("head_budget", {})
        vals = (r["tenants"], r["active"], r.get("budgets_mb", {}).get("slot", 0.0), r.get("budgets_mb", {}).get("head", 0.0),
                tr["micro_batches_per_device_s"], tr["micro_batches_per_wall_s"], tr["tenants_per_step"],
                inf["predicts_per_device_s"], inf["rows_per_forward"], sb.get("evictions", 0), sb.get("restores", 0),
                hb.get("evictions", 0), hb.get("reloads", 0), r["active_peak"].get("rss_bytes", {}).get("trainer", 0) * mb)
        print(" ".join(f"{v:>9.2f}" if isinstance(v, float) else f"{v:>9}" for v in vals))
    costs = rep.get("per_tenant", {})
    if costs.get("idle_bytes_per_tenant"):
        print("\nidle RSS per registered tenant (KB): " + ", ".join(
            f"{k} {v / 1024:.1f}" for k, v in costs["idle_bytes_per_tenant"].items()))


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    ax = axes[0][0]
    for label, style in (("this", "-"), ("baseline", "--")):
        for f in sorted({r["finished_per_tenant"] for r in rep.get("scheduler", {}).get(label, [])}):
            rows = [r for r in rep["scheduler"][label] if r["finished_per_tenant"] == f]
            ax.plot([r["tenants"] for r in rows], [r["p99_ms"] for r in rows], style, marker="o",
                    label=f"{label}, {f} finished/tenant (p99)")
    ax.set(title="scheduler: lease decision (in-process)", xlabel="ready tenants", ylabel="ms", xscale="log")
    ax.legend(fontsize=7)
    # The curves against N: per tenant count, the run with the fewest active tenants.
    rows = [r for r in rep.get("deployments", []) if "idle" in r]
    rows = [min((r for r in rows if r["tenants"] == n), key=lambda r: r["active"]) for n in sorted({r["tenants"] for r in rows})]
    xs = [r["tenants"] for r in rows]

    def series(ax, title, ylabel, lines):
        for name, ys in lines:
            ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=title, xlabel="registered tenants", ylabel=ylabel, xscale="log")
        ax.legend(fontsize=7)

    if rows:
        series(axes[0][1], "latency", "ms", [
            ("submit->running p50", [r["submit_to_running_ms"].get("p50", 0) for r in rows]),
            ("submit->running p99", [r["submit_to_running_ms"].get("p99", 0) for r in rows]),
            ("predict p99", [r["predict_ms"].get("p99", 0) for r in rows]),
            ("register p99", [r["register_ms"].get("p99", 0) for r in rows])])
        series(axes[0][2], "master: lease decision (in the master)", "ms", [
            ("p50", [r["master_scale"].get("lease_decision_ms", {}).get("p50", 0) for r in rows]),
            ("p99", [r["master_scale"].get("lease_decision_ms", {}).get("p99", 0) for r in rows])])
        series(axes[1][0], "master start-up with all records", "s", [
            ("kill -> answering", [r.get("master_restart", {}).get("wall_s", 0) for r in rows]),
            ("records load", [sum(r.get("master_restart", {}).get("startup_s", {}).values()) for r in rows])])
        roles = sorted({k for r in rows for k in r["idle"]["rss_bytes"]})
        series(axes[1][1], "RSS per role (idle)", "MiB",
               [(role, [r["idle"]["rss_bytes"].get(role, 0) / 2**20 for r in rows]) for role in roles])
        series(axes[1][2], "NATS (idle)", "count / MiB", [
            ("streams", [r["idle"]["nats"]["streams"] for r in rows]),
            ("consumers", [r["idle"]["nats"]["consumers"] for r in rows]),
            ("subscriptions", [r["idle"]["nats"]["subscriptions"] for r in rows]),
            ("server MiB", [r["idle"]["nats"]["mem_bytes"] / 2**20 for r in rows])])
    tp = [r for r in rows if "throughput" in r]
    if tp:
        xs = [r["tenants"] for r in tp]
        series(axes[2][0], "throughput per tenant-unit of work", "per device-second", [
            ("trainer: tenant micro-batches", [r["throughput"]["trainer"]["micro_batches_per_device_s"] for r in tp]),
            ("inferencer: predicts", [r["throughput"]["inferencer"]["predicts_per_device_s"] for r in tp])])
    # Peak trainer RSS against the active tenants, with and without a slot budget.
    ax = axes[2][1]
    every = [r for r in rep.get("deployments", []) if "active_peak" in r]
    for budget in sorted({r.get("budgets_mb", {}).get("slot", 0.0) for r in every}):
        pts = sorted((r["active"], r["active_peak"].get("rss_bytes", {}).get("trainer", 0) / 2**20)
                     for r in every if r.get("budgets_mb", {}).get("slot", 0.0) == budget)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"slot budget {budget:g} MiB" if budget else "no slot budget")
    ax.set(title="trainer peak RSS", xlabel="active tenants", ylabel="MiB")
    if every:
        ax.legend(fontsize=7)
    axes[2][2].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(rep: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, default=str))
    plot(rep, out.with_suffix(".png"))
    print_table(rep)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def merge(paths: list[Path], out: Path) -> int:
    reps = [json.loads(path.read_text()) for path in paths]
    rows = sorted((r for rep in reps for r in rep.get("deployments", [])),
                  key=lambda r: (r["tenants"], r.get("active", 0)))
    sched = next((rep["scheduler"] for rep in reps if rep.get("scheduler", {}).get("this")), {})
    rep = {"merged_from": [str(p) for p in paths], "scheduler": sched, "deployments": rows,
           "per_tenant": per_tenant_costs(rows)}
    write_report(rep, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", default="16,64", help="registered tenant counts, comma-separated")
    p.add_argument("--active", default="8", help="active tenants per count (one value, or one per count)")
    p.add_argument("--sched-only", action="store_true", help="only the in-process scheduler part")
    p.add_argument("--finished", type=int, default=200, help="finished job records per tenant (scheduler part)")
    p.add_argument("--picks", type=int, default=300, help="lease decisions timed per point (scheduler part)")
    p.add_argument("--baseline-root", type=Path, default=None, help="also time the scheduler of this checkout")
    # Each tenant's queue stream reserves its byte limit in JetStream's store up front: at the
    # default 256 MiB, 214 tenants filled this disk's 54 GB (docs/scale.md). A tiny job needs a
    # few MB.
    p.add_argument("--tq-max-bytes", type=int, default=16 * 2**20, help="nexus up --tq-max-bytes (per tenant)")
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--rl-episodes", type=int, default=4)
    p.add_argument("--predicts", type=int, default=10, help="predicts per trained tenant")
    p.add_argument("--slot-budget-mb", type=float, default=0.0, help="NEXUS_TRAINER_SLOT_BUDGET_MB (0: none)")
    p.add_argument("--head-budget-mb", type=float, default=0.0, help="NEXUS_INFER_HEAD_BUDGET_MB (0: none)")
    p.add_argument("--predict-tenants", type=int, default=4)
    p.add_argument("--run-timeout-s", type=float, default=1200.0)
    p.add_argument("--restart-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="combine earlier result files (their deployments, sorted by tenants then active; the "
                        "scheduler part of the first that has one) into --out, its plot and the table; runs nothing")
    args = p.parse_args(argv)
    stop_on_sigterm()  # a killed run takes its deployment down
    if args.merge:
        return merge(args.merge, args.out)
    tenants = [int(x) for x in args.tenants.split(",") if x]
    actives = [int(x) for x in args.active.split(",") if x]
    if len(actives) not in (1, len(tenants)):
        p.error(f"--active: {len(actives)} values for {len(tenants)} tenant counts; give one, or one per count")
    actives = actives * len(tenants) if len(actives) == 1 else actives
    if any(a > n for a, n in zip(actives, tenants)):
        p.error("--active: more active tenants than registered ones")
    rep: dict[str, Any] = {"started_at": time.time(), "argv": sys.argv[1:]}
    rep["scheduler"] = sched_part(tenants, args.finished, args.picks, args.baseline_root)
    if not args.sched_only:
        rep["deployments"] = []
        for n, m in zip(tenants, actives):
            try:
                rep["deployments"].append(deployment_part(n, m, args))
            except Exception as exc:  # one tenant count that breaks is a result too: say what broke
                rep["deployments"].append({"tenants": n, "active": m, "error": f"{type(exc).__name__}: {exc}"})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rep, indent=1, default=str))
        rep["per_tenant"] = per_tenant_costs(rep["deployments"])
    write_report(rep, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
