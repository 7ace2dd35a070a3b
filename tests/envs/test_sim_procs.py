"""Simulators that cannot starve or kill their env worker (issue 25 item 1), on real processes.

Each simulator runs in a child process of the env worker (envs/simproc.py). (a) a simulator
whose process dies mid-step fails its session with an error naming the env and the exit, and
the worker's other sessions go on; (b) a simulator that hangs in a step is killed at
NEXUS_SIM_TIMEOUT_S (its process is gone), its session fails naming the timeout, and the
worker keeps beating (the health manager never declares it down); (c) a slow scene build does
not stop the worker from answering other requests and sending heartbeats meanwhile; (d) two
env workers share the sessions (create goes to a queue group).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from transport.bus import Bus
from protocol.errors import FailedPrecondition, NotFound
from protocol.messages import HealthEvent, Heartbeat
from protocol.subjects import Names
from protocol.wire import decode
from sdk.client import AsyncClient

PLUGIN = "tests.support.crashy_env"


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux /proc), zombies left out."""
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(k) for k in (task / "children").read_text().split()}
    return {k for k in kids if _state(k) not in ("Z", "X", "")}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


class _Watch:
    """The env worker's heartbeats (their arrival times) and its health events."""

    def __init__(self, names: Names, instance: str) -> None:
        self.names, self.instance = names, instance
        self.beats: list[float] = []
        self.events: list[HealthEvent] = []

    async def start(self, bus: Bus) -> None:
        async def beat(msg) -> None:
            decode(msg.data, Heartbeat)
            self.beats.append(time.monotonic())

        async def event(msg) -> None:
            self.events.append(decode(msg.data, HealthEvent))

        await bus.nc.subscribe(self.names.heartbeat("env", self.instance), cb=beat)
        await bus.nc.subscribe(self.names.health_event("env", self.instance), cb=event)

    def beats_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.beats if t0 <= t <= t1)

    def max_gap(self, t0: float, t1: float) -> float:
        ts = [t0, *[t for t in self.beats if t0 <= t <= t1], t1]
        return max(b - a for a, b in itertools.pairwise(ts))


def test_crashed_or_hung_simulator_fails_its_session_and_the_worker_goes_on(roles):
    roles.start("health")
    worker = roles.start("env", NEXUS_ENV_PLUGINS=PLUGIN, NEXUS_SIM_TIMEOUT_S="2")
    names = Names(roles.prefix)

    async def go():
        bus = await Bus.connect(roles.nats_url, name="test-sim-procs", reconnect_forever=False)
        watch = _Watch(names, worker.instance)
        await watch.start(bus)
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=20).connect()
        try:
            good = await c.env_create("builtin/reach-v0")
            await c.env_reset(good, seed=1)
            base = _children(worker.pid)
            assert len(base) == 1  # one simulator process: the session's

            # (a) the simulator's process dies mid-step.
            crashy = await c.env_create("test/crashy-v0")
            await c.env_reset(crashy, seed=1)
            with pytest.raises(FailedPrecondition, match=r"crashed and was closed: simulator test/crashy-v0 process "
                                                         r"died during step \(exit code 3\)"):
                await c.env_step(crashy, np.array([8.0, 0.0], np.float32))
            with pytest.raises(NotFound):
                await c.env_step(crashy, np.zeros(2, np.float32))
            await c.env_step(good, np.zeros(2, np.float32))  # the other session goes on

            # A simulator that raises is stopped too: the same error path, its message kept.
            crashy = await c.env_create("test/crashy-v0")
            await c.env_reset(crashy, seed=1)
            with pytest.raises(FailedPrecondition, match="crashed and was closed.*physics blow-up"):
                await c.env_step(crashy, np.array([9.0, 0.0], np.float32))

            # (b) a step that never returns: killed at the timeout, the worker keeps beating.
            hangy = await c.env_create("test/hangy-v0")
            await c.env_reset(hangy, seed=0)
            hung_pid = (_children(worker.pid) - base).pop()
            t0 = time.monotonic()
            with pytest.raises(FailedPrecondition, match=r"hung and was closed: simulator test/hangy-v0 step did not "
                                                         r"return within 2 s \(NEXUS_SIM_TIMEOUT_S\); its process was killed"):
                await c.env_step(hangy, np.array([7.0, 0.0], np.float32))
            t1 = time.monotonic()
            with pytest.raises(NotFound):
                await c.env_step(hangy, np.zeros(2, np.float32))
            # Its replacement and the other session serve at once.
            again = await c.env_create("test/hangy-v0")
            await c.env_reset(again, seed=2)
            await c.env_step(again, np.zeros(2, np.float32))
            await c.env_step(good, np.zeros(2, np.float32))
            await c.env_close(again)
            await asyncio.sleep(1.5)  # the health manager's timeout (1.2 s) past the hang
            info = await c.info("env")
            return t1 - t0, hung_pid, base, watch, t0, t1, info
        finally:
            await c.close()
            await bus.close()

    took, hung_pid, base, watch, t0, t1, info = asyncio.run(go())
    assert 2.0 <= took < 4.5
    assert _state(hung_pid) in ("", "Z")  # the hung simulator's process is gone
    assert _children(worker.pid) == base  # only `good`'s simulator is left
    assert info.state == "ready" and info.extra["sessions"] == 1
    sim = info.extra["sim"]
    assert sim["timeouts"] == 1 and sim["crashes"] == 2 and sim["procs"] == 1
    # Beating through the hang: never a gap the health manager (1.2 s) calls death.
    assert watch.beats_between(t0, t1) >= 3 and watch.max_gap(t0, t1) < 1.2
    assert [e for e in watch.events if e.event == "role_down"] == []
    assert worker.poll() is None


def test_a_slow_scene_build_does_not_hold_the_worker(roles):
    roles.start("health")
    worker = roles.start("env", NEXUS_ENV_PLUGINS=PLUGIN, NEXUS_SIM_TIMEOUT_S="20")
    names = Names(roles.prefix)

    async def go():
        bus = await Bus.connect(roles.nats_url, name="test-sim-procs", reconnect_forever=False)
        watch = _Watch(names, worker.instance)
        await watch.start(bus)
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            t0 = time.monotonic()
            slow = asyncio.create_task(c.env_create("test/slow-make-v0", make_s=4.0))
            await asyncio.sleep(0.5)
            # Meanwhile: another session from create to step, and info answered, promptly.
            s = await c.env_create("builtin/reach-v0")
            await c.env_reset(s, seed=0)
            await c.env_step(s, np.zeros(2, np.float32))
            served = time.monotonic() - t0
            waits = []
            while not slow.done():
                t = time.monotonic()
                await c.info("env")
                waits.append(time.monotonic() - t)
                await asyncio.sleep(0.2)
            made = await slow
            t1 = time.monotonic()
            obs = await c.env_reset(made, seed=0)
            return served, waits, t0, t1, watch, obs
        finally:
            await c.close()
            await bus.close()

    served, waits, t0, t1, watch, obs = asyncio.run(go())
    assert t1 - t0 >= 4.0 and obs.images["top"].shape == (64, 64, 3)
    assert served < 3.5  # the other session was served before the slow build ended
    assert len(waits) >= 3 and max(waits) < 1.0
    assert watch.beats_between(t0, t1) >= 6 and watch.max_gap(t0, t1) < 1.2
    assert [e for e in watch.events if e.event == "role_down"] == []


def test_two_env_workers_both_serve_sessions(roles):
    workers = {roles.start("env").instance, roles.start("env").instance}

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=20).connect()
        served: dict[str, int] = {}
        try:
            # create goes to the workers' queue group: each session lands on one of them. Until
            # both served one (the chance of 40 on one is 2^-39).
            for _ in range(40):
                s = await c.env_create("builtin/reach-v0", cameras=["top"], image_size=32)
                await c.env_reset(s, seed=len(served))
                step = await c.env_step(s, np.zeros(2, np.float32))
                assert step.images["top"].shape == (32, 32, 3)
                await c.env_close(s)
                served[s.worker] = served.get(s.worker, 0) + 1
                if len(served) == 2:
                    break
            return served
        finally:
            await c.close()

    served = asyncio.run(go())
    assert set(served) == workers, served


def test_pool_bound_errors_and_loop_stay_free_without_a_worker():
    """The pool itself (as a workflow run outside an env worker uses it): a simulator's own
    refusal crosses the process boundary as the same class and leaves the env usable; the
    bound refuses, naming its setting; the event loop keeps running through a slow make."""
    import tests.support.crashy_env  # noqa: F401 - registers the test envs here (the children import it by name)
    from envs import simproc
    from envs.errors import ActionError, ConfigError, UnknownEnvError, UnknownTaskError
    from protocol.errors import Busy

    async def go():
        pool = simproc.SimPool(timeout_s=10.0, procs_max=2)
        ticks: list[float] = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        tick = asyncio.create_task(ticker())
        try:
            t0 = time.monotonic()
            slow = await pool.make("test/slow-make-v0", {"make_s": 2.0})
            t1 = time.monotonic()
            env = await pool.make("builtin/reach-v0", {"cameras": ["top"]})
            assert env.spec.camera_names == ("top",) and env.spec.action_dim == 2
            with pytest.raises(Busy, match="NEXUS_SIM_PROCS_MAX=2"):
                await pool.make("builtin/reach-v0")
            with pytest.raises(UnknownEnvError, match="unknown env id 'nope/x-v0'"):
                await pool.make("nope/x-v0")
            obs, info = await env.reset(seed=0, task="blue")
            assert obs.images["top"].dtype == np.uint8 and info["task"] == "blue"
            with pytest.raises(ActionError, match=r"shape \(2,\)"):
                await env.step(np.zeros(5))
            with pytest.raises(UnknownTaskError, match="purple"):
                await env.reset(task="purple")
            _, reward, _, _, _ = await env.step(np.zeros(2))  # refusals left it usable
            await slow.close()
            await env.close()
            with pytest.raises(ConfigError, match=r"unknown option\(s\) \['bogus'\]"):
                await pool.make("builtin/reach-v0", {"bogus": 1})
            crashy = await pool.make("test/crashy-v0")
            await crashy.reset(seed=0)
            pid = crashy.pid
            with pytest.raises(simproc.SimCrashed, match=r"died during step \(exit code 3\)"):
                await crashy.step(np.array([8.0, 0.0]))
            with pytest.raises(simproc.SimCrashed, match="process is gone"):
                await crashy.step(np.zeros(2))
            return t1 - t0, ticks, t0, t1, pool.info(), pid, reward
        finally:
            tick.cancel()

    made_s, ticks, t0, t1, info, pid, reward = asyncio.run(go())
    assert made_s >= 2.0
    during = [t for t in ticks if t0 <= t <= t1]
    gaps = [b - a for a, b in itertools.pairwise([t0, *during, t1])]
    assert len(during) >= 20 and max(gaps) < 0.5  # the loop ran all through the scene build
    assert info["procs"] == 0 and info["crashes"] == 1 and info["started"] == 4
    assert _state(pid) in ("", "Z") and isinstance(reward, float)


def test_a_workflows_dying_simulator_fails_its_episode_and_is_replaced(roles):
    """Eval workloads (the workflow path, through the services): an episode whose simulator
    process dies counts as a failure and the env is replaced by a new process; a simulator that
    dies in every episode fails its workload after SIM_REPLACE failures in a row, naming it."""
    from protocol.messages import WorkflowSpec
    from protocol.policy import SIM_REPLACE
    from tests.workflows.test_workflows import reach_tenant, run_workflow

    roles.start("master")
    worker = roles.start("env", NEXUS_ENV_PLUGINS=PLUGIN)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(reach_tenant("sim-t", "mlp"))
            once = await run_workflow(c, WorkflowSpec(
                workload="w-once", tenant="sim-t", kind="eval", env_id="test/dying-v0", eval_version=0,
                eval_episodes=4, eval_seed=10, env_options={"die_seeds": [11], "die_at_step": 2}))
            always = await run_workflow(c, WorkflowSpec(
                workload="w-always", tenant="sim-t", kind="eval", env_id="test/dying-v0", eval_version=0,
                eval_episodes=20, env_options={"die_at_step": 2}))
            return once[-1], always[-1], await c.info("env")
        finally:
            await c.close()

    once, always, info = asyncio.run(go())
    # Episode 1 (seed 11) died at its second step: a failure; the other three ran on its replacement.
    assert once.state != "failed", once.message
    assert once.metrics["episodes"] == 4.0 and once.metrics["success_rate"] <= 0.75
    assert always.state == "failed"
    assert (f"{SIM_REPLACE.attempts + 1} simulators of test/dying-v0 failed in a row (policy sim_replace); the last: "
            "simulator test/dying-v0 process died during step (exit code 3)") in always.message, always.message
    sim = info.extra["sim"]
    assert sim["crashes"] == 1 + SIM_REPLACE.attempts + 1 and sim["procs"] == 0
    assert info.state == "ready" and worker.poll() is None
