"""Fuzzing harness for every role op and the durable spec intake (hypothesis strategies).

Shared by the default-suite test (`tests/system/test_fuzz.py`, ~1,200 cases) and the benchmark
(`bench/fuzz.py`, 10,000+). It:
  1. discovers the targets: every op each live role lists in its ``info`` reply (on
     ``<prefix>.<role>.<op>``), each instance's own ``info``, the inferencer's predict
     subject and the durable intake ``<prefix>.workloads.submit``;
  2. generates cases per target with hypothesis, in three modes:
       raw       random bytes, truncated / nested / garbage msgpack;
       envelope  ``{"kind", "v", "body"}`` maps with wrong kinds, versions, unknown keys,
                 wrong types, and forged array ext payloads;
       typed     the op's own request type, built from its dataclass type hints (invalid
                 tokens, negative / huge ints, nan / inf, arrays of odd dtypes and shapes,
                 nested Structs), and valid templates with one or two fields mutated;
  3. sends them (bounded concurrency, a timeout per request) and checks each answer: the
     op's documented reply type or an `ErrorReply` with a stable `ErrorCode`; ``internal``
     (a handler bug), no reply and an undecodable reply are collected with their input.

Generation is deterministic (a fixed hypothesis seed, no example database), so a CI failure
replays locally. Reference names known at run time (the fuzz tenant, a reserved job, an env
session, the dataset fixture) are mixed into the strings, so typed cases reach past the
"unknown tenant" checks into the handlers' real code.

The harness's parts: tests/support/fuzz_types.py (policy, targets, cases, outcomes),
fuzz_strategies.py (generation), fuzz_send.py (discovery, sending, judging), fuzz_regressions.py
(inputs that once found a bug), fuzz_report.py (the table). This module starts the deployment
under test and runs the whole pass (`fuzz`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol import ops
from protocol.subjects import Names
from tests.support.fuzz_regressions import check_regressions, concurrent_samples
from tests.support.fuzz_send import discover, rss_kib, run_plan, warm_up
from tests.support.fuzz_strategies import plan
from tests.support.fuzz_types import Context, Outcome, Target


# -- the deployment under test ---------------------------------------------------------------
ROLE_ORDER = ("health", "monitor", "master", "trainer", "inferencer", "env")
FUZZ_TENANT = "fz"


def start_roles(roles: Any) -> None:
    """Start one real process of every role (a `tests.conftest.RoleProcs`), tiny base models.

    All six at once: none needs another to become ready, and their imports overlap. Each
    instance id carries its role's name, so the shared counter cannot make two collide."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.tq_helpers import BASE

    with ThreadPoolExecutor(max_workers=len(ROLE_ORDER)) as pool:
        futures = [pool.submit(roles.start, role, **({"NEXUS_INFER_BASE": BASE} if role == "inferencer" else {}))
                   for role in ROLE_ORDER]
        for f in futures:
            f.result()  # a role that failed to start raises here, with its log


async def make_context(nats_url: str, prefix: str, dataset: Path) -> Context:
    """A live tenant with a filling job and an open env session; lazy paths warmed. ``dataset``:
    a readable LeRobot root (the session's `libero_like`)."""
    from sdk.client import AsyncClient
    from tests.support.tq_helpers import BASE, micro_batch, tenant

    cfg = tenant(FUZZ_TENANT)
    async with AsyncClient(nats_url, prefix, timeout_s=60) as c:
        await c.create_tenant(cfg)
        job = await c.reserve(cfg.name, "sft")
        await c.queue_put(micro_batch(cfg, job.job, 0))
        session = await c.env_create("builtin/reach-v0", lease_s=3600)
        await c.env_reset(session, seed=0)  # so generated steps reach the simulator
        closable = await c.env_create("builtin/reach-v0", lease_s=3600)
        # What a first real request loads (the trainer's slot, the inferencer's head), loaded
        # now, so the RSS baseline after the warm-up already holds it.
        await c.export_params(cfg.name)
        images = {cam["name"]: np.zeros((cam["height"], cam["width"], 3), np.uint8) for cam in cfg.schema["cameras"]}
        await c.predict(cfg.name, images, np.zeros(cfg.schema["state_dim"], np.float32), "pick")
    return Context(tenant=cfg.name, schema=cfg.schema, base=BASE, jobs=[job.job],
                   sessions=[session.session, closable.session],
                   roots=[str(dataset)])


@dataclass
class Run:
    targets: list[Target]
    outcomes: list[Outcome]
    rss_warm_kib: dict[str, int]
    rss_end_kib: dict[str, int]
    infos: dict[str, Any]  # role -> RoleInfo at the end (None if it did not answer)
    wall_s: float
    regressions: list[tuple[str, str]]  # (label, message) of failed regression cases
    concurrency: list[str]  # failed concurrent sample requests


async def fuzz(nats_url: str, prefix: str, procs: list[tuple[str, str, Any]], ctx: Context, cases: int,
               warmup_fraction: float, seed: int = 0) -> Run:
    """Discover, send the regression cases, generate ``cases`` (spread evenly over the targets),
    send the first ``warmup_fraction`` of each target's, read RSS, send the rest, read RSS, ask
    every role for info."""
    from transport.bus import Bus
    from protocol.errors import NexusError
    from protocol.messages import InfoRequest

    names = Names(prefix)
    # In role order, whatever order they became ready in: the plan must not depend on it.
    instances = sorted(((role, inst) for role, inst, _ in procs), key=lambda ri: ROLE_ORDER.index(ri[0]))
    pids = {role: proc.pid for role, _, proc in procs}
    bus = await Bus.connect(nats_url, name="fuzz", reconnect_forever=False, prefix=prefix)
    try:
        targets = await discover(bus, names, instances)
        per_target = math.ceil(cases / len(targets))
        warmup_per_target = max(1, int(per_target * warmup_fraction))
        planned = plan(targets, ctx, per_target, seed=seed)
        # Regressions first: they name the live job and session, which the fuzzing may close.
        regressions = await check_regressions(bus.nc, ctx, names)
        concurrency = await concurrent_samples(bus.nc, ctx, names)
        started = time.monotonic()
        await warm_up(bus.nc, targets)
        out = await run_plan(bus, names, [c for c in planned if c.index < warmup_per_target])
        rss_warm = {r: rss_kib(p) for r, p in pids.items()}
        out += await run_plan(bus, names, [c for c in planned if c.index >= warmup_per_target])
        rss_end = {r: rss_kib(p) for r, p in pids.items()}
        wall_s = time.monotonic() - started
        infos: dict[str, Any] = {}
        for role, inst in instances:
            try:
                infos[role] = await bus.call(ops.INFO.of(role), InfoRequest(), instance=inst, timeout_s=10)
            except NexusError:
                infos[role] = None
        return Run(targets, out, rss_warm, rss_end, infos, wall_s, regressions, concurrency)
    finally:
        await bus.close()
