"""Tenant preprocessing (canonical features, bad inputs) and the grouping policy."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from models import (
    CameraSpec,
    IncompatibleBatchError,
    InputError,
    Observation,
    SchemaError,
    TenantPreprocessor,
    TenantSchema,
    TenantSlot,
    VLABatch,
    encode_grouped,
    encode_serial,
    train_step,
)
from models.testing import calvin_schema, libero_schema, random_batch, random_observations

torch.set_num_threads(1)


def obs(schema: TenantSchema, seed: int = 0) -> Observation:
    return random_observations(schema, 1, np.random.default_rng(seed))[0]


def test_canonical_feature(base) -> None:
    pre = TenantPreprocessor.for_base(calvin_schema(), base)
    o = obs(calvin_schema())
    o.images = dict(o.images, gripper=None)
    v = pre([o])
    lay = v.key.layout
    assert v.images_B_S_C_H_W.shape == (1, 2, 3, 64, 64)
    assert v.image_mask_B_S.tolist() == [[True, False]]
    assert float(v.images_B_S_C_H_W[0, 1].abs().sum()) == 0.0
    assert 0.0 <= float(v.images_B_S_C_H_W.min()) and float(v.images_B_S_C_H_W.max()) <= 1.0
    assert v.state_mask_B_D[0].tolist() == [True] * 15 + [False] * (lay.max_state_dim - 15)
    assert torch.equal(v.state_B_D[0, :15], torch.from_numpy(np.asarray(o.state, np.float32)))
    assert float(v.state_B_D[0, 15:].abs().sum()) == 0.0
    n = int(v.prompt_len_B[0])
    assert v.prompt_ids_B_T[0, :n].tolist() == base.encode_prompt(o.instruction)[:n]
    assert (v.prompt_ids_B_T[0, n:] == 0).all()


def test_resize_of_constant_frame_keeps_value(base) -> None:
    schema = TenantSchema(cameras=(("cam", 37, 91),), state_dim=0, action_dim=2, action_horizon=1)
    pre = TenantPreprocessor.for_base(schema, base)
    v = pre([Observation({"cam": np.full((37, 91, 3), 51, np.uint8)}, [], "x")])
    assert torch.allclose(v.images_B_S_C_H_W[0, 0], torch.full((3, 64, 64), 0.2), atol=1e-6)


def test_template_and_truncation(base) -> None:
    schema = TenantSchema(cameras=(("cam", 8, 8),), state_dim=1, action_dim=1, action_horizon=1,
                          instruction_template="Q: {instruction} A:")
    pre = TenantPreprocessor.for_base(schema, base)
    assert pre.prompt_ids("go") == base.encode_prompt("Q: go A:")
    long_ids = pre.prompt_ids("x" * 500)
    assert len(long_ids) == base.layout.max_prompt_tokens
    assert long_ids == base.encode_prompt("Q: " + "x" * 500 + " A:")[: base.layout.max_prompt_tokens]


@pytest.mark.parametrize("mutate,needle", [
    (lambda o: o.images.update(extra=np.zeros((4, 4, 3), np.uint8)), "unknown cameras"),
    (lambda o: o.images.pop("wrist"), "missing"),
    (lambda o: o.images.update(wrist=np.zeros((64, 64, 3), np.uint8)), "images[wrist]: shape"),
    (lambda o: o.images.update(wrist=np.zeros((128, 128, 3), np.float32)), "uint8"),
    (lambda o: setattr(o, "state", np.zeros(3)), "state: shape"),
    (lambda o: setattr(o, "state", np.full(8, np.nan)), "NaN"),
    (lambda o: setattr(o, "instruction", 42), "instruction"),
])
def test_bad_observations_error(base, mutate, needle: str) -> None:
    pre = TenantPreprocessor.for_base(libero_schema(), base)
    o = obs(libero_schema())
    o.images = dict(o.images)
    mutate(o)
    with pytest.raises(InputError) as e:
        pre([o])
    assert needle in str(e.value)
    with pytest.raises(InputError, match="empty"):
        pre([])


def test_schema_larger_than_layout(base) -> None:
    big_state = TenantSchema(cameras=(("a", 8, 8),), state_dim=64, action_dim=1, action_horizon=1)
    with pytest.raises(SchemaError, match="state_dim=64"):
        TenantPreprocessor.for_base(big_state, base)
    three = TenantSchema(cameras=tuple(CameraSpec(f"c{i}", 8, 8) for i in range(3)), state_dim=1, action_dim=1,
                         action_horizon=1)
    pre = TenantPreprocessor.for_base(three, base)  # widened layout: its own key
    assert pre.key.layout.camera_slots == 3 and pre.key != base.key


def test_bad_batch_shapes_and_actions(base) -> None:
    v = TenantPreprocessor.for_base(libero_schema(), base)([obs(libero_schema())])
    with pytest.raises(InputError, match="prompt_ids_B_T"):
        VLABatch(v.key, v.images_B_S_C_H_W, v.image_mask_B_S, v.prompt_ids_B_T[:, :3], v.prompt_len_B, v.state_B_D,
                 v.state_mask_B_D)
    from models import TenantBatch

    with pytest.raises(InputError, match="actions_B_H_A"):
        TenantBatch(v, torch.zeros(2, 8, 7))
    s = TenantSlot.create("t", libero_schema(), base, head_options={"width": 16})
    with pytest.raises(InputError, match="this head needs"):
        train_step(base, [(s, TenantBatch(v, torch.zeros(1, 4, 7)))])


def test_incompatible_keys_are_never_merged(base, monkeypatch) -> None:
    two = TenantPreprocessor.for_base(libero_schema(), base)
    three_schema = TenantSchema(cameras=tuple(CameraSpec(f"c{i}", 32, 32) for i in range(3)), state_dim=4,
                                action_dim=2, action_horizon=2)
    three = TenantPreprocessor.for_base(three_schema, base)
    va = two(random_observations(libero_schema(), 2, np.random.default_rng(0)))
    vb = three(random_observations(three_schema, 1, np.random.default_rng(1)))
    vc = two(random_observations(libero_schema(), 1, np.random.default_rng(2)))
    with pytest.raises(IncompatibleBatchError):
        VLABatch.cat([va, vb])
    sizes = []
    orig = base.encode
    monkeypatch.setattr(base, "encode", lambda v, **k: sizes.append(len(v)) or orig(v, **k))
    outs = encode_grouped(base, [va, vb, vc])
    assert sizes == [3, 1]  # one forward per key: (va + vc), then vb alone
    ref = encode_serial(base, [va, vb, vc])
    for o, r in zip(outs, ref):
        assert torch.allclose(o.hidden_B_L_D, r.hidden_B_L_D, atol=1e-5)
    with pytest.raises(IncompatibleBatchError, match="strict"):
        encode_grouped(base, [va, vb], strict=True)


def test_slot_refuses_batches_of_other_keys_and_duplicate_tenants(base) -> None:
    a = TenantSlot.create("a", libero_schema(), base, head_options={"width": 16})
    three_schema = TenantSchema(cameras=tuple(CameraSpec(f"c{i}", 32, 32) for i in range(3)), state_dim=8,
                                action_dim=7, action_horizon=8)
    other = random_batch(TenantPreprocessor.for_base(three_schema, base), 1, seed=0)
    with pytest.raises(InputError, match="not the slot's key"):
        train_step(base, [(a, other)])
    mine = random_batch(a.preprocessor, 1, seed=0)
    with pytest.raises(InputError, match="twice"):
        train_step(base, [(a, mine), (a, mine)])
