"""One run of `bench.multitenant` on one deployment: its `Config`, the deployment (`MtDeployment`,
the chaos bench's `Deployment` with this experiment's settings), and the `Runner` that submits each
tenant's workload, samples the services' busy time and returns a `RunRecord` (bench/mt_report.py
reads it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_deploy import ROOT, Deployment, Poll
from bench.mt_mix import PICK_DEMOS, Sizes, TenantPlan

RESULTS = ROOT / "bench" / "results"
TERMINAL = ("completed", "failed", "cancelled")
POLL = Poll("multitenant_poll", every_s=0.5, deadline_s=0.0)  # busy / state sampler of a run
REQUEST_TIMEOUT_S = 15.0  # each request of the harness (2 busy cores: replies have taken > 5 s)
INFO_ATTEMPTS = 3  # a role's info that fails (internal error) this often in a row fails the run
# Heartbeat silence before the health manager declares a role dead. The default (3 s) trips
# on this 2-core machine while an env worker imports ManiSkill / SAPIEN for a workflow (~30 s
# holding the GIL in bursts): the worker is killed and its workflows restart, so every run
# of the experiment gets this longer timeout (the same for shared and alone runs).
HEALTH_TIMEOUT_S = 30.0


# -- one run on one deployment ------------------------------------------------------------------
@dataclass
class RunRecord:
    name: str
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    up_s: float = 0.0
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    timeline: dict[str, list[list[float]]] = field(default_factory=lambda: {"trainer": [], "inferencer": []})
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_sync_s: list[float] = field(default_factory=list)
    # the inferencer's export -> servable breakdown at the end (stage -> n, p50, p95 seconds)
    weight_sync_stages: dict[str, dict[str, float]] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    info_errors: list[str] = field(default_factory=list)  # transient info failures, retried


def proc_start_time(pid: int) -> float | None:
    """Unix time a local process started (/proc), None if it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, after pid and (comm)
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class MtDeployment(Deployment):
    """`bench.chaos_deploy.Deployment` with this experiment's settings in every role's environment."""

    def __init__(self, data_dir: Path, settings: dict[str, str]) -> None:
        super().__init__(data_dir, 1)
        self.settings = settings

    def nexus(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **self.settings}
        return subprocess.run([sys.executable, "-m", "sdk.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)


def _busy(info: Any) -> float | None:
    usage = (info.extra or {}).get("usage") or {}
    busy = usage.get("busy_s")
    return float(sum(busy.values())) if isinstance(busy, dict) else None


class Runner:
    def __init__(self, name: str, plans: list[TenantPlan], cfg: "Config", dep: MtDeployment, seed: int | None = None) -> None:
        self.rec = RunRecord(name=name, settings=dict(dep.settings))
        self.plans, self.cfg, self.dep = plans, cfg, dep
        self.seed = cfg.seed if seed is None else seed
        self.t0 = 0.0
        self.pids: dict[str, int] = {}
        self.first: dict[str, str] = {}  # tenant -> its first workload (the one that trains)
        self.followed: dict[str, str] = {}  # tenant -> its follow-up workload (a closing eval), once submitted

    def log(self, text: str) -> None:
        print(f"[multitenant {self.rec.name}] {text}", flush=True)

    async def run(self) -> RunRecord:
        from transport.broker import free_port
        from sdk.client import AsyncClient

        self.t0 = time.time()
        try:
            state = await asyncio.to_thread(self.dep.up, free_port())
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            self.rec.error = f"nexus up failed: {exc}"[:2000]
            return self.rec
        ready_at = time.time()
        self.rec.up_s = ready_at - self.t0
        self.log(f"up in {self.rec.up_s:.1f} s")
        starts: dict[str, float] = {}
        for r in state.get("roles", []):
            if r["role"] in ("trainer", "inferencer"):
                self.pids[r["role"]] = int(r["pid"])
                starts[r["role"]] = proc_start_time(int(r["pid"])) or self.t0
        client = AsyncClient(state["nats_url"], state["prefix"], timeout_s=REQUEST_TIMEOUT_S)
        await client.connect()
        try:
            await self._watch_sync(client)
            await self._publish()
            ids = {}
            for i, p in enumerate(self.plans):
                spec = p.spec(self.cfg.base, seed=1 + i + self.seed, sizes=self.cfg.sizes, data_dir=self.dep.data_dir)
                ids[p.name] = (await client.submit(spec)).id
            self.first = dict(ids)
            self.log(f"submitted {len(ids)} workloads")
            records = await self._sample_until_done(client, ids)
            end_at = time.time()
            self.rec.wall_s = end_at - self.t0
            for role in ("trainer", "inferencer"):
                info = await self._info(client, role)
                busy = _busy(info)
                if busy is None:
                    raise RuntimeError(f"{role} reports no metered busy time (info.extra.usage.busy_s)")
                self.rec.timeline[role].append([end_at - self.t0, busy])
                self.rec.services[role] = {"pid": info.pid, "held_s": end_at - starts.get(role, self.t0),
                                           "held_ready_s": end_at - ready_at, "busy_s": busy}
                if role == "inferencer":
                    self.rec.weight_sync_stages = dict((info.extra or {}).get("weight_sync") or {})
            await self._tenants(client, ids, records)
            restarted = self._restarted(state)
            if restarted:
                # A replaced env worker restarts its workflows (work redone), a replaced
                # trainer / inferencer starts its counters over: not a clean comparison.
                self.rec.error = "roles restarted during the run: " + ", ".join(restarted)
            self.rec.ok = not self.rec.error and all(t["state"] == "completed" for t in self.rec.tenants.values())
        except (RuntimeError, asyncio.TimeoutError) as exc:
            self.rec.error = self.rec.error or f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - recorded as the run's failure, then re-checked by the caller
            from protocol.errors import NexusError

            if not isinstance(exc, NexusError):
                raise
            self.rec.error = f"{exc.code.value}: {exc.message}"
        finally:
            await client.close()
        return self.rec

    async def _publish(self) -> None:
        """`nexus dataset publish` of each dataset a tenant of this run trains from (its time
        counts: the deployment is up and held while it copies)."""
        for name in sorted({p.dataset for p in self.plans if p.dataset}):
            root = self.cfg.datasets.get(name)
            if root is None:
                raise RuntimeError(f"dataset {name!r}: none prepared (a bench bug: prepare_datasets runs first)")
            t = time.time()
            res = await asyncio.to_thread(self.dep.nexus, "dataset", "publish", str(root), name, "--data-dir",
                                          str(self.dep.data_dir), "--overwrite", timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"`nexus dataset publish {root} {name}` failed: {(res.stderr or res.stdout)[-1000:]}")
            self.log(f"published {name} in {time.time() - t:.1f} s")

    async def _info(self, client: Any, role: str) -> Any:
        """The role's info, retried on an internal error; when no instance answers, say
        whether its process died (and the last line of its log: a native crash prints
        nothing else)."""
        from protocol.errors import InternalError, Unavailable

        for attempt in range(1, INFO_ATTEMPTS + 1):
            try:
                return await client.info(role)
            except InternalError as exc:
                # A role whose info raced its own work (seen: the trainer's slot memory report
                # meeting a step that set the grads to None) answers the next one: counted, retried.
                self.rec.info_errors.append(f"{role}: {exc.message}"[:300])
                if attempt == INFO_ATTEMPTS:
                    raise RuntimeError(f"{role} info failed {INFO_ATTEMPTS} times in a row: {exc.message}") from None
                await asyncio.sleep(self.cfg.poll_s)
            except Unavailable as exc:
                raise RuntimeError(self._gone(role, exc.message)) from None
        raise AssertionError("INFO_ATTEMPTS must be >= 1")

    def _gone(self, role: str, why: str) -> str:
        pid = self.pids.get(role, 0)
        if not pid or Path(f"/proc/{pid}").exists():
            return f"{role} did not answer info ({why})"
        log = self.dep.data_dir / "logs" / f"{role}.log"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
        return (f"{role} did not answer info ({why}); its process {pid} exited, last log line: "
                f"{lines[-1][-300:] if lines else ''!r}")

    def _restarted(self, first: dict[str, Any]) -> list[str]:
        now = {r["role"]: r for r in (self.dep.state() or {}).get("roles", [])}
        return [f"{r['role']} {r['instance']} -> {now[r['role']]['instance']}" for r in first.get("roles", [])
                if r["role"] in now and now[r["role"]]["instance"] != r["instance"]]

    async def _watch_sync(self, client: Any) -> None:
        from protocol.messages import Metric
        from protocol.wire import decode

        async def on_metric(msg: Any) -> None:
            m = decode(msg.data, Metric)
            if m.signal == "weight_sync_s":  # export -> servable on an inferencer, per version
                self.rec.weight_sync_s.append(float(m.value))

        # Names spells no wildcard per signal (a scope of '*' is refused): take all, keep one.
        await client.bus.nc.subscribe(client.names.metrics_all, cb=on_metric)

    async def _sample_until_done(self, client: Any, ids: dict[str, str]) -> dict[str, Any]:
        deadline = time.monotonic() + self.cfg.run_timeout_s
        records: dict[str, Any] = {}
        last_note = 0.0
        while True:
            now = time.time()
            for role in ("trainer", "inferencer"):
                info = await self._info(client, role)
                if role in self.pids and info.pid != self.pids[role]:
                    raise RuntimeError(f"{role} restarted (pid {self.pids[role]} -> {info.pid}): "
                                       "its device time and busy counters start over")
                busy = _busy(info)
                if busy is not None:
                    self.rec.timeline[role].append([now - self.t0, busy])
            for name, wid in ids.items():
                records[name] = await client.workload(wid)
            for p in self.plans:
                # A tenant's closing eval goes in once its training completed (not on a failure:
                # the run is refused anyway); the tenant is done when that one is.
                if p.name not in self.followed and records[p.name].state == "completed":
                    follow = p.followup(self.cfg.sizes)
                    if follow is not None:
                        trained = records[p.name]
                        ids[p.name] = self.followed[p.name] = (await client.submit(follow)).id
                        records[p.name] = await client.workload(ids[p.name])
                        self.log(f"{p.name}: trained to v{trained.step}; its eval submitted")
            if all(r.state in TERMINAL for r in records.values()):
                return records
            if now - last_note > 15:
                last_note = now
                self.log(", ".join(f"{n}: {r.state} v{r.step} ep{r.episodes}"
                                   for n, r in records.items()))
            if time.monotonic() > deadline:
                left = [n for n, r in records.items() if r.state not in TERMINAL]
                raise RuntimeError(f"run timed out after {self.cfg.run_timeout_s:g} s (--run-timeout-s) with "
                                   f"{left} unfinished")
            await asyncio.sleep(self.cfg.poll_s)

    async def _tenants(self, client: Any, ids: dict[str, str], records: dict[str, Any]) -> None:
        from sdk.report import workload_events, workload_usage

        for p in self.plans:
            wid = self.first.get(p.name, ids[p.name])
            rec = records[p.name] if wid == ids[p.name] else await client.workload(wid)  # the training workload
            ev_rec = records[p.name] if p.name in self.followed else None  # its closing eval workload, if any
            usages = [await workload_usage(client, w) for w in (wid, self.followed.get(p.name)) if w]
            m = rec.metrics or {}
            if ev_rec is not None:
                success = (ev_rec.metrics or {}).get("success_rate", (ev_rec.metrics or {}).get("eval_success_rate"))
            else:
                success = m.get("eval_success_rate") if p.task == "sft" else m.get("success_rate")
            curve = []
            for ev in await workload_events(client, wid):
                value = (ev.metrics or {}).get("loss" if p.task == "sft" else "success_rate")
                if ev.kind == "progress" and value is not None:
                    curve.append([ev.at - self.t0, float(ev.step), float(ev.episodes), float(value)])
            state, message = rec.state, rec.message
            if p.followup(self.cfg.sizes) is not None:
                # Both workloads must complete; a tenant whose eval never went in did not.
                state = ev_rec.state if ev_rec is not None and rec.state == "completed" else (
                    rec.state if rec.state != "completed" else "no eval")
                message = f"train: {rec.message}; eval: {ev_rec.message if ev_rec is not None else 'not submitted'}"
            self.rec.tenants[p.name] = {
                "kind": p.kind, "task": p.task, "budget": p.budget, "workload": wid, "state": state,
                "message": message, "version": rec.step, "episodes": rec.episodes if ev_rec is None else ev_rec.episodes,
                "success": None if success is None else float(success),
                "loss": None if m.get("loss") is None else float(m["loss"]),
                "train_rows": sum(u.get("train_rows", 0) for u in usages),
                "infer_rows": sum(u.get("infer_rows", 0) for u in usages),
                "train_device_s": sum(u.get("train_device_s", 0.0) for u in usages),
                "infer_device_s": sum(u.get("infer_device_s", 0.0) for u in usages),
                "curve": curve}
            if ev_rec is not None:
                self.rec.tenants[p.name]["eval_workload"] = self.followed[p.name]


# -- the experiment -----------------------------------------------------------------------------
@dataclass
class Config:
    plans: list[TenantPlan]
    base: str = "tiny-qwen3-vl-64"
    fast: bool = False
    sizes: Sizes = field(default_factory=Sizes)
    run_timeout_s: float = 600.0
    seed: int = 0
    out: Path = RESULTS / "multitenant.json"
    scaling: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    keep_data: bool = False
    health_timeout_s: float = HEALTH_TIMEOUT_S
    trainer_group_max: int = 0  # 0: wide enough for every tenant of the shared run
    # Each poll is an `info` of the trainer and the inferencer; the trainer's info reads its
    # slots' memory while a step thread runs (a race: docs/results.md), so fewer polls = less
    # exposure, at a coarser busy timeline.
    poll_s: float = POLL.every_s
    seeds: list[int] = field(default_factory=list)  # each a full shared + alone pair; [] = [seed]
    resume: Path | None = None  # an earlier invocation's JSON: its successful runs are kept
    pick_dataset: Path | None = None  # --pick-dataset: a recorded PickCube dataset (None: record one)
    pick_demos: int = PICK_DEMOS  # episodes to record when there is none
    datasets: dict[str, Path] = field(default_factory=dict)  # published name -> recorded root (prepare_datasets)
    dataset_facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> episodes, frames, how recorded

    @property
    def run_seeds(self) -> list[int]:
        return self.seeds or [self.seed]

    def settings(self, n_tenants: int) -> dict[str, str]:
        """The deployment's settings: the same for the shared and every isolated run, except
        that the shared run's trainer group and rollout gate must fit all its tenants (a
        private deployment has one tenant: its 4-wide group and 3-wide gate are never full)."""
        s = {"NEXUS_INFER_BASE": self.base, "NEXUS_METRICS_PORT": "0", "NEXUS_TENSORBOARD": "0",
             "NEXUS_TRAINER_GROUP_MAX": str(self.trainer_group_max or max(4, min(256, n_tenants))),
             "NEXUS_MAX_ACTIVE_ROLLOUTS": str(max(3, n_tenants)),
             "NEXUS_HEALTH_TIMEOUT_S": f"{self.health_timeout_s:g}"}
        if self.fast:
            s["NEXUS_INFER_FAST"] = "1"
        return s
