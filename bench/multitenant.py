"""Multi-tenant vs isolated: the same tenants on one shared deployment, and each alone on its own.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.multitenant                 # 3 RL + 1 SFT, CPU, tiny base
    .venv/bin/python -m bench.multitenant --mix rl-reach:12,sft-reach:32 --out /tmp/mt.json
    .venv/bin/python -m bench.multitenant --scaling 1,2,4,8,16                       # shared side only
    .venv/bin/python -m bench.multitenant --replot bench/results/multitenant.json    # figures from a JSON
    NEXUS_SIM_TIMEOUT_S=600 .venv/bin/python -m bench.multitenant --seeds 1,2 \
        --mix rl-reach:1300,rl-reach-easy:600,rl-reach-top:1300,sft-pick:3000 \
        --rl-steps-per-update 512 --rl-parallel-envs 8 --rl-epochs 2 --pick-dataset DIR   # with learning
    python3 -m bench.multitenant --base qwen3-vl-4b --fast ...                       # on a GPU (docs/results.md)

What it does (issue 14, items 3-6):
  1. The tenant mix (``--mix``): each entry ``KIND[:BUDGET]``, KIND one of `TENANT_KINDS`
     (RL tenants on different tasks / task variants, ``rl-push`` on ManiSkill's PushCube,
     ``sft-pick``: SFT on ManiSkill's PickCube from the scripted expert's demos, recorded once per
     invocation with `nexus dataset record` or given with ``--pick-dataset``, published into each
     deployment that holds it, then an eval workload on held-out seeds), the budget a fixed
     amount of work: episodes for an RL tenant, optimizer steps for an SFT one (never wall
     time). Default 3 RL + 1 SFT, as in the reference system; where ManiSkill cannot run (no package or no Vulkan device), ``rl-push`` becomes ``rl-reach-top`` and the
     report says so (``--maniskill on`` makes that an error instead).
  2. (a) **shared**: one ``nexus up`` (a fresh temp data dir, a free port), every tenant
     submitted at once; (b) **alone**: for each tenant, a fresh ``nexus up`` holding only it,
     one after another. The deployment settings are the same for every run.
  3. While a run goes, every ``--poll-s`` (default ``POLL.every_s``): each service's metered busy seconds (its
     `info` op: the meter that charges tenants, `actors.metering`: each grouped train step or
     forward, ended by a device synchronize on a GPU) -> the busy timeline; the weight-sync
     lags the inferencers publish (``metrics.weight_sync_s.<tenant>``); workload states.
  4. At the end of a run (every workload terminal): held seconds per service (process start,
     from /proc, to the end), busy seconds, each tenant's result (RL: the success rate of its
     last training episodes; SFT: the closing evaluation's success rate and its loss), usage
     rows, curves from the workload events; then ``nexus down``.
  5. `bench.mt_report.compare`: device time shared vs the sum of the isolated runs
     (efficiency), utilisation per service and its gain, learning deltas, against issue 14's
     targets; JSON (``--out``), a PNG beside it (busy timelines of both runs; every tenant's
     learning curve, shared solid and alone dashed, on one axis: the paper's Fig. 12 view), and
     a table on stdout.
  6. ``--seeds 1,2``: steps 2-5 once per seed (each as ``--seed``); the JSON keeps the first
     seed's runs and comparison where a single-seed file has them, lists every seed under
     ``seeds`` and adds ``summary`` (`bench.mt_report.summarize`): per tenant the mean result
     shared vs alone and whether they are within 10 points, efficiency per seed and its mean.

Bad input: the mix, budgets, base and scaling list are checked before anything starts (exit 2,
one line naming the argument). Every deployment is stopped on the way out, on failure, Ctrl-C
or SIGTERM too (``nexus down``, then SIGKILL of whatever it left). A run that fails (``nexus up``
failed, a workload did not complete, a role restarted, the run timed out) stops the experiment;
the JSON then has ``"comparison": null`` and ``"refused"`` says which run failed and why, and
the exit status is 1. ``--resume THAT.json`` (the same command otherwise; another config is
refused naming what differs) keeps its successful shared run and the successful alone runs
before the failed one, lists them under the seed's ``resumed``, and runs the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.chaos import ROOT, Deployment, Poll, _example
from bench.mt_report import (compare, failures, merge_compare, planned_tenants, plot, plot_scaling, scaling,
                              scaling_table, summarize, summary_table, table)

RESULTS = ROOT / "bench" / "results"
TERMINAL = ("completed", "failed", "cancelled")
POLL = Poll("multitenant_poll", every_s=0.5, deadline_s=0.0)  # busy / state sampler of a run
REQUEST_TIMEOUT_S = 15.0  # each request of the harness (2 busy cores: replies have taken > 5 s)
MAX_TENANTS = 64  # a deployment's tenants in one run (the scaling curve goes to 16)
MAX_BUDGET = 100_000
INFO_ATTEMPTS = 3  # a role's info that fails (internal error) this often in a row fails the run
# Heartbeat silence before the health manager declares a role dead. The default (3 s) trips
# on this 2-core machine while an env worker imports ManiSkill / SAPIEN for a workflow (~30 s
# holding the GIL in bursts): the worker is killed and its workflows restart, so every run
# of the experiment gets this longer timeout (the same for shared and alone runs).
HEALTH_TIMEOUT_S = 30.0


# -- tenants -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Per-tenant work knobs that are not the budget (same in the shared and the alone runs)."""

    sft_demos: int = 40
    sft_batch: int = 32
    sft_items_per_job: int = 8
    sft_eval_episodes: int = 10
    rl_steps_per_update: int = 128
    rl_parallel_envs: int = 4
    rl_micro_batch: int = 32
    rl_epochs: int = 1
    pick_eval_episodes: int = 30  # sft-pick's closing eval on held-out PickCube seeds (30: as docs/results.md)
    pick_batch: int = 64  # rows per step: what took PickCube SFT to 100 % held-out (docs/results.md)
    pick_items_per_job: int = 16


def _rl(kind: str, env_id: str, options: dict[str, Any], cameras: list[dict[str, Any]] | None = None,
        state_dim: int | None = None, action_dim: int | None = None) -> Callable[..., dict[str, Any]]:
    def build(tenant: str, budget: int, base: str, seed: int, sz: Sizes) -> dict[str, Any]:
        rl = _example("rl_reach.yaml")
        rl.update(tenant=tenant, base=base, seed=seed)
        rl["env"] = {"id": env_id, "options": dict(options)}
        if cameras is not None:
            rl["observation"]["cameras"] = cameras
        if state_dim is not None:
            rl["observation"]["state_dim"] = state_dim
        if action_dim is not None:
            rl["action"]["dim"] = action_dim
        rl["algorithm"].update(steps_per_update=sz.rl_steps_per_update, parallel_envs=sz.rl_parallel_envs,
                               micro_batch=sz.rl_micro_batch, epochs=sz.rl_epochs)
        # A fixed amount of env work: episodes (checked by the workflow between updates, so
        # the same in both runs whatever the trainer's pace), never wall time.
        rl["schedule"]["budget"] = {"max_episodes": budget}
        rl.pop("eval", None)  # the result is the success rate of its own last training episodes
        rl.pop("outputs", None)
        return rl
    build.kind = kind  # type: ignore[attr-defined]
    build.task = "rl"  # type: ignore[attr-defined]
    build.env_id = env_id  # type: ignore[attr-defined]
    return build


def _sft(tenant: str, budget: int, base: str, seed: int, sz: Sizes) -> dict[str, Any]:
    sft = _example("sft_reach.yaml")
    sft.update(tenant=tenant, base=base, seed=seed)
    sft["env"]["demos"]["episodes"] = sz.sft_demos
    sft["algorithm"].update(steps=budget, items_per_job=min(sz.sft_items_per_job, budget),
                            batch_size=sz.sft_batch, warmup_steps=min(50, budget // 6))
    sft["schedule"]["budget"] = {}
    sft["eval"] = {"version": "latest", "episodes": sz.sft_eval_episodes, "seed": 10000}
    sft.pop("outputs", None)
    return sft


_sft.kind, _sft.task, _sft.env_id = "sft-reach", "sft", "builtin/reach-v0"  # type: ignore[attr-defined]

# sft-pick: SFT on ManiSkill3 PickCube-v1 from the scripted expert's demos (a LeRobot dataset,
# recorded once per invocation or given with --pick-dataset, published into every deployment that
# holds the tenant), then a read-only eval workload of its final export on held-out seeds: a
# dataset SFT cannot carry a closing eval (a spec has a dataset or an env, not both), so the
# runner submits the eval once the SFT completed; the tenant's result is that eval's success.
PICK_SFT, PICK_EVAL = "sft_maniskill_pickcube.yaml", "eval_maniskill_pickcube.yaml"
PICK_DATASET_NAME = "pickcube-demos"  # its name under <data dir>/datasets/published/
PICK_DEMO_SEED, PICK_DEMO_NOISE = 0, 0.1  # as docs/results.md's PickCube runs (DART noise 0.1)
PICK_EVAL_SEED = 100_000  # held-out: demo attempt i resets with PICK_DEMO_SEED + i, far below this
PICK_DEMOS = 150


def pick_published(data_dir: Path) -> Path:
    return data_dir / "datasets" / "published" / PICK_DATASET_NAME


def _sft_pick(tenant: str, budget: int, base: str, seed: int, sz: Sizes, data_dir: Path | None = None) -> dict[str, Any]:
    sft = _example(PICK_SFT)
    sft.update(tenant=tenant, base=base, seed=seed)
    if data_dir is not None:  # None: a spec to check (the example's placeholder root)
        sft["dataset"]["root"] = str(pick_published(data_dir))
    sft["algorithm"].update(steps=budget, batch_size=sz.pick_batch, items_per_job=min(sz.pick_items_per_job, budget),
                            warmup_steps=min(sft["algorithm"]["warmup_steps"], budget // 10))
    sft["schedule"]["budget"] = {}  # the steps are the budget (never wall time)
    sft["outputs"] = {"export_every_steps": min(sft["outputs"]["export_every_steps"], budget)}  # the last job exports
    return sft


def _pick_eval(tenant: str, sz: Sizes) -> dict[str, Any]:
    ev = _example(PICK_EVAL)
    ev["tenant"] = tenant
    ev["eval"].update(version="latest", episodes=sz.pick_eval_episodes, seed=PICK_EVAL_SEED)
    return ev


def pick_env() -> tuple[str, dict[str, Any]]:
    """The env id and options the eval (and so the demos) use."""
    ev = _example(PICK_EVAL)
    return ev["env"]["id"], dict(ev["env"]["options"])


_sft_pick.kind, _sft_pick.task, _sft_pick.env_id = "sft-pick", "sft", "maniskill/PickCube-v1"  # type: ignore[attr-defined]
_sft_pick.dataset = PICK_DATASET_NAME  # type: ignore[attr-defined]
_sft_pick.followup = _pick_eval  # type: ignore[attr-defined]
_CAM64 = {"height": 64, "width": 64}
TENANT_KINDS: dict[str, Callable[..., dict[str, Any]]] = {
    "rl-reach": _rl("rl-reach", "builtin/reach-v0", {"cameras": ["top", "wrist"], "image_size": 64, "reward": "dense"}),
    # Task variants of the built-in reach: larger steps and a wider success radius; the top
    # camera alone (another observation schema in the same trainer group).
    "rl-reach-easy": _rl("rl-reach-easy", "builtin/reach-v0",
                         {"cameras": ["top", "wrist"], "image_size": 64, "reward": "dense",
                          "max_step": 0.15, "success_radius": 0.2}),
    "rl-reach-top": _rl("rl-reach-top", "builtin/reach-v0", {"cameras": ["top"], "image_size": 64, "reward": "dense"},
                        cameras=[{"name": "top", **_CAM64}]),
    # ManiSkill3 PushCube through the adapter (SAPIEN on CPU, rendered by lavapipe or the GPU):
    # one 64x64 camera, 25-d state, 8-d joint-delta action (no IK: ~2x faster on CPU).
    "rl-push": _rl("rl-push", "maniskill/PushCube-v1",
                   {"obs_mode": "rgb", "image_size": 64, "control_mode": "pd_joint_delta_pos"},
                   cameras=[{"name": "base_camera", **_CAM64}], state_dim=25, action_dim=8),
    "sft-reach": _sft,
    "sft-pick": _sft_pick,
}
DEFAULT_MIX = "rl-reach:8,rl-reach-easy:8,rl-push:4,sft-reach:32"
DEFAULT_BUDGET = {"rl": 16, "sft": 48}  # sft-pick learns at ~3,000 (docs/results.md)
MANISKILL_STANDIN = "rl-reach-top"
DEFAULT_SCALING_KINDS = "rl-reach:8,sft-reach:24"


@dataclass(frozen=True)
class TenantPlan:
    name: str
    kind: str
    budget: int

    @property
    def task(self) -> str:
        return TENANT_KINDS[self.kind].task  # type: ignore[attr-defined]

    @property
    def dataset(self) -> str | None:
        """The published dataset this tenant trains from (None: none)."""
        return getattr(TENANT_KINDS[self.kind], "dataset", None)

    def spec(self, base: str, seed: int, sizes: Sizes, data_dir: Path | None = None) -> dict[str, Any]:
        build = TENANT_KINDS[self.kind]
        extra = {"data_dir": data_dir} if self.dataset else {}
        return build(self.name, self.budget, base, seed, sizes, **extra)

    def followup(self, sizes: Sizes) -> dict[str, Any] | None:
        """The workload submitted once this tenant's first completed (its closing eval), if any."""
        build = getattr(TENANT_KINDS[self.kind], "followup", None)
        return None if build is None else build(self.name, sizes)


class BadArgument(ValueError):
    """A bad command-line value; the message names the argument."""


def maniskill_problem() -> str | None:
    """Why ManiSkill cannot run here (None: it can): the package, then a Vulkan device."""
    import importlib.util

    if importlib.util.find_spec("mani_skill") is None:
        return "the mani-skill package is not installed"
    from envs.maniskill import vulkan_icd_candidates

    if not vulkan_icd_candidates():
        return "no Vulkan driver found (deploy/setup/vulkan.sh installs lavapipe)"
    return None


def parse_mix(text: str, maniskill: str = "auto", problem: Callable[[], str | None] | None = None
              ) -> tuple[list[TenantPlan], list[str]]:
    """``KIND[:BUDGET],...`` -> tenant plans (names unique: ``mt-<i>-<kind>``) and notes.
    ``problem``: why ManiSkill cannot run (default `maniskill_problem`, looked up at call time)."""
    problem = problem or maniskill_problem
    if maniskill not in ("auto", "on", "off"):
        raise BadArgument(f"--maniskill: {maniskill!r}; allowed: auto, on, off")
    entries = [e.strip() for e in (text or "").split(",")]
    if not text or not text.strip() or any(not e for e in entries):
        raise BadArgument(f"--mix: {text!r}: need comma-separated KIND[:BUDGET] entries, none empty; "
                          f"kinds: {', '.join(TENANT_KINDS)}")
    if len(entries) > MAX_TENANTS:
        raise BadArgument(f"--mix: {len(entries)} tenants; at most {MAX_TENANTS}")
    plans, notes = [], []
    why_not = None
    for i, entry in enumerate(entries):
        kind, sep, budget_text = entry.partition(":")
        kind = kind.strip()
        if kind not in TENANT_KINDS:
            raise BadArgument(f"--mix entry {i + 1} {entry!r}: unknown kind {kind!r}; kinds: {', '.join(TENANT_KINDS)}")
        task = TENANT_KINDS[kind].task  # type: ignore[attr-defined]
        if sep:
            try:
                budget = int(budget_text)
            except ValueError:
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: budget {budget_text!r} is not an integer "
                                  f"({'episodes' if task == 'rl' else 'optimizer steps'})") from None
        else:
            budget = DEFAULT_BUDGET[task]
        if not 1 <= budget <= MAX_BUDGET:
            raise BadArgument(f"--mix entry {i + 1} {entry!r}: budget {budget} is outside 1..{MAX_BUDGET} "
                              f"({'episodes' if task == 'rl' else 'optimizer steps'})")
        if kind == "sft-pick":
            # No stand-in: the SFT trains on PickCube demos and is scored in PickCube.
            if maniskill == "off":
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: sft-pick needs ManiSkill (--maniskill off)")
            why_not = why_not if why_not is not None else (problem() or "")
            if why_not:
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: sft-pick needs ManiSkill, which cannot run "
                                  f"here: {why_not}")
        if kind == "rl-push":
            if maniskill == "off":
                kind = MANISKILL_STANDIN
                notes.append(f"tenant {i + 1}: rl-push replaced by {kind} (--maniskill off)")
            else:
                why_not = why_not if why_not is not None else (problem() or "")
                if why_not:
                    if maniskill == "on":
                        raise BadArgument(f"--mix entry {i + 1} {entry!r}: ManiSkill cannot run here: {why_not} "
                                          "(--maniskill auto replaces it with " + MANISKILL_STANDIN + ")")
                    kind = MANISKILL_STANDIN
                    notes.append(f"tenant {i + 1}: rl-push replaced by {kind}: ManiSkill cannot run here ({why_not})")
        plans.append(TenantPlan(name=f"mt-{i + 1}-{kind}", kind=kind, budget=budget))
    return plans, notes


def parse_scaling(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise BadArgument(f"--scaling: {text!r}: need comma-separated tenant counts, e.g. 1,2,4,8,16") from None
    if not counts or any(not 1 <= n <= MAX_TENANTS for n in counts):
        raise BadArgument(f"--scaling: {text!r}: every count must be in 1..{MAX_TENANTS}")
    if counts != sorted(set(counts)):
        raise BadArgument(f"--scaling: {text!r}: counts must be increasing, without repeats")
    return counts


def scaled_mix(kinds: list[TenantPlan], n: int) -> list[TenantPlan]:
    """``n`` tenants cycling through ``kinds`` (their budgets), named uniquely."""
    return [TenantPlan(name=f"mt-{i + 1}-{kinds[i % len(kinds)].kind}", kind=kinds[i % len(kinds)].kind,
                       budget=kinds[i % len(kinds)].budget) for i in range(n)]


def check_base(base: str) -> None:
    from models.presets import PRESETS

    if base not in PRESETS and not Path(base).is_dir():
        raise BadArgument(f"--base: {base!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")


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
    """`bench.chaos.Deployment` with this experiment's settings in every role's environment."""

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


LIVE: list[MtDeployment] = []


def one_run(name: str, plans: list[TenantPlan], cfg: Config, n_for_settings: int, seed: int | None = None
            ) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"nexus-mt-{name.replace(':', '-')}-")).resolve()
    dep = MtDeployment(data_dir, cfg.settings(n_for_settings))
    LIVE.append(dep)
    rec: RunRecord | None = None
    try:
        rec = asyncio.run(Runner(name, plans, cfg, dep, seed=seed).run())
    finally:
        notes = dep.cleanup()
        LIVE.remove(dep)
        # A failed run keeps its data dir: the roles' logs there (a crashed role's fault
        # handler dump) are the only record of why; the error line names one log line only.
        failed = rec is None or not rec.ok
        if not cfg.keep_data and not failed:
            shutil.rmtree(data_dir, ignore_errors=True)
    out = asdict(rec)
    out["cleanup"] = notes
    if failed:
        out["data_dir"] = str(data_dir)
    print(f"[multitenant {name}] {'ok' if rec.ok else 'FAILED: ' + '; '.join(failures([out]))} "
          f"(wall {rec.wall_s:.1f} s){'' if rec.ok else f'; logs kept in {data_dir}/logs'}", flush=True)
    return out


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))


def compare_seed(cfg: Config, seed: int, saved: Callable[[dict[str, Any]], None] = lambda entry: None,
                 done: dict[str, Any] | None = None) -> dict[str, Any]:
    """One seed: the shared run, then each tenant alone (stops at the first failed run);
    ``saved`` gets the seed's entry after each run (to put it on disk). ``done``: this seed's
    runs of an earlier invocation (`--resume`): its successful shared run and the successful
    prefix of its alone runs are kept (listed in the entry's ``resumed``), the rest run now."""
    entry: dict[str, Any] = {"seed": seed, "runs": {"shared": None, "alone": []}, "comparison": None, "refused": [],
                             "resumed": []}
    n = len(cfg.plans)
    tag = f" s{seed}" if len(cfg.run_seeds) > 1 else ""
    before = done or {"shared": None, "alone": []}
    kept_alone: list[dict[str, Any]] = []
    if before["shared"] is not None and not failures([before["shared"]]):
        shared = before["shared"]
        entry["resumed"].append(shared["name"])
        for r in before["alone"]:
            if failures([r]):
                break
            kept_alone.append(r)
    else:
        shared = one_run("shared" + tag, cfg.plans, cfg, n, seed)
    entry["runs"]["shared"] = shared
    saved(entry)
    if not failures([shared]):
        for i, p in enumerate(cfg.plans):
            if i < len(kept_alone):
                entry["runs"]["alone"].append(kept_alone[i])
                entry["resumed"].append(kept_alone[i]["name"])
                continue
            # Same settings as the shared run: only the number of tenants differs.
            r = one_run(f"alone:{p.name}" + tag, [p], cfg, n, seed)
            entry["runs"]["alone"].append(r)
            saved(entry)
            if failures([r]):
                break
    try:
        entry["comparison"] = compare(shared, entry["runs"]["alone"])
    except ValueError as exc:
        entry["refused"] = failures([shared, *entry["runs"]["alone"]]) or [str(exc)]
        skipped = [p.name for p in cfg.plans][len(entry["runs"]["alone"]):]
        if skipped:
            entry["refused"].append(f"not run (an earlier run failed): alone runs of {skipped}")
    return entry


def assemble(cfg: Config, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The compare report of these seeds. The first seed's runs, comparison and refusals stay
    at the top level (the single-seed layout other code reads); ``seeds`` lists every seed (the
    first one's runs are not repeated there), ``summary`` the per-tenant means across seeds."""
    report: dict[str, Any] = {"kind": "compare", "config": _config_json(cfg),
                              "runs": {"shared": None, "alone": []}, "comparison": None, "refused": [],
                              "seeds": [], "summary": summarize(entries)}
    for k, entry in enumerate(entries):
        if k == 0:
            report.update(runs=entry["runs"], comparison=entry["comparison"], refused=list(entry["refused"]))
            report["seeds"].append({**{key: v for key, v in entry.items() if key != "runs"}, "runs": "top-level runs"})
        else:
            report["seeds"].append(entry)
            report["refused"] += [f"seed {entry['seed']}: {r}" for r in entry["refused"]]
    return report


# Config keys a resumed invocation may change: notes say what this invocation noticed.
RESUME_FREE = frozenset({"notes"})


def resumed_runs(cfg: Config) -> dict[int, dict[str, Any]]:
    """Seed -> its runs in the `--resume` JSON (an earlier invocation of the same config that
    stopped or failed part-way). A JSON of another config is refused naming what differs."""
    if cfg.resume is None:
        return {}
    try:
        report = json.loads(cfg.resume.read_text())
    except (OSError, ValueError) as exc:
        raise BadArgument(f"--resume {cfg.resume}: not a readable JSON report ({exc})") from None
    if not isinstance(report, dict) or report.get("kind") != "compare":
        raise BadArgument(f"--resume {cfg.resume}: not a shared-vs-alone report (kind {report.get('kind')!r})"
                          if isinstance(report, dict) else f"--resume {cfg.resume}: not a report object")
    mine, theirs = _config_json(cfg), report.get("config", {})
    differ = sorted(k for k in set(mine) | set(theirs) if k not in RESUME_FREE and mine.get(k) != theirs.get(k))
    if differ:
        raise BadArgument(f"--resume {cfg.resume}: made with other settings ({', '.join(differ)} differ); "
                          "resume it with the same command")
    out: dict[int, dict[str, Any]] = {}
    for k, entry in enumerate(report.get("seeds", [])):
        runs = report["runs"] if k == 0 else entry.get("runs")
        if isinstance(runs, dict) and "seed" in entry:
            out[int(entry["seed"])] = {"shared": runs.get("shared"), "alone": list(runs.get("alone") or [])}
    return out


def run_compare(cfg: Config) -> tuple[int, dict[str, Any]]:
    """Every seed a full shared + alone pair (`assemble` says where each lands in the JSON).
    The JSON is rewritten after every run, so an invocation stopped half-way keeps the runs
    it finished (the unfinished seed marked incomplete)."""
    entries: list[dict[str, Any]] = []
    runs_per_seed = 1 + len(cfg.plans)

    def saved(entry: dict[str, Any]) -> None:
        done = (entry["runs"]["shared"] is not None) + len(entry["runs"]["alone"])
        partial = {**entry, "refused": [f"incomplete: {done} of {runs_per_seed} runs done (the invocation was "
                                        "still running, or was stopped)"]}
        _write(assemble(cfg, [*entries, partial]), cfg.out)

    earlier = resumed_runs(cfg)
    for seed in cfg.run_seeds:
        entry = compare_seed(cfg, seed, saved, earlier.get(seed))
        entries.append(entry)
        if entry["comparison"] is None:
            break
    report = assemble(cfg, entries)
    rest = cfg.run_seeds[len(entries):]
    if rest:
        report["refused"].append(f"not run (seed {entries[-1]['seed']} failed): seeds {rest}")
    _write(report, cfg.out)
    png = _plotted(plot, report, cfg.out)
    if report["comparison"] is not None:
        print("\n" + table(report["comparison"]))
    if len(cfg.run_seeds) > 1 or any(p.dataset for p in cfg.plans):
        print("\n" + summary_table(report["summary"]))
    for note in cfg.notes:
        print(f"note: {note}")
    print(f"\nJSON: {cfg.out}\nPNG:  {png}")
    if report["refused"]:
        print("\nNO COMPARISON for a seed: a run failed\n  " + "\n  ".join(report["refused"]), file=sys.stderr)
        return 1, report
    return 0, report


def _plotted(fn: Callable[..., Path], *args: Any) -> str:
    """The PNG beside the JSON; where matplotlib is missing (a bare GPU machine), say how to
    make it later from the JSON instead of losing the run."""
    *rest, out = args
    try:
        return str(fn(*rest, out.with_suffix(".png")))
    except ImportError as exc:
        return f"not drawn ({exc}); draw it with: python -m bench.multitenant --replot {out}"


def run_scaling(cfg: Config) -> tuple[int, dict[str, Any]]:
    report: dict[str, Any] = {"kind": "scaling", "config": _config_json(cfg), "runs": [], "rows": [], "refused": []}
    for n in cfg.scaling:
        r = one_run(f"scale:{n}", scaled_mix(cfg.plans, n), cfg, n)
        report["runs"].append(r)
        if failures([r]):
            report["refused"] = failures([r]) + [f"not run: {[m for m in cfg.scaling if m > n]}"]
            break
    report["rows"] = scaling(report["runs"])
    _write(report, cfg.out)
    png = _plotted(plot_scaling, report["rows"], report["runs"], cfg.out)
    print("\n" + scaling_table(report["rows"]))
    print(f"\nJSON: {cfg.out}\nPNG:  {png}")
    if report["refused"]:
        print("\nFAILED RUN: " + " | ".join(report["refused"]), file=sys.stderr)
        return 1, report
    return 0, report


def _config_json(cfg: Config) -> dict[str, Any]:
    return {"plans": [asdict(p) for p in cfg.plans], "base": cfg.base, "fast": cfg.fast, "sizes": asdict(cfg.sizes),
            "run_timeout_s": cfg.run_timeout_s, "poll_s": cfg.poll_s, "seed": cfg.seed, "scaling": cfg.scaling, "notes": cfg.notes,
            "settings_shared": cfg.settings(max([len(cfg.plans), *cfg.scaling])), "seeds": cfg.run_seeds,
            "datasets": {k: str(v) for k, v in cfg.datasets.items()}, "dataset_facts": cfg.dataset_facts}


# -- the PickCube dataset (sft-pick) -----------------------------------------------------------
def pick_dataset_problem(root: Path) -> str | None:
    """Why ``root`` cannot train sft-pick (None: it can): no LeRobot dataset there, or features
    that do not fit the tenant's spec (the master's own check, before anything starts)."""
    from master.spec import dataset_errors, parse_spec

    info = root / "meta" / "info.json"
    if not info.is_file():
        return f"{str(root)!r} holds no LeRobot dataset (no meta/info.json); record one with --pick-demos, or give its root"
    try:
        json.loads(info.read_text())
    except ValueError as exc:
        return f"{str(info)!r} is not JSON: {exc}"
    errors = dataset_errors(parse_spec(_sft_pick("check", 1, "tiny-qwen3-vl-64", 0, Sizes())), root)
    if errors:
        return (f"{str(root)!r} does not fit sft-pick ({PICK_SFT}): "
                + "; ".join(f"{field}: {why}" for field, why, _ in errors)
                + " (record it with --env-option 'state_keys=[\"extra\"]', as bench.maniskill_sft does)")
    return None


def prepare_datasets(cfg: Config) -> None:
    """The PickCube demos, once per invocation: --pick-dataset as given (checked in
    build_config), else recorded now with `nexus dataset record` (every seed and run publishes
    the same one)."""
    if not any(p.dataset == PICK_DATASET_NAME for p in cfg.plans):
        return
    from bench.maniskill_sft import dataset_facts, record_demos

    root = cfg.pick_dataset
    facts: dict[str, Any] = {}
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="nexus-mt-pick-demos-")).resolve()
        env_id, options = pick_env()
        print(f"[multitenant] recording {cfg.pick_demos} PickCube demos into {root} (reuse: --pick-dataset {root})",
              flush=True)
        try:
            facts["record"] = record_demos(root, cfg.pick_demos, PICK_DEMO_SEED, PICK_DEMO_NOISE, options, env_id,
                                           timeout_s=6 * 3600)
            problem = pick_dataset_problem(root)
            if problem:
                raise RuntimeError(f"the recorded dataset: {problem}")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # nothing half-written left behind (Ctrl-C too)
            raise
        print(f"[multitenant] {facts['record']['summary']} ({facts['record']['wall_s']} s)", flush=True)
    last_demo_seed = PICK_DEMO_SEED + 2 * dataset_facts(root)["episodes"] + 10  # record's attempt cap
    if last_demo_seed > PICK_EVAL_SEED:
        raise BadArgument(f"--pick-demos: demo seeds up to {last_demo_seed} would reach the eval seeds {PICK_EVAL_SEED}..")
    facts.update(root=str(root), **dataset_facts(root))
    cfg.datasets[PICK_DATASET_NAME] = root
    cfg.dataset_facts[PICK_DATASET_NAME] = facts


def replot(paths: list[Path], out: Path | None = None) -> int:
    """The PNG and table again from saved JSON. Several scaling files (counts run in separate
    invocations) merge into one curve, several compare files of one mix (seeds run in separate
    invocations) into one report with the summary across their seeds; written to ``out``."""
    reports = [json.loads(p.read_text()) for p in paths]
    if len(reports) > 1:
        kinds = {r.get("kind") for r in reports}
        if len(kinds) != 1 or kinds - {"scaling", "compare"}:
            print("error: --replot: only files of one kind can be merged: scaling files (--scaling runs), or "
                  "compare files of the same mix (e.g. one seed each)", file=sys.stderr)
            return 2
        if out is None or out.suffix != ".json":
            print("error: --out: merging several files needs --out FILE.json", file=sys.stderr)
            return 2
    if len(reports) > 1 and reports[0].get("kind") == "compare":
        try:
            merged = merge_compare(reports, [str(p) for p in paths])
        except ValueError as exc:
            print(f"error: --replot: {exc}", file=sys.stderr)
            return 2
        _write(merged, out)
        reports, paths = [merged], [out]
    elif len(reports) > 1:
        runs = [run for r in reports for run in r["runs"]]
        good = {run["name"] for run in runs if not failures([run])}
        # A count that failed in one invocation and ran clean in another: the clean run counts.
        dropped = [run["name"] for run in runs if failures([run]) and run["name"] in good]
        runs = sorted((run for run in runs if not (failures([run]) and run["name"] in good)), key=planned_tenants)
        merged = {"kind": "scaling", "config": [r["config"] for r in reports], "runs": runs,
                  "rows": scaling(runs), "refused": failures(runs),
                  "replaced_failed_runs": [f"{n}: failed in one file, ran clean in another" for n in dropped],
                  "merged_from": [str(p) for p in paths]}
        _write(merged, out)
        reports, paths = [merged], [out]
    report, path = reports[0], paths[0]
    if report.get("kind") == "scaling":
        report["rows"] = scaling(report["runs"])  # the current definitions, not the file's
        print(scaling_table(report["rows"]))
        print(f"PNG: {_plotted(plot_scaling, report['rows'], report['runs'], path)}")
    else:
        print(table(report["comparison"]) if report.get("comparison")
              else "NO COMPARISON: " + " | ".join(report.get("refused", [])))
        if report.get("summary"):
            print("\n" + summary_table(report["summary"]))
        print(f"PNG: {_plotted(plot, report, path)}")
    return 0


def build_config(args: argparse.Namespace) -> Config:
    """Every argument checked before anything starts (BadArgument names the one at fault)."""
    check_base(args.base)
    if not 0 < args.run_timeout_s <= 86400:
        raise BadArgument(f"--run-timeout-s: {args.run_timeout_s}: must be in (0, 86400]")
    scaling_counts = parse_scaling(args.scaling) if args.scaling else []
    mix = args.mix or (DEFAULT_SCALING_KINDS if scaling_counts else DEFAULT_MIX)
    plans, notes = parse_mix(mix, args.maniskill)
    sizes = Sizes(sft_demos=args.sft_demos, sft_eval_episodes=args.sft_eval_episodes,
                  rl_steps_per_update=args.rl_steps_per_update, rl_parallel_envs=args.rl_parallel_envs,
                  rl_epochs=args.rl_epochs, pick_eval_episodes=args.pick_eval_episodes)
    for name, value, lo, hi in (("--sft-demos", sizes.sft_demos, 1, 10_000),
                                ("--sft-eval-episodes", sizes.sft_eval_episodes, 1, 1000),
                                ("--rl-steps-per-update", sizes.rl_steps_per_update, 8, 100_000),
                                ("--rl-parallel-envs", sizes.rl_parallel_envs, 1, 64),
                                ("--rl-epochs", sizes.rl_epochs, 1, 16),
                                ("--pick-eval-episodes", sizes.pick_eval_episodes, 1, 1000),
                                ("--pick-demos", args.pick_demos, 1, 10_000)):
        if not lo <= value <= hi:
            raise BadArgument(f"{name}: {value} is outside {lo}..{hi}")
    seeds = parse_seeds(args.seeds) if args.seeds else []
    if seeds and scaling_counts:
        raise BadArgument("--seeds: the scaling curve (--scaling) runs one seed (--seed)")
    has_pick = any(p.kind == "sft-pick" for p in plans)
    pick_dataset = None
    if args.pick_dataset is not None:
        if not has_pick:
            raise BadArgument(f"--pick-dataset: no sft-pick tenant in the mix ({mix!r}) to train from it")
        pick_dataset = args.pick_dataset.resolve()
        problem = pick_dataset_problem(pick_dataset)
        if problem:
            raise BadArgument(f"--pick-dataset: {problem}")
    if not 0.1 <= args.poll_s <= 10:
        raise BadArgument(f"--poll-s: {args.poll_s}: must be in [0.1, 10]")
    if not 0 <= args.trainer_group_max <= 256:
        raise BadArgument(f"--trainer-group-max: {args.trainer_group_max} is outside 0..256 (0: fit the tenants)")
    out = args.out or RESULTS / ("multitenant-scaling.json" if scaling_counts else "multitenant.json")
    if out.suffix != ".json":
        raise BadArgument(f"--out: {str(out)!r} must end in .json (the PNG goes beside it)")
    return Config(plans=plans, base=args.base, fast=args.fast, sizes=sizes, run_timeout_s=args.run_timeout_s,
                  seed=args.seed, out=out, scaling=scaling_counts, notes=notes, keep_data=args.keep_data,
                  resume=args.resume,
                  trainer_group_max=args.trainer_group_max, poll_s=args.poll_s, seeds=seeds,
                  pick_dataset=pick_dataset, pick_demos=args.pick_demos)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise BadArgument(f"--seeds: {text!r}: need comma-separated integers, e.g. 1,2") from None
    if len(set(seeds)) != len(seeds) or any(not 0 <= x <= 1_000_000 for x in seeds):
        raise BadArgument(f"--seeds: {text!r}: seeds must be distinct, each in 0..1000000")
    return seeds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.multitenant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", help=f"KIND[:BUDGET],... (default {DEFAULT_MIX}; with --scaling, the kinds cycled: "
                                 f"{DEFAULT_SCALING_KINDS}); budgets: RL episodes, SFT optimizer steps")
    p.add_argument("--maniskill", default="auto", help="auto | on | off: rl-push on ManiSkill (auto: a stand-in where it cannot run)")
    p.add_argument("--base", default="tiny-qwen3-vl-64", help="base preset or directory (every tenant's, and the inferencer's)")
    p.add_argument("--fast", action="store_true", help="the inferencer's fast engine (CUDA graphs; NEXUS_INFER_FAST)")
    p.add_argument("--scaling", help="tenant counts, e.g. 1,2,4,8,16: the shared side only, per count")
    p.add_argument("--sft-demos", type=int, default=Sizes.sft_demos)
    p.add_argument("--sft-eval-episodes", type=int, default=Sizes.sft_eval_episodes)
    p.add_argument("--rl-steps-per-update", type=int, default=Sizes.rl_steps_per_update)
    p.add_argument("--rl-parallel-envs", type=int, default=Sizes.rl_parallel_envs)
    p.add_argument("--trainer-group-max", type=int, default=0,
                   help="jobs per trainer round in every run (default: the shared run's tenant count, at least 4)")
    p.add_argument("--poll-s", type=float, default=POLL.every_s,
                   help="seconds between samples of the services' busy time (each an info request)")
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="one run (deployment) at most this long")
    p.add_argument("--seed", type=int, default=0, help="tenant i's spec seed is 1 + i + this")
    p.add_argument("--seeds", help="e.g. 1,2: each seed (as --seed) a full shared + alone pair; a summary across them")
    p.add_argument("--rl-epochs", type=int, default=Sizes.rl_epochs, help="PPO epochs per update of the RL tenants")
    p.add_argument("--pick-dataset", type=Path, default=None,
                   help="sft-pick: a PickCube LeRobot dataset recorded before (default: record --pick-demos now)")
    p.add_argument("--pick-demos", type=int, default=PICK_DEMOS, help="sft-pick: demo episodes to record")
    p.add_argument("--pick-eval-episodes", type=int, default=Sizes.pick_eval_episodes,
                   help=f"sft-pick: closing eval episodes on held-out seeds ({PICK_EVAL_SEED}..)")
    p.add_argument("--out", type=Path, help="JSON path (PNG beside it); default bench/results/multitenant[-scaling].json")
    p.add_argument("--keep-data", action="store_true", help="keep each run's temp data dir (logs)")
    p.add_argument("--resume", type=Path, default=None, metavar="JSON",
                   help="an earlier invocation's JSON (same command): its successful shared run and alone runs "
                        "are kept, the missing or failed ones run now")
    p.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                   help="rebuild the PNG and table from saved JSON (several scaling files: merged into --out); runs nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out)
    try:
        cfg = build_config(args)
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in cfg.notes:
        print(f"note: {note}", flush=True)

    # SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so every finally cleans up.
    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        try:
            prepare_datasets(cfg)
        except BadArgument as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"error: the PickCube demos could not be recorded: {exc}", file=sys.stderr)
            return 1
        try:
            code, _ = run_scaling(cfg) if cfg.scaling else run_compare(cfg)
        except BadArgument as exc:  # --resume of another config, or not a report
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        for dep in list(LIVE):  # a deployment whose own finally was cut short
            dep.cleanup()
        print(f"[multitenant] interrupted; every deployment it started was stopped; the runs it finished are in "
              f"{cfg.out}", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
