"""The compiled fast encode (`BaseConfig(fast=True, compile=True)`, what NEXUS_TRAINER_COMPILE
turns on for the trainer's bases) on CPU: torch.compile (inductor, through the C compiler) builds
the tiny base's vision block and decoder layer once, and a few training steps on it give the
eager steps' features, losses and parameters.

Slow: compiling the two functions costs about a minute of CPU (inductor generates and builds C++);
the steps after it take milliseconds. The trainer itself turns the fast engine on only on CUDA
(actors/trainer/slots.py `fast_engine_applies`), so this checks the compile path, not the trainer's
switch (tests/protocol/test_settings.py checks that the variable is parsed and read).

    OMP_NUM_THREADS=1 python -m pytest tests/models/test_model_compile.py -m slow -q
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil

import pytest
import torch

from models import BaseConfig, BaseModel, OptimConfig, TenantSlot, train_step
from models.testing import libero_schema, random_batch
from tests.models.grouping import BATCH, rel

torch.set_num_threads(1)

STEPS = 3
# Inductor fuses the elementwise work between matmuls (norms, rotary, SiLU) and may sum fp32
# reductions in another order: each fused op differs from eager by a few fp32 ulps (~1e-7
# relative), a little more after four layers. Measured on this CPU: features and losses within
# 1e-7 relative, parameters after 3 AdamW steps within 2e-6. The bounds leave 10-50x of room and
# still catch a wrong fused kernel (an error of one part in 1e4 or more).
FEATURE_TOL = 1e-5
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                       reason="torch.compile's inductor needs a C compiler (gcc, or $CC) on PATH"),
]


def _steps(base: BaseModel) -> tuple[list[float], dict[str, torch.Tensor]]:
    slot = TenantSlot.create("t", libero_schema(), base, head_kind="mlp", head_options={"width": 32},
                             optim=OptimConfig(lr=1e-3), seed=1)
    # One batch size throughout: the compile is static (dynamic=False), a new size recompiles.
    losses = [train_step(base, [(slot, random_batch(slot.preprocessor, BATCH, seed=step))])[0].loss
              for step in range(STEPS)]
    return losses, {name: p.detach().clone() for name, p in slot.named_trainable()}


def test_compiled_fast_encode_trains_as_the_eager_forward() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    compiled = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, compile=True))
    assert compiled.key == eager.key  # the same base: only the compute path differs

    vla = random_batch(TenantSlot.create("f", libero_schema(), eager, head_kind="mlp").preprocessor, BATCH, seed=9)
    with torch.no_grad():
        a, b = eager.encode(vla.features), compiled.encode(vla.features)
    # The compiled path ran: dynamo captured graphs (a silent fallback to eager would capture none).
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    assert torch.equal(a.mask_B_L, b.mask_B_L)
    m = a.mask_B_L
    torch.testing.assert_close(b.hidden_B_L_D[m], a.hidden_B_L_D[m], rtol=FEATURE_TOL, atol=FEATURE_TOL)

    e_losses, e_params = _steps(eager)
    c_losses, c_params = _steps(compiled)
    for step, (c, e) in enumerate(zip(c_losses, e_losses, strict=True)):
        assert abs(c - e) <= LOSS_TOL * abs(e), (step, c_losses, e_losses)
    assert c_params.keys() == e_params.keys()
    for name, p in c_params.items():
        assert rel(p, e_params[name]) < PARAM_TOL, (name, rel(p, e_params[name]))
