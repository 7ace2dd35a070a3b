"""The trainer's loop (actors/trainer/train_loop.py) sees its trainer only through `LoopHost`.

In-process, no NATS: the protocol lists exactly what the loop touches, `Trainer` provides all
of it, and a fake host of just those members runs a group of jobs to the end and drains.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from actors.trainer import train_loop
from actors.trainer.train_loop import LoopHost, TrainLoop, Work
from protocol.messages import JobRecord, QueuePutRequest


def _members() -> set[str]:
    return {n for n in vars(LoopHost) if not n.startswith("_")} | set(LoopHost.__annotations__)


def test_the_protocol_lists_exactly_what_the_loop_uses():
    tree = ast.parse(Path(train_loop.__file__).read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainLoop")
    used = set()
    for node in ast.walk(loop):
        # `self.t.X` and `t.X` (the methods' local alias of self.t)
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "t") or (
                    isinstance(v, ast.Attribute) and v.attr == "t" and isinstance(v.value, ast.Name)
                    and v.value.id == "self"):
                used.add(node.attr)
    assert used == _members()


def test_the_trainer_is_a_loop_host(tmp_path):
    from actors.runtime import RoleConfig
    from actors.trainer.trainer import Trainer, TrainerConfig

    trainer = Trainer(RoleConfig(data_dir=tmp_path), TrainerConfig())
    for name in _members():
        assert hasattr(trainer, name), name
        want = getattr(LoopHost, name, None)
        if inspect.isfunction(want):
            assert inspect.iscoroutinefunction(getattr(Trainer, name)) == inspect.iscoroutinefunction(want), name
    assert isinstance(trainer.loop, TrainLoop) and trainer.loop.group_max == trainer.tcfg.group_max


def _job(tenant: str, items: int) -> JobRecord:
    return JobRecord(tenant=tenant, job=f"{tenant}-j", task="sft", state="leased", created_at=0.0,
                     updated_at=0.0, items=items)


def _item(job: JobRecord, seq: int) -> QueuePutRequest:
    return QueuePutRequest(tenant=job.tenant, job=job.job, seq=seq, images={}, state=np.zeros((1, 1), np.float32),
                           instructions=["x"], actions=np.zeros((1, 1, 1), np.float32))


class FakeHost:
    """`LoopHost` and nothing else: two jobs in one lease, one micro-batch trained per step."""

    def __init__(self) -> None:
        self.compute = asyncio.Lock()
        self.lost_jobs: set[str] = set()
        self.log = SimpleNamespace(warning=lambda *a, **k: None, error=lambda *a, **k: None)
        self.stop = asyncio.Event()
        self.leases = [[_job("a", 2), _job("b", 3)]]
        self.held: set[str] = set()
        self.finished: list[str] = []
        self.steps: list[list[str]] = []

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def drain_overdue(self) -> bool:
        return False

    async def renew_loop(self) -> None:
        await asyncio.Event().wait()

    def hold(self, job: JobRecord) -> None:
        self.held.add(job.job)

    def unhold(self, job_id: str) -> None:
        self.held.discard(job_id)

    async def lease_jobs(self, max_jobs: int) -> list[JobRecord]:
        return self.leases.pop(0)[:max_jobs] if self.leases else []

    async def release(self, jobs: list[JobRecord], reason: str) -> None:
        raise AssertionError(f"nothing is released here: {reason}")

    def fault_point(self, point: str) -> None:
        pass

    def stage(self, job: JobRecord, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    async def slot_for(self, job: JobRecord):
        return SimpleNamespace(applied=OrderedDict())

    async def read_items(self, job: JobRecord) -> list[QueuePutRequest]:
        return [_item(job, i) for i in range(job.items)]

    async def reload_slot(self, tenant: str) -> None:
        raise AssertionError(f"no slot of {tenant} is dropped here")

    def trim_slots(self, keep: set[str]) -> None:
        pass

    async def train_step(self, group: list[Work]) -> None:
        self.steps.append(sorted(w.tenant for w in group))
        for w in group:
            w.cursor += 1
            w.losses.append(1.0)

    async def finish(self, w: Work) -> None:
        self.finished.append(w.job.job)
        self.unhold(w.job.job)
        if len(self.finished) == 2:
            self.stop.set()

    async def fail(self, job: JobRecord, reason: str) -> None:
        raise AssertionError(f"job {job.job} failed: {reason}")

    def count_lost(self, job: JobRecord, why: str) -> None:
        raise AssertionError(why)


def test_a_fake_host_runs_a_group_to_the_end():
    async def main() -> tuple[FakeHost, TrainLoop]:
        host = FakeHost()
        loop = TrainLoop(host, group_max=4, idle_poll_s=0.05, cohort_wait_s=1.0)
        await asyncio.wait_for(loop.run(), timeout=10)
        return host, loop

    host, loop = asyncio.run(main())
    # Leased together, so they share every step; a leaves after its 2, b trains its third alone.
    assert host.steps == [["a", "b"], ["a", "b"], ["b"]]
    assert sorted(host.finished) == ["a-j", "b-j"] and not host.held
    assert loop.steps == 3 and not loop.jobs and not loop.running
