"""The serving group's heads inside the fast engine's graph vs after it (issue 27 item 4).

    python -m bench.head_pool                                              # tiny preset, CPU
    python -m bench.head_pool --preset qwen3-vl-4b --device cuda --tenants 8 --batch 4 --compile \
        --json bench/results/head_pool_h200.json

N tenants with `mlp` heads (alternating LIBERO- and CALVIN-like schemas: two head shapes), each
`--batch` rows, packed as the inferencer packs a group, on canonical batches already on the
device. Medians over --repeats after --warmup, CUDA synchronised around each:
  after   the fast engine's forward (its CUDA graph), then each tenant's head on its rows, as
          the inferencer ran groups before (one head after another);
  inside  one forward whose graph also runs every head (`models.heads.pool`: heads stacked per
          shape, each row's index a graph input);
  base    the forward alone (the floor the heads add to);
and the largest |inside - after| over all actions (the same weights and features: only the
order of float operations differs). One JSON record.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.tenant_group import GroupRow, add_common_args, emit, time_ms  # noqa: E402
from models import BaseConfig, BaseModel, TenantSlot  # noqa: E402
from models.features import VLABatch  # noqa: E402
from models.testing import calvin_schema, libero_schema, random_batch  # noqa: E402


@dataclass
class Row(GroupRow):
    compile: bool
    base_ms: float
    heads_after_ms: float
    heads_inside_ms: float
    heads_after_over_base_ms: float
    heads_inside_over_base_ms: float
    max_abs_diff: float


def run(args: argparse.Namespace) -> Row:
    base = BaseModel.load(BaseConfig(args.preset, device=args.device, fast=True, compile=args.compile))
    slots = [TenantSlot.create(f"t{i}", libero_schema() if i % 2 == 0 else calvin_schema(), base, seed=i,
                               head_kind="mlp", head_options={"width": args.width}) for i in range(args.tenants)]
    packed = VLABatch.cat([random_batch(s.preprocessor, args.batch, seed=i).features
                           for i, s in enumerate(slots)]).to(base.device)
    runs = [(i * args.batch, (i + 1) * args.batch, s.head) for i, s in enumerate(slots)]
    plan = base.head_plan(runs, len(packed))
    if plan is None:
        raise SystemExit("the heads could not be pooled (see models/heads/pool.py: poolable)")

    def after() -> list:
        with torch.inference_mode():
            f = base.encode(packed, inference=True)
            return [h.predict(f.split([a, b - a, len(packed) - b])[1], packed.index(slice(a, b)), s.generator)
                    for (a, b, h), s in zip(runs, slots)]

    def inside() -> list:
        with torch.inference_mode():
            acts = base.encode(packed, inference=True, heads=plan).head_actions
            return [acts[plan.bucket_of_run[k]][a:b] for k, (a, b, _) in enumerate(runs)]

    def alone() -> None:
        with torch.inference_mode():
            base.encode(packed, inference=True)

    t = {name: time_ms(fn, base.device, args.warmup, args.repeats)
         for name, fn in (("base", alone), ("after", after), ("inside", inside))}
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(inside(), after()))
    r2 = lambda x: round(x, 2)  # noqa: E731
    return Row(args.preset, str(base.device), args.tenants, 0, args.batch, args.compile, r2(t["base"]), r2(t["after"]),
               r2(t["inside"]), r2(t["after"] - t["base"]), r2(t["inside"] - t["base"]), diff)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, tenants=8, batch=4)
    p.add_argument("--width", type=int, default=256, help="the heads' width (mlp head_options)")
    p.add_argument("--compile", action="store_true", help="the compiled engine (compiles first)")
    args = p.parse_args(argv)
    if args.tenants < 1 or args.batch < 1:
        p.error("--tenants and --batch must be >= 1")
    emit(asdict(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
