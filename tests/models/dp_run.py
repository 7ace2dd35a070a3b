"""The data-parallel test's tenants and run (tests/models/test_data_parallel.py), importable by
its rank processes: ``python -m tests.models.dp_run RANK WORLD INIT_FILE OUT [STEPS FAIL_AT]``.

FAIL_AT: at that step rank 1 feeds the `mlp` tenant actions of a wrong shape, so its
forward/backward raises there and only there (the step must then fail on every rank and change
nothing: equal to one process that skipped that step)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import sys
from datetime import timedelta

import torch

from models import BaseConfig, BaseModel, OptimConfig, TenantSlot, train_step
from models.lora import AdapterConfig
from models.testing import calvin_schema, libero_schema, random_batch

STEPS = 20
# (tenant, schema, head, options, seed, adapter, rows per step). Row counts cover an uneven
# split (3 rows: 2 + 1), a tenant with fewer rows than ranks on odd steps (1 row: rank 1 holds
# none and skips its forward) and an even one.
TENANTS = [
    ("mlp", libero_schema(), "mlp", {"width": 32}, 31, None, lambda step: 3),
    ("flow", calvin_schema(), "flow", {"width": 32, "depth": 1}, 32, None, lambda step: 1 + step % 2),
    ("lora", libero_schema(), "gaussian", {"width": 32}, 33,
     AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")), lambda step: 4),
]


def load_base() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))


def make_slots(base: BaseModel) -> list[TenantSlot]:
    optim = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=STEPS)
    slots = [TenantSlot.create(t, schema, base, head_kind=head, head_options=opts, optim=optim, seed=seed,
                               adapter=adapter) for t, schema, head, opts, seed, adapter, _ in TENANTS]
    # LoRA's B starts at zero (a no-op adapter at step 0); a seeded start tests it from step 0.
    with torch.no_grad():
        for s in slots:
            for b in (s.adapter.lora_B if s.adapter is not None else ()):
                b.normal_(0, 0.05, generator=torch.Generator().manual_seed(s.seed))
    return slots


def step_items(slots: list[TenantSlot], step: int) -> list:
    """The whole step's (slot, batch) per tenant: the same data in every run and on every rank."""
    return [(s, random_batch(s.preprocessor, rows(step), seed=1000 * i + step))
            for i, (s, (*_, rows)) in enumerate(zip(slots, TENANTS))]


def run(rank: int, world: int, steps: int = STEPS, fail_at: int = -1
        ) -> tuple[list[TenantSlot], list[list[float]], list[str]]:
    """``steps`` steps; world 1 is one process's plain grouped `train_step` (the reference),
    which skips step ``fail_at``. Returns slots, losses per tenant, errors raised."""
    from models.heads import TenantBatch
    from models.parallel import DataParallelStepError, shard, train_step_dp

    torch.set_num_threads(1)
    base = load_base()
    slots = make_slots(base)
    losses: list[list[float]] = [[] for _ in slots]
    errors: list[str] = []
    for step in range(steps):
        items = step_items(slots, step)
        if world == 1:
            if step == fail_at:
                continue
            results = train_step(base, items)
        else:
            shares = shard(items, rank, world)
            if step == fail_at and rank == 1:
                b = shares[0].batch
                shares[0].batch = TenantBatch(b.features, torch.zeros(len(b), 3, 2))
            try:
                results = train_step_dp(base, shares)
            except DataParallelStepError as exc:
                errors.append(str(exc))
                continue
        for i, r in enumerate(results):
            losses[i].append(r.loss)
    return slots, losses, errors


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    steps, fail_at = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (STEPS, -1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        slots, losses, errors = run(rank, world, steps, fail_at)
    finally:
        dist.destroy_process_group()
    tensors = {f"{s.tenant_id}/{n}": p.detach().contiguous() for s in slots for n, p in s.named_trainable()}
    save_file(tensors, f"{out}.safetensors")
    with open(f"{out}.json", "w") as f:
        json.dump({"losses": losses, "versions": [s.policy_version for s in slots], "errors": errors}, f)


if __name__ == "__main__":
    main()
