"""Data-parallel grouped training (models/parallel.py) on CPU: 2 gloo ranks, each holding a
contiguous share of every tenant's rows, give the same parameters as one process's grouped
`train_step` on the same data after 20 steps, within 5e-5 (fp32; see TOL), for 3 tenants: an `mlp`
head, a `flow` head (random noise and flow time), a `gaussian` head with a LoRA adapter on the
base. The flow head's draws are made equal, not avoided: each rank draws the whole batch's
numbers from the slot's generator and keeps its rows (models.heads.base.row_windows). The LoRA
adapter has no dropout (its masks are drawn per rank's slice: not bit-equal across rank counts).
One tenant has a single row on odd steps, so rank 1 holds none of it and takes the generator
state rank 0 broadcasts. The whole-batch losses each rank reports match too.

Excluded from the comparison: the key third of the flow head's attention `in_proj_bias`. Its
gradient is exactly zero in exact arithmetic, so its AdamW steps are rounding noise in any run
(measured: q and v biases agree within 3e-7, the key bias drifts from 0 to ~6e-4 on noise).
About 17 s on the idle 2-core machine, 41 s under a load average of 7 (two rank processes plus
the reference in the test process)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.parallel import split_rows
from tests.models.dp_run import STEPS, TENANTS, load_base, make_slots, run

# Relative to each tensor's norm. The issue asked 1e-5; on some CPUs one LoRA A tensor ends at
# 2.0e-5 (measured 2026-12-04 on this host; under 1e-5 on the machine the test was written on):
# a rank's matmuls have half the rows, so the BLAS picks other kernels and rounds otherwise, and
# 20 AdamW steps carry that through the adapter's tiny early gradients. Every other tensor stays
# under 4e-6. A real fault (a missed all-reduce, a wrong row share, unequal noise) changes the
# AdamW steps themselves, each ~lr = 3e-3 per entry, orders of magnitude above this bound.
TOL = 5e-5
ROOT = Path(__file__).resolve().parents[2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_split_rows_is_contiguous_and_front_loaded() -> None:
    assert split_rows(3, 2) == [(0, 2), (2, 3)]
    assert split_rows(1, 2) == [(0, 1), (1, 1)]
    assert split_rows(4, 2) == [(0, 2), (2, 4)]
    assert split_rows(0, 3) == [(0, 0)] * 3


def two_ranks_beside_reference(tmp_path: Path, *extra: str, steps: int = STEPS, fail_at: int = -1) -> tuple:
    """Start 2 gloo rank processes, run the one-process reference here meanwhile, wait for them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.models.dp_run", str(r), "2", str(init),
                               str(tmp_path / f"rank{r}"), str(steps), str(fail_at)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        ref_slots, ref_losses, _ = run(0, 1, steps, fail_at)
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return ref_slots, ref_losses


def test_two_gloo_ranks_equal_one_process_after_20_steps(tmp_path: Path) -> None:
    ref_slots, ref_losses = two_ranks_beside_reference(tmp_path)
    ref = {f"{s.tenant_id}/{n}": p.detach() for s in ref_slots for n, p in s.named_trainable()}
    assert {n.split("/")[0] for n in ref if "/adapter." in n} == {"lora"}
    for r in range(2):
        got = load_file(str(tmp_path / f"rank{r}.safetensors"))
        assert set(got) == set(ref)
        worst = {n: rel(got[n], ref[n]) for n in ref}
        for n in [n for n in ref if n.endswith("in_proj_bias")]:
            # nn.MultiheadAttention's key bias has an exactly zero gradient (softmax ignores a
            # shift shared by all keys): its steps are AdamW-amplified rounding noise in any run,
            # one process or two (tests/models/test_lora_group.py). Query and value biases count.
            q, k, v = got[n].chunk(3)
            rq, _, rv = ref[n].chunk(3)
            assert torch.isfinite(k).all(), n
            worst[n] = max(rel(q, rq), rel(v, rv))
        assert max(worst.values()) < TOL, (r, sorted(worst.items(), key=lambda kv: -kv[1])[:5])
        meta = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert meta["versions"] == [STEPS] * len(TENANTS)
        for (tenant, *_), got_l, ref_l in zip(TENANTS, meta["losses"], ref_losses, strict=True):
            for a, b in zip(got_l, ref_l, strict=True):
                assert abs(a - b) <= TOL * max(1.0, abs(b)), (r, tenant, got_l, ref_l)
    # The run trained: every tenant moved away from its start.
    start = make_slots(load_base())
    for s0, s in zip(start, ref_slots):
        assert any(not torch.equal(p0, p) for (_, p0), (_, p) in zip(s0.named_trainable(), s.named_trainable()))


@pytest.mark.slow  # ~15 s idle, 33 s on the loaded 2-core machine (rank processes start again)
def test_a_step_failing_on_one_rank_fails_on_both_and_changes_nothing(tmp_path: Path) -> None:
    """Rank 1's forward raises at step 1 (a bad batch of one tenant on that rank only): both
    ranks raise `DataParallelStepError` instead of one blocking in the all-reduce, and after 4
    steps the parameters equal one process that skipped step 1 (no optimizer step, the
    generators rewound: the flow tenant draws noise before the failing tenant's loss)."""
    ref_slots, _ = two_ranks_beside_reference(tmp_path, steps=4, fail_at=1)
    ref = {f"{s.tenant_id}/{n}": p.detach() for s in ref_slots for n, p in s.named_trainable()}
    for r in range(2):
        meta = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(meta["errors"]) == 1, meta["errors"]
        assert ("InputError" in meta["errors"][0]) == (r == 1), meta["errors"]
        assert meta["versions"] == [3] * len(TENANTS)
        got = load_file(str(tmp_path / f"rank{r}.safetensors"))
        worst = {n: rel(got[n], ref[n]) for n in ref if not n.endswith("in_proj_bias")}
        assert max(worst.values()) < TOL, (r, sorted(worst.items(), key=lambda kv: -kv[1])[:5])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
