"""Instance counts by hand: `nexus up --roles`, `nexus scale ROLE N`, their bounds, and scaling
under load on a real deployment (supervisor, NATS with auth, every role a process).

The refusals come first (no deployment: each is checked before anything starts). Then one
deployment with 2 env workers and 2 trainers: trainers scaled 2 -> 1 -> 2 while SFT jobs are
queued and training (every job cleared once, versions 1..N in job order, weights bit-identical
to the same micro-batches applied once each in process), trainers to 0 refused while jobs wait,
and the env worker running an RL workload drained by `nexus scale env 1 --drain` mid-run, then
env back to 2: the workload completes on the other worker and the audit of the chaos suite
(bench/chaos_audit.py) finds no job lost and none trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time

import pytest

from actors.supervisor.children import slot_key
from transport.cluster import ClusterState, SupervisorConfig
from bench.chaos_audit import audit_jobs
from protocol.errors import InvalidField, NexusError
from protocol.scaling import DEFAULT_BOUNDS, check_count, parse_bounds, parse_counts
from protocol.settings import ScaleSettings, SettingsError
from protocol.messages import Ok, ScaleRequest
from protocol.subjects import Names
from sdk.cli import main as nexus_main
from sdk.client import AsyncClient
from tests.conftest import nexus_run
from tests.master.test_workloads import rl_spec
from tests.support.tq_helpers import Reference, micro_batch, tenant, tensors_equal

REACH_SCHEMA = {  # the built-in reach task's, as the deployment's inferencer serves tiny-qwen3-vl-64
    "cameras": [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}],
    "state_dim": 4, "action_dim": 2, "action_horizon": 1, "instruction_template": "{instruction}",
}
BASE = "tiny-qwen3-vl-64"


# -- refusals: each names the setting or bound, and nothing starts -------------------------------
def test_counts_and_bounds_parse_and_refuse_naming_the_setting():
    assert parse_counts("env=4, inferencer=2,trainer=1") == {"env": 4, "inferencer": 2, "trainer": 1}
    assert parse_counts("") == {}
    for text, words in [("master=2", "master runs exactly once"), ("env=x", "not a whole number"),
                        ("robot=1", "unknown role 'robot'"), ("env=33", "allowed 0..32"),
                        ("env", "is not ROLE=N"), ("env=1,env=2", "named twice"), ("env=-1", "allowed 0..32")]:
        with pytest.raises(InvalidField, match=words) as exc:
            parse_counts(text)
        assert exc.value.field == "--roles"
    b = parse_bounds("trainer=0:3")
    assert b["trainer"].min == 0 and b["trainer"].max == 3 and b["env"] == DEFAULT_BOUNDS["env"]
    for text, words in [("trainer=4:2", "min 4 is above max 2"), ("trainer=3", "is not MIN:MAX"),
                        ("master=1:1", "no bounds"), ("env=0:99", "allowed 0..32")]:
        with pytest.raises(InvalidField, match=words) as exc:
            parse_bounds(text)
        assert exc.value.field == "NEXUS_SCALE_BOUNDS"
    with pytest.raises(SettingsError, match="NEXUS_SCALE_BOUNDS='trainer=4:2': trainer=4:2: min 4 is above max 2"):
        ScaleSettings.from_env({"NEXUS_SCALE_BOUNDS": "trainer=4:2"})
    with pytest.raises(InvalidField, match=r"trainer=9 is past its max bound 8 \(NEXUS_SCALE_BOUNDS trainer=1:8\)") as exc:
        check_count("trainer", 9, DEFAULT_BOUNDS)
    assert exc.value.details["bound"] == "max" and exc.value.details["limit"] == 8
    with pytest.raises(InvalidField, match="past its min bound 1"):
        check_count("env", 0, DEFAULT_BOUNDS)
    with pytest.raises(InvalidField, match="does not scale"):
        check_count("master", 2, DEFAULT_BOUNDS)
    with pytest.raises(InvalidField, match="--roles: trainer=0 is past its min bound 1"):
        SupervisorConfig(counts={"trainer": 0})
    cfg = SupervisorConfig(counts={"env": 3}, bounds=parse_bounds("env=0:3"))
    assert cfg.counts["env"] == 3 and cfg.counts["master"] == 1
    assert [slot_key("env", i) for i in range(3)] == ["env", "env.1", "env.2"]


def nexus(*args: str) -> tuple[int, str]:
    """One `nexus` command in this process (a child's interpreter start costs seconds here)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = nexus_main(list(args))
    return code, out.getvalue()


def test_up_refuses_counts_past_bounds_and_contradicting_bounds_before_starting(tmp_path, monkeypatch):
    monkeypatch.setenv("NEXUS_SCALE_BOUNDS", "trainer=1:4")
    code, out = nexus("up", "--detach", "--data-dir", str(tmp_path), "--roles", "trainer=5")
    assert code == 2 and "--roles: trainer=5 is past its max bound 4 (NEXUS_SCALE_BOUNDS trainer=1:4)" in out, out
    code, out = nexus("up", "--detach", "--data-dir", str(tmp_path), "--roles", "master=2")
    assert code == 2 and "master runs exactly once" in out, out
    monkeypatch.setenv("NEXUS_SCALE_BOUNDS", "env=3:1")
    code, out = nexus("up", "--detach", "--data-dir", str(tmp_path))
    assert code == 2 and "NEXUS_SCALE_BOUNDS='env=3:1'" in out and "min 3 is above max 1" in out, out
    assert not (tmp_path / "cluster.json").exists() and not (tmp_path / "logs").exists()
    code, out = nexus("scale", "env", "2", "--data-dir", str(tmp_path))
    assert code == 1 and "no running deployment" in out, out


# -- scaling under load on a real deployment -----------------------------------------------------
def _scale(data_dir, *args: str) -> tuple[int, str]:
    return nexus("scale", *args, "--data-dir", str(data_dir))


def _alive(data_dir) -> dict[str, int]:
    code, out = nexus("status", "--json", "--data-dir", str(data_dir))
    assert code == 0, out
    data = json.loads(out)
    counts: dict[str, int] = {}
    for r in data["roles"]:
        if r["state"] == "alive":
            counts[r["role"]] = counts.get(r["role"], 0) + 1
    return {"alive": counts, "wanted": data["counts"], "bounds": data["bounds"]}


def _wait_alive(data_dir, role: str, n: int, timeout_s: float = 30) -> dict:
    """The monitor forgets a drained instance at once (stopped) but sees a new one at its beat."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = _alive(data_dir)
        if st["alive"].get(role, 0) == n or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


# CUDA_VISIBLE_DEVICES: the devices the supervisor shows (ids 7, 6, 5, 4; nothing here runs CUDA,
# the roles' torch is a CPU build): `--devices` hands them out by index (protocol/placement.py).
ENV = {"NEXUS_SCALE_BOUNDS": "env=1:2,inferencer=1:2,trainer=0:2", "NEXUS_INFER_BASE": BASE,
       "CUDA_VISIBLE_DEVICES": "7,6,5,4"}
DEVICES = "trainer=0,1 env=2-3"  # trainer slots 0, 1 -> ids 7, 6; env slots 0, 1 -> 5, 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """`nexus up --roles env=2,trainer=2 --devices 'trainer=0,1 env=2-3'` with bounds env 1:2,
    inferencer 1:2, trainer 0:2."""
    from transport.broker import free_port

    data = tmp_path_factory.mktemp("scaling") / "d"
    up = nexus_run("up", "--detach", "--data-dir", str(data), "--nats-port", str(free_port()),
                   "--roles", "env=2,trainer=2", "--devices", DEVICES, timeout=300, **ENV)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield data
    finally:
        down = nexus_run("down", "--data-dir", str(data), timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr


def device_of(pid: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES a role process was started with (its environment, from /proc)."""
    env = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ").read().split("\0") if "=" in e)
    return env.get("CUDA_VISIBLE_DEVICES")


def devices_now(data) -> dict[str, list[str | None]]:
    out: dict[str, list[str | None]] = {}
    for r in ClusterState.read(data).roles:
        out.setdefault(r.role, []).append(device_of(r.pid))
    return out


def test_every_instance_runs_on_its_listed_device(deployment):
    """`--devices`: each trainer and env worker got one device of its list (CUDA_VISIBLE_DEVICES,
    by index of the supervisor's own), roles not listed got the supervisor's whole list unchanged."""
    got = devices_now(deployment)
    assert sorted(got["trainer"]) == ["6", "7"] and sorted(got["env"]) == ["4", "5"], got
    assert got["inferencer"] == ["7,6,5,4"] and got["master"] == ["7,6,5,4"], got


@pytest.mark.timeout(400)
def test_trainers_scaled_down_and_up_under_load_train_every_job_once(deployment):
    data = deployment
    state = ClusterState.read(data)
    st = _alive(data)
    assert st["wanted"] == {"health": 1, "monitor": 1, "master": 1, "trainer": 2, "inferencer": 1, "env": 2}
    assert st["alive"]["trainer"] == 2 and st["alive"]["env"] == 2, st
    assert st["bounds"] == {"trainer": "0:2", "inferencer": "1:2", "env": "1:2"}
    code, out = nexus("status", "--data-dir", str(data))
    assert code == 0 and "instances (alive/wanted, bounds MIN:MAX):" in out and "trainer 2/2 (0:2)" in out, out

    # Past a bound, a role that runs once: refused naming the bound, by the CLI and (asked
    # directly) by the supervisor; nothing changes.
    code, out = _scale(data, "trainer", "3")
    assert code == 2 and "trainer=3 is past its max bound 2 (NEXUS_SCALE_BOUNDS trainer=0:2)" in out, out

    async def refused():
        c = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        try:
            for req, words in [(ScaleRequest("inferencer", 3), "inferencer=3 is past its max bound 2"),
                               (ScaleRequest("master", 2), "'master' does not scale"),
                               (ScaleRequest("env", 1, drain=["env-nope00"]), "not live instances of env"),
                               (ScaleRequest("env", 2, drain=["env-nope00"]), "drains 0")]:
                with pytest.raises(NexusError, match=words):
                    await c.bus.request(Names(state.prefix).supervisor("scale"), req, Ok, timeout_s=30)
        finally:
            await c.close()

    asyncio.run(refused())
    assert _alive(data)["alive"]["env"] == 2

    cfg = tenant("scaled", schema=REACH_SCHEMA, base=BASE, seed=5, max_inflight_jobs=8)
    n_first, n_second = 6, 4

    async def trainers():
        c = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        loop = asyncio.get_running_loop()
        try:
            await c.create_tenant(cfg)
            items, jobs = [], []

            async def queue(n: int, seed0: int):
                for j in range(n):
                    job = await c.reserve(cfg.name, "sft", wait_s=60)
                    item = micro_batch(cfg, job.job, 0, seed=seed0 + j)
                    await c.queue_put(item)
                    await c.mark_ready(cfg.name, job.job)
                    items.append(item)
                    jobs.append(job)

            await queue(n_first, 0)
            # Jobs wait: zero trainers would strand them.
            code, out = await loop.run_in_executor(None, _scale, data, "trainer", "0")
            assert code == 1 and "trainer=0 refused: jobs wait for a trainer" in out, out
            # Scale in while they train: the surplus trainer trains its running jobs or hands
            # them back; scale out again and queue more.
            code, out = await loop.run_in_executor(None, _scale, data, "trainer", "1", "--reason", "test")
            assert code == 0 and "trainer: 2 -> 1; drained:" in out and "(exit 0)" in out, out
            code, out = await loop.run_in_executor(None, _scale, data, "trainer", "2")
            assert code == 0 and "trainer: 1 -> 2; ready:" in out, out
            await queue(n_second, 100)
            recs = [await c.wait_job(cfg.name, job.job, timeout_s=180) for job in jobs]
            ref = await c.latest_weights(cfg.name)
            payload, _ = await c.download_weights(ref)
            return items, recs, ref, payload
        finally:
            await c.close()

    items, recs, ref, payload = asyncio.run(trainers())
    n = n_first + n_second
    assert [r.state for r in recs] == ["cleared"] * n, [(r.state, r.reason) for r in recs]
    assert [r.trained_version for r in recs] == list(range(1, n + 1))
    assert ref.version == n
    expected = Reference(cfg)
    expected.train(items)
    assert tensors_equal(payload, expected.params()), "weights after scaling trainers differ from exactly-once"
    assert _wait_alive(data, "trainer", 2)["alive"]["trainer"] == 2


@pytest.mark.timeout(400)
def test_env_worker_drained_mid_workload_hands_it_on_and_no_job_is_lost(deployment):
    """The env worker running an RL workload is drained (`nexus scale env 1 --drain` it)
    mid-run; the other one carries it on; env back to 2."""
    data = deployment
    state = ClusterState.read(data)

    async def envs():
        c = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
        loop = asyncio.get_running_loop()
        try:
            spec = rl_spec("scaled-rl")
            spec["schedule"]["budget"]["max_episodes"] = 8
            # 32 rows a micro-batch fit one NATS message: one optimizer step per item, what
            # the audit counts (a larger one is stored as parts and trained as one step).
            spec["algorithm"]["micro_batch"] = 32
            w = await c.submit(spec)
            deadline = time.monotonic() + 120
            rec = await w.status()
            while not (rec.worker and rec.episodes >= 1) and rec.state not in ("completed", "failed"):
                assert time.monotonic() < deadline, f"the RL workload never started: {rec}"
                await asyncio.sleep(0.3)
                rec = await w.status()
            assert rec.state == "running", (rec.state, rec.message)
            drained = rec.worker
            code, out = await loop.run_in_executor(None, _scale, data, "env", "1", "--drain", drained)
            assert code == 0 and f"drained: {drained} (exit 0)" in out, out
            code, out = await loop.run_in_executor(None, _scale, data, "env", "2")
            assert code == 0 and "env: 1 -> 2; ready:" in out, out
            final = await w.wait(timeout_s=300)
            jobs = await c.jobs("scaled-rl")
            version = (await c.latest_weights("scaled-rl")).version
            return drained, final, jobs, version
        finally:
            await c.close()

    drained, final, jobs, version = asyncio.run(envs())
    assert final.state == "completed", (final.state, final.message)
    assert final.worker and final.worker != drained, final.worker
    assert final.episodes >= 8
    findings = audit_jobs(jobs, {"scaled-rl": version})
    audit = findings.tenants["scaled-rl"]
    assert findings.lost == 0, audit.lost
    assert findings.twice == 0, audit.twice
    assert audit.cleared >= 1
    st = _wait_alive(data, "env", 2)
    assert st["alive"]["env"] == 2 and st["wanted"]["env"] == 2, st


@pytest.mark.timeout(120)
def test_a_killed_extra_instance_comes_back_in_its_slot(deployment):
    """Each slot has its own restart: SIGKILL one of two env workers, the other keeps running
    and the killed one's slot gets a new instance; the wanted count is unchanged."""
    import os
    import signal

    data = deployment
    before = [r for r in ClusterState.read(data).roles if r.role == "env"]
    assert len(before) == 2, before
    victim, other = before[1], before[0]
    victim_device = device_of(victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        now = [r for r in ClusterState.read(data).roles if r.role == "env"]
        if len(now) == 2 and victim.instance not in {r.instance for r in now}:
            break
        assert time.monotonic() < deadline, f"the killed env worker was not replaced: {now}"
        time.sleep(0.3)
    assert other.instance in {r.instance for r in now}  # the other slot was not touched
    new = next(r.instance for r in now if r.instance != other.instance)
    # The new instance took its slot's device (`--devices`), the other kept its own.
    assert device_of(next(r.pid for r in now if r.instance == new)) == victim_device
    assert device_of(other.pid) != victim_device
    deadline = time.monotonic() + 60
    while True:  # the monitor: the new instance alive, the killed one not (3 s without beats)
        code, out = nexus("status", "--json", "--data-dir", str(data))
        states = {r["instance"]: r["state"] for r in json.loads(out)["roles"]} if code == 0 else {}
        if states.get(new) == "alive" and states.get(victim.instance) != "alive":
            break
        assert time.monotonic() < deadline, f"not seen: new {new} alive, {victim.instance} dead: {states}"
        time.sleep(0.5)
    assert states.get(other.instance) == "alive"
    assert json.loads(out)["counts"]["env"] == 2


@pytest.mark.timeout(300)
def test_an_inferencer_of_a_second_base_is_started_and_drained_by_its_pool(deployment, tmp_path):
    """Two bases: the default (a preset) and a registered directory (a save_pretrained copy of
    it). `nexus scale inferencer 2 --pool tiny2` starts one instance of that base (its beats
    name its pool; `nexus status` counts both pools), and `... 1 --pool tiny2` drains that
    one, not the default's. A pool that is not registered, and a pool on a role that has none,
    are refused naming what is allowed, and change nothing."""
    from models import BaseConfig, BaseModel
    from protocol.messages import Heartbeat
    from protocol.subjects import pool_name
    from protocol.wire import decode

    data = deployment
    base_dir = tmp_path / "tiny2"
    BaseModel.load(BaseConfig(source=BASE, device="cpu")).save_pretrained(base_dir)
    code, out = nexus("base", "add", "tiny2", str(base_dir), "--data-dir", str(data))
    assert code == 0, out
    other = pool_name(str(base_dir.resolve()))
    default = [r for r in ClusterState.read(data).roles if r.role == "inferencer"]
    assert len(default) == 1 and ClusterState.read(data).pools == {BASE: 1}

    code, out = _scale(data, "inferencer", "2", "--pool", "nosuch")
    assert code == 2 and "pool: 'nosuch' is no registered base" in out and "registered:tiny2" in out, out
    code, out = _scale(data, "env", "2", "--pool", "tiny2")
    assert code == 2 and "--pool: role env has no pools" in out, out

    async def over_the_bus(req):  # the supervisor refuses it too (the CLI checks first)
        state = ClusterState.read(data)
        async with AsyncClient(state.nats_url, state.prefix, timeout_s=30) as c:
            try:
                return await c.bus.request(Names(state.prefix).supervisor("scale"), req, Ok, timeout_s=30)
            except NexusError as exc:
                return exc

    got = asyncio.run(over_the_bus(ScaleRequest("env", 2, pool="tiny2")))
    assert isinstance(got, InvalidField) and got.field == "pool" and "role env has no pools" in got.message, got
    assert ClusterState.read(data).counts["inferencer"] == 1 and ClusterState.read(data).pools == {BASE: 1}

    code, out = _scale(data, "inferencer", "2", "--pool", "tiny2")
    assert code == 0 and f"inferencer: 1 -> 2 of pool {other}; ready:" in out, out
    st = ClusterState.read(data)
    assert st.pools == {BASE: 1, other: 1}, st.pools
    new = next(r.instance for r in st.roles if r.role == "inferencer" and r.instance != default[0].instance)
    code, out = nexus("status", "--data-dir", str(data))
    assert code == 0 and f"inferencers per pool: {BASE} 1, {other} 1" in out, out

    async def pools_on_beats() -> dict[str, str]:
        state = ClusterState.read(data)
        seen: dict[str, str] = {}
        async with AsyncClient(state.nats_url, state.prefix, timeout_s=30) as c:
            async def on(msg):
                hb = decode(msg.data, Heartbeat)
                seen[hb.instance] = hb.pool
            sub = await c.bus.nc.subscribe(Names(state.prefix).heartbeat_all, cb=on)
            deadline = time.monotonic() + 15
            while not {default[0].instance, new} <= set(seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await sub.unsubscribe()
        return seen

    seen = asyncio.run(pools_on_beats())
    assert seen.get(new) == other and seen.get(default[0].instance) == BASE, seen
    assert all(pool == "" for inst, pool in seen.items() if not inst.startswith("inferencer-")), seen

    code, out = _scale(data, "inferencer", "1", "--pool", "tiny2")
    assert code == 0 and f"inferencer: 2 -> 1 of pool {other}; drained: {new}" in out, out
    st = ClusterState.read(data)
    assert st.pools == {BASE: 1} and [r.instance for r in st.roles if r.role == "inferencer"] == [default[0].instance]


# Jobs kept ready behind the one the trainer trains, micro-batches (train steps) per job, and
# rows per micro-batch (enough that a step's compute outweighs the trainer's per-step overhead).
SCALER_READY, SCALER_JOB_STEPS, SCALER_ROWS = 3, 20, 16


@pytest.mark.slow  # ~2 min: its own deployment, and the scaler's 30 s window by design
@pytest.mark.timeout(300)
def test_the_scaler_adds_a_trainer_under_a_sustained_backlog_and_says_why(tmp_path):
    """NEXUS_SCALER on, trainer bounds 1:2: a priority-10 tenant's ready jobs (each weighs 4) wait
    while another of its jobs keeps the one trainer busy (one job per tenant on a trainer), past
    the scaler's 4-per-trainer backlog and 0.6 busy thresholds for its window, so the health
    manager decides trainer 1 -> 2, announces why with the signals, and the supervisor applies it."""
    from transport.broker import free_port
    from protocol.messages import ScaleDecision
    from protocol.wire import decode

    data = tmp_path / "d"
    up = nexus_run("up", "--detach", "--data-dir", str(data), "--nats-port", str(free_port()), timeout=300,
                   NEXUS_SCALER="on", NEXUS_SCALE_BOUNDS="trainer=1:2", NEXUS_INFER_BASE=BASE, NEXUS_METRICS_PORT="0")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = ClusterState.read(data)
        cfg = tenant("backlog", schema=REACH_SCHEMA, base=BASE, max_inflight_jobs=8, priority=10,
                     sft_prefetch_items=256)  # room for several ready SFT jobs at once

        async def go():
            c = await AsyncClient(state.nats_url, state.prefix, timeout_s=30).connect()
            seen: list[ScaleDecision] = []

            async def on_decision(msg):
                seen.append(decode(msg.data, ScaleDecision))

            try:
                await c.bus.nc.subscribe(Names(state.prefix).scale_decisions_all, cb=on_decision)
                await c.create_tenant(cfg)

                async def add_job(seed: int) -> None:
                    job = await c.reserve(cfg.name, "sft", wait_s=30)
                    for i in range(SCALER_JOB_STEPS):
                        await c.queue_put(micro_batch(cfg, job.job, i, b=SCALER_ROWS, seed=seed))
                    await c.mark_ready(cfg.name, job.job)

                # Keep SCALER_READY jobs ready behind the one the trainer trains (however fast
                # this machine trains them) until the scaler has decided.
                started, added = time.monotonic(), 0
                while not any(d.outcome for d in seen):
                    if time.monotonic() - started > 150:
                        _, out = await asyncio.to_thread(nexus, "top", "--json", "--data-dir", str(data))
                        raise AssertionError(f"no scale decision applied: {seen}; top: {out}")
                    if len(await c.jobs(cfg.name, ["ready"])) < SCALER_READY:
                        await add_job(added)
                        added += 1
                    else:
                        await asyncio.sleep(0.5)
                return seen, time.monotonic() - started
            finally:
                await c.close()

        seen, waited = asyncio.run(go())
        # The monitor has it too: in `nexus top` with its outcome, and on the metrics endpoint.
        deadline = time.monotonic() + 30
        while True:
            code, out = nexus("top", "--json", "--data-dir", str(data))
            view = json.loads(out) if code == 0 else {}
            shown = [d for d in view.get("decisions", []) if d["outcome"].startswith("applied")]
            if shown or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert shown and shown[0]["role"] == "trainer" and (shown[0]["from"], shown[0]["to"]) == (1, 2), view
        import urllib.request

        scrape = urllib.request.urlopen(view["metrics_url"], timeout=10).read().decode()
        assert 'nexus_scale_target{role="trainer"} 2.0' in scrape, [l for l in scrape.splitlines() if "scale" in l]
        assert waited >= 25, f"decided after {waited:.0f} s: before the 30 s window"
        first, done = seen[0], next(d for d in seen if d.outcome)
        print("decision:", first.reason, first.signals)
        assert (first.role, first.from_count, first.to_count) == ("trainer", 1, 2), first
        assert "ready_jobs_weighted per trainer" in first.reason and "trainer_busy" in first.reason, first.reason
        assert first.signals["ready_jobs_weighted"] == 4 * first.signals["ready_jobs"] >= 4, first.signals
        assert first.signals["trainer_busy"] >= 0.6 and first.signals["trainer_count"] == 1, first.signals
        assert done.outcome.startswith("applied: trainer: 1 -> 2; ready:"), done.outcome
        assert ClusterState.read(data).counts["trainer"] == 2
        assert all(d.role == "trainer" for d in seen)  # env / inferencer: min 1, nothing to do
    finally:
        down = nexus_run("down", "--data-dir", str(data), timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
