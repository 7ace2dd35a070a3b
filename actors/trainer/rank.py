"""A trainer rank 1..N-1: a child of the trainer role process (rank 0), no NATS of its own.

    python -m actors.trainer.rank --rank 1 --world 2 --port P --device cpu   (started by rank 0)

It holds mirrors of the tenants' slots and the bases they use, and follows rank 0's plans
(`actors.trainer.ranks`): per step it takes the slots rank 0 sent whole, checks every slot of
the step against rank 0's digest, canonicalises the step's raw micro-batches, and runs its rows
of `models.parallel.train_step_dp`. It exits 0 on the exit plan, non-zero when rank 0 is gone
(a collective fails) or, through PR_SET_PDEATHSIG, with it.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

from actors.trainer.ranks import FAILED, IN_STEP, OUT_OF_STEP, PLAN_EXIT, PLAN_STEP, base_digest, check, recv_plan, slot_digest

# Exit statuses: a collective failed (rank 0 gone or the group broken).
EXIT_GROUP_LOST = 3


class Mirror:
    """This rank's bases and slots."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.bases: dict[str, Any] = {}
        self.slots: dict[str, Any] = {}

    def base(self, source: str, cfg: dict[str, Any], digest: float) -> Any:
        base = self.bases.get(source)
        if base is None:
            from models import BaseConfig, BaseModel

            base = BaseModel.load(BaseConfig(source=source, device=self.device, fast=bool(cfg.get("fast")),
                                             compile=bool(cfg.get("compile")), image_size=cfg.get("image_size")))
            mine = base_digest(base)
            if mine != digest:
                raise RuntimeError(f"base {source!r} differs from rank 0's (weights sum {mine!r} vs {digest!r}): "
                                   "every rank must load the same frozen base")
            self.bases[source] = base
        return base

    def take(self, name: str, state: dict[str, Any], base: Any) -> None:
        """A slot sent whole: built from its config, then its checkpoint (head, adapter, moments,
        counters, RNG) restored."""
        from models import OptimConfig, TenantSchema, TenantSlot
        from protocol.messages import TenantConfig
        from protocol.wire import decode

        cfg = decode(state["config"], TenantConfig)
        slot = TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), base, head_kind=cfg.head,
                                 head_options=cfg.head_params, optim=OptimConfig(**cfg.optim), seed=cfg.seed,
                                 adapter=cfg.base_adapter or None)
        slot.restore(state["checkpoint"])
        self.slots[name] = slot

    def prepare(self, plan: dict[str, Any]) -> tuple[int, Any, list[tuple[Any, Any]]]:
        """(answer, base, [(slot, batch)]) for a step plan."""
        from actors.trainer.step import item_to_batch
        from protocol.messages import QueuePutRequest
        from protocol.wire import decode

        if plan.get("resident") is not None:
            self.keep_only(plan["resident"])
        base = self.base(plan["base"], plan["base_cfg"], plan["base_digest"])
        for t in plan["tenants"]:
            if t["slot"] is not None:
                self.take(t["name"], t["slot"], base)
        items = []
        for t in plan["tenants"]:
            slot = self.slots.get(t["name"])
            if slot is None or slot_digest(slot) != t["digest"]:
                return OUT_OF_STEP, base, []
            items.append((slot, item_to_batch(slot, decode(t["item"], QueuePutRequest))))
        return IN_STEP, base, items

    def keep_only(self, names: list[str]) -> None:
        """Rank 0's resident slots (sent when they change): mirrors of the others go, so a rank
        holds no more than rank 0 does (its slot budget, a deleted tenant)."""
        keep = set(names)
        for name in [n for n in self.slots if n not in keep]:
            del self.slots[name]


def serve(rank: int, world: int, port: int, device: str, timeout_s: float) -> int:
    import torch
    import torch.distributed as dist

    from actors.trainer.ranks import backend_for
    from models.parallel import DataParallelStepError, shard, train_step_dp

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    mirror = Mirror(rank, world, device)
    while True:
        try:
            plan = recv_plan()
        except Exception as exc:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
            print(f"trainer rank {rank}: rank 0 lost: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return EXIT_GROUP_LOST
        if plan.get("op") == PLAN_EXIT:
            dist.destroy_process_group()
            return 0
        if plan.get("op") != PLAN_STEP:
            print(f"trainer rank {rank}: unknown plan {plan.get('op')!r}", file=sys.stderr, flush=True)
            return EXIT_GROUP_LOST
        items: list[tuple[Any, Any]] = []
        base = None
        try:
            answer, base, items = mirror.prepare(plan)
        except Exception:  # noqa: BLE001 - told to every rank through the check; the reason stays here
            print(f"trainer rank {rank}: cannot take part in a step:\n{traceback.format_exc()}", file=sys.stderr,
                  flush=True)
            answer = FAILED
        try:
            agreed = check(answer)
            if agreed == OUT_OF_STEP:  # rank 0 sends every slot again, once
                plan = recv_plan()
                try:
                    answer, base, items = mirror.prepare(plan)
                except Exception:  # noqa: BLE001 - as above
                    print(f"trainer rank {rank}: cannot take part in a step:\n{traceback.format_exc()}",
                          file=sys.stderr, flush=True)
                    answer = FAILED
                agreed = check(answer)
            if agreed != IN_STEP:
                continue
            try:
                train_step_dp(base, shard(items, rank, world), grouped=bool(plan["grouped"]))
            except DataParallelStepError:
                continue  # every rank raised it; rank 0 decides what comes next
        except Exception as exc:  # noqa: BLE001 - a collective broke
            print(f"trainer rank {rank}: the group broke: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return EXIT_GROUP_LOST


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if not 0 < args.rank < args.world:
        p.error(f"--rank {args.rank}: must be in 1..{args.world - 1} (rank 0 is the trainer role)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return serve(args.rank, args.world, args.port, args.device, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
