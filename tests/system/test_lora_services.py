"""A LoRA tenant through the services beside a frozen-base tenant: both run SFT end to end on
one trainer (their micro-batches share grouped base forwards), the export carries the adapter
in peft's names next to the head (and nothing of the base), the inferencer serves both in one
group with the adapter applied to its tenant's rows only, and bad adapters are refused at
submit naming the field and what the base allows. One deployment for the module."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from protocol.errors import FailedPrecondition, InvalidField
from tests.conftest import module_roles, run_client
from tests.support.tq_helpers import role_info
from tests.master.test_workloads import BASE_SPEC

LORA = {"kind": "lora", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def sft(tenant: str, adapter: dict | None, steps: int = 3) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(tenant=tenant, task="sft", action_module={"kind": "mlp"},
                algorithm={"lr": 3e-3, "batch_size": 8, "steps": steps})
    spec["env"]["demos"] = {"episodes": 2}
    if adapter is not None:
        spec["base_adapter"] = adapter
    return spec


@pytest.fixture(scope="module")
def deployment(nats_server, tmp_path_factory):
    with module_roles(nats_server, tmp_path_factory, "lora-services") as roles:
        for role in ("master", "trainer", "env"):
            roles.start(role)
        # A longer batch wait so two concurrent requests land in one group.
        roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64", NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="0.3")
        yield roles


def run(deployment, body):
    return run_client(deployment, body, timeout_s=60)


def _instance(deployment, role: str) -> str:
    return next(i for r, i, _ in deployment.procs if r == role)


def test_lora_and_frozen_tenants_train_side_by_side(deployment):
    async def body(c):
        handles = [await c.submit(sft("lora-a", LORA)), await c.submit(sft("frozen-a", None))]
        recs = await asyncio.gather(*(h.wait(timeout_s=240) for h in handles))
        refs = [await c.latest_weights(t) for t in ("lora-a", "frozen-a")]
        payloads = [await c.download_weights(r) for r in refs]
        info = await role_info(c, "trainer", _instance(deployment, "trainer"))
        return recs, payloads, info

    recs, ((lora_payload, lora_manifest), (frozen_payload, frozen_manifest)), info = run(deployment, body)
    assert [r.state for r in recs] == ["completed", "completed"], [(r.state, r.message) for r in recs]
    assert [r.step for r in recs] == [3, 3]
    # Their micro-batches shared base forwards on the trainer (one group, LoRA and frozen rows).
    assert info.extra["mixed_lora_steps"] >= 1, info.extra

    from safetensors.torch import load

    lora_t, frozen_t = load(lora_payload), load(frozen_payload)
    adapter_keys = sorted(k for k in lora_t if k.startswith("base_model.model."))
    # 2 decoder layers x 3 modules x (A, B); the head's keys are the frozen tenant's own.
    assert len(adapter_keys) == 12 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter_keys)
    assert sorted(set(lora_t) - set(adapter_keys)) == sorted(frozen_t)
    assert not any(k.startswith(("language_model.", "visual.")) for k in lora_t)  # no base weights
    assert lora_manifest["base_adapter"] == {**LORA, "alpha": 8.0, "dropout": 0.0}
    assert lora_manifest["peft_config"]["r"] == 4 and lora_manifest["peft_config"]["peft_type"] == "LORA"
    assert frozen_manifest["base_adapter"] == {} and frozen_manifest["peft_config"] is None
    # B started at zero and trained: the adapter moved off its init.
    assert any(float(lora_t[k].abs().max()) > 0 for k in adapter_keys if ".lora_B." in k)


def test_inferencer_serves_both_in_one_group_with_the_adapter(deployment, tmp_path):
    import torch

    from models import BaseConfig, BaseModel, Observation, TenantSchema, TenantSlot, predict
    from models.group import encode_grouped
    from models.schema import CameraSpec

    rng = np.random.default_rng(0)
    obs = {"images": {c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("top", "wrist")},
           "state": rng.normal(size=4).astype(np.float32), "instruction": "reach the target"}

    async def body(c):
        ref = await c.latest_weights("lora-a")
        # The announcement of the last export reaches the inferencer asynchronously (the
        # service may serve the version before for a moment): ask until it serves this one.
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            replies = await asyncio.gather(*(c.predict(t, obs["images"], obs["state"], obs["instruction"],
                                                       sample=False, timeout_s=30) for t in ("lora-a", "frozen-a")))
            if replies[0].version == ref.version or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
        assert replies[0].version == ref.version, (replies[0].version, ref.version)
        payload, _ = await c.download_weights(ref)
        cfg = await c.tenant("lora-a")
        await c.download_policy("lora-a", out_dir=tmp_path)
        return replies, payload, cfg, ref.version

    (lora_reply, frozen_reply), payload, cfg, version = run(deployment, body)
    assert lora_reply.batch_size == frozen_reply.batch_size == 2  # one group forward for both

    # The same export on a local copy of the base: the inferencer applied the adapter.
    torch.set_num_threads(1)
    base = BaseModel.load(BaseConfig("tiny-qwen3-vl-64", device="cpu"))
    schema = TenantSchema.from_dict(cfg.schema)
    assert schema.cameras[0] == CameraSpec("top", 64, 64)
    slot = TenantSlot.create("lora-a", schema, base, head_kind="mlp", adapter=cfg.base_adapter)
    slot.load_params(payload)
    vla = slot.preprocessor([Observation(obs["images"], obs["state"], obs["instruction"])])
    (ours,) = predict(base, [(slot, vla)])
    np.testing.assert_allclose(lora_reply.actions, ours[0].numpy(), rtol=1e-4, atol=1e-5)
    # `nexus download` wrote peft's directory: peft loads it on another copy of the base and
    # gives the hidden states the service's adapter gives.
    from peft import PeftModel

    copy_ = BaseModel.load(BaseConfig("tiny-qwen3-vl-64", device="cpu"))
    peft_model = PeftModel.from_pretrained(copy_.core, str(tmp_path / f"lora-a-v{version}.peft")).eval()
    with torch.no_grad():
        theirs = copy_.family.forward(peft_model, copy_.build_inputs(vla))
    ours_h = encode_grouped(base, [vla], slots=[slot], inference=True)[0].hidden_B_L_D
    torch.testing.assert_close(theirs, ours_h, rtol=1e-5, atol=1e-5)
    slot.adapter = None  # the same head without its adapter answers differently
    (plain,) = predict(base, [(slot, vla)])
    assert not np.allclose(lora_reply.actions, plain[0].numpy(), rtol=1e-4, atol=1e-5)


def test_bad_adapters_are_refused_at_submit_naming_the_field(deployment):
    async def body(c):
        errors = []
        for adapter in ({**LORA, "target_modules": ["q_proj", "qkv"]}, {**LORA, "rank": 33, "target_modules": ["v_proj"]}):
            with pytest.raises(InvalidField) as err:
                await c.submit(sft("bad-lora", adapter))
            errors.append(str(err.value))
        with pytest.raises(InvalidField) as err:
            await c.submit(sft("bad-lora", {**LORA, "rank": 0}))
        errors.append(str(err.value))
        # A LoRA tenant cannot load a payload without its adapter (the frozen tenant's export).
        frozen = await c.latest_weights("frozen-a")
        with pytest.raises(FailedPrecondition) as err:
            await c.load_weights("lora-a", frozen.object_name)
        errors.append(str(err.value))
        return errors

    target, rank, zero, load = run(deployment, body)
    assert "base_adapter.target_modules[1]: 'qkv' is no linear layer" in target
    assert "allowed: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in target
    assert "base_adapter.rank: 33 is out of range; allowed for this base: 1..32" in rank
    assert "base_adapter.rank" in zero and ">= 1" in zero
    assert "carry base_adapter None" in load and "'rank': 4" in load
