"""Learning guarded through the services in the default suite (issue 25 item 6).

`tests/system/test_learning_short.py` guards the math in one process; this runs the same short SFT as a
workload on real roles (health, master, trainer, env worker, inferencer): the env worker records
the scripted expert's DART demos of builtin/reach-v0 as a LeRobot dataset and queues
micro-batches, the trainer trains the tenant's head on the frozen tiny base and exports, and the
workload's closing evaluation (deterministic actions, held-out reset seeds, through the
inferencer) must succeed at least 80 % of the time. The slow-marked
`tests/system/test_learning.py::test_sft_then_pinned_eval_through_the_services` is the longer run.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from sdk.client import AsyncClient
from tests.system.test_learning import HEAD
from tests.master.test_workloads import BASE_SPEC


@pytest.mark.timeout(1200)  # a few minutes of CPU; a loaded host stretches the wall time
def test_short_sft_through_the_services_reaches_80_percent(roles):
    for role in ("health", "master", "trainer", "env"):
        roles.start(role)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")
    sft = copy.deepcopy(BASE_SPEC)
    # test_learning_short's data (200 DART demos, lr 3e-3, 20k sampled rows) in steps of 32 rows:
    # a micro-batch is one training-queue message, and 128 rows of two 64x64 cameras are not.
    sft.update(tenant="guard-sft", task="sft", action_module=HEAD,
               algorithm={"lr": 3e-3, "batch_size": 32, "steps": 640, "warmup_steps": 80, "items_per_job": 16},
               eval={"version": "latest", "episodes": 40, "seed": 20000})
    sft["env"]["demos"] = {"episodes": 200, "seed": 0, "noise": 0.5}

    async def go():
        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            return await (await c.submit(sft)).wait(timeout_s=1100)

    rec = asyncio.run(go())
    assert rec.state == "completed", (rec.state, rec.message)
    assert rec.step == 640, rec
    assert rec.metrics["eval_success_rate"] >= 0.8, rec.metrics
