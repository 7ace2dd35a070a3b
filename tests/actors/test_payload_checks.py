"""Loading an exported payload checks its manifest: the base it was exported for (base key)
and the schema (signature) must be the loader's. An inferencer never serves, and a trainer's
load_weights never trains on, a payload exported for another base or schema."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import numpy as np
import pytest

from transport.weights import base_identity, check_manifest, manifest_name
from protocol import ops
from protocol.errors import FailedPrecondition
from protocol.messages import InfoRequest
from sdk.client import AsyncClient
from tests.support.tq_helpers import BASE, micro_batch, tenant


def _key():
    from models import BaseConfig, BaseModel, TenantSchema, TenantSlot
    from tests.support.tq_helpers import LIBERO_SCHEMA

    base = BaseModel.load(BaseConfig(source=BASE, device="cpu"))
    slot = TenantSlot.create("k", TenantSchema.from_dict(LIBERO_SCHEMA), base, head_kind="mlp", seed=0)
    return slot.key, slot.schema.signature()


def test_check_manifest_names_both_sides():
    import dataclasses

    key, sig = _key()
    good = {"base": BASE, "base_key": key.digest, "base_identity": base_identity(key), "schema_signature": sig}
    check_manifest(good, "t/v1", base=BASE, key=key, signature=sig)
    # Same weights and layout, another compute dtype (a GPU trainer, a CPU inferencer): the same base.
    bf16 = dataclasses.replace(key, dtype="bfloat16")
    check_manifest(good, "t/v1", base=BASE, key=bf16, signature=sig)
    with pytest.raises(FailedPrecondition, match=r"exported for base '/other/model'.*not for this base 'tiny-qwen3-vl'"):
        check_manifest(good | {"base": "/other/model", "base_key": "sha256:" + "0" * 64,
                               "base_identity": {"base_id": "dir:/other/model:abc", "layout": {}}},
                       "t/v1", base=BASE, key=key, signature=sig)
    with pytest.raises(FailedPrecondition, match="exported for base"):  # an older manifest: base_key only
        check_manifest({"base": "x", "base_key": "sha256:1", "schema_signature": sig}, "t/v1", base=BASE,
                       key=key, signature=sig)
    with pytest.raises(FailedPrecondition, match=r"schema sha256:00.*this tenant's schema sha256:"):
        check_manifest(good | {"schema_signature": "sha256:" + "0" * 64}, "t/v1", base=BASE, key=key, signature=sig)


def test_inferencer_and_trainer_refuse_a_payload_of_another_base(roles):
    roles.start("master")
    roles.start("trainer")
    first = roles.start("inferencer", NEXUS_INFER_BASE=BASE)
    cfg = tenant("pay", seed=5)
    obs_rng = np.random.default_rng(0)
    images = {c["name"]: obs_rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8)
              for c in cfg.schema["cameras"]}
    state = obs_rng.standard_normal(cfg.schema["state_dim"]).astype(np.float32)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            job = await c.reserve(cfg.name, "sft")
            await c.queue_put(micro_batch(cfg, job.job, 0))
            await c.mark_ready(cfg.name, job.job)
            await c.wait_job(cfg.name, job.job, timeout_s=120)
            ref = await c.latest_weights(cfg.name)
            # The right manifest: served (the running inferencer syncs v1) and loadable.
            deadline = time.monotonic() + 20
            while (served := await c.predict(cfg.name, images, state, "x")).version != 1:
                assert time.monotonic() < deadline, "v1 never served"
                await asyncio.sleep(0.1)
            ok = await c.load_weights(cfg.name, ref.object_name)

            store = await c.bus.js.object_store(c.names.obj_weights)
            _, manifest = await c.download_weights(ref)

            async def put_manifest(m):
                await store.put(manifest_name(ref.object_name), json.dumps(m).encode())

            other = manifest | {"base": "/elsewhere/model", "base_key": "sha256:" + "ab" * 32,
                                "base_identity": {"base_id": "dir:/elsewhere/model:0123", "layout": {}}}
            await put_manifest(other)
            with pytest.raises(FailedPrecondition) as trainer_err:
                await c.load_weights(cfg.name, ref.object_name)
            # A fresh inferencer loads v1 as it joins: refused, and a request for it hears why.
            first.send_signal(signal.SIGTERM)
            await asyncio.to_thread(first.wait, 30)
            fresh = await asyncio.to_thread(roles.start, "inferencer", NEXUS_INFER_BASE=BASE)
            with pytest.raises(FailedPrecondition) as serve_err:
                await c.predict(cfg.name, images, state, "x")
            info = await c.bus.call(ops.INFO.of("inferencer"), InfoRequest(), instance=fresh.instance, timeout_s=10)

            await put_manifest(manifest | {"schema_signature": "sha256:" + "cd" * 32})
            with pytest.raises(FailedPrecondition) as schema_err:
                await c.load_weights(cfg.name, ref.object_name)
            await put_manifest(manifest)
            ok_again = await c.load_weights(cfg.name, ref.object_name)
            return served, ok, trainer_err.value, serve_err.value, info, schema_err.value, ok_again
        finally:
            await c.close()

    served, ok, trainer_err, serve_err, info, schema_err, ok_again = asyncio.run(go())
    assert served.version == 1 and "loaded" in ok.detail and "loaded" in ok_again.detail
    for err in (trainer_err, serve_err):
        text = str(err)
        assert "exported for base '/elsewhere/model'" in text and f"this base '{BASE}'" in text, text
    assert list(info.extra["refused"]) == ["pay/v1"]
    assert "schema" in str(schema_err) and "sha256:cdcd" in str(schema_err)
