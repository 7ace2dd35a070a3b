"""The Environment Service for real: sessions over NATS, leases, isolation of a crashing session."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from protocol.errors import FailedPrecondition, InvalidField, NotFound
from sdk.client import AsyncClient


def test_sessions_reset_step_close_and_bad_input(roles):
    roles.start("env", NEXUS_ENV_PLUGINS="tests.support.crashy_env")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=10).connect()
        try:
            s = await c.env_create("builtin/reach-v0")
            assert s.spec["action_dim"] == 2 and [cam["name"] for cam in s.spec["cameras"]] == ["top", "wrist"]
            obs = await c.env_reset(s, seed=3, task="green")
            assert obs.images["top"].shape == (64, 64, 3) and obs.images["top"].dtype == np.uint8
            assert "green" in obs.instruction and obs.state.shape == (4,)
            step = await c.env_step(s, np.array([0.5, -0.5], np.float32))
            assert step.reward != 0 and not step.terminated and "success" in step.info
            with pytest.raises(InvalidField, match=r"shape \(2,\)"):
                await c.env_step(s, np.zeros(3, np.float32))
            await c.env_step(s, np.zeros(2, np.float32))  # the bad call left the session usable
            with pytest.raises(NotFound, match="unknown env id 'nope/x-v0'"):
                await c.env_create("nope/x-v0")
            with pytest.raises(NotFound, match="task"):
                await c.env_reset(s, task="purple")
            await c.env_close(s)
            with pytest.raises(NotFound, match="closed, expired or never opened"):
                await c.env_step(s, np.zeros(2, np.float32))

            # One crashing session never takes down the worker's other sessions.
            good = await c.env_create("builtin/reach-v0")
            bad = await c.env_create("test/crashy-v0")
            await c.env_reset(good, seed=1)
            await c.env_reset(bad, seed=1)
            with pytest.raises(FailedPrecondition, match="crashed and was closed.*physics blow-up"):
                await c.env_step(bad, np.array([9.0, 0.0], np.float32))
            with pytest.raises(NotFound):
                await c.env_step(bad, np.zeros(2, np.float32))
            ok = await c.env_step(good, np.zeros(2, np.float32))

            # A session whose client went away expires with its lease.
            short = await c.env_create("builtin/reach-v0", lease_s=1.0)
            await asyncio.sleep(2.5)
            with pytest.raises(NotFound):
                await c.env_reset(short)
            info = await c.info("env")
            return ok, info
        finally:
            await c.close()

    ok, info = asyncio.run(go())
    assert ok.state.shape == (4,)
    assert info.extra["expired"] >= 1 and info.extra["sessions"] == 1  # only `good` is left


def test_dataset_sample_primitive_and_bad_dataset(roles, tmp_path, libero_like):
    roles.start("env")
    fixture = libero_like

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            batch = await c.sample(str(fixture), n=4, seed=0)
            exact = await c.sample(str(fixture), indices=[0, 45, 89])
            from protocol.errors import NexusError

            with pytest.raises(NexusError, match="does not exist"):
                await c.sample(str(tmp_path / "nowhere"), n=2)
            with pytest.raises(NexusError, match="89|range|past"):
                await c.sample(str(fixture), indices=[90])
            return batch, exact, await c.info("env")
        finally:
            await c.close()

    batch, exact, info = asyncio.run(go())
    assert batch.images["observation.images.image"].shape == (4, 64, 64, 3)
    assert batch.state.shape == (4, 8) and batch.action.shape == (4, 7) and len(batch.tasks) == 4
    assert list(exact.index) == [0, 45, 89] and list(exact.episode_index) == [0, 1, 2]
    assert info.state == "ready"  # bad datasets left the worker serving
