"""`nexus env serve`: a tenant hosts its own env and runs the platform's workflows against it.

    nexus env serve --creds alice.creds --nats-url nats://host:4222 my_task:make_env

The process logs in with the tenant's credentials (its account reaches only the ops the
platform exports, each checked against the tenant the broker asserts), and calls the
master's ``hosted_claim`` about once a second (its lease: NEXUS_HOSTED_LEASE_S on the
master). A claim hands it a pending workload of its tenant whose spec says
``env: {hosted: tenant}``; it runs that workload's workflow (workflows/: RL rollouts or an
evaluation, the same code the platform's env workers run, found by kind in `protocol.recipes`
from the modules NEXUS_WORKFLOW_MODULES names) with the tenant's env, made by
``MODULE:FACTORY`` in child processes (`envs.simproc`, `envs.hosted.make_hosted`), through
``predict``, ``reserve`` / ``queue_put`` / ``mark_ready``, the rollout gate and
``hosted_event``. Several processes of one tenant share its workloads: each takes at most
``--capacity`` at once, and one that goes away leaves its workloads to the others.
docs/hosted_envs.md is the contract.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from protocol import ops, recipes
from protocol.errors import NexusError, PermissionDenied, Unauthenticated
from protocol.messages import (
    GetTenantRequest,
    HostedClaimReply,
    HostedClaimRequest,
    HostedEventRequest,
    WorkflowSpec,
    WeightsRef,
    WorkloadEvent,
)
from sdk.client import AsyncClient, retry_through_outage

log = logging.getLogger("nexus.env_serve")

HOSTED_FACTORY = "envs.hosted:make_hosted"  # what a hosted env id is made through, in the child
CLAIM_TIMEOUT_S = 10.0
# A claim every this many seconds, or a quarter of the lease when that is shorter.
CLAIM_EVERY_S = 1.0


class HostedClient(AsyncClient):
    """The SDK client a hosted workflow runs on: what a tenant account cannot reach directly
    goes through the master (events through ``hosted_event``; the newest version from
    ``tenant_show`` instead of the platform's versions bucket)."""

    def __init__(self, *args: Any, process: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.process = process

    async def publish_event(self, event: WorkloadEvent) -> None:
        req = HostedEventRequest(tenant=event.tenant, process=self.process, event=event)
        # A done event must arrive (it ends the workload): ride out a master restart.
        await retry_through_outage(self._call, ops.MASTER_HOSTED_EVENT, req)

    async def latest_weights(self, tenant: str) -> WeightsRef | None:
        show = await self._call(ops.MASTER_TENANT_SHOW, GetTenantRequest(tenant=tenant))
        if show.version <= 0:
            return None
        return WeightsRef(tenant=tenant, version=show.version, object_name="", size=0, manifest={})


def check_tenant_creds(creds: str | Path | None) -> str:
    """The tenant ``creds`` log in as; an error unless they are a tenant's."""
    from transport.creds import Credentials, creds_from_env

    path = Path(creds) if creds else creds_from_env()
    if path is None:
        raise PermissionDenied("nexus env serve needs a tenant's credentials: --creds FILE (from `nexus tenant create`)")
    tenant = Credentials.read(path).tenant
    if tenant is None:
        raise PermissionDenied(f"credentials {path} are no tenant's (the platform's or a foreign user's); a hosted env "
                               "process logs in as its tenant: --creds from `nexus tenant create`")
    return tenant


class EnvServer:
    """One hosted env process: claims, runs and stops its tenant's hosted workloads."""

    def __init__(self, url: str, prefix: str, creds: str | Path | None, factory: str, *, capacity: int = 1,
                 data_dir: str | Path | None = None) -> None:
        from transport.creds import creds_from_env
        from envs.hosted import load_factory

        from protocol.settings import WorkflowSettings

        load_factory(factory)  # here and now: a factory that does not import names its module
        # The workflows register by kind (`protocol.recipes`) from the modules named here.
        recipes.load_modules(WorkflowSettings.from_env().modules)
        self.tenant = check_tenant_creds(creds)
        self.url, self.prefix, self.factory = url, prefix, factory
        self.creds = Path(creds) if creds else creds_from_env()
        self.capacity = capacity
        self.process = uuid.uuid4().hex[:12]
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="nexus-hosted-"))
        self.running: dict[str, Any] = {}  # workload -> its Workflow (its task set)
        self.finished: list[tuple[str, str]] = []  # (workload, state) in order
        self.claims = 0
        self._client = AsyncClient(url, prefix, timeout_s=CLAIM_TIMEOUT_S, creds=self.creds)
        # The simulators' child processes import the tenant's module as this process does.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        from envs import simproc

        simproc.configure(plugins=())

    async def claim(self) -> HostedClaimReply:
        req = HostedClaimRequest(tenant=self.tenant, process=self.process, running=sorted(self.running),
                                 capacity=self.capacity)
        reply = await self._client._call(ops.MASTER_HOSTED_CLAIM, req)
        self.claims += 1
        for workload in reply.stop:
            wf = self.running.pop(workload, None)
            if wf is not None:
                log.info("stopping %s: no longer this process's (cancelled, finished or moved)", workload)
                await wf.stop()
        for spec in reply.start:
            try:
                await self._start(spec)
            except Exception as exc:  # noqa: BLE001 - whatever stops the start ends the workload, saying why
                log.error("could not start %s: %s", spec.workload, exc)
                await self._fail(spec, f"the hosted env process could not start it: {type(exc).__name__}: {exc}")
        return reply

    async def _fail(self, spec: WorkflowSpec, message: str) -> None:
        import time

        event = WorkloadEvent(workload=spec.workload, tenant=spec.tenant, kind="done", state="failed",
                              message=message, at=time.time())
        try:
            await self._client._call(ops.MASTER_HOSTED_EVENT, HostedEventRequest(
                tenant=spec.tenant, process=self.process, event=event))
        except NexusError as exc:  # not named in the next claim: the master takes it back
            log.warning("could not report %s failed (%s)", spec.workload, exc.message)

    async def _start(self, spec: WorkflowSpec) -> None:
        from envs import registry

        if not spec.hosted or spec.tenant != self.tenant:  # the master hands only these; a second line
            raise PermissionDenied(f"workload {spec.workload} is not a hosted workload of tenant {self.tenant!r}")
        cfg = await retry_through_outage(self._client.tenant, spec.policy_tenant or spec.tenant)  # a master restart
        schema = cfg.schema
        # The env id names the tenant's own env here: made through its factory, in a child,
        # with the workload's options and its observation schema to check at the first reset.
        registry.register(spec.env_id, HOSTED_FACTORY, overwrite=True)
        spec.env_options = {"factory": self.factory, "options": dict(spec.env_options),
                            "cameras": {c["name"]: [c["height"], c["width"]] for c in schema.get("cameras", [])},
                            "state_dim": int(schema.get("state_dim", 0))}
        client = HostedClient(self.url, self.prefix, timeout_s=60, creds=self.creds, process=self.process)
        wf = recipes.lookup(spec.kind)(spec, client=client, data_dir=self.data_dir)
        self.running[spec.workload] = wf
        wf.task = asyncio.create_task(self._run(wf), name=f"hosted-{spec.workload}")
        log.info("running %s workload %s of tenant %s on env %s", spec.kind, spec.workload, spec.tenant, spec.env_id)

    async def _run(self, wf: Any) -> None:
        try:
            await wf.main()
        finally:
            self.running.pop(wf.spec.workload, None)
            self.finished.append((wf.spec.workload, wf.state))
            log.info("workload %s ended: %s %s", wf.spec.workload, wf.state, wf.error)

    async def serve(self, until: asyncio.Event | None = None) -> None:
        """Claim until ``until`` is set (or forever); a refused login or claim (another
        tenant's workload, revoked credentials) ends it with that error."""
        await self._client.connect()
        log.info("hosted env process %s of tenant %s serving %s", self.process, self.tenant, self.factory)
        every = CLAIM_EVERY_S
        try:
            while until is None or not until.is_set():
                try:
                    reply = await self.claim()
                    every = min(CLAIM_EVERY_S, reply.lease_s / 4)
                except (PermissionDenied, Unauthenticated):
                    raise
                except NexusError as exc:  # a master restart or outage: claim again
                    log.warning("claim failed (%s); retrying", exc.message)
                if until is None:
                    await asyncio.sleep(every)
                else:
                    try:
                        await asyncio.wait_for(until.wait(), every)
                    except TimeoutError:
                        pass
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the workflows and hand their workloads back at once (not after the lease)."""
        running = sorted(self.running)
        for wf in list(self.running.values()):
            await wf.stop()
        self.running.clear()
        try:
            await self._client._call(ops.MASTER_HOSTED_CLAIM, HostedClaimRequest(
                tenant=self.tenant, process=self.process, running=running, leaving=True))
        except NexusError as exc:  # the lease runs out on the master instead
            log.warning("hand-back failed (%s); the master takes the workloads back after the lease", exc.message)
        await self._client.close()


def serve_main(url: str, prefix: str, creds: str | Path | None, factory: str, capacity: int = 1) -> int:
    """`nexus env serve`: run until interrupted. Exit 2 on a bad factory or credentials,
    3 when the platform refuses this process (another tenant's, revoked)."""
    import signal
    import sys

    from envs.hosted import FactoryError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = EnvServer(url, prefix, creds, factory, capacity=capacity)
    except (FactoryError, PermissionDenied, NexusError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    try:
        asyncio.run(go())
    except (PermissionDenied, Unauthenticated) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 3
    return 0
