"""Every NATS subject, stream, KV bucket and object bucket name, under one prefix.

Nothing else in the code base spells a subject string: roles and clients ask a `Names`
for it. The prefix (default ``nexus``) lets two deployments share one nats-server::

    names = Names("nexus")
    names.master("submit")          # 'nexus.master.submit'
    names.kv_services               # 'nexus_services'
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import InvalidField

DEFAULT_PREFIX = "nexus"

# nats-server's own: an account JWT sent here by a system-account user replaces that
# account's claims on every server of the cluster (operator mode, full resolver).
SYS_CLAIMS_UPDATE = "$SYS.REQ.CLAIMS.UPDATE"

# Roles that run as their own processes. The order is the start order of `nexus up`:
# the health manager and monitor come first so they see every other role's first beat.
ROLES: tuple[str, ...] = ("health", "monitor", "master", "trainer", "inferencer", "env")

# Subject tokens and bucket names share one safe alphabet: NATS tokens may not contain
# '.', '*', '>' or whitespace, and stream / bucket names may not contain '.' either.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def tenant_events_pattern(prefix: str, tenant: str = "*") -> str:
    """Every workload's events of ``tenant`` (`Names.tenant_events`); ``prefix`` and
    ``tenant`` may be ``*`` (the platform's export to every tenant, a test server's prefix)."""
    return f"{prefix}.tenant_events.{tenant}.*"


def check_token(what: str, value: str) -> str:
    """Validate one subject token (tenant name, instance id, op...) and return it."""
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        raise InvalidField(
            what,
            f"{value!r} is not a valid name: use 1-64 characters from A-Z a-z 0-9 _ -",
        )
    return value


# Hex digits of a directory's path hash in its pool name: 48 bits, so two directories of
# one deployment collide with odds ~n^2 / 2^49, while the name stays readable.
_POOL_HASH_CHARS = 12


def _is_preset(base: str) -> bool:
    """As `models.BaseConfig` decides: a preset name wins; anything else is a directory. A
    string that looks like a path is a directory without asking; only a bare name that is
    also a directory here needs the preset list (which imports torch, so only then)."""
    if not base or base in (".", "..") or "/" in base or os.sep in base or base.startswith("~"):
        return False
    if not os.path.isdir(base):
        return True  # a preset, or an unknown name that BaseConfig refuses
    from models.presets import PRESETS

    return base in PRESETS


def canonical_base(base: str) -> str:
    """The base's full identity as a string: a preset's name, or a local directory's resolved
    absolute path (so ``model``, ``./model/`` and ``/abs/model`` are one base). The master
    stores tenants' bases in this form, so every process derives the same pool from them."""
    if _is_preset(base):
        return base
    return str(Path(os.path.expanduser(base)).resolve())


def pool_name(base: str) -> str:
    """Inference pool of a base, from its full identity: a preset keeps its name; a local
    directory is ``<last component>-<hash of its resolved absolute path>``, so two
    directories with the same folder name never share a pool (and never serve each other's
    heads). Always a valid subject token (<= 64 characters). Every pool is computed here."""
    if _is_preset(base):
        return re.sub(r"[^A-Za-z0-9_-]", "_", base)[:64] or "base"
    path = canonical_base(base)
    digest = hashlib.sha256(path.encode()).hexdigest()[:_POOL_HASH_CHARS]
    last = re.sub(r"[^A-Za-z0-9_-]", "_", Path(path).name)[: 64 - _POOL_HASH_CHARS - 1] or "base"
    return f"{last}-{digest}"


# Names.template: position -> token name, by the subject's kind (see the methods above).
_TEMPLATE_SLOTS: dict[object, dict[int, str]] = {
    "tq": {2: "tenant", 3: "job"},
    "weights": {2: "tenant"},
    "svc": {3: "instance"},
    "metrics": {3: "scope"},
    ("tenants", "deleted"): {3: "tenant"},
    ("tenants", "updated"): {3: "tenant"},
    ("workloads", "events"): {3: "workload"},
    "tenant_events": {2: "tenant", 3: "workload"},
    ("health", "heartbeat"): {4: "instance"},
    ("health", "events"): {4: "instance"},
}


def subject_template(subject: str) -> str:
    """A subject with its high-cardinality tokens (tenant, job, workload, instance, reply
    inbox) replaced by ``{name}``: span names and ``messaging.destination.name`` use it, so a
    thousand tenants make one span name per operation, not a thousand. The first token (the
    prefix) is kept; a subject with no such token comes back unchanged."""
    parts = subject.split(".")
    if parts[0] == "_INBOX":
        return "_INBOX.{id}"
    if len(parts) < 3:
        return subject
    kind = parts[1]
    slots = _TEMPLATE_SLOTS.get((kind, parts[2]) if kind in ("tenants", "workloads", "health") else kind)
    if slots is None:
        return subject
    return ".".join(f"{{{slots[i]}}}" if i in slots else part for i, part in enumerate(parts))


@dataclass(frozen=True)
class Names:
    """All names of one deployment. Immutable; cheap to build."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_token("prefix", self.prefix)

    # -- request-reply control subjects: <prefix>.<role>.<op> -------------------------
    def role_op(self, role: str, op: str) -> str:
        """Request subject of an op served by every instance of a role (queue group)."""
        return f"{self.prefix}.{check_token('role', role)}.{check_token('op', op)}"

    def role_ops(self, role: str) -> str:
        """Wildcard a role subscribes to; unknown ops get an error reply, not silence."""
        return f"{self.prefix}.{check_token('role', role)}.*"

    def instance_op(self, role: str, instance: str, op: str) -> str:
        """Request subject addressed to one instance (info, drain of that process)."""
        return (
            f"{self.prefix}.svc.{check_token('role', role)}."
            f"{check_token('instance', instance)}.{check_token('op', op)}"
        )

    def instance_ops(self, role: str, instance: str) -> str:
        return f"{self.prefix}.svc.{check_token('role', role)}.{check_token('instance', instance)}.*"

    def master(self, op: str) -> str:
        return self.role_op("master", op)

    def queue_group(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    # -- workloads ---------------------------------------------------------------------
    @property
    def workloads_submit(self) -> str:
        """Durable intake: any plain NATS client may publish a spec here."""
        return f"{self.prefix}.workloads.submit"

    def workload_events(self, workload: str) -> str:
        return f"{self.prefix}.workloads.events.{check_token('workload', workload)}"

    @property
    def workload_events_all(self) -> str:
        return f"{self.prefix}.workloads.events.>"

    def tenant_events(self, tenant: str, workload: str) -> str:
        """The master's events of one tenant's workload, again under the tenant's name: the
        subject a tenant account imports (its own only; `transport.auth`)."""
        return f"{self.prefix}.tenant_events.{check_token('tenant', tenant)}.{check_token('workload', workload)}"

    def tenant_events_all(self, tenant: str) -> str:
        return tenant_events_pattern(self.prefix, check_token("tenant", tenant))

    # -- training queue: one stream per tenant, a subject partition per job -------------
    def tq_stream(self, tenant: str) -> str:
        return f"{self.prefix}_tq_{check_token('tenant', tenant)}"

    def tq_job(self, tenant: str, job: str) -> str:
        return f"{self.prefix}.tq.{check_token('tenant', tenant)}.{check_token('job', job)}"

    def tq_tenant_all(self, tenant: str) -> str:
        return f"{self.prefix}.tq.{check_token('tenant', tenant)}.>"

    @property
    def sched_ready(self) -> str:
        """The master announces newly ready jobs here, so idle trainers lease at once."""
        return f"{self.prefix}.sched.ready"

    # -- tenants -----------------------------------------------------------------------
    def tenant_deleted(self, tenant: str) -> str:
        return f"{self.prefix}.tenants.deleted.{check_token('tenant', tenant)}"

    @property
    def tenant_deleted_all(self) -> str:
        return f"{self.prefix}.tenants.deleted.*"

    def tenant_updated(self, tenant: str) -> str:
        """The master changed a tenant's config (its quotas): caches of it are stale."""
        return f"{self.prefix}.tenants.updated.{check_token('tenant', tenant)}"

    @property
    def tenant_updated_all(self) -> str:
        return f"{self.prefix}.tenants.updated.*"

    # -- inference ---------------------------------------------------------------------
    def infer(self, pool: str) -> str:
        return f"{self.prefix}.infer.{check_token('pool', pool)}"

    # -- weights -----------------------------------------------------------------------
    def weights(self, tenant: str) -> str:
        return f"{self.prefix}.weights.{check_token('tenant', tenant)}"

    @property
    def weights_all(self) -> str:
        return f"{self.prefix}.weights.*"

    # -- trace attributes ----------------------------------------------------------------
    def template(self, subject: str) -> str:
        """`subject_template` of one of this deployment's subjects."""
        return subject_template(subject)

    # -- environment -------------------------------------------------------------------
    def env(self, op: str) -> str:
        return self.role_op("env", op)

    # -- supervisor (the process behind `nexus up`) -------------------------------------
    def supervisor(self, op: str) -> str:
        """Requests to the local supervisor: restart one role in place (health manager)."""
        return f"{self.prefix}.supervisor.{check_token('op', op)}"

    # -- health and metrics ------------------------------------------------------------
    def heartbeat(self, role: str, instance: str) -> str:
        return (
            f"{self.prefix}.health.heartbeat.{check_token('role', role)}."
            f"{check_token('instance', instance)}"
        )

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.health.heartbeat.>"

    def health_event(self, role: str, instance: str) -> str:
        return (
            f"{self.prefix}.health.events.{check_token('role', role)}."
            f"{check_token('instance', instance)}"
        )

    @property
    def health_events_all(self) -> str:
        return f"{self.prefix}.health.events.>"

    def scale_decision(self, role: str) -> str:
        """The scaler's decisions about ``role`` (`ScaleDecision`), as events."""
        return f"{self.prefix}.scale.decisions.{check_token('role', role)}"

    @property
    def scale_decisions_all(self) -> str:
        return f"{self.prefix}.scale.decisions.>"

    def metrics(self, signal: str, scope: str) -> str:
        return f"{self.prefix}.metrics.{check_token('signal', signal)}.{check_token('scope', scope)}"

    @property
    def metrics_all(self) -> str:
        return f"{self.prefix}.metrics.>"

    # -- streams -----------------------------------------------------------------------
    @property
    def stream_intake(self) -> str:
        return f"{self.prefix}_workload_intake"

    @property
    def stream_events(self) -> str:
        return f"{self.prefix}_workload_events"

    @property
    def stream_health_events(self) -> str:
        return f"{self.prefix}_health_events"

    @property
    def stream_cluster_probe(self) -> str:
        """Placed and removed by `EmbeddedCluster.start` to prove R3 streams can be created."""
        return f"{self.prefix}_cluster_probe"

    @property
    def cluster_probe(self) -> str:
        return f"{self.prefix}.cluster.probe"

    # -- KV buckets --------------------------------------------------------------------
    @property
    def kv_tenants(self) -> str:
        return f"{self.prefix}_tenants"

    @property
    def kv_workloads(self) -> str:
        return f"{self.prefix}_workloads"

    @property
    def kv_jobs(self) -> str:
        return f"{self.prefix}_jobs"

    @property
    def kv_versions(self) -> str:
        return f"{self.prefix}_versions"

    @property
    def kv_services(self) -> str:
        return f"{self.prefix}_services"

    @property
    def kv_ckpt_refs(self) -> str:
        """Tenant -> `CheckpointRef`: which immutable checkpoint object is the committed state."""
        return f"{self.prefix}_ckpt_refs"

    @property
    def kv_bases(self) -> str:
        """Name -> `RegisteredBase`: the base directories the operator registered
        (`nexus base add`); tenants name them ``registered:<name>``. The master alone writes it."""
        return f"{self.prefix}_bases"

    @property
    def kv_usage(self) -> str:
        """``<tenant>.<workload>`` -> `UsageRecord`: metered device time, requests, bytes.
        The master is its only writer (roles send it `UsageReport`s, ``master.usage_report``)."""
        return f"{self.prefix}_usage"

    @staticmethod
    def usage_key(tenant: str, workload: str) -> str:
        """Key of a (tenant, workload) in the usage bucket; ``_`` for use outside a workload."""
        return f"{check_token('tenant', tenant)}.{check_token('workload', workload) if workload else '_'}"

    # -- object store buckets ----------------------------------------------------------
    @property
    def obj_weights(self) -> str:
        return f"{self.prefix}_weights"

    @property
    def obj_checkpoints(self) -> str:
        return f"{self.prefix}_checkpoints"

    # Key of the deployment's settings (`DeploymentSettings`) in the services bucket. It
    # has no dot, so it can never be a role instance's key (``<role>.<instance>``).
    deployment_settings_key = "deployment"

    @staticmethod
    def service_key(role: str, instance: str) -> str:
        """Key of a role instance in the services KV bucket."""
        return f"{check_token('role', role)}.{check_token('instance', instance)}"
