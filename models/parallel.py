"""Data-parallel grouped training step: one step's rows spread over N ranks (torch.distributed).

    shares = shard(items, rank, world)                 # this rank's rows of every tenant
    results = train_step_dp(base, shares)              # same parameters on every rank after it

With a frozen base only the tenants' trainable tensors (head, value head, LoRA adapter, action
expert: whatever `TenantSlot.named_trainable` lists) need their gradients combined, so a step
costs one `all_reduce` of one flat fp32 buffer, whatever the number of tenants.

The math. Every head's loss is a mean over its tenant's rows (L1 / MSE / NLL / PPO terms are
per-row means; a row's element count is fixed by the tenant's schema), so the whole batch's loss
is ``sum_r (n_r / N) * loss_r`` and its gradient ``sum_r (n_r / N) * grad_r``: each rank scales
its gradients by its row share, the all-reduce sums them. A term that does not depend on the rows
(the gaussian head's entropy bonus) has the same gradient on every rank, and the weights sum to 1.
Every rank then clips and takes the same AdamW step on the same gradients, so the parameters stay
identical without a broadcast. Losses and metrics ride in the same buffer, weighted the same way:
each rank reports the whole batch's figures.

Shares are contiguous (rank r holds rows [start_r, stop_r) of each tenant; the first
``N mod world`` ranks hold one more). A tenant with fewer rows than ranks has no rows on the last
ranks: they skip its forward and contribute zero gradient with zero weight; rank 0 always holds
rows of every tenant.

Randomness. Heads draw per-row noise (flow time and noise, the action expert's) from the slot's
generator through `models.heads.base.randn/rand`; during the step a row window makes each rank
draw the whole batch's numbers and keep its own rows (`row_windows`), so rows get the noise one
process would give them and every rank's generator advances alike. A rank without rows of a
tenant draws nothing: when any tenant has fewer rows than ranks, rank 0 broadcasts those
tenants' generator states (and metric names) before the all-reduce. A forward/backward that raises on one rank raises `DataParallelStepError` on every rank,
with no step taken (one small collective before the all-reduce). Not covered: LoRA dropout
(`AdapterConfig.dropout > 0`) draws its masks on each rank's own slice, so masks differ from one
process's (the estimator is the same, the numbers are not).
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from models.base import BaseModel
from models.errors import InputError, ModelCoreError
from models.group import StepResult, forward_backward
from models.heads import TenantBatch
from models.heads.base import row_windows
from models.slot import TenantSlot


class DataParallelStepError(ModelCoreError):
    """A data-parallel step failed on some rank, and so on every rank: no optimizer step was
    taken and every slot's generator is back where the step began (the caller may retry, e.g.
    tenant by tenant, with the same collective protocol)."""


@dataclass
class RowShare:
    """One tenant's part of a data-parallel step on one rank."""

    slot: TenantSlot
    batch: TenantBatch | None  # this rank's rows (None: the rank holds none of this tenant)
    start: int  # first row of the step's batch this rank holds
    total: int  # the tenant's rows in the whole step, over all ranks

    @property
    def rows(self) -> int:
        return 0 if self.batch is None else len(self.batch)


def split_rows(total: int, world: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) per rank; the first ``total % world`` ranks hold one row more."""
    if world < 1:
        raise InputError(f"world={world}: need at least one rank")
    base, extra = divmod(total, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def slice_batch(batch: TenantBatch, start: int, stop: int) -> TenantBatch:
    """Rows [start, stop) of a tenant batch (RL fields too)."""
    cut = slice(start, stop)
    opt = (batch.old_log_prob_B, batch.advantages_B, batch.returns_B)
    return TenantBatch(batch.features.index(cut), batch.actions_B_H_A[cut],
                       *(x[cut] if x is not None else None for x in opt), kl_coef=batch.kl_coef)


def shard(items: Sequence[tuple[TenantSlot, TenantBatch]], rank: int, world: int) -> list[RowShare]:
    """This rank's share of every tenant of a step (every rank gets every tenant, maybe 0 rows)."""
    if not 0 <= rank < world:
        raise InputError(f"rank={rank}: must be in [0, {world})")
    out = []
    for slot, batch in items:
        if len(batch) == 0:
            raise InputError(f"tenant {slot.tenant_id}: a step needs at least one row")
        start, stop = split_rows(len(batch), world)[rank]
        out.append(RowShare(slot, slice_batch(batch, start, stop) if stop > start else None, start, len(batch)))
    return out


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where collective buffers live: the current CUDA device for NCCL, the CPU for gloo. A
    group of both (the trainer's ranks on CUDA: ``cpu:gloo,cuda:nccl``) puts them on the
    device, so the gradients go over NCCL and only the plans over gloo."""
    backend = str(dist.get_backend(group))
    if backend == "nccl" or ("cuda:nccl" in backend and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train_step_dp(base: BaseModel, shares: Sequence[RowShare], *, group: dist.ProcessGroup | None = None,
                  grouped: bool = True, timings: dict[str, float] | None = None) -> list[StepResult]:
    """One grouped step of every tenant over the ranks of ``group`` (default: the world).

    Every rank calls it with the same tenants in the same order (`shard`). Runs the grouped
    forward/backward on this rank's rows (models.group.forward_backward), all-reduces the
    row-weighted gradients, losses and metrics in one flat buffer, then every rank takes the same
    optimizer step. Returns the whole batch's figures per tenant on every rank. If any rank's
    forward/backward raises, every rank raises `DataParallelStepError` with nothing changed."""
    ids = [s.slot.tenant_id for s in shares]
    if len(set(ids)) != len(ids):
        raise InputError(f"train_step_dp: a tenant appears twice in one step: {ids}")
    world = dist.get_world_size(group)
    t0 = time.perf_counter()
    local = [s for s in shares if s.batch is not None]
    for s in shares:
        s.slot.zero_grad()  # tenants without rows here contribute no gradient
    rng = [s.slot.generator.get_state() for s in shares]
    windows = {s.slot.generator: (s.start, s.rows, s.total) for s in local}
    error: Exception | None = None
    results: list[StepResult] = []
    try:
        with row_windows(windows):
            results = forward_backward(base, [(s.slot, s.batch) for s in local], grouped=grouped)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below and raises
        error = exc
    by_id = {r.tenant_id: r for r in results}
    t1 = time.perf_counter()
    _agree(shares, by_id, world, error, rng, group)
    names = _metric_names(shares, by_id, world, group)
    buf = _pack(shares, by_id, names, comm_device(group))
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    out = _unpack(shares, names, buf)
    t2 = time.perf_counter()
    for s, r in zip(shares, out):
        r.metrics.update(s.slot.optimizer_step())
        r.policy_version = s.slot.policy_version
    if timings is not None:
        timings.update(forward_backward_s=t1 - t0, allreduce_s=t2 - t1, optimizer_s=time.perf_counter() - t2)
    return out


def _agree(shares: Sequence[RowShare], by_id: dict[str, StepResult], world: int, error: Exception | None,
           rng: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """One small collective before the big one: did any rank fail its forward/backward, and do
    the ranks agree on the buffer's layout (a digest of the metric names of the tenants every
    rank holds rows of)? Either way every rank raises the same error instead of one rank raising
    and the others blocking in the all-reduce until its timeout."""
    dense = [sorted(by_id[s.slot.tenant_id].metrics) if s.slot.tenant_id in by_id else None
             for s in shares if s.total >= world]
    digest = zlib.crc32(json.dumps(dense).encode()) if error is None else 0
    flags = torch.tensor([int(error is not None), digest, -digest], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed, high, neg_low = (int(x) for x in flags.cpu())
    if not failed and high == -neg_low:
        return
    for s, state in zip(shares, rng):
        s.slot.zero_grad()
        s.slot.generator.set_state(state)
    rank = dist.get_rank(group)
    if error is not None:
        raise DataParallelStepError(f"rank {rank}: {type(error).__name__}: {error}") from error
    if failed:
        raise DataParallelStepError(f"rank {rank}: another rank's forward/backward failed; no step taken")
    raise DataParallelStepError(f"rank {rank}: ranks disagree on the tenants' metric names (a tenant's head or "
                                "batch kind differs between ranks); no step taken")


def _metric_names(shares: Sequence[RowShare], by_id: dict[str, StepResult], world: int,
                  group: dist.ProcessGroup | None) -> list[list[str]]:
    """Sorted metric names per tenant, equal on every rank. A tenant every rank holds rows of
    gives the same names everywhere (same head, same kind of batch); when a tenant has fewer rows
    than ranks, rank 0 (which always holds rows) broadcasts those tenants' names and generator
    states, so a rank that drew nothing for them continues from the same stream."""
    names = [sorted(by_id[s.slot.tenant_id].metrics) if s.batch is not None else [] for s in shares]
    sparse = [i for i, s in enumerate(shares) if s.total < world]
    if not sparse:
        return names
    dev = comm_device(group)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    if dist.get_rank(group) == 0:
        states = [shares[i].slot.generator.get_state() for i in sparse]
        meta = json.dumps({"names": [names[i] for i in sparse], "sizes": [int(t.numel()) for t in states]}).encode()
        payload = torch.cat([torch.frombuffer(bytearray(meta), dtype=torch.uint8), *states]).to(dev)
        head = torch.tensor([len(meta), payload.numel()], dtype=torch.int64, device=dev)
    else:
        head = torch.zeros(2, dtype=torch.int64, device=dev)
    dist.broadcast(head, src=src, group=group)
    meta_len, size = (int(x) for x in head.cpu())
    if dist.get_rank(group) != 0:
        payload = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src=src, group=group)
    payload = payload.cpu()
    meta = json.loads(bytes(payload[:meta_len].tolist()))
    at = meta_len
    for i, tenant_names, n in zip(sparse, meta["names"], meta["sizes"]):
        names[i] = tenant_names
        shares[i].slot.generator.set_state(payload[at:at + n].clone())
        at += n
    return names


def _pack(shares: Sequence[RowShare], by_id: dict[str, StepResult], names: list[list[str]],
          device: torch.device) -> torch.Tensor:
    """[per tenant: weighted grads of each trainable tensor | one has-grad flag per tensor |
    weighted loss, weighted metrics]: one fp32 buffer, one layout on every rank."""
    parts: list[torch.Tensor] = []
    for s, tenant_names in zip(shares, names):
        w = s.rows / s.total
        params = [p for _, p in s.slot.named_trainable()]
        flags = []
        for p in params:
            if p.grad is None:
                parts.append(torch.zeros(p.numel(), dtype=torch.float32, device=device))
                flags.append(0.0)
            else:
                parts.append(p.grad.detach().reshape(-1).to(device, torch.float32) * w)
                flags.append(1.0)
        figures = [0.0] * (1 + len(tenant_names))
        if s.batch is not None:
            r = by_id[s.slot.tenant_id]
            if sorted(r.metrics) != tenant_names:
                raise InputError(f"tenant {s.slot.tenant_id}: metrics {sorted(r.metrics)} differ from rank 0's "
                                 f"{tenant_names}")
            figures = [w * r.loss] + [w * float(r.metrics[k]) for k in tenant_names]
        parts.append(torch.tensor(flags + figures, dtype=torch.float32, device=device))
    return torch.cat(parts)


def _unpack(shares: Sequence[RowShare], names: list[list[str]], buf: torch.Tensor) -> list[StepResult]:
    """Reduced gradients into each trainable tensor's .grad (None where no rank had one, as one
    process would leave it: AdamW then skips that tensor), and the whole batch's figures."""
    out, at = [], 0
    for s, tenant_names in zip(shares, names):
        params = [p for _, p in s.slot.named_trainable()]
        grads = []
        for p in params:
            grads.append(buf[at:at + p.numel()])
            at += p.numel()
        flags = buf[at:at + len(params)].cpu()
        at += len(params)
        figures = buf[at:at + 1 + len(tenant_names)].cpu().tolist()
        at += 1 + len(tenant_names)
        for p, g, flag in zip(params, grads, flags.tolist()):
            p.grad = g.view_as(p).to(p.device, p.dtype) if flag > 0 else None
        out.append(StepResult(s.slot.tenant_id, figures[0], dict(zip(tenant_names, figures[1:]))))
    return out
