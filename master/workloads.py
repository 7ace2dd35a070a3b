"""The workload orchestrator half of the master: specs in, workflows out, lifecycle events.

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
4. start its workflow on an env worker (``running``); 5. follow the workflow's events
(progress, done) into the record (``completed`` / ``failed``); ``cancel`` stops the workflow
(``cancelled``). Every state change is published as an event. An eval workload's version
is resolved at submit and recorded (``eval_version``); one submitted while a training
workload of its tenant is pending or running waits for it and pins ``latest`` when it ends
(the trained result). A restarted master reloads every record and
keeps following; workflows live on env workers and are not interrupted.
"""

from __future__ import annotations

import asyncio
import time
from msgspec.structs import replace
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError, NotFoundError, ObjectNotFoundError

from actors.identity import require_tenant
from actors.paths import caller_roots, confine
from transport.bus import js_retry
from actors.runtime import op
from actors.tracing import consumer_span
from protocol import ops, recipes
from protocol.errors import Conflict, FailedPrecondition, FieldError, NexusError, NotFound
from protocol.messages import (
    TERMINAL_WORKLOAD_STATES,
    CreateTenantRequest,
    HandbackRequest,
    Ok,
    WorkflowSpec,
    SubmitRequest,
    TenantConfig,
    WeightsRef,
    WorkloadEvent,
    WorkloadRecord,
    WorkloadRef,
)
from protocol.policy import LIFECYCLE_SAVE
from protocol.wire import decode, encode
from master.records import is_hosted, is_hosted_worker, policy_pin_tenant
from master.store import kv_values, store_put
from master.tenant_checks import base_fit_errors
from master.policy_checks import MUTABLE_FIELDS, check_same_policy, policy_mismatches, policy_sections
from master.reports import bounded_task_rows, write_report
from master.bases import BaseOps
from master.hosted import HostedOps
from master.jobs import JobOps
from master.state import MasterState
from master.tenants import TenantOps
from master.uploads import UploadOps
from master.usage import UsageOps
from master.workload_views import require_own
from master.workload_plan import budget_note, compile_workflow, new_workload_id, policy_pin, step_budget

INTAKE_DURABLE = "master-intake"
# Deliveries of one intake message at most; the last one that fails is rejected with an event.
INTAKE_MAX_DELIVER = 5
PENDING_RETRY_S = 1.0


class WorkloadOps:
    """The master's part for workloads: submit, cancel, handback, the workload records and
    their lifecycle, and its background tasks (intake, pending starts). It calls the other
    parts through the references it is given."""

    def __init__(self, st: MasterState, *, tenant_ops: TenantOps, job_ops: JobOps, usage_ops: UsageOps,
                 base_ops: BaseOps, upload_ops: UploadOps, hosted_ops: HostedOps) -> None:
        self.st = st
        self.tenant_ops, self.job_ops, self.usage_ops = tenant_ops, job_ops, usage_ops
        self.base_ops, self.upload_ops, self.hosted_ops = base_ops, upload_ops, hosted_ops
        # workload -> (its transition lock, holders and waiters): one state change at a time
        # per workload; dropped when nobody holds or waits (bounded by the transitions in flight).
        self._state_locks: dict[str, tuple[asyncio.Lock, int]] = {}

    async def setup_workloads(self) -> None:
        self.st.workloads.clear()
        self.st.unsaved.clear()
        for value in await kv_values(self.st.kv_workloads):
            rec = decode(value, WorkloadRecord)
            self.st.workloads[rec.workload] = rec
        nc = self.st.bus.nc
        await nc.subscribe(self.st.names.workload_events_all, cb=self._on_workload_event)
        # Events that arrived while no master ran (a workflow finishing, say) are in the
        # events stream: apply each unfinished workload's last one.
        for rec in list(self.st.workloads.values()):
            if rec.state not in TERMINAL_WORKLOAD_STATES:
                try:
                    last = await js_retry(self.st.bus.js.get_last_msg, self.st.names.stream_events,
                                          self.st.names.workload_events(rec.workload))
                except NotFoundError:
                    continue
                await self.apply_event(decode(last.data, WorkloadEvent))
        # Workloads whose workflow's worker is gone (it stopped or died while no master ran)
        # are handed to another worker now, not left running on nobody.
        for rec in list(self.st.workloads.values()):
            if (rec.state == "running" and rec.worker and not is_hosted_worker(rec.worker)
                    and not await self.st.alive("env", rec.worker)):
                await self.repend(rec, f"env worker {rec.worker} is gone (found at master start)")
        self.st.spawn(self._intake_loop, "workload-intake", critical=True, max_quiet_s=60.0)
        self.st.spawn(self._pending_loop, "workload-pending", critical=True, max_quiet_s=60.0)

    # -- submission ----------------------------------------------------------------------
    @op(ops.MASTER_SUBMIT)
    async def submit(self, req: SubmitRequest) -> WorkloadRecord:
        data: Any = req.spec if req.spec else req.spec_text
        return await self._accept(data, new_workload_id())

    async def _accept(self, data: Any, workload: str) -> WorkloadRecord:
        from master.spec import compile_tenant, parse_spec, spec_to_dict

        if workload in self.st.workloads:
            return self.st.workloads[workload]  # a redelivered intake message: already accepted
        from master.spec import SpecError, dataset_errors
        from master.submit_checks import run_errors

        spec = parse_spec(data)  # SpecError lists every bad field
        require_tenant(spec.tenant, "submit")  # the platform's intake passes; a tenant submits its own
        # Capacity before anything is created: a refused workload leaves no tenant or record.
        self.tenant_ops.check_workload_capacity()
        if spec.family != "eval" and spec.tenant not in self.st.sched.tenants:
            self.tenant_ops.check_tenant_capacity()
        if spec.dataset is not None:
            confine(spec.dataset.root, "dataset.root", caller_roots(self.st.cfg.data_dir))
        ds_errors = dataset_errors(spec)  # features vs schema, when the dataset is readable here
        # What the run would refuse in its first seconds (env options and cameras, head params,
        # a row over this server's max payload): refused now, before any tenant slot exists.
        ds_errors += run_errors(spec, self.st.bus.max_payload, "this deployment's server")
        if ds_errors:
            raise SpecError(ds_errors)
        written = spec  # stored as the tenant wrote it (registered:<name>, never its host path)
        if spec.base is not None:
            spec = spec.model_copy(update={"base": await self.base_ops.resolve_base(spec.base, "base")})
        if spec.family == "eval":  # eval, or a recipe of its family: reads a pinned version
            return await self._accept_eval(spec, workload)
        serving_note = await self.base_ops.check_base_served(spec.tenant, spec.base) if spec.family == "rl" else ""
        cfg = compile_tenant(spec)
        if cfg.base_adapter or cfg.head == "expert":
            # Against the base's own layers (config only, no weights), before anything is created.
            errors = await asyncio.to_thread(base_fit_errors, cfg)
            if errors:
                raise SpecError(errors)
        existing = self.st.sched.tenants.get(spec.tenant)
        # The spec's priority and caps within the tenant's quotas (the operator's, or the
        # defaults: a spec carries none), checked before anything is created or changed.
        self.usage_ops.check_schedule(cfg, existing or cfg, "schedule")
        if existing is not None:
            # A tenant outlives its workloads: the next one (SFT, then RL from that policy,
            # then an eval) keeps the slot, versions and history, one workload at a time.
            active = [w.workload for w in self.st.workloads.values()
                      if w.tenant == spec.tenant and w.state in ("pending", "running")]
            if active:
                raise Conflict(f"tenant {spec.tenant!r} is running workload {active[0]}; a tenant runs one workload "
                               "at a time: wait for it to end or cancel it", details={"tenant": spec.tenant,
                                                                                       "workload": active[0]})
            check_same_policy(cfg, existing, same_tenant=True)
        if spec.init is not None and existing is not None:
            raise SpecError([("init", f"tenant {spec.tenant!r} exists (version {self.st.sched.versions.get(spec.tenant, 0)}) "
                              "and keeps its own weights; only a tenant this submit creates starts from uploaded "
                              "weights: remove init, or `nexus tenant delete` the tenant first", spec.init.weights)])
        # The budget counts from the tenant's version now (a tenant outlives its workloads: a
        # spec submitted again trains its steps again, from where the last one ended).
        version = max(0, self.st.sched.versions.get(spec.tenant, 0)) if existing is not None else 0
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
            started = await self.upload_ops.start_from_upload(cfg, spec.init) if spec.init is not None else ""
            cfg.base = written.base or cfg.base
            try:
                await self.tenant_ops.tenant_create(CreateTenantRequest(config=cfg))
            except BaseException:
                if started:
                    await self.upload_ops.drop_start(cfg.name)
                raise
        return await self._record(workload, spec, spec_to_dict(written), budget_note(spec, version) + serving_note,
                                  start_version=version, budget_steps=step_budget(spec, version))

    async def _record(self, workload: str, spec: Any, stored: dict[str, Any], note: str,
                      eval_version: int = -1, start_version: int = -1, budget_steps: int = 0) -> WorkloadRecord:
        now = time.time()
        hosted = spec.env is not None and spec.env.hosted is not None
        if hosted:
            note += self.hosted_ops.hosted_note(spec.tenant)  # says clearly when no hosted process is connected
        rec = WorkloadRecord(workload=workload, tenant=spec.tenant, task=spec.task, state="pending",
                             spec=stored, created_at=now, updated_at=now, eval_version=eval_version,
                             start_version=start_version, budget_steps=budget_steps, family=spec.family)
        if hosted:
            rec.message = f"waiting for a hosted env process{note}"
        await self._save_workload(rec)  # KV first: a record it does not hold is never in memory
        self.st.workloads[workload] = rec
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
        cfg = self.st.sched.tenants.get(target)
        if cfg is None:
            field = "tenant" if target == spec.tenant else "eval.version"
            # Names only the tenant asked about (the caller's own): never the deployment's others.
            raise NotFound(f"tenant {target!r} does not exist: an eval scores an existing tenant's policy "
                           "(train it first with an sft or rl workload)",
                           details={"field": field, "tenant": target})
        training = [w for w in self.st.workloads.values() if w.tenant == target and w.family != "eval"
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
        note = await self.base_ops.check_base_served(spec.tenant, sections["base"])
        # The stored spec says what is scored: the policy's sections filled in.
        stored = {**spec_to_dict(spec), **sections}
        if version < 0:
            note += f"; it starts when {training[0].workload} of tenant {target} ends and scores its latest version"
        return await self._record(workload, spec, stored, note, eval_version=version)

    async def _resolve_policy(self, cfg: TenantConfig, pin: int | str, training: bool) -> tuple[int, dict[str, Any]]:
        """(version, export manifest) of the policy an eval pins; (-1, the tenant's config as a
        manifest) for ``latest`` behind a training workload. A version that does not exist is
        an error naming tenant and version, never a silent version 0."""
        from transport.weights import get_manifest, weights_name

        tenant = cfg.name
        # A manifest of an older format may lack a key: the slot's config says the same.
        as_manifest = {"base": cfg.base, "schema": cfg.schema, "head": cfg.head, "head_params": cfg.head_params}
        if isinstance(pin, int):
            store = await js_retry(self.st.bus.js.object_store, self.st.names.obj_weights)
            try:
                await store.get_info(f"{weights_name(tenant, pin)}.manifest.json")
            except ObjectNotFoundError:
                latest = self.st.sched.versions.get(tenant)
                raise NotFound(f"tenant {tenant!r} has no policy version {pin}"
                               + (f" (its latest is {latest})" if latest is not None else " (it has none yet)"),
                               details={"field": "eval.version", "tenant": tenant, "version": pin}) from None
            manifest = await get_manifest(store, weights_name(tenant, pin))
            return pin, {**as_manifest, **manifest}
        if training:
            return -1, as_manifest
        try:
            ref = decode((await self.st.kv_versions.get(tenant)).value, WeightsRef)
        except KeyNotFoundError:
            raise FailedPrecondition(
                f"tenant {tenant!r} has no exported policy version and no training workload that would make one; "
                "evaluate after it trained", details={"field": "eval.version", "tenant": tenant}) from None
        return ref.version, {**as_manifest, **ref.manifest}

    async def _intake_loop(self) -> None:
        """Durable intake: plain NATS clients publish specs on <prefix>.workloads.submit."""
        js = self.st.bus.js
        cfg = ConsumerConfig(durable_name=INTAKE_DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=60,
                             max_deliver=INTAKE_MAX_DELIVER)
        sub = await js.pull_subscribe(self.st.names.workloads_submit, durable=INTAKE_DURABLE,
                                      stream=self.st.names.stream_intake, config=cfg)
        while True:
            self.st.tick("workload-intake")
            try:
                msgs = await sub.fetch(8, timeout=1.0)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            except Exception as exc:  # broker hiccup: keep polling
                self.st.log.warning("intake fetch failed", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                workload = f"i{msg.metadata.sequence.stream:010d}"
                try:
                    # The publisher's context (a CONSUMER span: its child, or a new root).
                    with consumer_span(self.st.tracer, "master.intake", msg.subject, msg.headers,
                                       {"nexus.workload": workload}):
                        await self._accept(msg.data, workload)
                except NexusError as exc:
                    await self._reject_intake(workload, msg.data, exc.message, exc.details)
                except Exception as exc:
                    delivered = int(getattr(msg.metadata, "num_delivered", 0) or 0)
                    self.st.log.error("intake failed", workload=workload, delivered=delivered, exc_info=exc)
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
        await self.st.bus.publish(self.st.names.workload_events(workload), WorkloadEvent(
            workload=workload, tenant=tenant, kind="rejected", state="failed", message=message,
            errors=[{k: str(v) for k, v in e.items()} for e in details.get("errors", [])]
            or [{"field": str(details.get("field", "")), "message": message}],
            at=time.time()))
        self.st.log.info("intake spec rejected", workload=workload, error=message)

    # -- lifecycle -----------------------------------------------------------------------
    async def _try_start(self, rec: WorkloadRecord) -> None:
        """Start ``rec``'s workflow, once: a submit's start and the pending loop's retry can
        overlap while an env worker is slow to answer (seen with 256 submits at once), and with
        several env workers the second start would land on another one and run it twice."""
        if rec.state != "pending" or rec.workload in self.st.starting or rec.workload in self.st.unsaved:
            return  # (unsaved: a change KV has not taken yet, `running` say, is still being written)
        self.st.starting.add(rec.workload)
        try:
            await self._start_pending(rec)
        finally:
            self.st.starting.discard(rec.workload)

    async def _start_pending(self, rec: WorkloadRecord) -> None:
        if is_hosted(rec):
            # The tenant's own `nexus env serve` processes take it (master/hosted.py), never
            # an env worker; this turn only bounds its wait.
            await self.hosted_ops.hosted_pending(rec)
            return
        compiled = await self.compile_start(rec)
        if compiled is None:
            return
        workflow, eval_version = compiled
        try:
            reply = await self.st.bus.call(ops.ENV_START_WORKFLOW, workflow, timeout_s=30)
        except FieldError as exc:
            # Refused as invalid (a kind the env worker has not loaded, a config its recipe
            # refuses): the same start would be refused again, so it fails now, saying why.
            why = (f"the env worker has no workflow of kind {rec.task!r}: name the module that registers it in "
                   f"{recipes.SETTING} of the env workers too, as on the master (it said: {exc.message})"
                   if exc.field == "kind" else f"the env worker refused its start: {exc.message}")
            await self.set_state(rec, "failed", why)
            return
        except NexusError as exc:
            self.st.log.warning("workflow start failed; will retry", workload=rec.workload, error=exc.message)
            return
        rec.worker = reply.detail.rsplit(" on ", 1)[-1]
        rec.eval_version = eval_version
        await self.set_state(rec, "running", f"workflow running on {rec.worker}")

    async def compile_start(self, rec: WorkloadRecord) -> tuple[WorkflowSpec, int] | None:
        """(the workflow of pending ``rec``, the eval version it pins); None while it must
        wait (an eval of a tenant whose training workload is still ahead)."""
        from master.spec import spec_from_dict

        spec = spec_from_dict(rec.spec)
        eval_version = -1
        if rec.family == "eval":
            target, pin = policy_pin(spec)
            if target not in self.st.sched.tenants:
                return None  # its tenant's workload has not been accepted yet
            busy = [w for w in self.st.workloads.values() if w.tenant == target and w.family != "eval"
                    and w.state in ("pending", "running")]
            if busy:
                return None  # evaluate the trained result, not a moving target
            # Resolved at submit unless a training workload was ahead: then now, its result.
            eval_version = rec.eval_version if rec.eval_version >= 0 else await self._pin_version(target, pin)
        if rec.family == "eval":
            workflow = compile_workflow(spec, rec.workload, eval_version)
        else:
            if rec.start_version < 0:  # a record from before start_version: its budget was a version to reach
                rec.start_version, rec.budget_steps = 0, step_budget(spec, 0)
            workflow = compile_workflow(spec, rec.workload, start_version=rec.start_version)
            workflow.max_steps = rec.budget_steps  # fixed at accept (until_version against that version)
            workflow.steps_done, workflow.jobs = self._steps_done(rec)
            workflow.episodes_done = rec.episodes
        return workflow, eval_version

    def _steps_done(self, rec: WorkloadRecord) -> tuple[int, list[str]]:
        """(steps of ``rec``'s budget already trained or queued, its unfinished jobs): the
        tenant's versions since the workload was accepted plus the micro-batches (one step
        each; a split micro-batch's parts are one: `JobRecord.steps`) of its jobs still to
        train (a stopped workflow's, sealed by `_repend`). Read in
        one go, with no await between: a job that trains meanwhile moves from one term to the
        other, never into both or neither. A resumed workflow queues only the rest."""
        from master.scheduler import UNFINISHED

        trained = max(0, self.st.sched.versions.get(rec.tenant, 0) - rec.start_version)
        live = [j for j in self.st.sched.tenant_jobs(rec.tenant) if j.workload == rec.workload and j.state in UNFINISHED]
        return trained + sum(j.steps or j.items for j in live), [j.job for j in live]

    async def _pin_version(self, tenant: str, version: Any) -> int:
        """The version an eval scores: a number (checked at submit) or the latest export.
        Never a silent version 0: no export is an error that fails the workload."""
        if isinstance(version, int):
            return version
        try:
            return decode((await self.st.kv_versions.get(tenant)).value, WeightsRef).version
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
        await store_put(self.st.kv_tenants, existing.name, encode(existing))
        self.st.log.info("tenant scheduling updated", tenant=existing.name, **changed)

    async def _pending_loop(self) -> None:
        while True:
            await self.st.idle("workload-pending", PENDING_RETRY_S)
            for rec in list(self.st.workloads.values()):
                if rec.state == "pending":
                    try:
                        await self._try_start(rec)
                    except Exception as exc:
                        self.st.log.error("starting workload failed", workload=rec.workload, exc_info=exc)
                        await self.set_state(rec, "failed", f"could not start: {exc}")

    async def _on_workload_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, WorkloadEvent)
        except Exception as exc:
            self.st.log.warning("bad workload event", error=str(exc))
            return
        await self.apply_event(ev)

    async def apply_event(self, ev: WorkloadEvent) -> None:
        rec = self.st.workloads.get(ev.workload)
        if rec is None or rec.state in TERMINAL_WORKLOAD_STATES or ev.kind not in ("progress", "done"):
            return
        rec.step, rec.episodes = max(rec.step, ev.step), max(rec.episodes, ev.episodes)
        rec.metrics.update(ev.metrics)
        if ev.per_task:
            rec.per_task = bounded_task_rows(ev.per_task)
        rec.updated_at = time.time()
        if ev.kind == "done":
            state = "failed" if ev.state == "failed" else "completed"
            if await self.set_state(rec, state, ev.message):
                # Its workflow is done: a job it reserved and never filled would hold the
                # tenant's in-flight cap until the orphan sweep (minutes); one half-filled is
                # sealed (its acknowledged micro-batches train), an empty one fails now.
                await self.job_ops.fail_unready_jobs(rec.workload, f"its workload {state}")
                self._release_rollouts(rec.workload)
        else:
            await self._save_workload(rec)

    async def set_state(self, rec: WorkloadRecord, state: str, message: str) -> bool:
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
                    self.st.unsaved.pop(rec.workload, None)
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
            first = rec.workload not in self.st.unsaved
            self.st.unsaved[rec.workload] = (state, message)  # the latest change wins
            self.st.log.error("workload state not saved; retrying", workload=rec.workload, state=state,
                           kept=rec.state, error=str(exc))
            if first:
                self.st.spawn(self._resave_state(rec.workload), f"resave-{rec.workload}")
            return False
        rec.state, rec.message, rec.updated_at = state, message, now  # type: ignore[assignment]
        self.st.unsaved.pop(rec.workload, None)
        if state in TERMINAL_WORKLOAD_STATES:
            try:
                path = await asyncio.to_thread(write_report, self.st.cfg.data_dir, rec,
                                               self.usage_ops.workload_usage(rec.workload))
                self.st.log.info("workload report written", workload=rec.workload, path=str(path))
            except (OSError, ValueError) as exc:  # the workload's end stands; the report is extra
                self.st.log.error("workload report not written", workload=rec.workload, error=str(exc))
        await self._publish_event(rec, "state", message=message)
        self.st.log.info("workload state", workload=rec.workload, tenant=rec.tenant, state=state, detail=message)
        return True

    async def _resave_state(self, workload: str) -> None:
        """A lifecycle change KV refused, written again after LIFECYCLE_SAVE's bounded back-off
        for as long as it takes (a `done` whose write failed must not leave the workload
        `running` until a master restart)."""
        attempt = 0
        while workload in self.st.unsaved:
            attempt += 1
            await asyncio.sleep(LIFECYCLE_SAVE.delay(attempt))
            rec, change = self.st.workloads.get(workload), self.st.unsaved.get(workload)
            if rec is None or change is None:  # deleted with its tenant, or saved meanwhile
                self.st.unsaved.pop(workload, None)
                return
            # Still listed while it runs: a refusal updates the entry instead of starting
            # another retry; a success removes it.
            if await self.set_state(rec, *change):
                self.st.log.info("workload state saved after retry", workload=workload, state=change[0],
                              attempts=attempt)

    async def _save_workload(self, rec: WorkloadRecord) -> None:
        await store_put(self.st.kv_workloads, rec.workload, encode(rec))

    async def _publish_event(self, rec: WorkloadRecord, kind: str, message: str = "") -> None:
        event = WorkloadEvent(
            workload=rec.workload, tenant=rec.tenant, kind=kind, state=rec.state, step=rec.step,  # type: ignore[arg-type]
            episodes=rec.episodes, metrics=dict(rec.metrics), message=message, at=time.time())
        await self.st.bus.publish(self.st.names.workload_events(rec.workload), event)
        # Again under the tenant's name: the subject its account imports (docs/security.md).
        await self.st.bus.publish(self.st.names.tenant_events(rec.tenant, rec.workload), event)

    # -- queries and control -------------------------------------------------------------
    @op(ops.MASTER_CANCEL)
    async def cancel(self, req: WorkloadRef) -> WorkloadRecord:
        rec = self.st.workload(req.workload)
        require_own(rec, "cancel")  # before anything changes
        if rec.state in TERMINAL_WORKLOAD_STATES:
            return rec
        worker = rec.worker if rec.state == "running" else ""
        if not await self.set_state(rec, "cancelled", "cancelled by request"):
            if rec.state in TERMINAL_WORKLOAD_STATES:  # it ended meanwhile (its workflow's done)
                return rec
            from protocol.errors import Unavailable

            raise Unavailable(f"the cancel of {rec.workload} could not be written yet (the workloads store refused "
                              "it); the master writes it again until it is taken", details={"workload": rec.workload})
        # Nothing of a cancelled workload trains any more, and it holds no cap or rollout.
        # A leased one too: its trainer's renewal or commit is refused from now on.
        await self.job_ops.fail_unready_jobs(rec.workload, "its workload was cancelled",
                                     ("reserved", "filling", "ready", "leased"), seal=False)
        self._release_rollouts(rec.workload)
        if worker and not is_hosted_worker(worker):  # a hosted process hears it at its next claim
            # Not awaited by the caller: a workflow inside a simulator step stops when the step
            # returns, and until then it can change nothing (its jobs are failed, its events
            # ignored past the terminal state), so the cancel answers at once.
            self.st.spawn(self._stop_workflow(rec.workload, worker), f"stop-workflow-{rec.workload}")
        return rec

    async def _stop_workflow(self, workload: str, worker: str) -> None:
        try:
            await self.st.bus.call(ops.ENV_STOP_WORKFLOW, WorkloadRef(workload=workload), instance=worker, timeout_s=30)
        except NexusError as exc:  # the worker may be gone: the workload is cancelled anyway
            self.st.log.warning("stop_workflow failed", workload=workload, worker=worker, error=exc.message)

    async def compact_workloads(self, now: float) -> tuple[int, int]:
        """Finished workload records past the retention (NEXUS_RETENTION_S), or past the
        count bound (NEXUS_RETENTION_MAX_WORKLOADS, oldest first), go from KV and memory; their
        usage folds into the tenant's `_compacted` usage record first. Their reports on disk
        stay. (removed workload records, folded usage records)"""

        r = self.st.retention
        done = sorted((w for w in self.st.workloads.values()
                       if w.state in TERMINAL_WORKLOAD_STATES and w.workload not in self.st.unsaved),
                      key=lambda w: (w.updated_at, w.workload))
        excess = max(0, len(done) - r.workload_records_max)
        victims = [w for i, w in enumerate(done) if i < excess or now - w.updated_at > r.records_s]
        if not victims:
            return 0, await self.usage_ops.compact_usage(now, [])
        folded = await self.usage_ops.compact_usage(now, [(w.tenant, w.workload) for w in victims])
        removed = 0
        for rec in victims:
            try:
                await js_retry(self.st.kv_workloads.purge, rec.workload)
            except Exception as exc:  # kept in memory and KV alike: the next pass
                self.st.log.warning("workload record purge failed", workload=rec.workload, error=str(exc))
                continue
            self.st.workloads.pop(rec.workload, None)
            removed += 1
        return removed, folded

    def pinned_versions(self) -> dict[str, set[int]]:
        """Policy versions a live workload reads (an eval's pinned version): never compacted."""
        out: dict[str, set[int]] = {}
        for rec in self.st.workloads.values():
            if rec.state in TERMINAL_WORKLOAD_STATES or rec.family != "eval":
                continue
            pin = (rec.spec.get("eval") or {}).get("version", "latest")
            digits = str(pin).rpartition("@")[2]
            version = rec.eval_version if rec.eval_version >= 0 else int(digits) if digits.isdigit() else -1
            if version >= 0:
                out.setdefault(policy_pin_tenant(rec), set()).add(version)
        return out

    @op(ops.MASTER_HANDBACK)
    async def handback(self, req: HandbackRequest) -> Ok:
        """A draining env worker's workflows stopped: resume their workloads elsewhere."""
        n = 0
        for workload in req.workloads:
            rec = self.st.workloads.get(workload)
            if rec is not None and rec.state == "running" and rec.worker == req.worker:
                await self.repend(rec, f"handed back by env worker {req.worker}: {req.reason}")
                n += 1
        return Ok(detail=f"{n} workloads pending again")

    async def on_env_worker_down(self, instance: str, how: str = "died") -> None:
        """Restart the workflows of a dead (or stopped) env worker elsewhere (RL and SFT resume
        from the tenant's state; an eval starts its episodes over)."""
        for rec in list(self.st.workloads.values()):
            if rec.state == "running" and rec.worker == instance:
                await self.repend(rec, f"env worker {instance} {how}; restarting the workflow")

    async def repend(self, rec: WorkloadRecord, message: str) -> None:
        # The workflow is gone: its half-filled jobs are sealed (marked ready with the
        # micro-batches they hold: nothing acknowledged is dropped), empty ones fail, and its
        # rollout slot is free; ready jobs stay and are trained.
        await self.job_ops.fail_unready_jobs(rec.workload, f"its workflow stopped: {message}")
        self._release_rollouts(rec.workload)
        rec.worker = ""
        await self.set_state(rec, "pending", message)
        await self._try_start(rec)

    def _release_rollouts(self, workload: str) -> None:
        for key in [k for k in self.st.rollouts if k.split("/", 1)[1] == workload]:
            del self.st.rollouts[key]


def _tenant_guess(data: bytes) -> str:
    """Best-effort tenant name of a rejected spec, for the event (empty if unreadable)."""
    try:
        import yaml

        doc = yaml.safe_load(data)
        name = doc.get("tenant", "") if isinstance(doc, dict) else ""
        return name if isinstance(name, str) else ""
    except Exception:  # an unreadable spec has no tenant to name
        return ""
