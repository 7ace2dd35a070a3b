"""An action-expert tenant through the services beside a frozen-base tenant: both run SFT end to
end on one trainer (their micro-batches share grouped base forwards, the expert reading the
prefix KV cache of that one forward), the export carries the expert's layers (and nothing of
the base), the inferencer serves both in one group and the expert's actions are what the
exported weights give on a local copy of the base; an expert that cannot read the base's cache
is refused at submit naming the field and what the base allows. One deployment for the module."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from protocol import ops
from protocol.errors import InvalidField
# The LoRA services module's deployment (master, trainer, env, an inferencer with a longer batch
# wait so concurrent requests group): one instance for this module.
from tests.system.test_lora_services import deployment, run  # noqa: F401
from tests.master.test_workloads import BASE_SPEC

EXPERT = {"kind": "expert", "params": {"width": 32, "euler_steps": 2}}


def sft(tenant: str, module: dict, steps: int = 3) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(tenant=tenant, task="sft", action_module=module, algorithm={"lr": 3e-3, "batch_size": 8, "steps": steps})
    spec["env"]["demos"] = {"episodes": 2}
    return spec


def test_expert_and_frozen_tenants_train_side_by_side_and_serve_in_one_group(deployment):  # noqa: F811 (the fixture)
    from protocol.messages import InfoRequest

    rng = np.random.default_rng(0)
    obs = {"images": {c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("top", "wrist")},
           "state": rng.normal(size=4).astype(np.float32), "instruction": "reach the target"}
    trainer = next(i for r, i, _ in deployment.procs if r == "trainer")

    async def body(c):
        handles = [await c.submit(sft("expert-a", EXPERT)), await c.submit(sft("frozen-e", {"kind": "mlp"}))]
        recs = await asyncio.gather(*(h.wait(timeout_s=240) for h in handles))
        info = await c.bus.call(ops.INFO.of("trainer"), InfoRequest(), instance=trainer, timeout_s=10)
        replies = await asyncio.gather(*(c.predict(t, obs["images"], obs["state"], obs["instruction"], sample=False,
                                                   timeout_s=30) for t in ("expert-a", "frozen-e")))
        ref = await c.latest_weights("expert-a")
        payload, manifest = await c.download_weights(ref)
        cfg = await c.tenant("expert-a")
        return recs, info, replies, payload, manifest, cfg

    recs, info, (expert_reply, frozen_reply), payload, manifest, cfg = run(deployment, body)
    assert [r.state for r in recs] == ["completed", "completed"], [(r.state, r.message) for r in recs]
    assert [r.step for r in recs] == [3, 3]
    # Their micro-batches shared base forwards (and the prefix KV cache) on the trainer.
    assert info.extra["mixed_expert_steps"] >= 1, info.extra
    assert expert_reply.batch_size == frozen_reply.batch_size == 2  # one group forward for both
    assert manifest["head"] == "expert" and manifest["version"] == 3

    from safetensors.torch import load

    tensors = load(payload)
    assert {"layers.0.q.weight", "layers.1.v.weight", "time_in.weight"} <= set(tensors)
    assert not any(k.startswith(("language_model.", "visual.")) for k in tensors)  # no base weights

    # The same export on a local copy of the base gives the inferencer's actions (the slot's
    # seeded noise: this was the version's first request).
    import torch

    from models import BaseConfig, BaseModel, Observation, TenantSchema, TenantSlot, predict

    torch.set_num_threads(1)
    base = BaseModel.load(BaseConfig("tiny-qwen3-vl-64", device="cpu"))
    slot = TenantSlot.create("expert-a", TenantSchema.from_dict(cfg.schema), base, head_kind=cfg.head,
                             head_options=cfg.head_params, seed=cfg.seed)
    slot.load_params(payload)
    vla = slot.preprocessor([Observation(obs["images"], obs["state"], obs["instruction"])])
    (ours,) = predict(base, [(slot, vla)])
    np.testing.assert_allclose(expert_reply.actions, ours[0].numpy(), rtol=1e-4, atol=1e-5)


def test_an_expert_that_cannot_read_the_cache_is_refused_at_submit(deployment):  # noqa: F811 (the fixture)
    async def body(c):
        errors = []
        for params in ({"depth": 3}, {"head_dim": 32, "num_heads": 3}):
            with pytest.raises(InvalidField) as err:
                await c.submit(sft("bad-expert", {"kind": "expert", "params": params}))
            errors.append(str(err.value))
        return errors

    depth, shape = run(deployment, body)
    assert ("action_module.params.depth: 3 expert layers cannot map onto this base's 2 text layers; allowed: 1, 2"
            in depth), depth
    assert "action_module.params.head_dim: 32 cannot read this base's KV cache; allowed: 16" in shape, shape
    assert "action_module.params.num_heads: 3 query heads cannot share this base's 2 KV heads" in shape, shape


def test_tenant_create_names_the_config_field():
    """The tenant_create path (a TenantConfig, not a spec) checks the same, naming head_params."""
    from master.tenant_checks import base_fit_errors
    from protocol.messages import TenantConfig

    cfg = TenantConfig(name="x", base="tiny-qwen3-vl", schema={}, head="expert", head_params={"num_heads": 3},
                       base_adapter={"kind": "lora", "rank": 99})
    fields = [f for f, _, _ in base_fit_errors(cfg, "head_params")]
    assert fields == ["base_adapter.rank", "head_params.num_heads"]
    assert base_fit_errors(TenantConfig(name="x", base="tiny-paligemma", schema={}, head="expert"), "head_params") == []
