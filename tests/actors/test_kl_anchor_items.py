"""The trainer's side of PPO's KL term (algorithm.kl_coef), in-process: a queued micro-batch
with ``kl_coef`` > 0 makes the slot take its anchor (the policy at ``anchor_version``) before the
step, one with 0 takes none, the fields survive the wire, and the memory budget counts the
anchor of a head that can hold one."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from actors.trainer.slots import slot_footprint
from actors.trainer.step import item_to_batch
from protocol.messages import QueuePutRequest
from protocol.wire import decode, encode
from tests.support.tq_helpers import BASE, micro_batch, tenant


@pytest.fixture(scope="module")
def new_slot():
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot

    base = BaseModel.load(BaseConfig(source=BASE))

    def make(head: str = "gaussian"):
        cfg = tenant(f"kl-{head}", head=head)
        return cfg, TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), base, head_kind=head,
                                      optim=OptimConfig(**cfg.optim)), base

    return make


def test_a_kl_item_takes_the_anchor_before_its_step_and_a_plain_one_none(new_slot):
    from models import InputError, train_step

    cfg, slot, base = new_slot()
    plain = decode(encode(micro_batch(cfg, "j", 0, rl_version=0)), QueuePutRequest)
    [r] = train_step(base, [(slot, item_to_batch(slot, plain))])
    assert slot.anchor_version == -1 and slot.head.anchor_tensors() == {} and "kl_ref" not in r.metrics
    item = micro_batch(cfg, "j", 1, rl_version=1)
    item.kl_coef, item.anchor_version = 0.3, 1
    item = decode(encode(item), QueuePutRequest)  # as the trainer reads it from the queue
    assert (item.kl_coef, item.anchor_version) == (0.3, 1)
    batch = item_to_batch(slot, item)
    assert slot.anchor_version == 1 and batch.kl_coef == 0.3
    [r] = train_step(base, [(slot, batch)])
    assert r.metrics["kl_ref"] == 0.0  # the first step is taken at the anchor itself
    [r] = train_step(base, [(slot, item_to_batch(slot, item))])
    assert r.metrics["kl_ref"] > 0 and slot.anchor_version == 1
    # An anchor of a version the slot is past and does not hold cannot be taken any more.
    item.anchor_version = 0
    with pytest.raises(InputError, match="anchored at version 0, but the slot is at version 3"):
        item_to_batch(slot, item)


def test_the_budget_counts_an_anchor_taken_or_not(new_slot):
    _, slot, _ = new_slot()
    params = sum(p.numel() * p.element_size() for _, p in slot.named_trainable())
    anchor = slot.head.anchor_bytes()
    assert 0 < anchor < params  # the policy part: everything but the value net
    assert slot_footprint(slot) == 4 * params + anchor
    slot.use_anchor(0)
    assert slot_footprint(slot) == 4 * params + anchor  # held now: among the buffers, counted once
    _, mlp, _ = new_slot("mlp")
    mlp_params = sum(p.numel() * p.element_size() for _, p in mlp.named_trainable())
    assert slot_footprint(mlp) == 4 * mlp_params  # a head without a KL term: as before


@pytest.mark.parametrize("field,value,message", [
    ("kl_coef", float("nan"), "must be >= 0.0"), ("kl_coef", -0.5, "must be >= 0.0"),
    ("kl_coef", 1e9, "must be <= 100.0"), ("anchor_version", -5, "must be >= -1")])
def test_a_tenants_item_with_a_bad_kl_field_is_refused_naming_it(field, value, message):
    """A tenant puts queue items itself (the SDK's queue_put): a NaN, negative or huge KL weight
    would poison its own slot's loss; it is refused at decode, naming the field."""
    from protocol.errors import InvalidField

    item = micro_batch(tenant("kl-bad", head="gaussian"), "j1", 0)
    setattr(item, field, value)
    with pytest.raises(InvalidField, match=message) as err:
        decode(encode(item), QueuePutRequest)
    assert err.value.field.endswith(field)
