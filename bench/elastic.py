"""Elastic vs fixed counts under a stepped load (issue 29 item 5).

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.elastic                  # 2 RL tenants, then 2 join (CPU)
    .venv/bin/python -m bench.elastic --base-tenants 2 --join 8 --episodes 16      # the issue's sizes
    .venv/bin/python -m bench.elastic --replot bench/results/elastic.json          # table and PNG from a JSON

Each arm is one fresh ``nexus up`` (a temp data dir, a free port) given the same load:

1. ``--base-tenants`` RL tenants submitted at once; ``--join-at-s`` later ``--join`` more RL tenants
   join; each has a fixed budget of ``--episodes`` episodes (never wall time), so they finish.
2. Arms (``--arms``): **fixed**: ``nexus up --roles FIXED`` (``--fixed``, default sized for the peak)
   and ``NEXUS_SCALER`` off; **scaler**: ``nexus up`` at the minimum of ``--bounds`` with
   ``NEXUS_SCALER=on`` and ``NEXUS_SCALE_BOUNDS=BOUNDS``. After the last workload ends an arm
   keeps running ``--tail-s`` so the scaler's scale-down shows (its held seconds count too:
   a fixed deployment also stays up between loads).
3. Every ``--poll-s``: cluster.json's live instances per role (their pids; held seconds from each
   process's start in /proc, `bench.mt_run.proc_start_time`, to its last sight alive) and
   the workload states; the scaler's decisions as they are announced
   (``<prefix>.scale.decisions.>``, `protocol.messages.ScaleDecision`).
4. At the end: every job record (the master's ``jobs`` op) and version, audited by
   `bench.chaos_audit.audit_jobs` (no job lost, none trained twice, across the scale-downs).

Per tenant: submit -> first rollout (its first training job reserved: the first rollout's data
is in), env steps per second (its rollout jobs x ``steps_per_update``, over submit -> done).
Per arm: device-seconds held (trainer + inferencer processes: what holds an accelerator on a GPU
host), env-worker seconds held (CPU), the decisions, the audit. A table on stdout, JSON
(``--out``) and a PNG beside it (instances per role over time, decisions marked).

Bad input is refused before anything starts (exit 2, one line naming the argument). A run that
fails (``nexus up``, a workload that does not complete, the timeout) is recorded in the JSON
with its error and the exit status is 1. Every deployment is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_audit import audit_jobs
from bench.mt_mix import BadArgument, Sizes, TenantPlan, check_base
from bench.mt_run import HEALTH_TIMEOUT_S, REQUEST_TIMEOUT_S, MtDeployment, proc_start_time

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
TERMINAL = ("completed", "failed", "cancelled")
ARMS = ("fixed", "scaler")
DEVICE_ROLES = ("trainer", "inferencer")
MAX_TENANTS = 32


@dataclass
class Config:
    base_tenants: int = 2
    join: int = 2
    join_at_s: float = 60.0
    episodes: int = 8
    arms: tuple[str, ...] = ARMS
    fixed: str = "env=2,inferencer=1,trainer=2"
    bounds: str = "env=1:2,inferencer=1:1,trainer=1:2"
    tail_s: float = 60.0
    poll_s: float = 2.0
    run_timeout_s: float = 1200.0
    base: str = "tiny-qwen3-vl-64"
    sizes: Sizes = field(default_factory=lambda: Sizes(rl_steps_per_update=64, rl_parallel_envs=2, rl_epochs=1))
    seed: int = 0
    out: Path = RESULTS / "elastic.json"
    keep_data: bool = False

    def plans(self) -> list[TenantPlan]:
        kinds = ("rl-reach", "rl-reach-easy")
        n = self.base_tenants + self.join
        return [TenantPlan(name=f"el-{i + 1}", kind=kinds[i % 2], budget=self.episodes) for i in range(n)]

    def settings(self, arm: str) -> dict[str, str]:
        n = self.base_tenants + self.join
        return {"NEXUS_INFER_BASE": self.base, "NEXUS_METRICS_PORT": "0", "NEXUS_TENSORBOARD": "0",
                "NEXUS_TRAINER_GROUP_MAX": str(max(4, n)), "NEXUS_MAX_ACTIVE_ROLLOUTS": str(max(3, n)),
                "NEXUS_HEALTH_TIMEOUT_S": f"{HEALTH_TIMEOUT_S:g}", "NEXUS_SCALE_BOUNDS": self.bounds,
                "NEXUS_SCALER": "on" if arm == "scaler" else "off"}

    def roles(self, arm: str) -> str:
        from protocol.scaling import parse_bounds

        if arm == "fixed":
            return self.fixed
        b = parse_bounds(self.bounds, "--bounds")
        return ",".join(f"{r}={b[r].min}" for r in ("env", "inferencer", "trainer"))


def build_config(args: argparse.Namespace) -> Config:
    """Every argument checked before anything starts (BadArgument names the one at fault)."""
    from protocol.errors import InvalidField
    from protocol.scaling import check_count, parse_bounds, parse_counts

    check_base(args.base)
    if not 1 <= args.base_tenants <= MAX_TENANTS:
        raise BadArgument(f"--base-tenants: {args.base_tenants} is outside 1..{MAX_TENANTS}")
    if not 0 <= args.join <= MAX_TENANTS - args.base_tenants:
        raise BadArgument(f"--join: {args.join} is outside 0..{MAX_TENANTS - args.base_tenants} "
                          f"(at most {MAX_TENANTS} tenants in all)")
    for name, value, lo, hi in (("--join-at-s", args.join_at_s, 0, 3600), ("--tail-s", args.tail_s, 0, 3600),
                                ("--poll-s", args.poll_s, 0.2, 30), ("--run-timeout-s", args.run_timeout_s, 10, 86400)):
        if not lo <= value <= hi:
            raise BadArgument(f"{name}: {value} is outside [{lo}, {hi}]")
    if not 1 <= args.episodes <= 100_000:
        raise BadArgument(f"--episodes: {args.episodes} is outside 1..100000")
    for name, value, lo, hi in (("--rl-steps-per-update", args.rl_steps_per_update, 8, 100_000),
                                ("--rl-parallel-envs", args.rl_parallel_envs, 1, 64)):
        if not lo <= value <= hi:
            raise BadArgument(f"{name}: {value} is outside {lo}..{hi}")
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise BadArgument(f"--arms: {args.arms!r}; allowed: a comma-separated subset of {', '.join(ARMS)}")
    try:
        bounds = parse_bounds(args.bounds, "--bounds")
        fixed = parse_counts(args.fixed, "--fixed")
        for role, n in fixed.items():
            if role in bounds:
                check_count(role, n, bounds, "--fixed")
    except InvalidField as exc:
        raise BadArgument(f"{exc.field}: {exc.message}") from None
    if args.out.suffix != ".json":
        raise BadArgument(f"--out: {str(args.out)!r} must end in .json (the PNG goes beside it)")
    return Config(base_tenants=args.base_tenants, join=args.join, join_at_s=args.join_at_s, episodes=args.episodes,
                  arms=arms, fixed=args.fixed, bounds=args.bounds, tail_s=args.tail_s, poll_s=args.poll_s,
                  run_timeout_s=args.run_timeout_s, base=args.base, seed=args.seed, out=args.out,
                  keep_data=args.keep_data,
                  sizes=Sizes(rl_steps_per_update=args.rl_steps_per_update, rl_parallel_envs=args.rl_parallel_envs,
                              rl_epochs=1))


# -- one arm ------------------------------------------------------------------------------------
@dataclass
class ArmRecord:
    arm: str
    roles: str
    settings: dict[str, str]
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    up_s: float = 0.0
    # role -> [[t, live instances], ...]; pid -> {role, start, last}
    counts: dict[str, list[list[float]]] = field(default_factory=dict)
    pids: dict[str, dict[str, Any]] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)


class Arm:
    def __init__(self, arm: str, cfg: Config, dep: MtDeployment) -> None:
        self.cfg, self.dep = cfg, dep
        self.rec = ArmRecord(arm=arm, roles=cfg.roles(arm), settings=dict(dep.settings))
        self.t0 = 0.0

    def log(self, text: str) -> None:
        print(f"[elastic {self.rec.arm}] {text}", flush=True)

    def _sample(self) -> None:
        from transport.cluster import pid_alive

        now = time.time()
        live: dict[str, int] = {}
        for r in (self.dep.state() or {}).get("roles", []):
            pid = int(r["pid"])
            if not pid_alive(pid):
                continue
            live[r["role"]] = live.get(r["role"], 0) + 1
            p = self.rec.pids.setdefault(str(pid), {"role": r["role"], "instance": r.get("instance", ""),
                                                    "start": proc_start_time(pid) or now})
            p["last"] = now
        for role in ("env", "inferencer", "trainer"):
            self.rec.counts.setdefault(role, []).append([now - self.t0, float(live.get(role, 0))])

    async def run(self) -> ArmRecord:
        from transport.broker import free_port
        from protocol.messages import ScaleDecision
        from protocol.wire import decode
        from sdk.client import AsyncClient

        self.t0 = time.time()
        try:
            state = await asyncio.to_thread(self.dep.up_args, [
                "up", "--detach", "--data-dir", str(self.dep.data_dir), "--nats-port", str(free_port()),
                "--ready-timeout-s", "180", "--roles", self.rec.roles], 300)
        except (RuntimeError, OSError) as exc:
            self.rec.error = f"nexus up failed: {exc}"[:2000]
            return self.rec
        self.rec.up_s = time.time() - self.t0
        self.log(f"up in {self.rec.up_s:.1f} s with {self.rec.roles}")
        client = AsyncClient(state["nats_url"], state["prefix"], timeout_s=REQUEST_TIMEOUT_S)
        await client.connect()

        async def on_decision(msg: Any) -> None:
            d = decode(msg.data, ScaleDecision)
            self.rec.decisions.append({"t": time.time() - self.t0, "role": d.role, "from": d.from_count,
                                       "to": d.to_count, "outcome": d.outcome, "reason": d.reason})

        try:
            await client.bus.nc.subscribe(client.names.scale_decisions_all, cb=on_decision)
            plans = self.cfg.plans()
            ids: dict[str, str] = {}
            submitted: dict[str, float] = {}

            async def submit(group: list[TenantPlan]) -> None:
                for i, p in enumerate(group):
                    spec = p.spec(self.cfg.base, seed=1 + self.cfg.seed + int(p.name.split("-")[1]), sizes=self.cfg.sizes)
                    submitted[p.name] = time.time()
                    ids[p.name] = (await client.submit(spec)).id

            self._sample()
            start = time.time()
            await submit(plans[:self.cfg.base_tenants])
            self.log(f"submitted {self.cfg.base_tenants} tenants")
            joined = self.cfg.join == 0
            records: dict[str, Any] = {}
            done_at = None
            deadline = time.monotonic() + self.cfg.run_timeout_s
            last_note = 0.0
            while True:
                now = time.time()
                if not joined and now - start >= self.cfg.join_at_s:
                    await submit(plans[self.cfg.base_tenants:])
                    joined = True
                    self.log(f"{self.cfg.join} tenants joined at {now - self.t0:.0f} s")
                self._sample()
                for name, wid in ids.items():
                    records[name] = await client.workload(wid)
                if joined and done_at is None and all(r.state in TERMINAL for r in records.values()):
                    done_at = now
                    self.log(f"every workload ended at {now - self.t0:.0f} s; {self.cfg.tail_s:g} s tail")
                if done_at is not None and now - done_at >= self.cfg.tail_s:
                    break
                if now - last_note > 20:
                    last_note = now
                    self.log(", ".join(f"{n}: {r.state} ep{r.episodes}" for n, r in records.items()) +
                             " | " + ", ".join(f"{r}={int(c[-1][1])}" for r, c in self.rec.counts.items()))
                if time.monotonic() > deadline:
                    left = [n for n, r in records.items() if r.state not in TERMINAL]
                    raise RuntimeError(f"timed out after {self.cfg.run_timeout_s:g} s (--run-timeout-s); "
                                       f"unfinished: {left}")
                await asyncio.sleep(self.cfg.poll_s)
            end = time.time()
            self.rec.wall_s = end - self.t0
            jobs = await client.jobs()
            versions = await _versions(client, sorted({p.name for p in plans}))
            self._tenants(plans, ids, submitted, records, jobs)
            findings = audit_jobs([j for j in jobs if j.tenant in ids], versions)
            self.rec.audit = {"jobs": sum(t.jobs for t in findings.tenants.values()), "lost": findings.lost,
                              "trained_twice": findings.twice, "out_of_order": findings.out_of_order,
                              "detail": {t: asdict(a) for t, a in findings.tenants.items() if a.lost or a.twice or a.order}}
            bad = [n for n, t in self.rec.tenants.items() if t["state"] != "completed"]
            if bad:
                self.rec.error = f"workloads not completed: {bad}"
            elif findings.lost or findings.twice:
                self.rec.error = f"audit: {findings.lost} jobs lost, {findings.twice} trained twice"
            self.rec.ok = not self.rec.error
        except (TimeoutError, RuntimeError) as exc:
            self.rec.error = self.rec.error or f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            from protocol.errors import NexusError

            if not isinstance(exc, NexusError):
                raise
            self.rec.error = f"{exc.code.value}: {exc.message}"
        finally:
            await client.close()
        return self.rec

    def _tenants(self, plans: list[TenantPlan], ids: dict[str, str], submitted: dict[str, float],
                 records: dict[str, Any], jobs: list[Any]) -> None:
        for p in plans:
            if p.name not in ids:
                continue
            rec = records[p.name]
            mine = [j for j in jobs if j.tenant == p.name and j.task == "rl"]
            rollouts = [j for j in mine if j.items > 0]
            first = min((j.created_at for j in mine), default=None)
            done = rec.updated_at if rec.state in TERMINAL else None
            env_steps = len(rollouts) * self.cfg.sizes.rl_steps_per_update
            span = (done - submitted[p.name]) if done else None
            self.rec.tenants[p.name] = {
                "submitted_s": submitted[p.name] - self.t0, "state": rec.state, "message": rec.message,
                "episodes": rec.episodes, "jobs": len(mine),
                "first_rollout_s": None if first is None else first - submitted[p.name],
                "done_s": None if done is None else done - self.t0,
                "env_steps": env_steps, "env_steps_per_s": env_steps / span if span else None}


async def _versions(client: Any, tenants: list[str]) -> dict[str, int]:
    from protocol.messages import WeightsRef
    from protocol.wire import decode

    kv = await client.bus.js.key_value(client.names.kv_versions)
    out = {}
    for t in tenants:
        try:
            out[t] = decode((await kv.get(t)).value, WeightsRef).version
        except Exception:  # noqa: BLE001 - nothing exported yet: version 0
            out[t] = 0
    return out


LIVE: list[MtDeployment] = []


def one_arm(arm: str, cfg: Config) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"nexus-elastic-{arm}-")).resolve()
    dep = MtDeployment(data_dir, cfg.settings(arm))
    LIVE.append(dep)
    try:
        rec = asyncio.run(Arm(arm, cfg, dep).run())
    finally:
        notes = dep.cleanup()
        LIVE.remove(dep)
        if not cfg.keep_data:
            import shutil

            shutil.rmtree(data_dir, ignore_errors=True)
    out = asdict(rec)
    out["cleanup"] = notes
    out["summary"] = summarise(out)
    print(f"[elastic {arm}] {'ok' if rec.ok else 'FAILED: ' + rec.error} (wall {rec.wall_s:.1f} s)", flush=True)
    return out


# -- report (pure: tested on made-up arms) -------------------------------------------------------
def held_s(arm: dict[str, Any]) -> dict[str, float]:
    """Seconds each role's processes were held, summed over instances (start -> last seen alive)."""
    out: dict[str, float] = {}
    for p in arm.get("pids", {}).values():
        out[p["role"]] = out.get(p["role"], 0.0) + max(0.0, p.get("last", p["start"]) - p["start"])
    return out


def summarise(arm: dict[str, Any]) -> dict[str, Any]:
    held = held_s(arm)
    tenants = arm.get("tenants", {})
    waits = [t["first_rollout_s"] for t in tenants.values() if t.get("first_rollout_s") is not None]
    steps = sum(t.get("env_steps", 0) for t in tenants.values())
    ends = [t["done_s"] for t in tenants.values() if t.get("done_s") is not None]
    starts = [t["submitted_s"] for t in tenants.values()]
    span = (max(ends) - min(starts)) if ends and starts else None
    peak = {r: max((c[1] for c in series), default=0.0) for r, series in arm.get("counts", {}).items()}
    return {"ok": arm.get("ok", False), "error": arm.get("error", ""),
            "first_rollout_mean_s": sum(waits) / len(waits) if waits else None,
            "first_rollout_max_s": max(waits) if waits else None,
            "env_steps": steps, "env_steps_per_s": steps / span if span else None, "load_span_s": span,
            "device_s": sum(held.get(r, 0.0) for r in DEVICE_ROLES), "env_worker_s": held.get("env", 0.0),
            "held_s": held, "peak_instances": peak,
            "decisions": sum(1 for d in arm.get("decisions", []) if not d.get("outcome")),
            "applied": sum(1 for d in arm.get("decisions", []) if str(d.get("outcome", "")).startswith("applied")),
            "audit": {k: arm.get("audit", {}).get(k) for k in ("jobs", "lost", "trained_twice")}}


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(report: dict[str, Any]) -> str:
    arms = report["arms"]
    lines = ["per tenant: submit -> first rollout (s) | env steps/s"]
    names = sorted({n for a in arms.values() for n in a.get("tenants", {})}, key=lambda n: int(n.split("-")[1]))
    lines.append(f"{'tenant':<8}" + "".join(f"{arm:>24}" for arm in arms))
    for n in names:
        cells = []
        for a in arms.values():
            t = a.get("tenants", {}).get(n, {})
            cells.append(f"{_f(t.get('first_rollout_s')):>12} {_f(t.get('env_steps_per_s'), '{:.2f}'):>11}")
        lines.append(f"{n:<8}" + "".join(f"{c:>24}" for c in cells))
    lines.append("")
    rows = (("first rollout mean (s)", "first_rollout_mean_s", "{:.1f}"), ("first rollout max (s)", "first_rollout_max_s", "{:.1f}"),
            ("env steps / s (all)", "env_steps_per_s", "{:.2f}"), ("device-s held (trainer+inferencer)", "device_s", "{:.0f}"),
            ("env-worker-s held", "env_worker_s", "{:.0f}"), ("scaler decisions (applied)", None, ""),
            ("jobs / lost / trained twice", None, ""), ("status", None, ""))
    lines.append(f"{'':<36}" + "".join(f"{arm:>16}" for arm in arms))
    for label, key, fmt in rows:
        cells = []
        for a in arms.values():
            s = a["summary"]
            if key:
                cells.append(_f(s.get(key), fmt))
            elif label.startswith("scaler"):
                cells.append(f"{s['decisions']} ({s['applied']})")
            elif label.startswith("jobs"):
                au = s["audit"]
                cells.append(f"{_f(au.get('jobs'), '{}')}/{_f(au.get('lost'), '{}')}/{_f(au.get('trained_twice'), '{}')}")
            else:
                cells.append("ok" if s["ok"] else "FAILED")
        lines.append(f"{label:<36}" + "".join(f"{c:>16}" for c in cells))
    for arm, a in arms.items():
        if a["summary"]["error"]:
            lines.append(f"{arm}: {a['summary']['error']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    from bench.mt_report import load_pyplot, save_figure

    plt = load_pyplot()
    arms = report["arms"]
    fig, axes = plt.subplots(len(arms), 1, figsize=(9, 3.2 * len(arms)), squeeze=False, sharex=True)
    colors = {"env": "tab:green", "inferencer": "tab:blue", "trainer": "tab:red"}
    nudge = {"env": 0.05, "inferencer": 0.0, "trainer": -0.05}  # equal counts stay apart
    for ax, (arm, a) in zip(axes[:, 0], arms.items()):
        for role, series in sorted(a.get("counts", {}).items()):
            if series:
                ax.step([s[0] for s in series], [s[1] + nudge.get(role, 0.0) for s in series], where="post", color=colors.get(role),
                        label=f"{role} instances")
        for d in a.get("decisions", []):
            if not d.get("outcome"):
                ax.axvline(d["t"], color=colors.get(d["role"], "k"), ls=":", lw=1)
                ax.annotate(f"{d['role']} {d['from']}->{d['to']}", (d["t"], d["to"]), fontsize=7, rotation=90,
                            va="bottom")
        for t in a.get("tenants", {}).values():
            ax.plot([t["submitted_s"]], [0], marker="v", color="k", ms=5)
            if t.get("done_s") is not None:
                ax.plot([t["done_s"]], [0], marker="^", color="grey", ms=5)
        s = a["summary"]
        ax.set_title(f"{arm}: first rollout mean {_f(s['first_rollout_mean_s'])} s, "
                     f"{_f(s['env_steps_per_s'], '{:.2f}')} env steps/s, device-s {_f(s['device_s'], '{:.0f}')}",
                     fontsize=9)
        ax.set_ylabel("instances")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since nexus up (v: submit, ^: done; dotted: a scaler decision)")
    return save_figure(plt, fig, path)


def _plotted(report: dict[str, Any], out: Path) -> str:
    try:
        return str(plot(report, out.with_suffix(".png")))
    except ImportError as exc:
        return f"not drawn ({exc}); draw it with: python -m bench.elastic --replot {out}"


def run(cfg: Config) -> tuple[int, dict[str, Any]]:
    report: dict[str, Any] = {"kind": "elastic", "config": {**asdict(cfg), "out": str(cfg.out)},
                              "arms": {}}
    for arm in cfg.arms:
        report["arms"][arm] = one_arm(arm, cfg)
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(report, indent=1, default=str))
    png = _plotted(report, cfg.out)
    print("\n" + table(report))
    print(f"\nJSON: {cfg.out}\nPNG:  {png}")
    return (0 if all(a["summary"]["ok"] for a in report["arms"].values()) else 1), report


def parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m bench.elastic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-tenants", type=int, default=d.base_tenants, help="RL tenants submitted at the start")
    p.add_argument("--join", type=int, default=d.join, help="RL tenants that join at --join-at-s (the issue: 8)")
    p.add_argument("--join-at-s", type=float, default=d.join_at_s, help="seconds after the first submit")
    p.add_argument("--episodes", type=int, default=d.episodes, help="each tenant's budget (episodes)")
    p.add_argument("--arms", default=",".join(ARMS), help="fixed,scaler or one of them")
    p.add_argument("--fixed", default=d.fixed, help="the fixed arm's --roles (default sized for the peak)")
    p.add_argument("--bounds", default=d.bounds, help="NEXUS_SCALE_BOUNDS of both arms; the scaler arm starts at the mins")
    p.add_argument("--tail-s", type=float, default=d.tail_s, help="seconds an arm keeps running after the last workload")
    p.add_argument("--poll-s", type=float, default=d.poll_s)
    p.add_argument("--run-timeout-s", type=float, default=d.run_timeout_s, help="one arm at most this long")
    p.add_argument("--rl-steps-per-update", type=int, default=d.sizes.rl_steps_per_update)
    p.add_argument("--rl-parallel-envs", type=int, default=d.sizes.rl_parallel_envs)
    p.add_argument("--base", default=d.base)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=d.out, help="JSON path (PNG beside it)")
    p.add_argument("--keep-data", action="store_true", help="keep each arm's temp data dir (logs)")
    p.add_argument("--replot", type=Path, metavar="JSON", help="the table and PNG again from a saved JSON; runs nothing")
    return p


def replot(path: Path) -> int:
    report = json.loads(path.read_text())
    for a in report["arms"].values():
        a["summary"] = summarise(a)
    print(table(report))
    print(f"PNG: {_plotted(report, path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replot:
        return replot(args.replot)
    try:
        cfg = build_config(args)
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        code, _ = run(cfg)
    except KeyboardInterrupt:
        for dep in LIVE:
            dep.cleanup()
        print("[elastic] interrupted; every deployment it started was stopped", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
