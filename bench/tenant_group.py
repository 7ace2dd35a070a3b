"""Set-up shared by the per-tenant model-core benchmarks (bench/lora_group.py,
bench/expert_group.py): a base, N tenant slots alternating LIBERO-like and CALVIN-like schemas,
one canonical batch per tenant already on the device, the grouped-vs-serial inference forward,
medians of CUDA-synchronised wall times, and the one-row table + JSON they print."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from models import BaseConfig, BaseModel, TenantSlot, encode_grouped, encode_serial
from models.heads import TenantBatch
from models.testing import calvin_schema, libero_schema, random_batch


@dataclass
class GroupRow:
    """The leading fields of every per-tenant benchmark row (subclasses add their figures)."""

    preset: str
    device: str
    tenants: int
    frozen: int
    batch: int


@dataclass
class TenantGroup:
    base: BaseModel
    slots: list[TenantSlot]
    batches: list[TenantBatch]

    @property
    def vlas(self) -> list:
        return [b.features for b in self.batches]

    @property
    def items(self) -> list[tuple[TenantSlot, TenantBatch]]:
        return list(zip(self.slots, self.batches))

    def encode(self, grouped: bool) -> list:
        """The base forward for every tenant's rows (inference_mode): one, or one per tenant."""
        with torch.inference_mode():
            return (encode_grouped(self.base, self.vlas, inference=True, slots=self.slots) if grouped
                    else encode_serial(self.base, self.vlas, inference=True, slots=self.slots))


def build(args: argparse.Namespace, slot_options: Callable[[int], dict[str, Any]]) -> TenantGroup:
    """`args.tenants` slots on `args.preset` (TenantSlot.create keyword options per tenant index
    from ``slot_options``), `args.batch` rows each, seeded by the tenant index."""
    base = BaseModel.load(BaseConfig(args.preset, device=args.device))
    slots = [TenantSlot.create(f"t{i}", libero_schema() if i % 2 == 0 else calvin_schema(), base, seed=i,
                               **slot_options(i)) for i in range(args.tenants)]
    batches = [random_batch(s.preprocessor, args.batch, seed=i) for i, s in enumerate(slots)]
    for b in batches:
        b.features = b.features.to(base.device)
    return TenantGroup(base, slots, batches)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` (ms) after ``warmup`` calls, CUDA synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def add_common_args(p: argparse.ArgumentParser, tenants: int, batch: int) -> None:
    p.add_argument("--preset", default="tiny-qwen3-vl-64")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tenants", type=int, default=tenants)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the row here")


def emit(row: dict[str, Any], path: Path | None) -> None:
    """The row as a one-line markdown table, and as JSON at ``path``."""
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=2) + "\n")
