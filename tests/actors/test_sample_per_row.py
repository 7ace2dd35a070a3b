"""`sample` is per row: requests of one tenant and version that share a group each get what they
asked for, the mean action (sample=False) or a sampled one with its log-prob (sample=True).
In-process on the inferencer's group path, and for real through a running inferencer."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
import torch

from actors.inferencer.batching import Pending
from actors.inferencer.inferencer import Inferencer
from models import BaseConfig, BaseModel, Observation, TenantSchema, TenantSlot
from models.group import predict as predict_alone
from protocol.messages import PredictReply
from sdk.client import AsyncClient
from tests.actors.test_inference_group_path import _inferencer, _request
from tests.support.tq_helpers import BASE, CALVIN_SCHEMA, LIBERO_SCHEMA, tenant


def test_gaussian_head_act_takes_one_flag_per_row():
    torch.manual_seed(0)
    base = BaseModel.load(BaseConfig(source=BASE, device="cpu"))
    slot = TenantSlot.create("g", TenantSchema.from_dict(CALVIN_SCHEMA), base, head_kind="gaussian", seed=2)
    reqs = [_request("g", CALVIN_SCHEMA, seed=0) for _ in range(4)]
    vla = slot.preprocessor([Observation(images=r.images, state=r.state, instruction=r.instruction) for r in reqs])
    with torch.inference_mode():
        feats = base.encode(vla, inference=True)
        mean, _, _ = slot.head.act(feats, vla, torch.Generator().manual_seed(0), deterministic=True)
        mixed, log_prob, _ = slot.head.act(feats, vla, torch.Generator().manual_seed(0),
                                           deterministic=[True, False, True, False])
        lp_check, _, _ = slot.head.evaluate_actions(feats, vla, mixed)
        with pytest.raises(ValueError, match="2 flags for 4 rows"):
            slot.head.act(feats, vla, torch.Generator(), deterministic=[True, False])
    # Same observation in every row: the deterministic rows are the mean, the sampled ones not.
    assert torch.equal(mixed[0], mean[0]) and torch.equal(mixed[2], mean[2])
    assert not torch.allclose(mixed[1], mean[1]) and not torch.allclose(mixed[3], mean[3])
    assert not torch.allclose(mixed[1], mixed[3])  # each sampled row its own noise
    torch.testing.assert_close(log_prob, lp_check)  # the log-prob is of the action returned


def test_group_path_gives_each_row_its_own_sample_flag():
    torch.manual_seed(0)
    base = BaseModel.load(BaseConfig(source=BASE, device="cpu"))
    slots = {
        "a": TenantSlot.create("a", TenantSchema.from_dict(LIBERO_SCHEMA), base, head_kind="mlp", seed=1),
        "g": TenantSlot.create("g", TenantSchema.from_dict(CALVIN_SCHEMA), base, head_kind="gaussian", seed=2),
    }
    schemas = {"a": LIBERO_SCHEMA, "g": CALVIN_SCHEMA}
    # One group: the gaussian tenant's rows mix sample=False and sample=True on one observation.
    plan = [("g", False), ("a", True), ("g", True), ("g", False), ("g", True)]
    reqs = [_request(t, schemas[t], seed=0, sample=s) for t, s in plan]
    now = time.monotonic()
    group = [Pending(req=r, msg=None, slot=slots[r.tenant], version=1, arrived=now) for r in reqs]
    results = Inferencer._run_group(_inferencer(base), group, now)
    assert all(isinstance(r, PredictReply) and r.batch_size == 5 for r in results), results
    g = slots["g"]
    r = reqs[0]
    vla = g.preprocessor([Observation(images=r.images, state=r.state, instruction=r.instruction)])
    mean = predict_alone(base, [(g, vla)])[0].float().numpy()[0]
    np.testing.assert_allclose(results[0].actions, mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[3].actions, mean, rtol=1e-5, atol=1e-5)
    for i in (2, 4):
        assert not np.allclose(results[i].actions, mean, atol=1e-3), i
        assert results[i].log_prob is not None
    assert not np.allclose(results[2].actions, results[4].actions)
    assert results[2].log_prob < results[0].log_prob  # the mean is the density's peak


def test_mixed_sample_flags_in_one_group_through_a_running_inferencer(roles):
    roles.start("master")
    # A long wait window so the two concurrent requests certainly meet in one group.
    roles.start("inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="0.4")
    cfg = tenant("mix", schema=CALVIN_SCHEMA, head="gaussian", seed=4)
    rng = np.random.default_rng(0)
    images = {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8) for c in cfg.schema["cameras"]}
    state = rng.standard_normal(cfg.schema["state_dim"]).astype(np.float32)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)

            def call(sample: bool):
                return c.predict(cfg.name, images, state, "pick up the block", sample=sample,
                                 request_id=uuid.uuid4().hex)

            alone = await call(False)
            together = await asyncio.gather(call(False), call(True))
            again = await asyncio.gather(call(False), call(True))
            return alone, together, again
        finally:
            await c.close()

    alone, (mean, sampled), (mean2, sampled2) = asyncio.run(go())
    assert mean.batch_size == sampled.batch_size == 2 and mean2.batch_size == 2  # one group each time
    assert alone.batch_size == 1
    np.testing.assert_allclose(mean.actions, alone.actions, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean2.actions, alone.actions, rtol=1e-5, atol=1e-5)
    assert not np.allclose(sampled.actions, alone.actions, atol=1e-3)
    assert not np.allclose(sampled.actions, sampled2.actions)  # fresh request ids: fresh samples
    assert sampled.log_prob is not None and sampled.log_prob < mean.log_prob
