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
    with pytest.raises(ValueError, match=r"fp8='rowwise': .*cpu"):
        FastQwen3VLEncoder(base, fp8="rowwise", fp8_vision=False)
    with pytest.raises(ValueError, match=r"fp8='block': one of False, True, 'tensor', 'rowwise'"):
        FastQwen3VLEncoder(base, fp8="block")


def test_fp8_rowwise_scales_follow_each_token() -> None:
    """Row-wise FP8 (one scale per token, one per output channel) keeps tokens of very different
    magnitude accurate where one scale per tensor loses the small ones (the lever measured on the
    H200 in docs/benchmarks.md; torch._scaled_mm runs both scalings on CPU too)."""
    import pytest

    from models.fast import _fp8_linear, _fp8_weight

    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm missing")
    g = torch.Generator().manual_seed(0)
    # Tokens spanning 1e-3..1e2 in magnitude (activation outliers), weight rows spanning 1e-2..1.
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 64)[:, None]).to(torch.bfloat16)
    w = (torch.randn(96, 128, generator=g) * torch.logspace(-2, 0, 96)[:, None]).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w.float())
    try:
        y_row = _fp8_linear(x, _fp8_weight(w, False, rowwise=True), None).float()
        y_ten = _fp8_linear(x, _fp8_weight(w, False), None).float()
        y_row_b = _fp8_linear(x, _fp8_weight(w, False, rowwise=True), b).float()
    except RuntimeError as e:  # a CPU build without FP8 _scaled_mm
        pytest.skip(f"torch._scaled_mm on CPU: {e}")
    assert y_row.shape == ref.shape
    # The bias is added (checked on the small tokens, where bf16 rounding leaves it visible).
    assert torch.allclose((y_row_b - y_row)[:16], b.float().expand(16, -1), atol=2e-2)
    # Per-token relative error of the smallest tokens (first 16 rows): row-wise keeps them.
    def tok_err(y: torch.Tensor) -> float:
        return float(((y - ref)[:16].norm(dim=1) / ref[:16].norm(dim=1)).max())

    assert tok_err(y_row) < 0.1
    assert tok_err(y_ten) > 3 * tok_err(y_row)
