"""Who may connect to the broker, and as which account: the data dir's ``auth/`` folder.

One NATS account per tenant is the isolation boundary (inside one account, user permissions
do not reliably fence JetStream). `AuthStore` keeps, under ``<data>/auth/``:

    state.json          every identity: SYS, PLATFORM (the roles), admin, one per tenant
    accounts.conf       the accounts block nats-server includes (rewritten on every change)
    platform.creds      the roles' credentials (the platform account: all of JetStream)
    admin.creds         the operator's (a user of the platform account)
    tenants/<name>.creds  a tenant's (its own account; only the exported subjects)

A creds file is a small JSON document ``{"user", "password", "account"}``, mode 0600::

    store = AuthStore(Path(".nexus"), prefix="nexus")
    store.ensure()                       # SYS, PLATFORM, admin; idempotent
    path = store.add_tenant("acme")      # then reload the server: `reload_servers(pids)`
    store.revoke_tenant("acme")

The tenant accounts get no JetStream at all and import only the platform's request-reply
subjects (`tenant_services`), with ``share: true`` so the server stamps the requester's
account into the ``Nats-Request-Info`` header every responder reads (`actors.identity`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from protocol.errors import InvalidField, NotFound, Unavailable
from protocol.subjects import check_token

SYS_ACCOUNT = "SYS"
PLATFORM_ACCOUNT = "PLATFORM"
# A tenant's account is this prefix + its name: the responder maps the server-asserted
# account back to the tenant (`actors.identity.Caller`).
TENANT_ACCOUNT_PREFIX = "tenant_"
AUTH_DIR = "auth"
RESERVED_USERS = ("sys", "platform", "admin")
ENV_CREDS = "NEXUS_CREDS"


def creds_from_env() -> Path | None:
    """The credentials file named by ``NEXUS_CREDS`` (the one place that variable is read)."""
    from protocol.settings import AuthSettings

    return AuthSettings.from_env().creds


# Tenant accounts made beyond those issued, at every start: tenants `nexus tenant create`
# can add before the next restart.
SPARE_TENANT_ACCOUNTS = 64


def slot_account(slot: int) -> str:
    """The name of tenant account ``slot``; the tenant in it is its (only) user's name, which
    the server asserts alongside the account (`actors.identity.Caller.tenant`)."""
    return f"{TENANT_ACCOUNT_PREFIX}{slot:04d}"


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


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str
    account: str

    @classmethod
    def read(cls, path: Path) -> Credentials:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
            return cls(user=str(raw["user"]), password=str(raw["password"]), account=str(raw.get("account", "")))
        except FileNotFoundError:
            raise NotFound(f"credentials file {path} does not exist", details={"creds": str(path)}) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidField("creds", f"{path} is not a vla-nexus credentials file "
                                        f"(JSON with user and password): {exc}") from None

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        tmp.replace(path)
        return path

    def connect_options(self) -> dict[str, str]:
        """nats.connect keyword arguments for these credentials."""
        return {"user": self.user, "password": self.password}

    def url(self, url: str) -> str:
        """``url`` (comma-separated servers) with these credentials as each server's userinfo."""
        out = []
        for one in (u.strip() for u in url.split(",") if u.strip()):
            parts = urlsplit(one)
            host = parts.netloc.rsplit("@", 1)[-1]
            netloc = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@{host}"
            out.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))
        return ",".join(out)


def strip_userinfo(url: str) -> str:
    """One server URL without ``user:password@`` (explicit credentials replace it)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, parts.query, parts.fragment))


def redact_url(url: str) -> str:
    """``url`` without passwords (for logs and error messages)."""
    out = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        if "@" in parts.netloc:
            user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
            host = parts.netloc.rsplit("@", 1)[-1]
            one = urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
        out.append(one.strip())
    return ",".join(out)


def _new(user: str, account: str) -> Credentials:
    # 32 random bytes: the password is the whole secret (the server config holds it, 0600).
    return Credentials(user=user, password=secrets.token_urlsafe(32), account=account)


def _quote(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid nats-server config string


class AuthStore:
    """The identities of one deployment, and the accounts block of its server config."""

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
                tmp = self.state_path.with_suffix(".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(state, f, indent=2, sort_keys=True)
                tmp.replace(self.state_path)
            self._write_conf(state)

    def _state(self) -> dict:
        if not self.state_path.exists():
            raise NotFound(f"no credentials in {self.root}: start the cluster with `nexus up` first",
                           details={"auth_dir": str(self.root)})
        return json.loads(self.state_path.read_text())

    def ensure(self) -> None:
        """Create the system, platform and admin identities once; keep them after."""
        with self._locked() as state:
            state["prefix"] = self.prefix  # the deployment's, as `nexus up` was given it
            state.setdefault("sys", asdict(_new("sys", SYS_ACCOUNT)))
            state.setdefault("platform", asdict(_new("platform", PLATFORM_ACCOUNT)))
            state.setdefault("admin", asdict(_new("admin", PLATFORM_ACCOUNT)))
            state.setdefault("tenants", {})
            # Tenant accounts exist from the server's start, each with its imports: an account
            # a config reload *adds* gets no working service imports on nats-server 2.15.1
            # (requests from it find no responders), while users added to an account that
            # was already there do work. So the pool is made at `up` and a tenant gets one.
            state.setdefault("next_slot", 0)
            state["slots"] = state["next_slot"] + SPARE_TENANT_ACCOUNTS
            Credentials(**state["platform"]).write(self.platform_creds)
            Credentials(**state["admin"]).write(self.admin_creds)

    def platform(self) -> Credentials:
        return Credentials(**self._state()["platform"])

    def admin(self) -> Credentials:
        return Credentials(**self._state()["admin"])

    def tenants(self) -> list[str]:
        return sorted(self._state().get("tenants", {}))

    def add_tenant(self, tenant: str) -> Path:
        """A tenant's account and credentials (new ones each call: a re-issue replaces the
        old password, in the same account). Returns the creds file; the running server
        needs a reload (`reload_servers`)."""
        check_token("tenant", tenant)
        if tenant in RESERVED_USERS:
            # User names are one namespace across the server's accounts.
            raise InvalidField("tenant", f"{tenant!r} is the name of a platform user; pick another "
                                         f"(reserved: {', '.join(RESERVED_USERS)})")
        self._state()  # refuses before `nexus up` made the base identities
        with self._locked() as state:
            old = state["tenants"].get(tenant)
            if old is not None:
                account = old["account"]
            else:
                slot = state.get("next_slot", 0)
                if slot >= state.get("slots", 0):
                    raise Unavailable(
                        f"all {state.get('slots', 0)} tenant accounts of this server are issued; restart the "
                        "cluster (`nexus down`, `nexus up`) to add more", details={"slots": state.get("slots", 0)})
                state["next_slot"] = slot + 1
                account = slot_account(slot)
            creds = _new(tenant, account)
            state["tenants"][tenant] = asdict(creds)
        return creds.write(self.tenant_creds(tenant))

    def revoke_tenant(self, tenant: str) -> None:
        """Remove a tenant's user: after the reload its connections are closed and its
        credentials refused. Its account is never issued again (see `slot_account`)."""
        check_token("tenant", tenant)
        with self._locked() as state:
            if tenant not in state.get("tenants", {}):
                raise NotFound(f"tenant {tenant!r} has no credentials to revoke "
                               f"(known: {sorted(state.get('tenants', {}))})", details={"tenant": tenant})
            del state["tenants"][tenant]
        self.tenant_creds(tenant).unlink(missing_ok=True)

    # -- server config -----------------------------------------------------------------
    def _write_conf(self, state: dict) -> None:
        if not state:
            return
        tmp = self.accounts_conf.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(render_accounts(state))
        tmp.replace(self.accounts_conf)


def render_accounts(state: dict) -> str:
    """The ``accounts`` block (and ``system_account``) for nats-server, from the state."""
    prefix = state.get("prefix", "nexus")
    services = tenant_services(prefix)

    def user(c: dict) -> str:
        return f"{{user: {_quote(c['user'])}, password: {_quote(c['password'])}}}"

    exports = ", ".join(f"{{service: {_quote(s)}}}" for s in services)
    lines = [
        "# Written by vla-nexus (actors/auth.py) on every change; do not edit.",
        "accounts {",
        f"  {SYS_ACCOUNT} {{ users: [{user(state['sys'])}] }}",
        f"  {PLATFORM_ACCOUNT} {{",
        "    jetstream: enabled",
        f"    users: [{user(state['platform'])}, {user(state['admin'])}]",
        f"    exports: [{exports}]",
        "  }",
    ]
    by_account = {c["account"]: c for c in state.get("tenants", {}).values()}
    # share: the server puts the requester's account and user in Nats-Request-Info
    # (overwriting any header of that name the tenant set): how a responder knows the caller.
    imports = ", ".join(
        f"{{service: {{account: {PLATFORM_ACCOUNT}, subject: {_quote(s)}}}, share: true}}" for s in services)
    for slot in range(state.get("slots", 0)):
        account = slot_account(slot)
        users = f"[{user(by_account[account])}]" if account in by_account else "[]"
        lines += [f"  {account} {{", f"    users: {users}", f"    imports: [{imports}]", "  }"]
    lines += ["}", f"system_account: {SYS_ACCOUNT}", ""]
    return "\n".join(lines)


def reload_servers(pids: list[int]) -> None:
    """Ask each nats-server to re-read its config (SIGHUP): accounts added or removed take
    effect without a restart, and a removed user's connections are closed."""
    if not pids:
        raise Unavailable("no embedded nats-server is running to reload (is the cluster up, and was it "
                          "started by `nexus up` rather than on --nats-url?)")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            raise Unavailable(f"nats-server pid {pid} is not running; start the cluster with `nexus up`",
                              details={"pid": pid}) from None


async def wait_login(url: str, creds: Path | Credentials, *, accepted: bool, timeout_s: float = 10.0,
                     poll_s: float = 0.1) -> None:
    """Until the server accepts (``accepted``) or refuses these credentials: a reload is
    asynchronous, and `nexus tenant create` / `revoke` return only once it took effect."""
    import asyncio
    import time

    import nats

    login = (creds if isinstance(creds, Credentials) else Credentials.read(creds)).connect_options()
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
            raise Unavailable(f"the server did not {want} the credentials of user {login['user']!r} within "
                              f"{timeout_s:g} s after the reload (last: {last})", details={"last": last})
        await asyncio.sleep(poll_s)
