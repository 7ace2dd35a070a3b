"""The gaussian head's ``value_detach``: the value loss trains the value net only, never the trunk
the policy's mean reads (PPO from an SFT start, docs/results.md); off, it trains both, as before."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import OptimConfig, TenantSlot, train_step
from models.testing import libero_schema, random_batch

torch.set_num_threads(1)
OPTIONS = {"width": 32, "init_log_std": -1.0, "instruction_encoder": True, "image_channels": 4}
TRUNK = ("norm.", "in_proj.", "instruction_proj.", "image_encoder.")


def slot(base, detach: bool) -> TenantSlot:
    return TenantSlot.create("t-vd", libero_schema(horizon=2), base, head_kind="gaussian",
                             head_options={**OPTIONS, "value_detach": detach}, optim=OptimConfig(lr=1e-2, weight_decay=0.0), seed=3)


def value_only_batch(s: TenantSlot, base):
    """A PPO batch with zero advantages: the policy term has no gradient, the value term does."""
    batch = random_batch(s.preprocessor, 4, seed=5)
    with torch.no_grad():
        lp, _, _ = s.head.evaluate_actions(base.encode(batch.features), batch.features, batch.actions_B_H_A)
    batch.old_log_prob_B = lp
    batch.advantages_B = torch.zeros(4)
    batch.returns_B = torch.full((4,), 10.0)  # far from an untrained value net's outputs
    return batch


@pytest.mark.parametrize("detach", [True, False])
def test_value_loss_reaches_the_trunk_only_without_value_detach(base, detach: bool) -> None:
    s = slot(base, detach)
    before = {n: p.detach().clone() for n, p in s.head.named_parameters()}
    train_step(base, [(s, value_only_batch(s, base))])
    moved = {n for n, p in s.head.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any(n.startswith("value.") for n in moved), moved  # the value net learns either way
    trunk_moved = {n for n in moved if n.startswith(TRUNK)}
    if detach:
        # Nothing the mean reads moved: the policy's actions are those of before, bit for bit.
        assert not trunk_moved and not any(n.startswith(("mean.", "log_std")) for n in moved), moved
    else:
        assert trunk_moved, moved


def test_value_detach_is_a_checked_head_option(base) -> None:
    with pytest.raises(Exception, match="value_detch"):
        TenantSlot.create("t-vd", libero_schema(horizon=2), base, head_kind="gaussian",
                          head_options={"value_detch": True}, optim=OptimConfig(), seed=0)


@pytest.mark.parametrize("value", ["yes", 3, None])
def test_value_detach_must_be_true_or_false(base, value) -> None:
    with pytest.raises(Exception, match="gaussian.value_detach=.*must be true or false"):
        slot_opts = {**OPTIONS, "value_detach": value}
        TenantSlot.create("t-vd", libero_schema(horizon=2), base, head_kind="gaussian", head_options=slot_opts,
                          optim=OptimConfig(), seed=0)


@pytest.mark.parametrize("kind,option", [("mlp", "use_state"), ("mlp", "instruction_encoder"),
                                         ("gaussian", "instruction_encoder")])
def test_every_heads_switches_are_checked_alike(kind: str, option: str) -> None:
    """The check sits in head_config, for every head kind's bool options, not in one head."""
    from models.heads import head_config
    from models.errors import SchemaError

    with pytest.raises(SchemaError, match=f"{kind}.{option}='yes': must be true or false"):
        head_config(kind, {option: "yes"})
    assert getattr(head_config(kind, {option: True}), option) is True
