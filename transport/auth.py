"""Who may connect to the broker, and as which account: the data dir's ``auth/`` folder.

One NATS account per tenant is the isolation boundary (inside one account, user permissions
do not reliably fence JetStream). nats-server runs in operator mode (decentralized JWT auth,
`transport.nats_jwt`): it trusts the operator key, the operator signs each account's JWT, each
account signs its users'. `AuthStore` keeps, under ``<data>/auth/`` (0700, files 0600):

    state.json          the seeds of the operator and of every account, each account's JWT
    accounts.conf       operator, system account and the account JWTs nats-server preloads
    nats-auth.conf      a node's include: accounts.conf + its resolver (`nexus auth init`)
    jwt/<node>/         each server's full resolver (account JWTs pushed at run time)
    sys.creds           the system account's user: pushes account updates to the servers
    platform.creds      a user with every permission in the platform account (no role gets it)
    admin.creds         the operator's CLI and SDK (a user of the platform account)
    tenants/<name>.creds  a tenant's (its own account; only the exported subjects)

and, beside it, ``<data>/role-creds/<role>.creds`` (dir 0711): each platform process's own
user of the platform account, allowed only its subjects (`transport.permissions`); a role
process is handed its own file and nothing of ``auth/``.

A creds file is the standard NATS one (user JWT + seed; read and written by
`transport.creds.Credentials`, which clients use without this store)::

    store = AuthStore(Path(".nexus"), prefix="nexus")
    store.ensure()                       # operator, SYS, PLATFORM, admin, role users; idempotent
    path = store.add_tenant("acme")      # then make it live: `await store.push(url, "acme")`
    store.revoke_tenant("acme")          # and push again: acme's connections close

A tenant account imports the platform's request-reply subjects (`tenant_services`) with
``share: true``, so the server stamps the requester's account and user (its JWT's tags name
the tenant) into the ``Nats-Request-Info`` header every responder reads (`actors.identity`),
and hears its own workloads' events (`protocol.subjects.tenant_events_pattern`).
Its own JetStream is bounded by its
storage quota, and its connections, subscriptions and message size by its core limits (the
account JWT's limits, `ACCOUNT_LIMITS`), all set by the operator.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transport import nats_jwt
from transport.creds import TENANT_TAG, Credentials, strip_userinfo
from protocol.errors import InvalidField, NotFound, Unavailable
from protocol.subjects import check_token, tenant_events_pattern

SYS_ACCOUNT = "SYS"
PLATFORM_ACCOUNT = "PLATFORM"
# A tenant account's JWT name is this prefix + its name (what `nsc` / server logs show).
TENANT_ACCOUNT_PREFIX = "tenant_"
AUTH_DIR = "auth"
# Each platform process's own credentials (`AuthStore.role_creds`), outside AUTH_DIR.
ROLE_CREDS_DIR = "role-creds"
RESERVED_USERS = ("sys", "platform", "admin")


def tenant_services(prefix: str) -> list[str]:
    """Subjects the platform exports to every tenant account (request-reply only).

    The master (workload submit, status, cancel, the training-queue primitives), the
    trainer's primitives (train_batch, export_params, load_weights), predict on every pool,
    and the env service (sessions on a worker, dataset samples). Which op a tenant may call,
    and on which tenant, is then decided by each role's runtime (`actors.identity`).
    ``prefix`` may be ``*`` (a test server shared by many prefixes).
    """
    return [f"{prefix}.master.*", f"{prefix}.trainer.*", f"{prefix}.infer.*", f"{prefix}.env.*",
            f"{prefix}.svc.env.*.*"]


def default_storage_bytes() -> int:
    """A new tenant account's JetStream storage quota when `nexus tenant create` names none."""
    from protocol.settings import CliSettings

    return int(CliSettings.model_fields["tenant_storage_mb"].default * 2**20)


# The core NATS limits of a tenant's account, set by the operator (`nexus tenant create
# --max-conns / --max-subs / --max-payload-kb`) and enforced by nats-server: state.json's
# name -> the account JWT's ``limits`` key. conn: connections of the account, all servers
# together (past it a new one is refused); subs: per connection; payload: bytes per message.
ACCOUNT_LIMITS = {"max_conns": "conn", "max_subs": "subs", "max_payload": "payload"}


def default_account_limits() -> dict[str, int]:
    """A new tenant account's limits when `nexus tenant create` names none (state.json names)."""
    from protocol.settings import CliSettings

    fields = CliSettings.model_fields
    return {"max_conns": int(fields["tenant_max_conns"].default), "max_subs": int(fields["tenant_max_subs"].default),
            "max_payload": int(fields["tenant_max_payload_kb"].default) * 1024}


class AuthStore:
    """The keys and identities of one deployment, and the account JWTs its servers trust.

    Keys never leave the data dir: the operator's seed signs account JWTs, each account's
    seed signs its users. Adding or revoking a tenant re-signs its account JWT; `push` hands
    it to the running servers over the system account (`$SYS.REQ.CLAIMS.UPDATE`), and
    ``accounts.conf`` (the preload for the next start) is rewritten on every change."""

    def __init__(self, data_dir: Path, prefix: str = "nexus") -> None:
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / AUTH_DIR
        self.prefix = prefix

    # -- paths -------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def accounts_conf(self) -> Path:
        return self.root / "accounts.conf"

    @property
    def platform_creds(self) -> Path:
        return self.root / "platform.creds"

    @property
    def admin_creds(self) -> Path:
        return self.root / "admin.creds"

    @property
    def sys_creds(self) -> Path:
        return self.root / "sys.creds"

    @property
    def server_include(self) -> Path:
        """What a NATS node's own config includes (`write_server_include`): the accounts
        preload and its resolver (the compose cluster's nodes mount this folder read-only)."""
        return self.root / "nats-auth.conf"

    def resolver_dir(self, node: str = "") -> Path:
        """Where a server's full resolver keeps the account JWTs (one dir per node)."""
        return self.root / "jwt" / (node or "server")

    def tenant_creds(self, tenant: str) -> Path:
        return self.root / "tenants" / f"{check_token('tenant', tenant)}.creds"

    @property
    def exists(self) -> bool:
        return self.state_path.exists()

    # -- state -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The state, read under an exclusive lock and written back (with the conf) on exit:
        two `nexus tenant create` at once never lose one another's account."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:
                _write_private(self.state_path, json.dumps(state, indent=2, sort_keys=True))
                _write_private(self.accounts_conf, render_preload(state))

    def _state(self) -> dict:
        if not self.state_path.exists():
            raise NotFound(f"no credentials in {self.root}: start the cluster with `nexus up` first",
                           details={"auth_dir": str(self.root)})
        return json.loads(self.state_path.read_text())

    def ensure(self) -> None:
        """Create the operator, system, platform and admin identities once; keep them after
        (the platform's exports follow the prefix ``nexus up`` was given)."""
        with self._locked() as state:
            fresh = "operator" not in state
            if fresh:
                state.clear()
                state["operator"] = nats_jwt.new_key("operator")
                state["accounts"] = {SYS_ACCOUNT: {"seed": nats_jwt.new_key("account")},
                                     PLATFORM_ACCOUNT: {"seed": nats_jwt.new_key("account")}}
                state["tenants"] = {}
            if fresh or state.get("prefix") != self.prefix:
                state["prefix"] = self.prefix
                _sign_base(state)
        for name, path, account in (("sys", self.sys_creds, SYS_ACCOUNT),
                                    ("platform", self.platform_creds, PLATFORM_ACCOUNT),
                                    ("admin", self.admin_creds, PLATFORM_ACCOUNT)):
            # A file from before these keys (an older data dir's) is signed by no account of ours.
            if fresh or not path.exists():
                _issue_user(state["accounts"][account]["seed"], name).write(path)
        if fresh:
            for stale in (self.root / "tenants").glob("*.creds"):
                stale.unlink()
        if self.prefix != "*":  # a test server shared by many prefixes has no role users
            self._issue_roles(fresh)

    # -- the roles' own users --------------------------------------------------------------
    @property
    def role_creds_dir(self) -> Path:
        """Where each platform process's own credentials lie: beside ``auth/``, not in it,
        so a role can read its file (`role_creds`) while ``auth/`` (every seed) stays 0700."""
        return self.data_dir / ROLE_CREDS_DIR

    def role_creds(self, role: str) -> Path:
        """``role``'s credentials (one of `transport.permissions.PROCESSES`): a user of the
        platform account whose JWT allows only what that role publishes and subscribes to."""
        from transport.permissions import PROCESSES

        if role not in PROCESSES:
            raise InvalidField("role", f"{role!r} is not a platform process; allowed: {list(PROCESSES)}")
        return self.role_creds_dir / f"{role}.creds"

    def _issue_roles(self, fresh: bool) -> None:
        """Issue each process's user when its file is missing, was signed by other keys, or
        its permissions differ from what `transport.permissions` derives now (a new prefix, a
        new version); the replaced user key is revoked in the platform account's JWT."""
        from transport.permissions import PROCESSES, role_permissions

        self.role_creds_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.role_creds_dir, 0o711)  # traversable, not listable: each file names its reader
        with self._locked() as state:
            platform_seed = state["accounts"][PLATFORM_ACCOUNT]["seed"]
            keys = state.setdefault("role_users", {})
            revoked = state["accounts"][PLATFORM_ACCOUNT].setdefault("revoked", {})
            changed = False
            for role in PROCESSES:
                path = self.role_creds(role)
                want = role_permissions(role, self.prefix)
                if not fresh and path.exists() and _same_user(path, keys.get(role), want):
                    continue
                creds = _issue_user(platform_seed, role, permissions=want)
                if keys.get(role):
                    revoked[keys[role]] = int(time.time())
                keys[role] = creds.user_key
                creds.write(path)
                changed = True
            if changed:
                _sign_base(state)

    def write_server_include(self, resolver_dir: Path) -> Path:
        """`server_include`: ``accounts.conf`` (included relative to this file, as nats-server
        resolves includes) and a full resolver in ``resolver_dir``, a path on the server's own
        machine that must be writable there and one per node."""
        self._state()
        _write_private(self.server_include, f"include {self.accounts_conf.name}\n{resolver_block(resolver_dir)}")
        return self.server_include

    def platform(self) -> Credentials:
        self._state()
        return Credentials.read(self.platform_creds)

    def admin(self) -> Credentials:
        self._state()
        return Credentials.read(self.admin_creds)

    def tenants(self) -> list[str]:
        """Tenants whose credentials are live (issued and not revoked)."""
        return sorted(t for t, rec in self._state().get("tenants", {}).items() if rec.get("user"))

    def account_jwt(self, tenant: str) -> str:
        return self._state()["tenants"][tenant]["jwt"]

    def storage_bytes(self, tenant: str) -> int:
        """The tenant account's JetStream storage quota (bytes)."""
        rec = self._state().get("tenants", {}).get(tenant)
        if rec is None:
            raise NotFound(f"tenant {tenant!r} has no account", details={"tenant": tenant})
        return int(rec["storage_bytes"])

    def account_limits(self, tenant: str) -> dict[str, int]:
        """The tenant account's core limits (`ACCOUNT_LIMITS` names: max_conns, max_subs,
        max_payload in bytes)."""
        rec = self._state().get("tenants", {}).get(tenant)
        if rec is None:
            raise NotFound(f"tenant {tenant!r} has no account", details={"tenant": tenant})
        defaults = default_account_limits()
        return {k: int(rec.get(k, defaults[k])) for k in ACCOUNT_LIMITS}

    def add_tenant(self, tenant: str, storage_bytes: int | None = None, expires_in_s: float | None = None,
                   limits: dict[str, int] | None = None) -> Path:
        """A tenant's account (made once) and a new user's credentials: a re-issue revokes
        the tenant's previous user key. ``storage_bytes``: the account's JetStream storage
        quota (default: the last one set, else `default_storage_bytes`). ``limits``: some of
        its core limits (`ACCOUNT_LIMITS` names; each default: the last one set, else
        `default_account_limits`). ``expires_in_s``:
        the credentials' lifetime (None: no expiry); the server refuses them after it and
        closes the connections made with them, and a re-issue is the rotation. Returns the
        creds file; `push` makes it live on a running server."""
        check_token("tenant", tenant)
        if tenant in RESERVED_USERS:
            raise InvalidField("tenant", f"{tenant!r} is the name of a platform user; pick another "
                                         f"(reserved: {', '.join(RESERVED_USERS)})")
        if storage_bytes is not None and (not isinstance(storage_bytes, int) or storage_bytes < 1):
            raise InvalidField("storage_bytes", f"must be an integer >= 1, got {storage_bytes!r}")
        if expires_in_s is not None and not expires_in_s > 0:
            raise InvalidField("expires_in_s", f"must be > 0 (None: no expiry), got {expires_in_s!r}")
        for name, value in (limits or {}).items():
            if name not in ACCOUNT_LIMITS:
                raise InvalidField(f"limits.{name}", f"not an account limit; allowed: {', '.join(ACCOUNT_LIMITS)}")
            # int32 on the server (a larger value would wrap there).
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise InvalidField(f"limits.{name}", f"must be an integer in 1..{2**31 - 1}, got {value!r}")
        self._state()  # refuses before `nexus up` made the base identities
        with self._locked() as state:
            rec = state["tenants"].setdefault(tenant, {"seed": nats_jwt.new_key("account"), "revoked": {}})
            if storage_bytes is not None:
                rec["storage_bytes"] = storage_bytes
            rec.setdefault("storage_bytes", default_storage_bytes())
            rec.update(limits or {})
            if rec.get("user"):
                rec["revoked"][rec["user"]] = int(time.time())
            expires_at = None if expires_in_s is None else math.ceil(time.time() + expires_in_s)
            creds = _issue_user(rec["seed"], tenant, tags=[f"{TENANT_TAG}{tenant}"], expires_at=expires_at)
            rec["user"] = creds.user_key
            _sign_tenant(state, tenant)
        return creds.write(self.tenant_creds(tenant))

    def revoke_tenant(self, tenant: str) -> None:
        """Revoke the tenant's user key in its account JWT: once pushed, its connections are
        closed and the credentials refused. The account (and what it stored) stays;
        `add_tenant` issues a new user in it."""
        check_token("tenant", tenant)
        with self._locked() as state:
            rec = state.get("tenants", {}).get(tenant)
            if rec is None or not rec.get("user"):
                raise NotFound(f"tenant {tenant!r} has no credentials to revoke "
                               f"(known: {sorted(t for t, r in state.get('tenants', {}).items() if r.get('user'))})",
                               details={"tenant": tenant})
            rec["revoked"][rec.pop("user")] = int(time.time())
            _sign_tenant(state, tenant)
        self.tenant_creds(tenant).unlink(missing_ok=True)

    def remove_tenant(self, tenant: str) -> dict[str, int]:
        """A deleted tenant's account goes from the state and ``accounts.conf`` (the next
        start preloads it no more) and its creds file from disk. Call it after `revoke_tenant`
        was pushed: the running servers keep the account JWT that revokes its user.
        Counts: accounts, creds."""
        check_token("tenant", tenant)
        if not self.exists:
            return {"accounts": 0, "creds": 0}
        with self._locked() as state:
            accounts = int(state.get("tenants", {}).pop(tenant, None) is not None)
        path = self.tenant_creds(tenant)
        creds = int(path.exists())
        path.unlink(missing_ok=True)
        return {"accounts": accounts, "creds": creds}

    async def push(self, url: str, tenant: str, timeout_s: float = 10.0) -> None:
        """Hand the tenant's account JWT to the running server(s) over the system account:
        a new account, its imports and limits, and its revocations take effect at once
        (every server of a cluster takes the update; one answers)."""
        import nats

        from protocol.subjects import SYS_CLAIMS_UPDATE

        token = self.account_jwt(tenant)
        servers = [strip_userinfo(u.strip()) for u in url.split(",") if u.strip()]
        nc = await nats.connect(servers, name="nexus-auth", allow_reconnect=False, connect_timeout=2,
                                **Credentials.read(self.sys_creds).connect_options())
        try:
            reply = await nc.request(SYS_CLAIMS_UPDATE, token.encode(), timeout=timeout_s)
        finally:
            await nc.close()
        data = json.loads(reply.data).get("data", {}) if reply.data else {}
        if data.get("code") != 200:
            raise Unavailable(f"the server refused tenant {tenant!r}'s account update: "
                              f"{data.get('description') or data.get('message') or reply.data!r}",
                              details={"tenant": tenant, "reply": data})


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def _issue_user(account_seed: str, name: str, tags: list[str] | None = None,
                expires_at: int | None = None, permissions: dict[str, Any] | None = None) -> Credentials:
    seed = nats_jwt.new_key("user")
    token = nats_jwt.encode(account_seed, nats_jwt.public(seed), name,
                            nats_jwt.user_claims(tags, permissions=permissions), expires_at=expires_at)
    return Credentials(text=nats_jwt.creds_text(token, seed))


def _same_user(path: Path, key: str | None, permissions: dict[str, Any]) -> bool:
    """Whether the creds file at ``path`` is the user ``key`` with exactly ``permissions``."""
    try:
        claims = nats_jwt.decode_claims(nats_jwt.parse_creds(path.read_text())[0])
    except (OSError, ValueError):
        return False
    nats = claims.get("nats", {})
    return bool(key) and claims.get("sub") == key and all(nats.get(k) == v for k, v in permissions.items())


# JetStream of the platform account: everything the host gives (its streams, KV, objects).
PLATFORM_JETSTREAM = {"mem_storage": nats_jwt.NO_LIMIT, "disk_storage": nats_jwt.NO_LIMIT,
                      "streams": nats_jwt.NO_LIMIT, "consumer": nats_jwt.NO_LIMIT}
# A tenant account's own JetStream, besides its storage quota: no memory storage (a tenant's
# memory streams would take the host's RAM), a handful of streams and consumers.
TENANT_STREAMS = 16
TENANT_CONSUMERS = 64


def _sign_base(state: dict) -> None:
    """(Re-)sign the operator, SYS and PLATFORM JWTs (PLATFORM's exports follow the prefix)."""
    op = state["operator"]
    accounts = state["accounts"]
    sys_pub = nats_jwt.public(accounts[SYS_ACCOUNT]["seed"])
    state["operator_jwt"] = nats_jwt.encode(op, nats_jwt.public(op), "vla-nexus",
                                            nats_jwt.operator_claims(sys_pub))
    accounts[SYS_ACCOUNT]["jwt"] = nats_jwt.encode(op, sys_pub, SYS_ACCOUNT, nats_jwt.account_claims())
    exports = [{"name": s, "subject": s, "type": "service"} for s in tenant_services(state["prefix"])]
    # Every tenant's workload events; each tenant account imports only its own.
    events = tenant_events_pattern(state["prefix"])
    exports.append({"name": events, "subject": events, "type": "stream"})
    platform_pub = nats_jwt.public(accounts[PLATFORM_ACCOUNT]["seed"])
    # revoked: role users replaced by a re-issue (`AuthStore._issue_roles`).
    accounts[PLATFORM_ACCOUNT]["jwt"] = nats_jwt.encode(
        op, platform_pub, PLATFORM_ACCOUNT,
        nats_jwt.account_claims(jetstream=PLATFORM_JETSTREAM, exports=exports,
                                revocations=accounts[PLATFORM_ACCOUNT].get("revoked") or None))
    for tenant in state.get("tenants", {}):
        _sign_tenant(state, tenant)


def _sign_tenant(state: dict, tenant: str) -> None:
    rec = state["tenants"][tenant]
    platform_pub = nats_jwt.public(state["accounts"][PLATFORM_ACCOUNT]["seed"])
    # share: the server puts the requester's account and user (its JWT's tags, so its
    # tenant) in Nats-Request-Info, overwriting any header of that name the tenant set: how
    # a responder knows the caller.
    imports = [{"name": s, "subject": s, "account": platform_pub, "type": "service", "share": True}
               for s in tenant_services(state["prefix"])]
    events = tenant_events_pattern(state["prefix"], tenant)
    imports.append({"name": events, "subject": events, "account": platform_pub, "type": "stream"})
    jetstream = {"mem_storage": 0, "disk_storage": int(rec["storage_bytes"]), "streams": TENANT_STREAMS,
                 "consumer": TENANT_CONSUMERS}
    # Recorded once (an account from before these limits gets the defaults, then keeps them).
    for name, value in default_account_limits().items():
        rec.setdefault(name, value)
    # leaf 0: no leaf node joins as a tenant. (The JWT's ``data`` stays unlimited: nats-server
    # does not enforce it; a tenant's traffic is bounded by these, its quotas and rates.)
    core = {jwt_key: int(rec[name]) for name, jwt_key in ACCOUNT_LIMITS.items()} | {"leaf": 0}
    rec["jwt"] = nats_jwt.encode(
        state["operator"], nats_jwt.public(rec["seed"]), f"{TENANT_ACCOUNT_PREFIX}{tenant}",
        nats_jwt.account_claims(jetstream=jetstream, imports=imports, revocations=rec["revoked"], limits=core))


def render_preload(state: dict) -> str:
    """The operator, system account and every account JWT, for nats-server's config: what a
    (re)started server trusts before anything is pushed (the resolver keeps newer pushes)."""
    if "operator_jwt" not in state:
        return ""
    sys_pub = nats_jwt.public(state["accounts"][SYS_ACCOUNT]["seed"])
    lines = ["# Written by vla-nexus (transport/auth.py) on every change; do not edit.",
             f"operator: {state['operator_jwt']}",
             f"system_account: {sys_pub}",
             "resolver_preload: {"]
    for rec in [*state["accounts"].values(), *state.get("tenants", {}).values()]:
        lines.append(f"  {nats_jwt.public(rec['seed'])}: {rec['jwt']}")
    lines += ["}", ""]
    return "\n".join(lines)


def resolver_block(directory: Path) -> str:
    """The full resolver of one server: account JWTs kept in ``directory``, updated at run
    time over the system account; ``allow_delete`` lets the operator remove an account."""
    return (f'resolver: {{\n  type: full\n  dir: "{directory}"\n  allow_delete: true\n'
            f'  interval: "2m"\n}}\n')


async def wait_login(url: str, creds: Path | Credentials, *, accepted: bool, timeout_s: float = 10.0,
                     poll_s: float = 0.1) -> None:
    """Until the server accepts (``accepted``) or refuses these credentials: `nexus tenant
    create` / `revoke` return only once the pushed account took effect on the server."""
    import asyncio

    import nats

    who = creds if isinstance(creds, Credentials) else Credentials.read(creds)
    login = who.connect_options()
    servers = [strip_userinfo(u.strip()) for u in url.split(",") if u.strip()]
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        async def quiet(exc: Exception) -> None:
            pass

        try:
            nc = await nats.connect(servers, allow_reconnect=False, max_reconnect_attempts=0,
                                    connect_timeout=2, error_cb=quiet, **login)
            await nc.close()
            if accepted:
                return
            last = "still accepted"
        except Exception as exc:  # nats raises its own errors, OSError, TimeoutError
            last = str(exc)
            if not accepted and "authorization" in last.lower():
                return
        if time.monotonic() > deadline:
            want = "accept" if accepted else "refuse"
            raise Unavailable(f"the server did not {want} the credentials of user {who.user!r} within "
                              f"{timeout_s:g} s after the account update (last: {last})", details={"last": last})
        await asyncio.sleep(poll_s)
