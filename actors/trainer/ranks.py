"""The trainer over N ranks: one training service whose grouped steps run data-parallel.

    ranks = RankGroup(RankSpec(world=2, device="cpu", timeout_s=300), log)
    ranks.start()                                   # ranks 1..N-1 as child processes
    results = ranks.step(source, base, entries)     # one grouped step over every rank
    ranks.close()                                   # the workers exit 0

Rank 0 is the role process: the only rank that talks to NATS, holds leases, commits and
exports (exactly-once is untouched: one process commits, whatever N is). Ranks 1..N-1
(`python -m actors.trainer.rank`) are its children, killed with it (PR_SET_PDEATHSIG), and
hold mirrors of the tenants' slots. Each step rank 0 broadcasts a *plan* (msgpack through
`protocol.codec`, one uint8 tensor after its length): the base, and per tenant its raw queued
micro-batch (each rank canonicalises it and keeps its own rows, `models.parallel.shard`), a
digest of the slot (the float64 sum of its trainable tensors, its step and version), and,
where rank 0 has not sent this slot object before, the slot itself (its `TenantConfig` and
checkpoint bytes: head, adapter, AdamW moments, counters, RNG). Every rank then answers one
small collective: whether its mirror matches the digest. A mismatch (rank 0 changed a slot
between steps: a restore, `load_weights`) makes rank 0 send every slot of the step again
once; then every rank calls `models.parallel.train_step_dp`, which keeps the slots equal
(same reduced gradients, same AdamW step). A step that failed on any rank fails on every rank
with nothing changed (`DataParallelStepError`), so the trainer's culprit search (tenant by
tenant) runs over the ranks too.

A lost rank is a lost trainer: a collective that raises anything else (a rank died: its
socket closed; a rank hung past ``timeout_s``) raises `RankLost`, and the trainer exits
non-zero; the supervisor starts a new one and the jobs resume from their committed
checkpoints, as after a SIGKILL (docs/data_parallel.md).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Collection, Sequence

from protocol.codec import packb, unpackb

PLAN_STEP = "step"
PLAN_EXIT = "exit"
# The check collective's answers (MAX over the ranks): in step; out of step (a resend fixes
# it); failed (a rank could not take part: its message is in its log).
IN_STEP, OUT_OF_STEP, FAILED = 0, 1, 2
# A plan's size bound: a step's raw micro-batches plus the slots sent with it.
MAX_PLAN_BYTES = 1 << 31
_PR_SET_PDEATHSIG = 1
# How long `close` waits for the workers to exit after the exit plan.
CLOSE_WAIT_S = 10.0


class RankLost(RuntimeError):
    """A collective failed for a reason other than a step's own error: a rank died or hung.
    The trainer cannot go on with fewer ranks (its communicator is broken): it exits."""


class RankStepRefused(RuntimeError):
    """A rank could not take part in a step even after every slot was sent again (its log says
    why): the step is not taken anywhere; the trainer fails it as a step error."""


@dataclass(frozen=True)
class RankSpec:
    world: int
    device: str  # rank 0's torch device; rank r takes cuda:r when it is CUDA
    timeout_s: float = 300.0
    port: int = 0  # the rendezvous port on 127.0.0.1 (0: a free one)


@dataclass
class Entry:
    """One tenant of a step, as rank 0 holds it."""

    name: str
    slot: Any  # models.TenantSlot
    config: Any  # protocol.messages.TenantConfig
    item: Any  # protocol.messages.QueuePutRequest: the raw micro-batch
    batch: Any  # models.TenantBatch: rank 0's canonical batch of the same item


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r of the trainer's visible devices on CUDA, the CPU otherwise."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def backend_for(device: str) -> str:
    """gloo for the plans (CPU tensors) everywhere; NCCL for the gradient buffer on CUDA."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def slot_digest(slot: Any) -> list[float]:
    """What two copies of a slot must agree on before a step: the float64 sum of its trainable
    tensors and of their AdamW moments, its step and its version (bit-equal tensors give equal
    sums; a restore or a weights load on one side does not)."""
    import torch

    with torch.no_grad():
        params = [p for _, p in slot.named_trainable()]
        sums = [p.detach().double().sum() for p in params]
        for st in slot.optimizer.state.values():
            sums += [v.detach().double().sum() for k, v in st.items() if torch.is_tensor(v) and k != "step"]
        total = float(torch.stack(sums).sum().cpu()) if sums else 0.0
    return [total, float(slot.step_count), float(slot.policy_version)]


def base_digest(base: Any) -> float:
    """The float64 sum of a base's weights: every rank must hold the same frozen base."""
    import torch

    with torch.no_grad():
        return float(torch.stack([p.detach().double().sum() for p in base.core.parameters()]).sum().cpu())


# -- the plan's transport: length, then payload (uint8), broadcast from rank 0 --------------
def send_plan(plan: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    data = packb(plan)
    if len(data) > MAX_PLAN_BYTES:
        raise RankStepRefused(f"a step's plan is {len(data)} bytes, over {MAX_PLAN_BYTES}: fewer or smaller "
                              "micro-batches per step")
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)


def recv_plan() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 < n <= MAX_PLAN_BYTES:
        raise RankLost(f"plan of {n} bytes announced")
    buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return unpackb(buf.numpy().tobytes())


def check(answer: int) -> int:
    """Every rank's answer to a plan; the worst one (MAX) comes back to all."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([answer], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class RankGroup:
    """Rank 0's side: starts the workers, sends plans, runs its share of every step."""

    spec: RankSpec
    log: Any = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    # slot name -> id() of the slot object last sent whole (a rebuilt slot is a new object).
    sent: dict[str, int] = field(default_factory=dict)
    bases: dict[str, float] = field(default_factory=dict)  # base source -> digest sent
    resident: frozenset[str] = frozenset()  # the slot names the workers were last told to keep
    steps: int = 0
    resends: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    started: bool = False

    def spawn(self) -> None:
        """Start ranks 1..N-1 (on the event loop's thread: PR_SET_PDEATHSIG follows the thread
        that forked, and a pool thread may end before the trainer does)."""
        from transport.broker import free_port

        port = self.spec.port or free_port()
        self.spec = RankSpec(self.spec.world, self.spec.device, self.spec.timeout_s, port)
        for rank in range(1, self.spec.world):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "actors.trainer.rank", "--rank", str(rank), "--world", str(self.spec.world),
                 "--port", str(port), "--device", rank_device(self.spec.device, rank),
                 "--timeout-s", str(self.spec.timeout_s)],
                preexec_fn=_die_with_parent, env=os.environ.copy()))

    def join(self) -> None:
        """Rank 0 joins the group (blocking: waits for every worker, up to the timeout)."""
        import torch.distributed as dist

        dist.init_process_group(backend_for(self.spec.device), init_method=f"tcp://127.0.0.1:{self.spec.port}",
                                rank=0, world_size=self.spec.world, timeout=timedelta(seconds=self.spec.timeout_s))
        self.started = True
        self._log("info", "trainer ranks up", world=self.spec.world, pids=[p.pid for p in self.procs])

    def step(self, source: str, base_cfg: dict[str, Any], base: Any, entries: Sequence[Entry],
             grouped: bool, resident: Collection[str] = ()) -> list[Any]:
        """One grouped step of ``entries`` over every rank; the whole batch's results.

        Raises `DataParallelStepError` (the step failed on some rank; nothing changed anywhere),
        `RankStepRefused` (a rank could not take part), `RankLost` (a collective broke)."""
        from models.parallel import DataParallelStepError, shard, train_step_dp
        from protocol.wire import encode

        t0 = time.perf_counter()
        # Built before any collective: a local error here fails the step on rank 0 alone, while
        # the workers still wait for a plan.
        plan: dict[str, Any] = {"op": PLAN_STEP, "base": source, "base_cfg": base_cfg, "grouped": grouped,
                                "tenants": []}
        if source not in self.bases:
            self.bases[source] = base_digest(base)
        plan["base_digest"] = self.bases[source]
        keep = frozenset(resident) | {e.name for e in entries}
        if keep != self.resident:  # the workers drop the mirrors of slots rank 0 dropped
            plan["resident"] = sorted(keep)
            self.resident = keep
            self.sent = {n: i for n, i in self.sent.items() if n in keep}
        for e in entries:
            whole = self.sent.get(e.name) != id(e.slot)
            plan["tenants"].append({"name": e.name, "digest": slot_digest(e.slot), "item": encode(e.item),
                                    "slot": _slot_state(e) if whole else None})
        answer = _collective(lambda: (send_plan(plan), check(IN_STEP))[1])
        if answer == OUT_OF_STEP:
            self.resends += 1
            self._log("warning", "a rank's slot mirror was out of step; sending the step's slots again",
                      tenants=[e.name for e in entries])
            for t, e in zip(plan["tenants"], entries):
                t["slot"] = _slot_state(e)
            answer = _collective(lambda: (send_plan(plan), check(IN_STEP))[1])
        if answer != IN_STEP:
            for e in entries:
                self.sent.pop(e.name, None)
            raise RankStepRefused("a trainer rank could not take part in the step (its log says why); "
                                  "no step was taken")
        for e in entries:
            self.sent[e.name] = id(e.slot)
        t1 = time.perf_counter()
        timings: dict[str, float] = {}
        try:
            results = train_step_dp(base, shard([(e.slot, e.batch) for e in entries], 0, self.spec.world),
                                    grouped=grouped, timings=timings)
        except DataParallelStepError:
            raise
        except Exception as exc:  # a collective broke mid-step: the ranks may differ now
            raise RankLost(f"a trainer rank was lost mid-step: {type(exc).__name__}: {exc}") from exc
        self.steps += 1
        self.timings = {"plan_s": t1 - t0, **timings}
        return results

    def close(self) -> None:
        """The workers exit 0 (a drain); the group is torn down."""
        import torch.distributed as dist

        if self.started:
            try:
                send_plan({"op": PLAN_EXIT})
            except Exception as exc:  # noqa: BLE001 - a worker already gone: nothing to tell
                self._log("warning", "could not tell the trainer ranks to exit", error=str(exc))
            with _suppress():
                dist.destroy_process_group()
            self.started = False
        for p in self.procs:
            try:
                p.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=CLOSE_WAIT_S)

    def info(self) -> dict[str, Any]:
        return {"world": self.spec.world, "steps": self.steps, "resends": self.resends,
                "pids": [p.pid for p in self.procs], "alive": [p.poll() is None for p in self.procs],
                "last_step": {k: round(v, 6) for k, v in self.timings.items()}}

    def _log(self, level: str, event: str, **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)


def _slot_state(e: Entry) -> dict[str, Any]:
    from protocol.wire import encode

    return {"config": encode(e.config), "checkpoint": e.slot.checkpoint()}


def _collective(fn: Any) -> Any:
    """A collective of the plan protocol; any failure of it is a lost rank."""
    try:
        return fn()
    except RankStepRefused:
        raise
    except Exception as exc:  # gloo/NCCL: a rank died (its socket closed) or hung (the timeout)
        raise RankLost(f"a trainer rank was lost: {type(exc).__name__}: {exc}") from exc


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return True
