"""The workload orchestrator half of the master: specs in, producers out, lifecycle events.

Two ways in, one path:
  * request-reply ``<prefix>.master.submit`` (the SDK, `nexus submit`): the reply is the
    accepted `WorkloadRecord` or an error listing every invalid field;
  * the durable intake stream on ``<prefix>.workloads.submit``: any NATS client publishes a
    spec (YAML or JSON bytes); acceptance or the field errors arrive as `WorkloadEvent`s on
    ``<prefix>.workloads.events.<workload>``. The workload id is derived from the stream
    sequence, so a message redelivered after a master crash is recognised, never run twice.

Then, in order: 1. validate (`master.spec.parse_spec`); 2. create the tenant (sft / rl) from
the compiled config, or (eval) resolve the policy it scores: that tenant must exist, the
version too (``latest``: its newest export), and base, head and schema come from the
version's export manifest; 3. record the workload ``pending`` in KV;
4. start its producer on an env worker (``running``); 5. follow the producer's events
(progress, done) into the record (``completed`` / ``failed``); ``cancel`` stops the producer
(``cancelled``). Every state change is published as an event. An eval workload's version
is resolved at submit and recorded (``eval_version``); one submitted while a training
workload of its tenant is pending or running waits for it and pins ``latest`` when it ends
(the trained result). A restarted master reloads every record and
keeps following; producers live on env workers and are not interrupted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import time
import uuid
from msgspec.structs import replace
from pathlib import Path
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError, NotFoundError, ObjectNotFoundError

from actors.identity import current_caller, deny, require_tenant
from actors.paths import caller_roots, confine, tenant_datasets
from actors.bus import js_retry
from actors.runtime import op
from actors.tracing import consumer_span
from protocol.errors import Conflict, FailedPrecondition, NexusError, NotFound
from protocol.messages import (
    MAX_TASK_ROWS,
    MAX_TASK_TEXT,
    TERMINAL_WORKLOAD_STATES,
    CreateTenantRequest,
    HandbackRequest,
    Ok,
    ProducerSpec,
    SubmitRequest,
    TaskResult,
    TenantConfig,
    TenantsReply,
    WeightsRef,
    WorkloadEvent,
    WorkloadRecord,
    WorkloadRef,
    WorkloadReport,
    WorkloadsReply,
    WorkloadsRequest,
)
from protocol.policy import LIFECYCLE_SAVE, MAX_REPORTS_PER_TENANT
from protocol.wire import decode, encode, to_body
from master.records import is_hosted, is_hosted_worker, policy_pin_tenant
from master.paging import page, time_key
from master.store import kv_keys, kv_values, store_put
from master.tenant_checks import base_fit_errors

INTAKE_DURABLE = "master-intake"
# Deliveries of one intake message at most; the last one that fails is rejected with an event.
INTAKE_MAX_DELIVER = 5
PENDING_RETRY_S = 1.0
# Asking each registered inferencer which base it serves, at submit: a short bound per
# instance (a busy one still answers info at once: control ops skip the concurrency slots).
INFERENCER_INFO_TIMEOUT_S = 2.0


def new_workload_id() -> str:
    return f"w{int(time.time()):010d}{uuid.uuid4().hex[:6]}"


def policy_pin(spec: Any) -> tuple[str, int | str]:
    """(tenant whose policy an eval scores, version pin: an int or 'latest')."""
    version = spec.eval.version if spec.eval is not None else "latest"
    if isinstance(version, str) and version.startswith("tenant:"):
        name, _, pin = version.removeprefix("tenant:").partition("@")
        return name, int(pin) if pin.isdigit() else "latest"
    return spec.tenant, version


def step_budget(spec: Any, version: int) -> int:
    """The optimizer steps a workload trains from its tenant's ``version`` (0: no step budget):
    this workload's own, never the tenant's total. sft: algorithm.steps, or up to
    algorithm.until_version; schedule.budget.max_steps, when set, caps either (the first limit
    reached ends the workload); rl: schedule.budget.max_steps."""
    limit = spec.schedule.budget.max_steps or 0
    if spec.task != "sft" or spec.algorithm is None:
        return limit
    alg = spec.algorithm
    planned = alg.steps if alg.steps is not None else max(0, alg.until_version - version)
    return min(limit, planned) if limit else planned


def budget_note(spec: Any, version: int) -> str:
    """What the accepted event (and `nexus submit`) says the workload will train."""
    steps = step_budget(spec, version)
    if spec.task == "eval":
        return ""
    if not steps:
        return f"; from version {version}"
    return f"; from version {version}, {steps} more steps (to version {version + steps})"


def compile_producer(spec: Any, workload: str, eval_version: int = -1, start_version: int = 0) -> ProducerSpec:
    """The env worker's part of a workload spec; ``start_version``: the tenant's version when
    the workload was accepted (its step budget counts from there)."""
    budget = spec.schedule.budget
    algo = spec.algorithm.model_dump() if spec.algorithm is not None else {}
    p = ProducerSpec(workload=workload, tenant=spec.tenant, kind=spec.task, seed=spec.seed,
                     max_steps=step_budget(spec, start_version), max_episodes=budget.max_episodes or 0,
                     max_wall_s=float(budget.max_wall_s or 0.0),
                     start_version=start_version if spec.task != "eval" else -1)
    if budget.target is not None:
        t = budget.target
        p.target_metric, p.target_at_least, p.target_at_most, p.target_window = (
            t.metric, t.at_least, t.at_most, t.window)
    if spec.env is not None:
        p.env_id, p.env_options, p.hosted = spec.env.id, dict(spec.env.options), spec.env.hosted or ""
        if spec.env.demos is not None:
            p.demo_episodes, p.demo_noise = spec.env.demos.episodes, spec.env.demos.noise
            p.demo_seed = spec.env.demos.seed
            p.record_path = str(tenant_datasets(Path(), spec.tenant) / workload)
    if spec.dataset is not None:
        p.dataset_root, p.camera_map = spec.dataset.root, dict(spec.dataset.camera_map)
        p.state_key, p.action_key = spec.dataset.state_key, spec.dataset.action_key
    if spec.eval is not None:
        # eval: the workload itself; sft / rl: a closing evaluation of the final version.
        p.eval_episodes, p.eval_seed, p.eval_sample = spec.eval.episodes, spec.eval.seed, spec.eval.sample
        tasks = spec.eval.tasks
        p.eval_all_tasks = tasks == "all"
        p.eval_tasks = list(tasks) if isinstance(tasks, list) else []
    if spec.task == "sft":
        p.algo = {"batch_size": algo["batch_size"], "items_per_job": algo["items_per_job"]}
    elif spec.task == "rl":
        # `is not None`, not truthiness: gamma 0 and gae_lambda 0 are meaningful values.
        p.algo = {k: algo[k] for k in ("gamma", "gae_lambda", "episodes_per_update", "steps_per_update",
                                       "micro_batch", "epochs", "parallel_envs") if algo.get(k) is not None}
        p.algo["normalize_advantages"] = bool(algo["normalize_advantages"])
        p.algo["value_warmup_episodes"] = int(algo["value_warmup_episodes"])
    else:
        p.policy_tenant, _ = policy_pin(spec)
        p.eval_version = eval_version
    return p


class WorkloadOps:
    """Mixed into `master.service.Master`: the workload ops and their background tasks."""

    workloads: dict[str, WorkloadRecord]
    _starting: set[str]

    async def setup_workloads(self) -> None:
        self.workloads = {}
        self._unsaved: dict[str, tuple[str, str]] = {}  # workload -> (state, message) KV refused
        # workload -> (its transition lock, holders and waiters): one state change at a time
        # per workload; dropped when nobody holds or waits (bounded by the transitions in flight).
        self._state_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        for value in await kv_values(self.kv_workloads):
            rec = decode(value, WorkloadRecord)
            self.workloads[rec.workload] = rec
        nc = self.bus.nc
        await nc.subscribe(self.names.workload_events_all, cb=self._on_workload_event)
        # Events that arrived while no master ran (a producer finishing, say) are in the
        # events stream: apply each unfinished workload's last one.
        for rec in list(self.workloads.values()):
            if rec.state not in TERMINAL_WORKLOAD_STATES:
                try:
                    last = await js_retry(self.bus.js.get_last_msg, self.names.stream_events,
                                          self.names.workload_events(rec.workload))
                except NotFoundError:
                    continue
                await self._apply_event(decode(last.data, WorkloadEvent))
        # Workloads whose producer's worker is gone (it stopped or died while no master ran)
        # are handed to another worker now, not left running on nobody.
        for rec in list(self.workloads.values()):
            if (rec.state == "running" and rec.worker and not is_hosted_worker(rec.worker)
                    and not await self.alive("env", rec.worker)):
                await self._repend(rec, f"env worker {rec.worker} is gone (found at master start)")
        self.spawn(self._intake_loop, "workload-intake", critical=True, max_quiet_s=60.0)
        self.spawn(self._pending_loop, "workload-pending", critical=True, max_quiet_s=60.0)

    # -- submission ----------------------------------------------------------------------
    @op("submit", SubmitRequest, access="checked")
    async def submit(self, req: SubmitRequest) -> WorkloadRecord:
        data: Any = req.spec if req.spec else req.spec_text
        return await self._accept(data, new_workload_id())

    async def _accept(self, data: Any, workload: str) -> WorkloadRecord:
        from master.spec import compile_tenant, parse_spec, spec_to_dict

        if workload in self.workloads:
            return self.workloads[workload]  # a redelivered intake message: already accepted
        from master.spec import SpecError, dataset_errors
        from master.submit_checks import run_errors

        spec = parse_spec(data)  # SpecError lists every bad field
        require_tenant(spec.tenant, "submit")  # the platform's intake passes; a tenant submits its own
        # Capacity before anything is created: a refused workload leaves no tenant or record.
        self.check_workload_capacity()
        if spec.task != "eval" and spec.tenant not in self.sched.tenants:
            self.check_tenant_capacity()
        if spec.dataset is not None:
            confine(spec.dataset.root, "dataset.root", caller_roots(self.cfg.data_dir))
        ds_errors = dataset_errors(spec)  # features vs schema, when the dataset is readable here
        # What the run would refuse in its first seconds (env options and cameras, head params,
        # a row over this server's max payload): refused now, before any tenant slot exists.
        ds_errors += run_errors(spec, self.bus.max_payload, "this deployment's server")
        if ds_errors:
            raise SpecError(ds_errors)
        written = spec  # stored as the tenant wrote it (registered:<name>, never its host path)
        if spec.base is not None:
            spec = spec.model_copy(update={"base": await self.resolve_base(spec.base, "base")})
        if spec.task == "eval":
            return await self._accept_eval(spec, workload)
        serving_note = await self._check_base_served(spec.tenant, spec.base) if spec.task == "rl" else ""
        cfg = compile_tenant(spec)
        if cfg.base_adapter or cfg.head == "expert":
            # Against the base's own layers (config only, no weights), before anything is created.
            errors = await asyncio.to_thread(base_fit_errors, cfg)
            if errors:
                raise SpecError(errors)
        existing = self.sched.tenants.get(spec.tenant)
        # The spec's priority and caps within the tenant's quotas (the operator's, or the
        # defaults: a spec carries none), checked before anything is created or changed.
        self.check_schedule(cfg, existing or cfg, "schedule")
        if existing is not None:
            # A tenant outlives its workloads: the next one (SFT, then RL from that policy,
            # then an eval) keeps the slot, versions and history, one workload at a time.
            active = [w.workload for w in self.workloads.values()
                      if w.tenant == spec.tenant and w.state in ("pending", "running")]
            if active:
                raise Conflict(f"tenant {spec.tenant!r} is running workload {active[0]}; a tenant runs one workload "
                               "at a time: wait for it to end or cancel it", details={"tenant": spec.tenant,
                                                                                       "workload": active[0]})
            _check_same_policy(cfg, existing, same_tenant=True)
        if spec.init is not None and existing is not None:
            raise SpecError([("init", f"tenant {spec.tenant!r} exists (version {self.sched.versions.get(spec.tenant, 0)}) "
                              "and keeps its own weights; only a tenant this submit creates starts from uploaded "
                              "weights: remove init, or `nexus tenant delete` the tenant first", spec.init.weights)])
        # The budget counts from the tenant's version now (a tenant outlives its workloads: a
        # spec submitted again trains its steps again, from where the last one ended).
        version = max(0, self.sched.versions.get(spec.tenant, 0)) if existing is not None else 0
        until = getattr(spec.algorithm, "until_version", None)
        if until is not None and until <= version:
            raise SpecError([("algorithm.until_version", f"{until} is already reached (the tenant is at version "
                              f"{version}); allowed: a version above {version}, or algorithm.steps to train more",
                              until)])
        if cfg.optim:
            # The LR schedule (warmup, cosine over the budget) is this workload's: it starts at
            # the tenant's version now, and an until_version total is the steps to it from here.
            cfg.optim["schedule_start"] = version
            if until is not None:
                cfg.optim["total_steps"] = until - version
        if existing is not None:
            await self._update_scheduling(existing, cfg)
        else:
            # The base as the spec named it: tenant_create resolves it again, under the same rule.
            started = await self.start_from_upload(cfg, spec.init) if spec.init is not None else ""
            cfg.base = written.base or cfg.base
            try:
                await self.tenant_create(CreateTenantRequest(config=cfg))
            except BaseException:
                if started:
                    await self.drop_start(cfg.name)
                raise
        return await self._record(workload, spec, spec_to_dict(written), budget_note(spec, version) + serving_note,
                                  start_version=version, budget_steps=step_budget(spec, version))

    async def _record(self, workload: str, spec: Any, stored: dict[str, Any], note: str,
                      eval_version: int = -1, start_version: int = -1, budget_steps: int = 0) -> WorkloadRecord:
        now = time.time()
        hosted = spec.env is not None and spec.env.hosted is not None
        if hosted:
            note += self.hosted_note(spec.tenant)  # says clearly when no hosted process is connected
        rec = WorkloadRecord(workload=workload, tenant=spec.tenant, task=spec.task, state="pending",
                             spec=stored, created_at=now, updated_at=now, eval_version=eval_version,
                             start_version=start_version, budget_steps=budget_steps)
        if hosted:
            rec.message = f"waiting for a hosted env process{note}"
        await self._save_workload(rec)  # KV first: a record it does not hold is never in memory
        self.workloads[workload] = rec
        await self._publish_event(rec, "accepted",
                                  message=f"{spec.task} workload of tenant {spec.tenant} accepted{note}")
        await self._try_start(rec)
        return rec

    async def _accept_eval(self, spec: Any, workload: str) -> WorkloadRecord:
        """An eval names an existing policy (its tenant and a version) and takes base, head and
        schema from it: nothing is repeated, no slot is made. The version is resolved now and
        recorded (``eval_version``); ``latest`` while a training workload of that tenant is
        still ahead is resolved when it ends (the trained result). Sections the spec repeats
        anyway must match the policy, each mismatch an error naming its field."""
        from master.spec import SpecError, spec_to_dict

        target, pin = policy_pin(spec)
        require_tenant(target, "submit an eval of")  # another tenant's policy is not the caller's to read
        cfg = self.sched.tenants.get(target)
        if cfg is None:
            field = "tenant" if target == spec.tenant else "eval.version"
            # Names only the tenant asked about (the caller's own): never the deployment's others.
            raise NotFound(f"tenant {target!r} does not exist: an eval scores an existing tenant's policy "
                           "(train it first with an sft or rl workload)",
                           details={"field": field, "tenant": target})
        training = [w for w in self.workloads.values() if w.tenant == target and w.task != "eval"
                    and w.state in ("pending", "running")]
        version, policy = await self._resolve_policy(cfg, pin, bool(training))
        sections = policy_sections(policy)
        errors = policy_mismatches(spec, sections, target, version)
        if not errors:
            # The env against the scored policy's cameras, state and action (its rows fit already).
            from master.spec import ActionSpec, ObservationSpec
            from master.submit_checks import env_errors

            scored = spec.model_copy(update={"observation": ObservationSpec.model_validate(sections["observation"]),
                                             "action": ActionSpec.model_validate(sections["action"])})
            errors = env_errors(scored, f"the scored policy's (tenant {target}"
                                 + (f", version {version})" if version >= 0 else ")"))
        if errors:
            raise SpecError(errors)
        note = await self._check_base_served(spec.tenant, sections["base"])
        # The stored spec says what is scored: the policy's sections filled in.
        stored = {**spec_to_dict(spec), **sections}
        if version < 0:
            note += f"; it starts when {training[0].workload} of tenant {target} ends and scores its latest version"
        return await self._record(workload, spec, stored, note, eval_version=version)

    async def _resolve_policy(self, cfg: TenantConfig, pin: int | str, training: bool) -> tuple[int, dict[str, Any]]:
        """(version, export manifest) of the policy an eval pins; (-1, the tenant's config as a
        manifest) for ``latest`` behind a training workload. A version that does not exist is
        an error naming tenant and version, never a silent version 0."""
        from actors.weights import get_manifest, weights_name

        tenant = cfg.name
        # A manifest of an older format may lack a key: the slot's config says the same.
        as_manifest = {"base": cfg.base, "schema": cfg.schema, "head": cfg.head, "head_params": cfg.head_params}
        if isinstance(pin, int):
            store = await js_retry(self.bus.js.object_store, self.names.obj_weights)
            try:
                await store.get_info(f"{weights_name(tenant, pin)}.manifest.json")
            except ObjectNotFoundError:
                latest = self.sched.versions.get(tenant)
                raise NotFound(f"tenant {tenant!r} has no policy version {pin}"
                               + (f" (its latest is {latest})" if latest is not None else " (it has none yet)"),
                               details={"field": "eval.version", "tenant": tenant, "version": pin}) from None
            manifest = await get_manifest(store, weights_name(tenant, pin))
            return pin, {**as_manifest, **manifest}
        if training:
            return -1, as_manifest
        try:
            ref = decode((await self.kv_versions.get(tenant)).value, WeightsRef)
        except KeyNotFoundError:
            raise FailedPrecondition(
                f"tenant {tenant!r} has no exported policy version and no training workload that would make one; "
                "evaluate after it trained", details={"field": "eval.version", "tenant": tenant}) from None
        return ref.version, {**as_manifest, **ref.manifest}

    async def _check_base_served(self, tenant: str, base: str) -> str:
        """An rl / eval workload needs an inferencer serving its base. Rejected (naming the
        pools that exist) when inferencers are registered and none serves it; accepted with a
        note when none is registered at all (they may start later; tests without inference)."""
        from master.spec import SpecError
        from protocol.messages import InfoRequest, RoleInfo, ServiceRecord
        from protocol.subjects import pool_name

        kv = await js_retry(self.bus.js.key_value, self.names.kv_services)
        pools: dict[str, str] = {}  # pool -> base
        registered = 0
        for key in await kv_keys(kv):
            if not key.startswith("inferencer."):
                continue
            try:
                svc = decode((await kv.get(key)).value, ServiceRecord)
            except Exception as exc:  # a record of another version: skip it, say so
                self.log.warning("unreadable service record", key=key, error=str(exc))
                continue
            if svc.state == "stopped":
                continue
            registered += 1
            try:
                info = await self.bus.request(self.names.instance_op("inferencer", svc.instance, "info"),
                                              InfoRequest(), RoleInfo, timeout_s=INFERENCER_INFO_TIMEOUT_S)
            except NexusError as exc:
                self.log.info("inferencer did not answer info at submit", instance=svc.instance, error=exc.message)
                continue
            if info.extra.get("pool"):
                pools[str(info.extra["pool"])] = str(info.extra.get("base", ""))
        if not registered:
            self.log.info("no inferencer registered: base check skipped", tenant=tenant, base=base)
            return (f"; note: no inferencer is registered yet, so nothing serves base {self.base_label(base)!r} "
                    "until one starts")
        if not pools:
            return f"; note: no inferencer answered, base {self.base_label(base)!r} not checked"
        if base in pools.values() or pool_name(base) in pools:
            return ""
        # Bases as the caller may name them: a registered one by its name, no host path to a tenant.
        known = ", ".join(f"{p} (base {self.base_label(b)})" for p, b in sorted(pools.items()))
        shown = self.base_label(base)
        raise SpecError([("base", f"no inferencer serves {shown!r}; allowed: a base one of the inference "
                                  f"pools serves: {known}", shown)])

    async def _intake_loop(self) -> None:
        """Durable intake: plain NATS clients publish specs on <prefix>.workloads.submit."""
        js = self.bus.js
        cfg = ConsumerConfig(durable_name=INTAKE_DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=60,
                             max_deliver=INTAKE_MAX_DELIVER)
        sub = await js.pull_subscribe(self.names.workloads_submit, durable=INTAKE_DURABLE,
                                      stream=self.names.stream_intake, config=cfg)
        while True:
            self.tick("workload-intake")
            try:
                msgs = await sub.fetch(8, timeout=1.0)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            except Exception as exc:  # broker hiccup: keep polling
                self.log.warning("intake fetch failed", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                workload = f"i{msg.metadata.sequence.stream:010d}"
                try:
                    # The publisher's context (a CONSUMER span: its child, or a new root).
                    with consumer_span(self.tracer, "master.intake", msg.subject, msg.headers,
                                       {"nexus.workload": workload}):
                        await self._accept(msg.data, workload)
                except NexusError as exc:
                    await self._reject_intake(workload, msg.data, exc.message, exc.details)
                except Exception as exc:
                    delivered = int(getattr(msg.metadata, "num_delivered", 0) or 0)
                    self.log.error("intake failed", workload=workload, delivered=delivered, exc_info=exc)
                    if delivered < INTAKE_MAX_DELIVER:
                        await msg.nak(delay=2)
                        continue
                    # The last delivery: JetStream would drop it silently; the publisher hears why.
                    await self._reject_intake(
                        workload, msg.data, f"not accepted after {delivered} attempts (the intake's bound, "
                        f"max_deliver={INTAKE_MAX_DELIVER}); last error: {type(exc).__name__}: {exc}", {})
                await msg.ack()

    async def _reject_intake(self, workload: str, data: bytes, message: str, details: dict[str, Any]) -> None:
        """The `rejected` event of an intake message that is dropped, naming every bad field."""
        tenant = _tenant_guess(data)
        await self.bus.publish(self.names.workload_events(workload), WorkloadEvent(
            workload=workload, tenant=tenant, kind="rejected", state="failed", message=message,
            errors=[{k: str(v) for k, v in e.items()} for e in details.get("errors", [])]
            or [{"field": str(details.get("field", "")), "message": message}],
            at=time.time()))
        self.log.info("intake spec rejected", workload=workload, error=message)

    # -- lifecycle -----------------------------------------------------------------------
    async def _try_start(self, rec: WorkloadRecord) -> None:
        """Start ``rec``'s producer, once: a submit's start and the pending loop's retry can
        overlap while an env worker is slow to answer (seen with 256 submits at once), and with
        several env workers the second start would land on another one and run it twice."""
        if rec.state != "pending" or rec.workload in self._starting or rec.workload in self._unsaved:
            return  # (unsaved: a change KV has not taken yet, `running` say, is still being written)
        self._starting.add(rec.workload)
        try:
            await self._start_pending(rec)
        finally:
            self._starting.discard(rec.workload)

    async def _start_pending(self, rec: WorkloadRecord) -> None:
        if is_hosted(rec):
            # The tenant's own `nexus env serve` processes take it (master/hosted.py), never
            # an env worker; this turn only bounds its wait.
            await self.hosted_pending(rec)
            return
        compiled = await self.compile_start(rec)
        if compiled is None:
            return
        producer, eval_version = compiled
        try:
            reply = await self.bus.request(self.names.env("start_producer"), producer, Ok, timeout_s=30)
        except NexusError as exc:
            self.log.warning("producer start failed; will retry", workload=rec.workload, error=exc.message)
            return
        rec.worker = reply.detail.rsplit(" on ", 1)[-1]
        rec.eval_version = eval_version
        await self._set_state(rec, "running", f"producer running on {rec.worker}")

    async def compile_start(self, rec: WorkloadRecord) -> tuple[ProducerSpec, int] | None:
        """(the producer of pending ``rec``, the eval version it pins); None while it must
        wait (an eval of a tenant whose training workload is still ahead)."""
        from master.spec import spec_from_dict

        spec = spec_from_dict(rec.spec)
        eval_version = -1
        if rec.task == "eval":
            target, pin = policy_pin(spec)
            if target not in self.sched.tenants:
                return None  # its tenant's workload has not been accepted yet
            busy = [w for w in self.workloads.values() if w.tenant == target and w.task != "eval"
                    and w.state in ("pending", "running")]
            if busy:
                return None  # evaluate the trained result, not a moving target
            # Resolved at submit unless a training workload was ahead: then now, its result.
            eval_version = rec.eval_version if rec.eval_version >= 0 else await self._pin_version(target, pin)
        if rec.task == "eval":
            producer = compile_producer(spec, rec.workload, eval_version)
        else:
            if rec.start_version < 0:  # a record from before start_version: its budget was a version to reach
                rec.start_version, rec.budget_steps = 0, step_budget(spec, 0)
            producer = compile_producer(spec, rec.workload, start_version=rec.start_version)
            producer.max_steps = rec.budget_steps  # fixed at accept (until_version against that version)
            producer.steps_done, producer.jobs = self._steps_done(rec)
            producer.episodes_done = rec.episodes
        return producer, eval_version

    def _steps_done(self, rec: WorkloadRecord) -> tuple[int, list[str]]:
        """(steps of ``rec``'s budget already trained or queued, its unfinished jobs): the
        tenant's versions since the workload was accepted plus the micro-batches (one step
        each; a split micro-batch's parts are one: `JobRecord.steps`) of its jobs still to
        train (a stopped producer's, sealed by `_repend`). Read in
        one go, with no await between: a job that trains meanwhile moves from one term to the
        other, never into both or neither. A resumed producer queues only the rest."""
        from master.scheduler import UNFINISHED

        trained = max(0, self.sched.versions.get(rec.tenant, 0) - rec.start_version)
        live = [j for j in self.sched.tenant_jobs(rec.tenant) if j.workload == rec.workload and j.state in UNFINISHED]
        return trained + sum(j.steps or j.items for j in live), [j.job for j in live]

    async def _pin_version(self, tenant: str, version: Any) -> int:
        """The version an eval scores: a number (checked at submit) or the latest export.
        Never a silent version 0: no export is an error that fails the workload."""
        if isinstance(version, int):
            return version
        try:
            return decode((await self.kv_versions.get(tenant)).value, WeightsRef).version
        except KeyNotFoundError:
            raise NotFound(f"tenant {tenant!r} has no exported policy version to evaluate",
                           details={"tenant": tenant}) from None

    async def _update_scheduling(self, existing: TenantConfig, cfg: TenantConfig) -> None:
        """A later workload may change how the tenant is scheduled and optimised (not what it is)."""
        changed = {k: getattr(cfg, k) for k in MUTABLE_FIELDS if getattr(cfg, k) != getattr(existing, k)}
        if not changed:
            return
        for k, v in changed.items():
            setattr(existing, k, v)
        await store_put(self.kv_tenants, existing.name, encode(existing))
        self.log.info("tenant scheduling updated", tenant=existing.name, **changed)

    async def _pending_loop(self) -> None:
        while True:
            await self.idle("workload-pending", PENDING_RETRY_S)
            for rec in list(self.workloads.values()):
                if rec.state == "pending":
                    try:
                        await self._try_start(rec)
                    except Exception as exc:
                        self.log.error("starting workload failed", workload=rec.workload, exc_info=exc)
                        await self._set_state(rec, "failed", f"could not start: {exc}")

    async def _on_workload_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, WorkloadEvent)
        except Exception as exc:
            self.log.warning("bad workload event", error=str(exc))
            return
        await self._apply_event(ev)

    async def _apply_event(self, ev: WorkloadEvent) -> None:
        rec = self.workloads.get(ev.workload)
        if rec is None or rec.state in TERMINAL_WORKLOAD_STATES or ev.kind not in ("progress", "done"):
            return
        rec.step, rec.episodes = max(rec.step, ev.step), max(rec.episodes, ev.episodes)
        rec.metrics.update(ev.metrics)
        if ev.per_task:
            rec.per_task = bounded_task_rows(ev.per_task)
        rec.updated_at = time.time()
        if ev.kind == "done":
            state = "failed" if ev.state == "failed" else "completed"
            if await self._set_state(rec, state, ev.message):
                # Its producer is done: a job it reserved and never filled would hold the
                # tenant's in-flight cap until the orphan sweep (minutes); one half-filled is
                # sealed (its acknowledged micro-batches train), an empty one fails now.
                await self.fail_unready_jobs(rec.workload, f"its workload {state}")
                self._release_rollouts(rec.workload)
        else:
            await self._save_workload(rec)

    async def _set_state(self, rec: WorkloadRecord, state: str, message: str) -> bool:
        """Move ``rec`` to ``state``: written to KV first, then applied in memory and announced.
        A write that fails leaves memory as KV has it and is retried in the background
        (`LIFECYCLE_SAVE`) until KV takes it; False then (the change is not made yet). One
        change at a time per workload; once one made it terminal, a later one is not made
        (False): a `done` that raced a cancel does not end it twice."""
        lock, users = self._state_locks.get(rec.workload, (asyncio.Lock(), 0))
        self._state_locks[rec.workload] = (lock, users + 1)
        try:
            async with lock:
                if rec.state in TERMINAL_WORKLOAD_STATES:
                    self._unsaved.pop(rec.workload, None)
                    return False
                return await self._write_state(rec, state, message)
        finally:
            lock, users = self._state_locks[rec.workload]
            if users <= 1:
                del self._state_locks[rec.workload]
            else:
                self._state_locks[rec.workload] = (lock, users - 1)

    async def _write_state(self, rec: WorkloadRecord, state: str, message: str) -> bool:
        # The change is written from a copy and applied to ``rec`` only once KV took it: a
        # write held up in its retries (STORE_WRITE, up to 20 s) must not show the new state to
        # a reader meanwhile (the retention test read `completed` while KV refused it: CI of
        # stop 35).
        now = time.time()
        changed = replace(rec, state=state, message=message, updated_at=now)
        try:
            await self._save_workload(changed)
        except Exception as exc:
            first = rec.workload not in self._unsaved
            self._unsaved[rec.workload] = (state, message)  # the latest change wins
            self.log.error("workload state not saved; retrying", workload=rec.workload, state=state,
                           kept=rec.state, error=str(exc))
            if first:
                self.spawn(self._resave_state(rec.workload), f"resave-{rec.workload}")
            return False
        rec.state, rec.message, rec.updated_at = state, message, now  # type: ignore[assignment]
        self._unsaved.pop(rec.workload, None)
        if state in TERMINAL_WORKLOAD_STATES:
            try:
                path = await asyncio.to_thread(write_report, self.cfg.data_dir, rec,
                                               self.workload_usage(rec.workload))
                self.log.info("workload report written", workload=rec.workload, path=str(path))
            except (OSError, ValueError) as exc:  # the workload's end stands; the report is extra
                self.log.error("workload report not written", workload=rec.workload, error=str(exc))
        await self._publish_event(rec, "state", message=message)
        self.log.info("workload state", workload=rec.workload, tenant=rec.tenant, state=state, detail=message)
        return True

    async def _resave_state(self, workload: str) -> None:
        """A lifecycle change KV refused, written again after LIFECYCLE_SAVE's bounded back-off
        for as long as it takes (a `done` whose write failed must not leave the workload
        `running` until a master restart)."""
        attempt = 0
        while workload in self._unsaved:
            attempt += 1
            await asyncio.sleep(LIFECYCLE_SAVE.delay(attempt))
            rec, change = self.workloads.get(workload), self._unsaved.get(workload)
            if rec is None or change is None:  # deleted with its tenant, or saved meanwhile
                self._unsaved.pop(workload, None)
                return
            # Still listed while it runs: a refusal updates the entry instead of starting
            # another retry; a success removes it.
            if await self._set_state(rec, *change):
                self.log.info("workload state saved after retry", workload=workload, state=change[0],
                              attempts=attempt)

    async def _save_workload(self, rec: WorkloadRecord) -> None:
        await store_put(self.kv_workloads, rec.workload, encode(rec))

    async def _publish_event(self, rec: WorkloadRecord, kind: str, message: str = "") -> None:
        event = WorkloadEvent(
            workload=rec.workload, tenant=rec.tenant, kind=kind, state=rec.state, step=rec.step,  # type: ignore[arg-type]
            episodes=rec.episodes, metrics=dict(rec.metrics), message=message, at=time.time())
        await self.bus.publish(self.names.workload_events(rec.workload), event)
        # Again under the tenant's name: the subject its account imports (docs/security.md).
        await self.bus.publish(self.names.tenant_events(rec.tenant, rec.workload), event)

    # -- queries and control -------------------------------------------------------------
    def _workload(self, workload: str) -> WorkloadRecord:
        rec = self.workloads.get(workload)
        if rec is None:
            raise NotFound(f"unknown workload {workload!r}", details={"workload": workload})
        return rec

    @op("workload", WorkloadRef, access="checked")
    async def workload(self, req: WorkloadRef) -> WorkloadRecord:
        rec = self._workload(req.workload)
        _require_own(rec, "workload")
        return rec

    @op("workload_report", WorkloadRef, access="checked")
    async def workload_report(self, req: WorkloadRef) -> WorkloadReport:
        """A finished workload's report, read back from where the master wrote it."""
        from protocol.errors import FailedPrecondition

        rec = self._workload(req.workload)
        _require_own(rec, "workload_report")
        if rec.state not in TERMINAL_WORKLOAD_STATES:
            raise FailedPrecondition(f"workload {rec.workload} is {rec.state}; its report is written when it ends")
        rel = str((rec.spec.get("outputs") or {}).get("report_path") or f"{rec.workload}.json")
        try:
            rel = "/".join(report_parts(rec))  # relative to the data dir: no host path to a tenant
            report = await asyncio.to_thread(read_report, self.cfg.data_dir, rec)
        except (FileNotFoundError, ValueError):
            raise NotFound(f"no report of {rec.workload} at {rel} (it was not written: see the master's log)",
                           details={"path": rel}) from None
        return WorkloadReport(workload=rec.workload, path=rel, report=report)

    @op("workloads", WorkloadsRequest)
    async def list_workloads(self, req: WorkloadsRequest) -> WorkloadsReply:
        # One page (master/paging.py), oldest first: the whole history passed the max payload.
        recs = [(time_key(w.created_at, w.workload), w) for w in self.workloads.values()
                if not req.tenant or w.tenant == req.tenant]
        out, cursor = page(recs, req.limit, req.cursor, self.bus.max_payload, lambda w: len(encode(w)))
        return WorkloadsReply(workloads=out, next_cursor=cursor)

    @op("tenants", WorkloadsRequest, access="admin")
    async def list_tenants(self, req: WorkloadsRequest) -> TenantsReply:
        """One page of tenants by name, with their versions and workload history (ids)."""
        history: dict[str, list[str]] = {}
        for rec in sorted(self.workloads.values(), key=lambda w: w.created_at):
            history.setdefault(rec.tenant, []).append(rec.workload)
        cfgs = [(t, cfg) for t, cfg in self.sched.tenants.items() if not req.tenant or t == req.tenant]
        out, cursor = page(cfgs, req.limit, req.cursor, self.bus.max_payload,
                           lambda c: len(encode(c)) + 16 * len(history.get(c.name, ())) + 32)
        names = {c.name for c in out}
        return TenantsReply(tenants=out, versions={t: v for t, v in self.sched.versions.items() if t in names},
                            history={t: h for t, h in history.items() if t in names}, next_cursor=cursor)

    @op("cancel", WorkloadRef, access="checked")
    async def cancel(self, req: WorkloadRef) -> WorkloadRecord:
        rec = self._workload(req.workload)
        _require_own(rec, "cancel")  # before anything changes
        if rec.state in TERMINAL_WORKLOAD_STATES:
            return rec
        worker = rec.worker if rec.state == "running" else ""
        if not await self._set_state(rec, "cancelled", "cancelled by request"):
            if rec.state in TERMINAL_WORKLOAD_STATES:  # it ended meanwhile (its producer's done)
                return rec
            from protocol.errors import Unavailable

            raise Unavailable(f"the cancel of {rec.workload} could not be written yet (the workloads store refused "
                              "it); the master writes it again until it is taken", details={"workload": rec.workload})
        # Nothing of a cancelled workload trains any more, and it holds no cap or rollout.
        # A leased one too: its trainer's renewal or commit is refused from now on.
        await self.fail_unready_jobs(rec.workload, "its workload was cancelled",
                                     ("reserved", "filling", "ready", "leased"), seal=False)
        self._release_rollouts(rec.workload)
        if worker and not is_hosted_worker(worker):  # a hosted process hears it at its next claim
            # Not awaited by the caller: a producer inside a simulator step stops when the step
            # returns, and until then it can change nothing (its jobs are failed, its events
            # ignored past the terminal state), so the cancel answers at once.
            self.spawn(self._stop_producer(rec.workload, worker), f"stop-producer-{rec.workload}")
        return rec

    async def _stop_producer(self, workload: str, worker: str) -> None:
        try:
            await self.bus.request(self.names.instance_op("env", worker, "stop_producer"),
                                   WorkloadRef(workload=workload), Ok, timeout_s=30)
        except NexusError as exc:  # the worker may be gone: the workload is cancelled anyway
            self.log.warning("stop_producer failed", workload=workload, worker=worker, error=exc.message)

    async def compact_workloads(self, now: float) -> tuple[int, int]:
        """Finished workload records past the retention (NEXUS_RETENTION_S), or past the
        count bound (NEXUS_RETENTION_MAX_WORKLOADS, oldest first), go from KV and memory; their
        usage folds into the tenant's `_compacted` usage record first. Their reports on disk
        stay. (removed workload records, folded usage records)"""

        r = self.retention
        done = sorted((w for w in self.workloads.values()
                       if w.state in TERMINAL_WORKLOAD_STATES and w.workload not in self._unsaved),
                      key=lambda w: (w.updated_at, w.workload))
        excess = max(0, len(done) - r.workload_records_max)
        victims = [w for i, w in enumerate(done) if i < excess or now - w.updated_at > r.records_s]
        if not victims:
            return 0, await self.compact_usage(now, [])
        folded = await self.compact_usage(now, [(w.tenant, w.workload) for w in victims])
        removed = 0
        for rec in victims:
            try:
                await js_retry(self.kv_workloads.purge, rec.workload)
            except Exception as exc:  # kept in memory and KV alike: the next pass
                self.log.warning("workload record purge failed", workload=rec.workload, error=str(exc))
                continue
            self.workloads.pop(rec.workload, None)
            removed += 1
        return removed, folded

    def pinned_versions(self) -> dict[str, set[int]]:
        """Policy versions a live workload reads (an eval's pinned version): never compacted."""
        out: dict[str, set[int]] = {}
        for rec in self.workloads.values():
            if rec.state in TERMINAL_WORKLOAD_STATES or rec.task != "eval":
                continue
            pin = (rec.spec.get("eval") or {}).get("version", "latest")
            digits = str(pin).rpartition("@")[2]
            version = rec.eval_version if rec.eval_version >= 0 else int(digits) if digits.isdigit() else -1
            if version >= 0:
                out.setdefault(policy_pin_tenant(rec), set()).add(version)
        return out

    @op("handback", HandbackRequest, access="admin")
    async def handback(self, req: HandbackRequest) -> Ok:
        """A draining env worker's producers stopped: resume their workloads elsewhere."""
        n = 0
        for workload in req.workloads:
            rec = self.workloads.get(workload)
            if rec is not None and rec.state == "running" and rec.worker == req.worker:
                await self._repend(rec, f"handed back by env worker {req.worker}: {req.reason}")
                n += 1
        return Ok(detail=f"{n} workloads pending again")

    async def on_env_worker_down(self, instance: str, how: str = "died") -> None:
        """Restart the producers of a dead (or stopped) env worker elsewhere (RL and SFT resume
        from the tenant's state; an eval starts its episodes over)."""
        for rec in list(self.workloads.values()):
            if rec.state == "running" and rec.worker == instance:
                await self._repend(rec, f"env worker {instance} {how}; restarting the producer")

    async def _repend(self, rec: WorkloadRecord, message: str) -> None:
        # The producer is gone: its half-filled jobs are sealed (marked ready with the
        # micro-batches they hold: nothing acknowledged is dropped), empty ones fail, and its
        # rollout slot is free; ready jobs stay and are trained.
        await self.fail_unready_jobs(rec.workload, f"its producer stopped: {message}")
        self._release_rollouts(rec.workload)
        rec.worker = ""
        await self._set_state(rec, "pending", message)
        await self._try_start(rec)

    def _release_rollouts(self, workload: str) -> None:
        for key in [k for k in self.rollouts if k.split("/", 1)[1] == workload]:
            del self.rollouts[key]


def bounded_task_rows(rows: list[TaskResult]) -> list[TaskResult]:
    """An event's per-task table as the record keeps it: MAX_TASK_ROWS rows by task index,
    texts cut to MAX_TASK_TEXT, counts made consistent (an event is a producer's word, and a
    record must stay small enough for KV and the report's reader)."""
    out = []
    for r in sorted(rows, key=lambda r: r.task_index)[:MAX_TASK_ROWS]:
        episodes = max(0, r.episodes)
        successes = min(max(0, r.successes), episodes)
        out.append(TaskResult(task_index=r.task_index, task=r.task[:MAX_TASK_TEXT],
                              instruction=r.instruction[:MAX_TASK_TEXT], episodes=episodes, successes=successes,
                              success_rate=successes / episodes if episodes else 0.0))
    return out


REPORTS_DIR = "reports"
# A report read back is the master's own JSON: anything larger is not one.
MAX_REPORT_BYTES = 16 * 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def report_parts(rec: WorkloadRecord) -> list[str]:
    """The report's place under the data dir, as path parts: ``reports/<tenant>/`` and then
    outputs.report_path (default ``<workload>.json``), each part checked again (a record
    stored before the rule, or written by hand, is no exception)."""
    from master.spec import TENANT_PATTERN, report_path_problem

    if not isinstance(rec.tenant, str) or not re.fullmatch(TENANT_PATTERN, rec.tenant):
        raise ValueError(f"tenant {rec.tenant!r} is no tenant name")  # never a path part
    rel = (rec.spec.get("outputs") or {}).get("report_path") or f"{rec.workload}.json"
    problem = report_path_problem(rel) if isinstance(rel, str) else "not a string"
    if problem:
        raise ValueError(f"outputs.report_path {rel!r} is not allowed ({problem})")
    return [REPORTS_DIR, rec.tenant, *rel.split("/")]


def report_file(data_dir: str | Path, rec: WorkloadRecord) -> Path:
    """Where a workload's report goes: ``<data dir>/reports/<tenant>/<outputs.report_path>``
    (default ``<workload>.json``). A name only: `write_report` and `read_report` walk to it
    one directory at a time without following a link, so nothing outside the tenant's
    reports dir (auth/, cluster.json, another tenant's reports) is ever written or read."""
    return Path(data_dir).resolve().joinpath(*report_parts(rec))


def _open_dirs(data_dir: str | Path, parts: list[str], create: bool) -> int:
    """An fd of ``data_dir/parts...``, each part opened with O_NOFOLLOW relative to the one
    before (a symlink or a file in the way is an OSError, never followed); made if missing
    when ``create``. The caller closes it."""
    fd = os.open(Path(data_dir).resolve(), _DIR_FLAGS)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o750, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_report(data_dir: str | Path, rec: WorkloadRecord, usage: dict[str, Any] | None = None) -> Path:
    """The report: the workload record, and the usage charged to it by the time it ended
    (`master.usage`; the last seconds of device time may still be on their way: `nexus usage`
    has the final figure). Written to a new temp file (O_EXCL, a unique name) in the report's
    directory and renamed over the name: never a half-written report, never through a link."""
    parts = report_parts(rec)
    report = {"format": "vla-nexus/workload-report/1", **to_body(rec), "usage": usage or {}}
    data = json.dumps(report, indent=2, sort_keys=True, default=str).encode()
    dfd = _open_dirs(data_dir, parts[:-1], create=True)
    try:
        tmp = f".{parts[-1]}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o640, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # rename never follows a link at the target name: it replaces the name itself.
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    _prune_reports(Path(data_dir) / REPORTS_DIR / rec.tenant, keep=MAX_REPORTS_PER_TENANT)
    return report_file(data_dir, rec)


def _prune_reports(tenant_dir: Path, keep: int) -> int:
    """Remove the oldest of a tenant's report files past ``keep`` (a tenant can end workloads
    without bound; its reports may not grow with them). Links are never followed: os.walk
    does not enter a linked dir, and unlink removes a link, not its target."""
    if tenant_dir.is_symlink() or not tenant_dir.is_dir():
        return 0
    files = []
    for top, _, names in os.walk(tenant_dir, followlinks=False):
        for name in names:
            path = os.path.join(top, name)
            try:
                files.append((os.lstat(path).st_mtime, path))
            except FileNotFoundError:
                continue  # removed meanwhile
    files.sort()
    for _, path in files[:max(0, len(files) - keep)]:
        os.unlink(path)
    return max(0, len(files) - keep)


def read_report(data_dir: str | Path, rec: WorkloadRecord) -> dict[str, Any]:
    """The report `write_report` wrote for ``rec``, read the same confined way (O_NOFOLLOW at
    every step, a regular file, bounded). FileNotFoundError when there is none for this
    workload (never a report of another workload at the same path)."""
    parts = report_parts(rec)
    try:
        dfd = _open_dirs(data_dir, parts[:-1], create=False)
    except OSError as exc:
        raise FileNotFoundError(str(exc)) from None
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
        except OSError as exc:
            raise FileNotFoundError(str(exc)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REPORT_BYTES:
            os.close(fd)
            raise FileNotFoundError("not a report file")
        with os.fdopen(fd, "rb") as f:
            report = json.loads(f.read(MAX_REPORT_BYTES + 1))
    finally:
        os.close(dfd)
    if not isinstance(report, dict) or report.get("workload") != rec.workload:
        raise FileNotFoundError("the file there is no report of this workload")
    return report


def _require_own(rec: WorkloadRecord, op_name: str) -> None:
    """`require_tenant` for an op that names a workload id: a tenant asking about another
    tenant's workload is denied without being told whose it is."""
    caller = current_caller()
    if caller.is_platform or (caller.tenant is not None and caller.tenant == rec.tenant):
        return
    raise deny(caller, f"{op_name} {rec.workload}", None, "it is not one of the caller's workloads")


def policy_sections(policy: dict[str, Any]) -> dict[str, Any]:
    """The spec sections (base, action_module, observation, action) of a policy, from its
    export manifest (or its tenant config, which has the same keys), defaults filled in."""
    from master.spec import PPO_HEAD_FIELDS, ActionModuleSpec, ActionSpec, ObservationSpec

    schema = policy["schema"]
    # PPO loss coefficients live in a gaussian head's params (compile_tenant): an eval computes no loss.
    params = {k: v for k, v in dict(policy.get("head_params") or {}).items() if k not in PPO_HEAD_FIELDS}
    return {
        "base": policy["base"],
        "action_module": ActionModuleSpec(kind=policy["head"], params=params).model_dump(mode="json"),
        "observation": ObservationSpec(cameras=schema["cameras"], state_dim=schema["state_dim"],
                                       instruction_template=schema["instruction_template"]).model_dump(mode="json"),
        "action": ActionSpec(dim=schema["action_dim"], horizon=schema["action_horizon"]).model_dump(mode="json"),
    }


def policy_mismatches(spec: Any, sections: dict[str, Any], tenant: str, version: int) -> list[tuple[str, str, Any]]:
    """Each leaf of a section an eval spec repeats that differs from the policy it scores."""
    from master.spec import POLICY_FIELDS
    from protocol.subjects import canonical_base

    which = f"tenant {tenant}'s policy" + (f" version {version}" if version >= 0 else "")
    errors: list[tuple[str, str, Any]] = []
    for name in POLICY_FIELDS:
        given = getattr(spec, name)
        if given is None:
            continue
        mine = given if isinstance(given, str) else given.model_dump(mode="json")
        theirs = sections[name]
        if name == "base" and canonical_base(given) == theirs:
            continue  # './my_base' and its absolute path are one base (tenants store the latter)
        pairs = [(name, mine, theirs)] if isinstance(mine, str) else [
            (f"{name}.{k}", mine[k], theirs[k]) for k in mine]
        for path, a, b in pairs:
            if a != b:
                errors.append((path, f"{a!r} differs from {which}: {b!r}; an eval takes {name} from the policy "
                                     "it scores: leave it out", a))
    return errors


# TenantConfig fields a later workload of the same tenant may change: how it is scheduled and
# how it is optimised (the optimizer's moments carry over; its hyper-parameters and the PPO
# loss coefficients are the new workload's). Everything else is what the slot *is*.
MUTABLE_FIELDS = ("priority", "max_inflight_jobs", "sft_prefetch_items", "staleness_bound", "optim", "head_params",
                  "export_every_steps")


def _check_same_policy(mine: TenantConfig, target: TenantConfig, same_tenant: bool = False) -> None:
    """An eval scores another tenant's export, and a tenant's next workload trains the same
    slot: its schema and head (and, for the same tenant, base, head options, optimizer and
    seed) must be that policy's."""
    from master.spec import SpecError
    from models.schema import TenantSchema

    who = "this tenant's existing slot" if same_tenant else f"tenant {target.name}'s policy"
    errors: list[tuple[str, str]] = []
    if TenantSchema.from_dict(mine.schema).signature() != target.signature:
        for path, stored, asked in schema_differences(target.schema, mine.schema):
            errors.append((path, f"stored {stored!r} (in {who}), asked {asked!r}"))
        if not errors:  # same fields, other signature (a schema from an older version of the code)
            errors.append(("observation", f"schema differs from {who} (cameras, state_dim, action dim/horizon "
                                          "and template must match)"))
    if mine.head != target.head:
        errors.append(("action_module.kind", f"{mine.head!r}, but {who} uses {target.head!r}"))
    if not same_tenant and mine.base_adapter != target.base_adapter:
        errors.append(("base_adapter", f"{mine.base_adapter or None!r}, but {who} uses "
                                       f"{target.base_adapter or None!r}"))
    if same_tenant:
        from master.spec import PPO_HEAD_FIELDS

        def structure(params: dict[str, Any]) -> dict[str, Any]:  # loss coefficients may change
            return {k: v for k, v in params.items() if k not in PPO_HEAD_FIELDS}

        for name, path, get in (("base", "base", lambda c: c.base), ("seed", "seed", lambda c: c.seed),
                                ("base_adapter", "base_adapter", lambda c: c.base_adapter),
                                ("head_params", "action_module", lambda c: structure(c.head_params))):
            if get(mine) != get(target):
                errors.append((path, f"{get(mine)!r} differs from {who}'s {get(target)!r}"))
        if errors:  # the way out, said once (on the last error): a slot keeps what it is for life
            path, message = errors[-1]
            errors[-1] = (path, f"{message}; a tenant's slot keeps its schema, head and base: `nexus tenant "
                                f"reset {target.name}` drops the slot (its versions and checkpoints; its workload "
                                "records and usage stay) so this spec registers anew, or use another tenant name")
    if errors:
        raise SpecError(errors)


# A stored schema's keys (models.schema.TenantSchema.to_dict) and where a spec sets each.
SCHEMA_SPEC_FIELDS = (("cameras", "observation.cameras"), ("state_dim", "observation.state_dim"),
                      ("instruction_template", "observation.instruction_template"),
                      ("action_dim", "action.dim"), ("action_horizon", "action.horizon"))


def schema_differences(stored: dict[str, Any], asked: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(spec field, stored value, asked value) for each schema field that differs, both read
    canonically (`TenantSchema.to_dict`: cameras as name / height / width)."""
    from models.schema import TenantSchema

    a, b = TenantSchema.from_dict(stored).to_dict(), TenantSchema.from_dict(asked).to_dict()
    return [(path, a[key], b[key]) for key, path in SCHEMA_SPEC_FIELDS if a[key] != b[key]]


def _tenant_guess(data: bytes) -> str:
    """Best-effort tenant name of a rejected spec, for the event (empty if unreadable)."""
    try:
        import yaml

        doc = yaml.safe_load(data)
        name = doc.get("tenant", "") if isinstance(doc, dict) else ""
        return name if isinstance(name, str) else ""
    except Exception:  # an unreadable spec has no tenant to name
        return ""
