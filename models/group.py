"""Group-batched forward: many tenants' batches through one base forward.

    outs = encode_grouped(base, [vla_a, vla_b, vla_c])        # one forward per distinct key
    res = train_step(base, [(slot_a, batch_a), (slot_b, batch_b)], grouped=True)
    acts = predict(base, [(slot_a, vla_a), (slot_b, vla_b)], grouped=True)

Policy for mixed keys: batches are partitioned by `CompatibilityKey`; each partition gets its
own base forward, in order of first appearance. Batches with different keys are never
concatenated (`VLABatch.cat` raises `IncompatibleBatchError` if asked). Pass `strict=True` to
refuse mixed keys instead, for callers that promised a single key.

Training: the base forward runs under no_grad once per partition; each tenant's head then
computes its loss on its own rows of the features, backward reaches only that head (the
features are leaves without grad), and each slot takes its own AdamW step. Slots with a LoRA
adapter (models/lora.py) add their deltas to their own rows inside that one forward, which then
records autograd through the language model for them; their losses go backward together, once.
Slots with an action expert (models/heads/expert.py) read the per-layer KV cache that same one
forward returns for all rows, each on its own rows. `grouped=False`
runs the identical math with one base forward per tenant: the reference for correctness
tests and benchmarks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from models.base import BaseModel
from models.errors import IncompatibleBatchError, InputError
from models.features import VLABatch
from models.heads import TenantBatch
from models.outputs import BaseOutput
from models.slot import TenantSlot


@dataclass
class StepResult:
    tenant_id: str
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0


def partition_by_key(vlas: Sequence[VLABatch]) -> list[list[int]]:
    """Indices of `vlas` grouped by key, groups in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for i, v in enumerate(vlas):
        groups.setdefault(v.key, []).append(i)
    return list(groups.values())


def encode_grouped(base: BaseModel, vlas: Sequence[VLABatch], *, strict: bool = False,
                   inference: bool = False, slots: Sequence[TenantSlot] | None = None,
                   train: bool = False) -> list[BaseOutput]:
    """Base features for each batch, one base forward per distinct compatibility key.

    slots (one per batch): route each batch's rows through its slot's LoRA adapter, if it has
    one, inside that shared forward (models.lora); `train` records autograd for them. When any
    slot's head is an action expert, that one forward also returns the per-layer prefix KV
    cache for all its rows (`BaseOutput.prefix`)."""
    if not vlas:
        return []
    parts = partition_by_key(vlas)
    if strict and len(parts) > 1:
        raise IncompatibleBatchError(f"{len(parts)} compatibility keys in a strict group: {[str(vlas[p[0]].key) for p in parts]}")
    outs: list[BaseOutput | None] = [None] * len(vlas)
    for idx in parts:
        packed = VLABatch.cat([vlas[i] for i in idx])
        feats = base.encode(packed, inference=inference, adapters=_segments(slots, idx, vlas, train),
                            prefix_kv=needs_prefix_kv(slots, idx))
        for i, f in zip(idx, feats.split([len(vlas[i]) for i in idx])):
            outs[i] = f
    return outs  # type: ignore[return-value]


def encode_serial(base: BaseModel, vlas: Sequence[VLABatch], *, inference: bool = False,
                  slots: Sequence[TenantSlot] | None = None, train: bool = False) -> list[BaseOutput]:
    return [base.encode(v, inference=inference, adapters=_segments(slots, [i], vlas, train),
                        prefix_kv=needs_prefix_kv(slots, [i]))
            for i, v in enumerate(vlas)]


def needs_prefix_kv(slots: Sequence[TenantSlot] | None, idx: Sequence[int]) -> bool:
    """Whether a forward over batches ``idx`` must also return the per-layer KV cache."""
    return slots is not None and any(slots[i].head.needs_prefix_kv for i in idx)


def _segments(slots: Sequence[TenantSlot] | None, idx: list[int], vlas: Sequence[VLABatch], train: bool) -> list:
    """LoRA segments of one packed forward of batches ``idx`` (rows in that order)."""
    if slots is None:
        return []
    out, start = [], 0
    for i in idx:
        seg = slots[i].adapter_segment(start, start + len(vlas[i]), train=train)
        if seg is not None:
            out.append(seg)
        start += len(vlas[i])
    return out


def _check(base: BaseModel, slot: TenantSlot, vla: VLABatch) -> None:
    if vla.key != slot.key:
        raise InputError(f"tenant {slot.tenant_id}: batch key {vla.key} is not the slot's key {slot.key}")
    if slot.device != base.device:
        raise InputError(f"tenant {slot.tenant_id}: slot is on {slot.device}, base on {base.device}; call slot.to()")


def forward_backward(base: BaseModel, items: Sequence[tuple[TenantSlot, TenantBatch]], *, grouped: bool = True,
                     timings: dict[str, float] | None = None) -> list[StepResult]:
    """Base forward (grouped or serial), then per tenant: zero_grad, head loss, backward.
    No optimizer step. `timings` (if given) receives base_s and heads_s wall times.

    Tenants with a LoRA adapter: their features carry autograd through the shared forward; their
    losses go backward together, once through it (each adapter's gradient comes only from its
    own tenant's rows). Frozen-base tenants' features are detached: their backward stops at
    their head, as without LoRA."""
    for slot, batch in items:
        _check(base, slot, batch.features)
    t0 = time.perf_counter()
    vlas = [b.features for _, b in items]
    slots = [s for s, _ in items]
    for slot in slots:
        slot.zero_grad()
    # Dropout seeds come from the slots' generators before any head draws, in both paths.
    feats = (encode_grouped(base, vlas, slots=slots, train=True) if grouped
             else encode_serial(base, vlas, slots=slots, train=True))
    _sync(base)
    t1 = time.perf_counter()
    results = []
    adapted: list[torch.Tensor] = []
    for (slot, batch), f in zip(items, feats):
        if slot.adapter is None and f.hidden_B_L_D.requires_grad:
            f = f.detach()
        out = slot.head.loss(f, batch, slot.generator)
        if slot.adapter is None:
            out.loss.backward()
        else:
            adapted.append(out.loss)
        results.append(StepResult(slot.tenant_id, float(out.loss.detach()), dict(out.metrics)))
    if adapted:
        torch.autograd.backward(adapted)
    _sync(base)
    if timings is not None:
        timings["base_s"] = t1 - t0
        timings["heads_s"] = time.perf_counter() - t1
    return results


def train_step(base: BaseModel, items: Sequence[tuple[TenantSlot, TenantBatch]], *, grouped: bool = True
               ) -> list[StepResult]:
    """One training step for every (slot, batch): shared base forward, private backward and AdamW step."""
    ids = [s.tenant_id for s, _ in items]
    if len(set(ids)) != len(ids):
        raise InputError(f"train_step: a tenant appears twice in one step: {ids}")
    results = forward_backward(base, items, grouped=grouped)
    for (slot, _), r in zip(items, results):
        r.metrics.update(slot.optimizer_step())
        r.policy_version = slot.policy_version
    return results


def predict(base: BaseModel, items: Sequence[tuple[TenantSlot, VLABatch]], *, grouped: bool = True
            ) -> list[torch.Tensor]:
    """Actions (B, H, A) per tenant from the current heads; base under inference_mode."""
    for slot, vla in items:
        _check(base, slot, vla)
    vlas = [v for _, v in items]
    with torch.inference_mode():
        slots = [s for s, _ in items]
        feats = (encode_grouped(base, vlas, inference=True, slots=slots) if grouped
                 else encode_serial(base, vlas, inference=True, slots=slots))
        if not grouped:
            return [slot.head.predict(f, vla, slot.generator) for (slot, vla), f in zip(items, feats)]
        return predict_heads(items, feats)


def predict_heads(items: Sequence[tuple[TenantSlot, VLABatch]], feats: list[BaseOutput]) -> list[torch.Tensor]:
    """Each tenant's head on its features; heads of one `batch_key` (the action experts of one
    shape, with equally many rows) sample together through `predict_many` (a bucket of one too)."""
    out: list[torch.Tensor | None] = [None] * len(items)
    buckets: dict[object, list[int]] = {}
    for j, ((slot, _), f) in enumerate(zip(items, feats)):
        key = slot.head.batch_key(f)
        buckets.setdefault(key if key is not None else ("alone", j), []).append(j)
    for key, idx in buckets.items():
        slots = [items[j][0] for j in idx]
        # A head with a batch key samples through `predict_many` even alone (the action expert's
        # captured Euler loop, models/heads/expert.py); one without samples on its own.
        if isinstance(key, tuple) and key[:1] == ("alone",):
            out[idx[0]] = slots[0].head.predict(feats[idx[0]], items[idx[0]][1], slots[0].generator)
            continue
        acts = type(slots[0].head).predict_many([s.head for s in slots], [feats[j] for j in idx],
                                                [items[j][1] for j in idx], [s.generator for s in slots])
        for j, a in zip(idx, acts):
            out[j] = a
    return out  # type: ignore[return-value]


def _sync(base: BaseModel) -> None:
    if base.device.type == "cuda":
        torch.cuda.synchronize(base.device)
