"""One grouped training step, on the trainer's torch thread (`actors.trainer.torch_thread`).

`run_step` takes the next micro-batch of every job in the running group, canonicalises it
(`item_to_batch`), and steps each base's jobs together (`models.train_step(grouped=True)`, or
the data-parallel ranks); a tenant whose batch or step raises is isolated (its job fails, the
others step on). Every step is timed to a device synchronize and charged to its tenants by
rows (`actors.metering`). Split from `actors.trainer.trainer`, which schedules and commits;
this module only computes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from actors.trainer.ranks import Entry, RankLost
from protocol.messages import QueuePutRequest


def run_step(t: Any, group: list[Any], bases: dict[str, Any]) -> None:
    """The next micro-batch of every job of ``group`` (`actors.trainer.train_loop.Work`), in one
    grouped step per base. ``t``: the `actors.trainer.trainer.Trainer` (its counters, meter,
    ranks and settings; not imported: the trainer imports this)."""
    live = []
    for w in group:
        try:
            w.batch = item_to_batch(w.res.slot, w.items[w.cursor])
            live.append(w)
        except Exception as exc:  # noqa: BLE001 - reported as the job's failure reason
            w.error = f"micro-batch {w.cursor}: {type(exc).__name__}: {exc}"
    by_base: dict[int, list[Any]] = {}
    for w in live:
        by_base.setdefault(id(bases[w.tenant]), []).append(w)
    for part in by_base.values():
        base = bases[part[0].tenant]
        try:
            results = metered_step(t, base, part, grouped=True)
            if len({w.res.slot.adapter is None for w in part}) == 2:
                t.mixed_lora_steps += 1
            if len({w.res.slot.head.needs_prefix_kv for w in part}) == 2:
                t.mixed_expert_steps += 1
        except RankLost:
            raise
        except Exception:
            # Find the culprit: run the tenants one by one; only the failing one fails.
            results = []
            for w in part:
                try:
                    results.extend(metered_step(t, base, [w], grouped=False))
                except RankLost:
                    raise
                except Exception as exc:  # noqa: BLE001 - reported as the job's failure reason
                    w.error = f"training step {w.cursor} failed: {type(exc).__name__}: {exc}"
                    results.append(None)
        for w, r in zip(part, results):
            if r is None:
                continue
            w.cursor += 1
            t.micro_batches += 1
            w.losses.append(r.loss)
            for k, v in r.metrics.items():
                w.metrics.setdefault(k, []).append(float(v))
    for w in group:
        w.batch = None  # canonical tensors live for one step only
        w.res.measure()  # for `info`, which must not read the slot's tensors itself


def metered_step(t: Any, base: Any, part: list[Any], grouped: bool) -> list[Any]:
    """One `models.train_step`, timed (wall time ending in a device synchronize) and charged
    to the part's tenants by their rows (`actors.metering`); a step that raises is charged
    too: the device time was spent."""
    from models import train_step

    t0 = time.perf_counter()
    try:
        if t.ranks is not None:
            source = part[0].res.config.base
            return t.ranks.step(source, base_cfg(t.tcfg, source), base,
                                [Entry(w.tenant, w.res.slot, w.res.config, w.items[w.cursor], w.batch)
                                 for w in part], grouped=grouped, resident=t.store.resident)
        return train_step(base, [(w.res.slot, w.batch) for w in part], grouped=grouped)
    finally:
        sync_device(base)
        t.meter.charge("train", time.perf_counter() - t0,
                       {(w.tenant, w.job.workload): len(w.batch.features) for w in part})


def base_cfg(tcfg: Any, source: str) -> dict[str, Any]:
    """How the other ranks load ``source``: as this rank's store did (``tcfg``: TrainerConfig)."""
    from actors.trainer.slots import fast_engine_applies

    fast = tcfg.fast and fast_engine_applies(source, tcfg.device)
    return {"fast": fast, "compile": fast and tcfg.compile, "image_size": tcfg.image_size}


def sync_device(base: Any) -> None:
    """Wait for the device: a step's wall time then covers its kernels, not just their launch."""
    if base.device.type == "cuda":
        import torch

        torch.cuda.synchronize(base.device)


def item_to_batch(slot: Any, item: QueuePutRequest) -> Any:
    """One queued micro-batch (tenant schema) -> `models.TenantBatch` (canonical VLAFeature) on
    the slot's device. The frames cross to the device as uint8 and are resized there (as the
    inferencer does); the same math as ``slot.preprocessor`` on the host, bit-equal on CPU."""
    import torch
    from models import Observation, TenantBatch

    cams = slot.schema.camera_names
    obs = [Observation(images={c: item.images[c][i] for c in cams}, state=item.state[i],
                       instruction=item.instructions[i])
           for i in range(len(item.instructions))]
    device = slot.device
    vla = slot.preprocessor(obs, device=device).to(device)

    def t(x: Any) -> Any:
        return None if x is None else torch.as_tensor(np.asarray(x, dtype=np.float32), device=device)

    if item.kl_coef > 0:  # its anchor, taken now (before this step) if the slot is at its version
        slot.use_anchor(item.anchor_version)
    return TenantBatch(vla, t(item.actions), t(item.old_log_prob), t(item.advantages), t(item.returns),
                       kl_coef=item.kl_coef)
