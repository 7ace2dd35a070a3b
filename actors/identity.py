"""Who is calling: the account the broker asserts, and what that account may do.

A tenant reaches a role only through a service import with ``share: true`` (`transport.auth`):
the server then writes the requester's account (its public key), user and the user JWT's
tags into the ``Nats-Request-Info`` header, replacing any header of that name the tenant
sent. A tenant's user JWT, signed by its account's key that only the operator holds, carries
the tag ``nexus-tenant:NAME``. A request with no such header came from inside the platform
account (a role, the admin's CLI, or a deployment without auth).

Every op declares its access (`protocol.ops`, one table of every op):

- ``tenant`` (the default): the request's ``tenant`` field must be the caller's (an empty
  one, meaning "all tenants" on a listing, becomes the caller's); an op whose request has
  no ``tenant`` field is refused to tenants unless it is marked ``checked``;
- ``checked``: the handler calls `require_tenant` itself, once it knows the tenant (a
  workload id, a spec);
- ``admin``: platform callers only (drain, layout, leases, tenant delete, ...);
- ``any``: every authenticated caller (``info``, env sessions).
"""

from __future__ import annotations

import contextvars
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from transport.auth import PLATFORM_ACCOUNT
from transport.creds import tenant_of_tags
from protocol.errors import PermissionDenied
from protocol.ops import ACCESS_LEVELS  # noqa: F401 (re-exported: the levels the docstring lists)

REQUEST_INFO_HEADER = "Nats-Request-Info"


@dataclass(frozen=True)
class Caller:
    account: str  # as the server asserted it (a public key); PLATFORM_ACCOUNT when no header came
    user: str = ""  # the user JWT's name
    tenant_tag: str | None = None  # the tenant the user JWT's tags name

    @property
    def is_platform(self) -> bool:
        return self.account == PLATFORM_ACCOUNT

    @property
    def tenant(self) -> str | None:
        """The tenant calling: the one its user JWT's tag names (the server asserts the
        tags; only the operator signs tenant users). None for the platform, and for a user
        without the tag: such a caller may do nothing a tenant may."""
        return None if self.is_platform else self.tenant_tag

    def describe(self) -> str:
        return f"tenant {self.tenant!r}" if self.tenant else f"account {self.account!r}"


PLATFORM = Caller(PLATFORM_ACCOUNT)
_current: contextvars.ContextVar[Caller] = contextvars.ContextVar("nexus_caller", default=PLATFORM)


def caller_from_headers(headers: dict[str, str] | None) -> Caller:
    raw = (headers or {}).get(REQUEST_INFO_HEADER)
    if not raw:
        return PLATFORM
    try:
        info = json.loads(raw)
        account = str(info["acc"])
        if account == PLATFORM_ACCOUNT:  # our sentinel, never a server-asserted account key
            raise ValueError(account)
        return Caller(account=account, user=str(info.get("name_tag") or info.get("user", "")),
                      tenant_tag=tenant_of_tags(info.get("tags") or []))
    except (ValueError, KeyError, TypeError, AttributeError):
        # Only the server writes this header across accounts; one we cannot read is no
        # platform caller either.
        return Caller(account="?")


def current_caller() -> Caller:
    return _current.get()


def set_caller(caller: Caller) -> contextvars.Token:
    return _current.set(caller)


def reset_caller(token: contextvars.Token) -> None:
    _current.reset(token)


# What an op does, in a user's words, for refusals ("may not read the policy weights of tenant
# 'bob'", not "may not weights_read on tenant 'bob'"); the op's own name stays in the details
# and in brackets, for whoever reads the code. An op not listed reads as its name in words.
OP_WORDS = {
    "weights_read": "read the policy weights of", "load_weights": "load the policy weights of",
    "export_params": "export the policy of", "checkpoint_get": "read the checkpoint of",
    "checkpoint_commit": "commit a checkpoint for", "submit": "submit a workload for",
    "submit an eval of": "evaluate the policy of", "tenant_create": "register",
    "tenant_get": "see the record of", "tenant_show": "see the record of", "tenant_reset": "reset",
    "tenant_delete": "delete", "tenant_quotas": "set the quotas of",
    "tenants": "list the tenants", "jobs": "list the jobs of", "job": "see a job of",
    "job_update": "update a job of", "reserve": "reserve a training job for", "queue_put": "queue data for",
    "queue_get": "read the training queue of", "queue_clear": "clear the training queue of",
    "mark_ready": "mark a job ready for", "lease": "lease training jobs", "predict": "run the policy of",
    "usage": "read the usage of", "usage_report": "report usage", "workloads": "list the workloads of",
    "workload": "see workload", "cancel": "cancel workload", "workload_report": "read the report of workload",
    "base_add": "register a base model", "drain": "drain a role", "handback": "hand workloads back",
    "start_workflow": "start a workload's workflow", "stop_workflow": "stop a workload's workflow",
    "train_batch": "train a batch", "rollout_begin": "begin a rollout for", "rollout_end": "end a rollout for",
    "hosted_claim": "serve the hosted envs of", "hosted_event": "report hosted workload events for",
}


def op_words(op: str) -> str:
    """``op`` in words: the table's phrase, else the op's name with spaces."""
    head, _, rest = op.partition(" ")  # "cancel w123": the op, then what it names
    words = OP_WORDS.get(op) or OP_WORDS.get(head) or head.replace("_", " ")
    return f"{words} {rest}".strip() if rest and op not in OP_WORDS else words


def deny(caller: Caller, op: str, tenant: str | None, why: str) -> PermissionDenied:
    words = op_words(op)
    if tenant:
        # "... of" / "register" / "delete" take the tenant as their object; others say "for".
        joiner = " " if words.endswith((" of", " for")) or words in ("register", "delete", "reset") else " for "
        what = f"{words}{joiner}tenant {tenant!r}"
    else:
        what = words
    name = op.partition(" ")[0]
    ref = f"; op {name}" if op in OP_WORDS or name in OP_WORDS else ""
    return PermissionDenied(
        f"permission denied: {caller.describe()} may not {what} ({why}{ref})",
        details={"op": op, "tenant": tenant or "", "caller": caller.tenant or caller.account},
    )


def require_tenant(tenant: str, op: str, caller: Caller | None = None) -> None:
    """Raise `PermissionDenied` unless the caller is the platform or ``tenant`` itself."""
    caller = caller or current_caller()
    if caller.is_platform or (caller.tenant is not None and caller.tenant == tenant):
        return
    raise deny(caller, op, tenant, "a tenant reaches only its own work")


def require_admin(op: str, caller: Caller | None = None) -> None:
    caller = caller or current_caller()
    if not caller.is_platform:
        raise deny(caller, op, None, "an operator-only command: it needs the platform's credentials")


def authorize(caller: Caller, op: str, access: str, req: Any) -> Any:
    """Check ``req`` for ``op`` under ``access``; return it (a listing's empty tenant filled
    in with the caller's). Platform callers pass unchanged."""
    if caller.is_platform or access == "any":
        return req
    if access == "admin":
        raise deny(caller, op, getattr(req, "tenant", None) or None,
                   "an operator-only command: it needs the platform's credentials")
    if access == "checked":
        if caller.tenant is None:
            raise deny(caller, op, None, "the account is no tenant's")
        return req
    tenant = getattr(req, "tenant", None)
    if not isinstance(tenant, str):
        raise deny(caller, op, None, "the op names no tenant of the caller's")
    if tenant == "" and caller.tenant is not None:
        # "every tenant" from a tenant means its own.
        return msgspec.structs.replace(req, tenant=caller.tenant) if isinstance(req, msgspec.Struct) else req
    require_tenant(tenant, op, caller)
    return req


def check_reply(caller: Caller, op: str, reply: Any) -> None:
    """Second line: a reply about another tenant never goes to a tenant caller."""
    if caller.is_platform:
        return
    tenant = getattr(reply, "tenant", None)
    if isinstance(tenant, str) and tenant and tenant != caller.tenant:
        raise deny(caller, op, tenant, "a tenant reaches only its own work")
