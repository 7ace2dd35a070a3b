"""The optimized Qwen3-VL encode (models.fast) computes what the transformers forward computes."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from models import BaseConfig, BaseModel, TenantPreprocessor
from models.testing import calvin_schema, random_observations

torch.set_num_threads(1)


@pytest.mark.parametrize("image_size", [64, 96])
def test_fast_encode_matches_transformers_forward(image_size: int) -> None:
    slow = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=image_size, device="cpu"))
    fast = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=image_size, device="cpu", fast=True))
    assert fast._fast is not None and slow._fast is None
    assert fast.key == slow.key  # same weights and layout: a compute path, not a different base
    pre = TenantPreprocessor.for_base(calvin_schema(), slow)
    obs = random_observations(calvin_schema(), 3, np.random.default_rng(0))
    obs[2].images = dict(obs[2].images, static=None)  # absent slot 0: exercises masked image groups
    vla = pre(obs)
    a, b = slow.encode(vla), fast.encode(vla)
    assert torch.equal(a.mask_B_L, b.mask_B_L)
    m = a.mask_B_L
    assert torch.allclose(a.hidden_B_L_D[m], b.hidden_B_L_D[m], rtol=1e-5, atol=1e-5)
    assert torch.allclose(a.query_B_Q_D, b.query_B_Q_D, rtol=1e-5, atol=1e-5)


def test_fast_is_qwen_only() -> None:
    with pytest.raises(NotImplementedError):
        BaseModel.load(BaseConfig("tiny-paligemma", image_size=64, device="cpu", fast=True))
