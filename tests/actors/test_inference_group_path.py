"""The inferencer's group path in-process (no NATS): per-slot canonicalisation, the side
stream on CUDA, one sync per group. Each reply must equal what `models.group.predict` gives
for that request alone, and a bad request fails alone. Runs on CPU here; on a CUDA machine
the `cuda` case also checks that the forward waits for the canonicalise stream."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from actors.inferencer.batching import Pending
from actors.inferencer.inferencer import Inferencer
from models import BaseConfig, BaseModel, Observation, TenantSchema, TenantSlot
from models.group import predict
from protocol.messages import ErrorReply, PredictReply, PredictRequest
from tests.support.tq_helpers import BASE, CALVIN_SCHEMA, LIBERO_SCHEMA

# (device, fast): the optimized encode (CUDA graphs, groups padded to capture sizes) on CUDA too.
DEVICES = [("cpu", False)] + ([("cuda", False), ("cuda", True)] if torch.cuda.is_available() else [])


class _Heads:
    def __init__(self, base: BaseModel) -> None:
        self.base = base


def _inferencer(base: BaseModel, fast: bool = False) -> Inferencer:
    from opentelemetry import trace

    from actors.metering import Meter

    inf = Inferencer.__new__(Inferencer)  # the group path needs only these attributes
    inf.heads, inf.fast, inf.tracer = _Heads(base), fast, trace.get_tracer("test")
    inf.warmup = False  # the service's warm-up is tested on real roles (tests/actors/test_inference.py)
    inf.meter, inf.busy_s = Meter({"train": 0.0, "infer": 0.0}), 0.0  # metering: the busy time is charged
    return inf


def _request(tenant: str, schema: dict, seed: int, sample: bool = False) -> PredictRequest:
    rng = np.random.default_rng(seed)
    images = {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8) for c in schema["cameras"]}
    state = rng.standard_normal(schema["state_dim"]).astype(np.float32)
    return PredictRequest(tenant=tenant, images=images, state=state, instruction=f"task {seed}", timeout_s=30.0,
                          sample=sample)


@pytest.mark.parametrize("device,fast", DEVICES)
def test_group_path_matches_per_request_predict_and_isolates_bad_rows(device, fast):
    torch.manual_seed(0)
    base = BaseModel.load(BaseConfig(source=BASE, device=device, fast=fast))
    slots = {
        "a": TenantSlot.create("a", TenantSchema.from_dict(LIBERO_SCHEMA), base, head_kind="mlp", seed=1),
        "b": TenantSlot.create("b", TenantSchema.from_dict(CALVIN_SCHEMA), base, head_kind="gaussian", seed=2),
    }
    schemas = {"a": LIBERO_SCHEMA, "b": CALVIN_SCHEMA}
    now = time.monotonic()
    # Interleaved tenants; row 3 has a wrong image shape, row 6 a wrong state length.
    names = ["a", "b", "a", "a", "b", "b", "a", "b"]
    reqs = [_request(n, schemas[n], seed=i) for i, n in enumerate(names)]
    reqs[3].images["agentview"] = reqs[3].images["agentview"][:8]
    reqs[6].state = reqs[6].state[:3]
    group = [Pending(req=r, msg=None, slot=slots[r.tenant], version=7, arrived=now) for r in reqs]

    results = Inferencer._run_group(_inferencer(base, fast), group, now)

    assert isinstance(results[3], ErrorReply) and "images[agentview]" in results[3].message
    assert isinstance(results[6], ErrorReply) and "state" in results[6].message
    for i, (r, res) in enumerate(zip(reqs, results)):
        if i in (3, 6):
            continue
        assert isinstance(res, PredictReply), (i, res)
        assert res.tenant == r.tenant and res.version == 7 and res.batch_size == 6
        slot = slots[r.tenant]
        vla = slot.preprocessor([Observation(images=r.images, state=r.state, instruction=r.instruction)])
        alone = predict(base, [(slot, vla)])[0].float().cpu().numpy()[0]
        # bf16/TF32 kernels on a GPU differ slightly between batch shapes; exact on CPU.
        tol = 1e-4 if device == "cpu" else 3e-2
        np.testing.assert_allclose(res.actions, alone, rtol=tol, atol=tol)
        if r.tenant == "b":  # RL head: log-prob and value come back too
            assert res.log_prob is not None and res.value is not None
        else:
            assert res.log_prob is None and res.value is None


def test_a_request_past_its_timeout_is_dropped_unworked():
    base = BaseModel.load(BaseConfig(source=BASE))
    slot = TenantSlot.create("a", TenantSchema.from_dict(LIBERO_SCHEMA), base, head_kind="mlp", seed=1)
    now = time.monotonic()
    late = _request("a", LIBERO_SCHEMA, 0)
    late.timeout_s = 0.5
    group = [Pending(req=late, msg=None, slot=slot, version=1, arrived=now - 1.0),
             Pending(req=_request("a", LIBERO_SCHEMA, 1), msg=None, slot=slot, version=1, arrived=now)]
    results = Inferencer._run_group(_inferencer(base), group, now)
    assert results[0] is None  # dropped: no reply is sent for it
    assert isinstance(results[1], PredictReply) and results[1].batch_size == 1
