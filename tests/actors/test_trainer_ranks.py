"""The trainer over N ranks on real role processes (issue 31 item 1; actors/trainer/ranks.py).

(a) A trainer of 2 gloo ranks trains an SFT workload to the same weights as a trainer of one
process on the same spec (within the data-parallel tolerance of tests/models/test_data_parallel.py),
its info names the ranks and their steps; (b) a killed rank takes its trainer down with the
rank-lost status, and a new trainer finishes the workload with every step applied once.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time

import pytest

from actors.trainer.trainer import EXIT_RANK_LOST
from sdk.client import AsyncClient
from tests.master.test_workloads import sft_spec

# tests/models/test_data_parallel.py's bound, and why: a rank's half-size matmuls take other
# BLAS kernels; AdamW carries their rounding through the steps.
TOL = 5e-5
STEPS = 12


def _spec(tenant: str, steps: int = STEPS) -> dict:
    spec = sft_spec(tenant, steps=steps)
    spec["algorithm"] = {**spec["algorithm"], "items_per_job": 4}
    spec["seed"] = 7
    return spec


async def _train(roles, spec: dict, timeout_s: float = 300) -> tuple[object, dict]:
    from safetensors.torch import load as st_load

    async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
        rec = await (await c.submit(spec)).wait(timeout_s=timeout_s)
        assert rec.state == "completed", (rec.state, rec.message)
        ref = await c.latest_weights(spec["tenant"])
        payload, _ = await c.download_weights(ref)
        return rec, st_load(payload)


async def _info(roles, instance: str):
    async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=30) as c:
        return await c.info("trainer", instance)


def _stop(roles, proc) -> None:
    proc.send_signal(signal.SIGTERM) if hasattr(proc, "send_signal") else os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead child nobody has reaped yet is gone for this purpose)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pids(info) -> list[int]:
    return list(info.extra["ranks"]["pids"])


@pytest.mark.timeout(600)
def test_two_ranks_train_as_one_process_does(roles):
    for role in ("health", "master", "env"):
        roles.start(role)
    one = roles.start("trainer")
    rec1, w1 = asyncio.run(_train(roles, _spec("dp-one")))
    assert rec1.state == "completed" and rec1.step == STEPS, (rec1.state, rec1.message)
    _stop(roles, one)

    two = roles.start("trainer", NEXUS_TRAINER_RANKS="2")
    rec2, w2 = asyncio.run(_train(roles, _spec("dp-two")))
    assert rec2.state == "completed" and rec2.step == STEPS, (rec2.state, rec2.message)
    info = asyncio.run(_info(roles, two.instance))
    ranks = info.extra["ranks"]
    assert ranks["world"] == 2 and ranks["steps"] >= STEPS and all(ranks["alive"]), ranks
    assert ranks["resends"] == 0, ranks  # the mirrors never fell out of step
    assert sorted(w1) == sorted(w2)
    worst = {}
    for k in w1:
        a, b = w1[k].double(), w2[k].double()
        worst[k] = float((a - b).abs().max() / max(a.abs().max(), 1e-12))
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert info.extra["jobs_done"] >= STEPS // 4  # every job of the workload trained over both ranks

    # Rank 0 changes the slot between steps (an earlier version loaded into it, committed): the
    # next workload's steps train on it over both ranks (the rebuilt slot goes to the rank whole;
    # a slot changed in place is found by its digest: the test below).
    async def reload_and_train():
        from transport.weights import weights_name

        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            await c.load_weights("dp-two", weights_name("dp-two", 4))
            more = _spec("dp-two")  # the same config: the same slot object, changed in place
            return await (await c.submit(more)).wait(timeout_s=300)

    rec3 = asyncio.run(reload_and_train())
    assert rec3.state == "completed", (rec3.state, rec3.message)
    ranks = asyncio.run(_info(roles, two.instance)).extra["ranks"]
    assert ranks["steps"] >= 2 * STEPS and all(ranks["alive"]), ranks
    _stop(roles, two)
    assert two.poll() == 0, "the drained trainer (and its rank) exit 0"


@pytest.mark.slow  # ~45 s; the default suite keeps the equivalence and the in-place resend
@pytest.mark.timeout(600)
def test_a_killed_rank_takes_its_trainer_down_and_the_next_one_finishes(roles):
    for role in ("health", "master", "env"):
        roles.start(role)
    trainer = roles.start("trainer", NEXUS_TRAINER_RANKS="2")
    [worker] = _worker_pids(asyncio.run(_info(roles, trainer.instance)))
    spec = _spec("dp-kill", steps=40)

    async def kill_mid_way():
        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            wl = await c.submit(spec)
            deadline = time.monotonic() + 240
            while (await c.workload(wl.id)).step < 4:  # some steps in, then the rank dies
                assert time.monotonic() < deadline, "no training progress"
                await asyncio.sleep(0.2)
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while trainer.poll() is None:
                assert time.monotonic() < deadline, "the trainer outlived its rank"
                await asyncio.sleep(0.2)
            return wl.id, trainer.poll()

    async def finish(workload: str):
        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            deadline = time.monotonic() + 300
            while (rec := await c.workload(workload)).state not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline, "the workload did not finish on the next trainer"
                await asyncio.sleep(0.5)
            return rec, await c.jobs(spec["tenant"])

    workload, status = asyncio.run(kill_mid_way())
    second = roles.start("trainer", NEXUS_TRAINER_RANKS="2")  # what the supervisor does after the exit
    rec, jobs = asyncio.run(finish(workload))
    # And the other way round: a SIGKILLed trainer takes its ranks with it (PR_SET_PDEATHSIG).
    [worker2] = _worker_pids(asyncio.run(_info(roles, second.instance)))
    os.kill(second.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while _running(worker2):
        assert time.monotonic() < deadline, "a rank outlived its SIGKILLed trainer"
        time.sleep(0.2)
    assert status == EXIT_RANK_LOST, status
    assert rec.state == "completed" and rec.step == 40, (rec.state, rec.message, rec.step)
    log = io.open(roles.data_dir / f"{trainer.instance}.log", errors="replace").read()
    assert "a trainer rank was lost; exiting" in log, log[-3000:]
    assert all(j.state == "cleared" for j in jobs), [(j.job, j.state) for j in jobs]


def test_rank_refusals_name_the_setting(monkeypatch):
    from protocol.settings import TrainerSettings

    monkeypatch.setenv("NEXUS_TRAINER_RANKS", "0")
    with pytest.raises(Exception, match="NEXUS_TRAINER_RANKS"):
        TrainerSettings.from_env()


def test_more_ranks_than_cuda_devices_is_refused_at_start(nats_url, layout, tmp_path):
    import subprocess
    import sys

    from tests.conftest import python_env

    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "actors.run", "trainer", "--nats-url", nats_url, "--prefix", layout.prefix,
             "--data-dir", str(tmp_path), "--instance", "t-ranks"],
            env=python_env(NEXUS_TRAINER_RANKS="2", NEXUS_TRAINER_DEVICE="cuda", CUDA_VISIBLE_DEVICES=""),
            stdout=out, stderr=subprocess.STDOUT, timeout=120)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0, text[-2000:]
    assert "NEXUS_TRAINER_RANKS=2 needs a CUDA device per rank; this trainer sees 0" in text, text[-2000:]


def _item(schema, rows: int, seed: int):
    import numpy as np

    from protocol.messages import QueuePutRequest

    rng = np.random.default_rng(seed)
    return QueuePutRequest(
        tenant="inplace", job="j", seq=seed,
        images={c.name: rng.integers(0, 256, (rows, c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras},
        state=rng.standard_normal((rows, schema.state_dim)).astype(np.float32),
        instructions=["pick up the cube"] * rows,
        actions=rng.standard_normal((rows, schema.action_horizon, schema.action_dim)).astype(np.float32))


@pytest.mark.timeout(300)
def test_a_slot_changed_in_place_between_steps_is_sent_again():
    """Rank 0 and one real rank process, no NATS: after two steps rank 0's slot is changed in
    place (as a weights load does); the next step finds the mirror out of step by its digest,
    sends the slot again, and the run still equals one process making the same change."""
    import torch
    import torch.distributed as dist

    from actors.trainer.step import item_to_batch
    from actors.trainer.ranks import Entry, RankGroup, RankSpec
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot, train_step
    from models.testing import libero_schema
    from protocol.messages import TenantConfig

    base = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    schema = libero_schema()
    cfg = TenantConfig(name="inplace", base="tiny-qwen3-vl", schema=schema.to_dict(), head="mlp",
                       head_params={"width": 32}, optim={"lr": 3e-3}, seed=5)

    def slot() -> TenantSlot:
        return TenantSlot.create("inplace", TenantSchema.from_dict(cfg.schema), base, head_kind="mlp",
                                 head_options={"width": 32}, optim=OptimConfig(lr=3e-3), seed=5)

    def change(s: TenantSlot) -> None:
        with torch.no_grad():
            next(s.head.parameters()).mul_(0.5)

    ref, dp = slot(), slot()
    group = RankGroup(RankSpec(world=2, device="cpu", timeout_s=120))
    group.spawn()
    try:
        group.join()
        for step in range(4):
            if step == 2:
                change(ref)
                change(dp)
            item = _item(schema, 3, step)
            train_step(base, [(ref, item_to_batch(ref, item))])
            group.step("tiny-qwen3-vl", {"image_size": 64}, base,
                       [Entry("inplace", dp, cfg, item, item_to_batch(dp, item))], grouped=True)
        info = group.info()
    finally:
        group.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert info["steps"] == 4 and info["resends"] == 1, info
    assert [p.returncode for p in group.procs] == [0]
    for (name, a), (_, b) in zip(ref.named_trainable(), dp.named_trainable()):
        assert float((a - b).abs().max()) <= TOL * max(float(a.abs().max()), 1e-12), name


@pytest.mark.parametrize("argv, needle", [(["--ranks", "0"], "each in 1..64"), (["--ranks", "1,x"], "comma-separated"),
                                          (["--steps", "0"], "--steps 0: must be >= 1")])
def test_the_ranks_benchmark_refuses_bad_arguments_before_starting(argv, needle, capsys):
    from bench import trainer_ranks

    with pytest.raises(SystemExit) as exc:
        trainer_ranks.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err
