"""What a stored WorkloadRecord says of itself: hosted by its tenant or not, whose policy it reads."""

from __future__ import annotations

from protocol.messages import WorkloadRecord

HOSTED_WORKER_PREFIX = "hosted-"  # WorkloadRecord.worker of a workload on a hosted process


def is_hosted(rec: WorkloadRecord) -> bool:
    """Does ``rec``'s spec have its env hosted by its tenant?"""
    env = rec.spec.get("env") if isinstance(rec.spec, dict) else None
    return isinstance(env, dict) and env.get("hosted") is not None


def hosted_worker(process: str) -> str:
    return f"{HOSTED_WORKER_PREFIX}{process}"


def is_hosted_worker(worker: str) -> bool:
    return worker.startswith(HOSTED_WORKER_PREFIX)


def policy_pin_tenant(rec: WorkloadRecord) -> str:
    """The tenant whose policy a workload reads (an eval may score another tenant)."""
    version = (rec.spec.get("eval") or {}).get("version", "latest")
    if isinstance(version, str) and version.startswith("tenant:"):
        return version.removeprefix("tenant:").partition("@")[0]
    return rec.tenant
