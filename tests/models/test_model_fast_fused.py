"""The fast engine's opt-in fused decoder layer (models.fast `fused=True`: q/k/v and gate/up as
one matmul each) and its patch embedding as a matmul compute what the transformers forward
computes (CPU fp32, 1e-5), and the stage hook sees every stage of an uncaptured forward."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from models import BaseConfig, BaseModel, TenantPreprocessor
from models.fast import FastQwen3VLEncoder
from models.testing import calvin_schema, random_observations

torch.set_num_threads(1)


def test_fused_layers_match_transformers_forward() -> None:
    base = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    pre = TenantPreprocessor.for_base(calvin_schema(), base)
    obs = random_observations(calvin_schema(), 3, np.random.default_rng(1))
    obs[1].images = dict(obs[1].images, static=None)  # a masked image group
    vla = pre(obs)
    ref = base.encode(vla)
    enc = FastQwen3VLEncoder(base, fused=True)
    stages: list[str] = []
    enc.on_stage = stages.append
    with torch.no_grad():
        hidden, mask = enc(vla)
    assert stages == ["inputs", "patch_embed", "vision_blocks", "embed", "text"]
    assert torch.equal(mask, ref.mask_B_L)
    m = ref.mask_B_L
    assert torch.allclose(hidden[m], ref.hidden_B_L_D[m], rtol=1e-5, atol=1e-5)


def test_fp8_refuses_without_an_sm89_gpu() -> None:
    """FP8 matmuls (`fp8=True`) need CUDA compute capability 8.9+: a CPU base is refused up front,
    with the reason, and nothing of the engine is built."""
    import pytest

    base = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    with pytest.raises(ValueError, match=r"fp8=True: .*compute capability 8\.9\+.*cpu"):
        FastQwen3VLEncoder(base, fp8=True)
