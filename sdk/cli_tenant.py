"""`nexus tenants`, `usage`, `base ...`, `tenant ...` and `auth init`: tenants, their accounts,
credentials and quotas, and the bases they may name. Registered on the apps of sdk/cli_common.py;
`nexus` (sdk/cli.py) imports this module."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from sdk.cli_run import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from sdk.cli_common import (DEFAULT_DATA_DIR, DataDir, Json, NatsUrl, Prefix, TimeoutS, as_dict, cluster_client,
                            print_error, run_command, tenant_caller, app, auth_app, base_app, tenant_app)


def _tenant_rows(reply: Any) -> list[dict]:
    history = reply.history
    return [{"tenant": t.name, "base": t.base, "head": t.head, "signature": t.signature,
             "version": reply.versions.get(t.name, 0), "priority": t.priority,
             "workloads": list(history.get(t.name, []))} for t in reply.tenants]


@app.command()
def tenants(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Table of tenants: base, head, latest version."""
    from sdk.term import print_json, table

    async def fetch():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.tenants()

    rows = [{**r, "registered": True} for r in _tenant_rows(run_command(fetch()))]
    rows += _accounts_without_record(data_dir, {r["tenant"] for r in rows})
    if json:
        print_json(rows)
        return EXIT_OK
    table(("TENANT", "BASE", "HEAD", "VERSION", "WORKLOADS", "SIGNATURE"),
          [(r["tenant"], r["base"], r["head"], r["version"], len(r["workloads"]),
            r["signature"][:19] if r["registered"] else "(no workload yet)") for r in rows])
    return EXIT_OK


def _accounts_without_record(data_dir: Path, known: set[str]) -> list[dict]:
    """Tenants with credentials (`nexus tenant create`) that the master has no record of yet:
    a tenant is registered at its first submit, so `nexus tenants` right after `tenant create`
    was empty. Read from this data dir's auth store, for the operator only."""
    from transport.auth import AuthStore

    if tenant_caller() is not None:
        return []
    store = AuthStore(data_dir.resolve())
    if not store.exists:
        return []
    return [{"tenant": t, "base": "-", "head": "-", "signature": "", "version": "-", "priority": None,
             "workloads": [], "registered": False} for t in store.tenants() if t not in known]


def usage_rows(reply: Any) -> list[dict]:
    """One row per (tenant, workload): device-seconds, rows, requests, bytes (workload "_" =
    use outside any workload), plus each tenant's bytes stored now."""
    import msgspec

    return [{"tenant": r.tenant, "workload": r.workload, **msgspec.structs.asdict(r.usage),
             "stored_now": reply.stored_now.get(r.tenant, 0)} for r in reply.records]


@app.command()
def usage(
    tenant: Annotated[str, typer.Option("--tenant", help="only this tenant's usage")] = "",
    workload: Annotated[str, typer.Option("--workload", help="only this workload's usage")] = "",
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Metered usage per tenant and workload: train / inference device-seconds, requests, bytes."""
    from sdk.term import print_json, table

    async def fetch():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.usage(tenant, workload)

    rows = usage_rows(run_command(fetch()))
    if json:
        print_json(rows)
        return EXIT_OK
    table(("TENANT", "WORKLOAD", "TRAIN_DEVICE_S", "INFER_DEVICE_S", "TRAIN_ROWS", "REQUESTS", "EXPORTED_BYTES",
           "STORED_NOW"),
          [(r["tenant"], r["workload"], f"{r['train_device_s']:.3f}", f"{r['infer_device_s']:.3f}", r["train_rows"],
            r["requests"], r["stored_bytes"], r["stored_now"]) for r in rows])
    return EXIT_OK


@base_app.command("add")
def base_add(
    name: Annotated[str, typer.Argument(help="the name tenants use: registered:NAME (A-Z a-z 0-9 _ -)")],
    path: Annotated[str, typer.Argument(help="the base's save_pretrained directory on the master's host")],
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Register a base directory under a name (an operator op): tenants name `registered:NAME`."""
    from sdk.term import print_json

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.add_base(name, path)

    rec = run_command(go())
    if json:
        print_json(as_dict(rec))
    else:
        print(f"registered:{rec.name} -> {rec.path}")
    return EXIT_OK


@base_app.command("list")
def base_list(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """What a spec's base may name: presets and registered names (paths: the operator only)."""
    from sdk.term import print_json, table

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.bases()

    reply = run_command(go())
    if json:
        print_json(as_dict(reply))
        return EXIT_OK
    paths = {f"registered:{b.name}": b.path for b in reply.bases}
    table(("BASE", "KIND", "PATH"), [(p, "preset", "") for p in reply.presets]
          + [(n, "registered", paths.get(n, "")) for n in reply.names])
    return EXIT_OK


@tenant_app.command("show")
def tenant_show(
    name: Annotated[str, typer.Argument(help="tenant name (a tenant's credentials: its own, the default)")] = "",
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """One tenant: base, head, schema, latest policy version, quotas in force, its workloads.
    A tenant (`--creds`) shows itself; the operator names any."""
    from sdk.term import print_json, table

    async def fetch():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            shown = await client.tenant_show(name)
            return shown, await client.workloads(shown.tenant)

    shown, workloads = run_command(fetch())
    config = shown.config
    out = {"tenant": shown.tenant, "config": as_dict(config) if config is not None else None,
           "version": shown.version, "quotas": as_dict(shown.quotas), "quotas_default": shown.quotas_default,
           "workloads": [{"workload": w.workload, "task": w.task, "state": w.state, "version": w.step}
                         for w in workloads]}
    if json:
        print_json(out)
        return EXIT_OK
    if config is None:
        print(f"tenant {shown.tenant}: no slot (reset, or nothing trained yet); its next sft or rl submit "
              "registers the spec's base, head and schema")
    else:
        print(f"tenant {shown.tenant}: base {config.base}, head {config.head}, version {shown.version}")
        print(f"  schema  {_schema_text(config.schema)}")
    quotas = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in out["quotas"].items())
    print(f"  quotas  {quotas}" + (" (the deployment's defaults)" if shown.quotas_default else ""))
    if out["workloads"]:
        table(("WORKLOAD", "TASK", "STATE", "VERSION"),
              [(w["workload"], w["task"], w["state"], w["version"]) for w in out["workloads"]])
    return EXIT_OK


def _schema_text(schema: dict) -> str:
    """A stored schema in the spec's words: cameras, observation.state_dim, action dim / horizon."""
    cams = ", ".join(f"{c.get('name')} {c.get('height')}x{c.get('width')}" for c in schema.get("cameras") or [])
    return (f"cameras [{cams}], state_dim {schema.get('state_dim')}, action dim {schema.get('action_dim')} "
            f"horizon {schema.get('action_horizon')}, instruction_template {schema.get('instruction_template')!r}")


@tenant_app.command("reset")
def tenant_reset(
    name: Annotated[str, typer.Argument(help="tenant name (a tenant's credentials: its own, the default)")] = "",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 30.0,
) -> int:
    """Drop a tenant's slot: its config (base, head, schema), policy versions, checkpoints, job
    records and queue, so its next submit registers a new schema. Its credentials, workload
    records, reports and usage stay. A tenant (`--creds`) resets itself, without admin rights;
    refused while one of its workloads runs (cancel it first)."""
    from sdk.term import print_json

    who = f"tenant {name}" if name else "your tenant"
    refused = _confirmed(yes, f"resetting {who} drops its policy versions and checkpoints",
                         f"Reset {who}: drop its slot, policy versions and checkpoints?", "not reset")
    if refused is not None:
        return refused

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.reset_tenant(name)

    gone = run_command(go())
    if json:
        print_json(as_dict(gone))
    else:
        removed = ", ".join(f"{n} {what}" for what, n in sorted(gone.removed.items()) if what != "slot")
        print(f"tenant {gone.tenant} reset: its slot is gone ({removed}); its credentials, workload records "
              "and usage stay; its next sft or rl submit registers the spec's schema")
    return EXIT_OK


def _confirmed(yes: bool, what: str, question: str, declined: str) -> int | None:
    """None to go on (``--yes``, or the user said yes); else the exit code, having said why:
    with no terminal to ask on, a destructive command needs ``--yes``."""
    if yes:
        return None
    if not sys.stdin.isatty():
        print_error(f"{what}; confirm with --yes")
        return EXIT_BAD_INPUT
    if not typer.confirm(question):
        print_error(declined)
        return EXIT_FAILED
    return None


@tenant_app.command("delete")
def tenant_delete(
    name: Annotated[str, typer.Argument(help="tenant name")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 30.0,
) -> int:
    """Delete a tenant: its slot, training-queue stream, policy versions, checkpoints, job,
    workload and usage records, reports, recorded datasets, TensorBoard run, and (when this data
    dir holds the credentials) its account and creds. Refused while one of its workloads runs
    (cancel it first)."""
    from sdk.term import print_json

    refused = _confirmed(yes, f"deleting tenant {name} removes its policies and history",
                         f"Delete tenant {name}, its policy versions, checkpoints and history?", "not deleted")
    if refused is not None:
        return refused

    from transport.auth import AuthStore
    from protocol.errors import NotFound
    from protocol.messages import TenantDeleted

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            try:
                return await client.delete_tenant(name)
            except NotFound:
                # Credentials issued (`tenant create`) but nothing submitted yet: the master
                # has no record, the auth store still has the account; that one goes below.
                if name not in AuthStore(Path(data_dir).resolve()).tenants():
                    raise
                return TenantDeleted(tenant=name, at=time.time(), removed={})

    gone = run_command(go())
    gone.removed.update(_remove_tenant_account(data_dir, name, timeout_s))
    if json:
        print_json(as_dict(gone))
    else:
        removed = ", ".join(f"{n} {what}" for what, n in sorted(gone.removed.items()))
        print(f"tenant {gone.tenant} deleted ({removed or 'nothing else stored'})")
    return EXIT_OK


def _remove_tenant_account(data_dir: Path, name: str, timeout_s: float) -> dict[str, int]:
    """A deleted tenant's account and creds, when this data dir's auth holds them: the user is
    revoked (pushed to the running cluster, its connections closed), then the account leaves
    the state and ``accounts.conf``, and the creds file goes. The master cannot do this: the
    auth dir (the operator's keys) is the CLI's, not the master role's."""
    from transport.auth import AuthStore
    from transport.creds import Credentials
    from transport.cluster import ClusterState
    from protocol.errors import NexusError

    resolved = data_dir.resolve()
    store = AuthStore(resolved)
    if not store.exists:
        return {}
    path = store.tenant_creds(name)
    old = Credentials.read(path) if path.exists() else None
    try:
        store.revoke_tenant(name)
        revoked = True
    except NexusError:  # no live user (revoked before, or never issued here)
        revoked = False
    url = _push_url(ClusterState.read(resolved), None)
    if revoked and url is not None:
        run_command(_push_and_wait(store, url, name, old, accepted=False, timeout_s=timeout_s))
    removed = store.remove_tenant(name)
    # revoke_tenant already took the creds file: it counts as removed here all the same.
    if old is not None and not path.exists():
        removed["creds"] = max(removed.get("creds", 0), 1)
    return removed


@tenant_app.command("quotas")
def tenant_quotas(
    name: Annotated[str, typer.Argument(help="tenant name")],
    max_inflight_jobs: Annotated[int | None, typer.Option(
        "--max-inflight-jobs", min=1, show_default=False,
        help="unfinished training jobs, all tasks together (also the ceiling of its schedule.max_inflight_jobs)")] = None,
    max_active_rollouts: Annotated[int | None, typer.Option(
        "--max-active-rollouts", min=1, show_default=False, help="rollouts collecting at once")] = None,
    predict_rate_per_s: Annotated[float | None, typer.Option(
        "--predict-rate-per-s", show_default=False, help="predicts per second per inferencer (> 0)")] = None,
    predict_burst: Annotated[int | None, typer.Option(
        "--predict-burst", min=1, show_default=False, help="predicts above that rate in a burst")] = None,
    max_priority: Annotated[int | None, typer.Option(
        "--max-priority", show_default=False, help="the highest scheduling priority its jobs may ask (-10..10)")] = None,
    defaults: Annotated[bool, typer.Option("--defaults", help="back to the deployment's defaults (NEXUS_QUOTA_*)")] = False,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Show or set a tenant's quotas (an operator command: a tenant's own request never sets
    them). Options given change those quotas, the others stay; none: show them."""
    from sdk.term import print_json

    changes = {k: v for k, v in (("max_inflight_jobs", max_inflight_jobs), ("max_active_rollouts", max_active_rollouts),
                                 ("predict_rate_per_s", predict_rate_per_s), ("predict_burst", predict_burst),
                                 ("max_priority", max_priority)) if v is not None}
    if defaults and changes:
        print_error("--defaults: give it alone (it drops every quota of the tenant's own)")
        return EXIT_BAD_INPUT

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            if defaults:
                return await client.set_quotas(name, None)
            if changes:
                return await client.update_quotas(name, **changes)
            return await client.tenant(name)

    config = run_command(go())
    quotas = as_dict(config.quotas) if config.quotas is not None else None
    if json:
        print_json({"tenant": name, "quotas": quotas})
    elif quotas is None:
        print(f"tenant {name}: the deployment's default quotas (NEXUS_QUOTA_*)")
    else:
        print(f"tenant {name}: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in quotas.items()))
    return EXIT_OK


# A tenant's credentials expire unless the operator says otherwise: a leaked file stops
# working by itself, and `nexus tenant create NAME` again is the rotation.
DEFAULT_CREDS_TTL = "90d"
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float | None:
    """Seconds of a lifetime like ``90d``, ``12h``, ``30m``, ``45s``; None for ``never``."""
    value = text.strip().lower()
    if value == "never":
        return None
    number, unit = value[:-1], value[-1:]
    try:
        seconds = float(number) * _DURATION_UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a lifetime: a number with s, m, h or d (e.g. 12h, 90d), "
                         "or `never`") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{text!r}: a lifetime must be > 0")
    return seconds


@tenant_app.command("create")
def tenant_creds_create(
    name: Annotated[str, typer.Argument(help="tenant name")],
    data_dir: DataDir = DEFAULT_DATA_DIR, json: Json = False, nats_url: PushUrl = None,
    storage_mb: Annotated[float | None, typer.Option(
        "--storage-mb", envvar="NEXUS_TENANT_STORAGE_MB", show_default=False,
        help="JetStream storage quota of the tenant's own account, MiB (default: the last one set, "
             "else 64)")] = None,
    max_conns: Annotated[int | None, typer.Option(
        "--max-conns", envvar="NEXUS_TENANT_MAX_CONNS", show_default=False, min=1,
        help="connections the tenant's account may hold at once (default: the last one set, else 16)")] = None,
    max_subs: Annotated[int | None, typer.Option(
        "--max-subs", envvar="NEXUS_TENANT_MAX_SUBS", show_default=False, min=1,
        help="subscriptions per connection of the tenant's account (default: the last one set, else 256)")] = None,
    max_payload_kb: Annotated[int | None, typer.Option(
        "--max-payload-kb", envvar="NEXUS_TENANT_MAX_PAYLOAD_KB", show_default=False, min=1,
        help="largest message the tenant may publish, KiB (default: the last one set, else 1024)")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="how long to wait for the server to accept them")] = 10.0,
    expires_in: Annotated[str, typer.Option(
        "--expires-in", help="the credentials' lifetime: a number with s, m, h or d (e.g. 12h, 90d), or "
                             "`never`; past it the server refuses them and closes their connections")] = DEFAULT_CREDS_TTL,
) -> int:
    """Issue a tenant's credentials file (its own NATS account), live on the running server.
    Again for the same name: new credentials; the old ones stop working (the rotation). The
    account's storage quota and limits (connections, subscriptions, message size) are the
    operator's: set here, kept when not given again."""
    from transport.auth import AuthStore
    from transport.creds import Credentials
    from transport.cluster import ClusterState
    from sdk.term import print_json

    resolved = data_dir.resolve()
    state = ClusterState.read(resolved)
    store = AuthStore(resolved)
    if storage_mb is not None and storage_mb <= 0:
        print_error(f"--storage-mb: must be > 0, got {storage_mb:g}")
        return EXIT_BAD_INPUT
    try:
        ttl_s = duration_s(expires_in)
    except ValueError as exc:
        print_error(f"--expires-in: {exc}")
        return EXIT_BAD_INPUT
    limits = {k: v for k, v in (("max_conns", max_conns), ("max_subs", max_subs),
                                ("max_payload", None if max_payload_kb is None else max_payload_kb * 1024))
              if v is not None}
    path = store.add_tenant(name, storage_bytes=None if storage_mb is None else int(storage_mb * 2**20),
                            expires_in_s=ttl_s, limits=limits)
    expires_at = Credentials.read(path).expires_at
    until = ("never expire" if expires_at is None
             else f"expire {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires_at))}")
    url = _push_url(state, nats_url)
    live = url is not None
    if live:
        run_command(_push_and_wait(store, url, name, path, accepted=True, timeout_s=timeout_s))
    if json:
        print_json({"tenant": name, "creds": str(path), "live": live, "storage_bytes": store.storage_bytes(name),
                    **store.account_limits(name), "expires_at": expires_at})
    else:
        print(f"tenant {name}: credentials in {path} ({'accepted by the running server' if live else 'used from the next `nexus up`'}; "
              f"they {until}); the tenant logs in with `nexus --creds {path} ...` or NEXUS_CREDS={path}")
    return EXIT_OK


# Not NEXUS_NATS_URL: a role's environment names its broker, not where an account is pushed.
PushUrl = Annotated[str | None, typer.Option(
    "--nats-url", show_default=False,
    help="push the account to this running broker (one `nexus up` did not start, e.g. the compose "
         "cluster's); default: the data dir's cluster, if it runs")]


def _push_url(state: Any, nats_url: str | None) -> str | None:
    """Where a tenant's account update goes: ``--nats-url``, else the data dir's running
    cluster, else nowhere (the next `nexus up` preloads it)."""
    if nats_url:
        return nats_url
    return state.nats_url if state is not None and state.broker_pids else None


@auth_app.command("init")
def auth_init(
    data_dir: DataDir = DEFAULT_DATA_DIR, prefix: Prefix = None,
    resolver_dir: Annotated[Path, typer.Option(
        "--resolver-dir", help="where each NATS node keeps the account JWTs pushed to it (a path on the "
                               "node, writable there, one per node)")] = Path("/data/jwt"),
    json: Json = False,
) -> int:
    """Create the operator, system, platform and admin identities in DATA_DIR/auth, a user per
    role in DATA_DIR/role-creds (kept when they exist), and the include a NATS node's config
    needs (auth/nats-auth.conf)."""
    from transport.auth import AuthStore
    from protocol.subjects import DEFAULT_PREFIX
    from sdk.term import print_json

    store = AuthStore(data_dir.resolve(), prefix=prefix or DEFAULT_PREFIX)
    fresh = not store.exists
    store.ensure()
    include = store.write_server_include(resolver_dir)
    out = {"auth_dir": str(store.root), "created": fresh, "include": str(include),
           "platform_creds": str(store.platform_creds), "admin_creds": str(store.admin_creds),
           "role_creds": str(store.role_creds_dir)}
    if json:
        print_json(out)
    else:
        print(f"identities {'created' if fresh else 'kept'} in {store.root}; NATS nodes include {include}; "
              f"each role logs in with NEXUS_CREDS={store.role_creds_dir}/<role>.creds (its own), "
              f"operators with {store.admin_creds}")
    return EXIT_OK


async def _push_and_wait(store: Any, url: str, tenant: str, creds: Any, *, accepted: bool, timeout_s: float) -> None:
    """Push the tenant's account JWT to the running servers, then wait until they accept
    (or refuse) ``creds``."""
    from transport.auth import wait_login

    await store.push(url, tenant, timeout_s=timeout_s)
    if creds is not None:
        await wait_login(url, creds, accepted=accepted, timeout_s=timeout_s)


@tenant_app.command("revoke")
def tenant_creds_revoke(
    name: Annotated[str, typer.Argument(help="tenant name")],
    data_dir: DataDir = DEFAULT_DATA_DIR, json: Json = False, nats_url: PushUrl = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="how long to wait for the server to drop them")] = 10.0,
) -> int:
    """Revoke a tenant's credentials: its connections are closed now and it cannot log in
    again. Its workloads, policies and data stay (`nexus tenant delete` removes those)."""
    from transport.auth import AuthStore
    from transport.creds import Credentials
    from transport.cluster import ClusterState
    from sdk.term import print_json

    resolved = data_dir.resolve()
    state = ClusterState.read(resolved)
    store = AuthStore(resolved)
    old = Credentials.read(store.tenant_creds(name)) if store.tenant_creds(name).exists() else None
    store.revoke_tenant(name)
    url = _push_url(state, nats_url)
    live = url is not None
    if live:
        run_command(_push_and_wait(store, url, name, old, accepted=False, timeout_s=timeout_s))
    if json:
        print_json({"tenant": name, "revoked": True, "live": live})
    else:
        print(f"tenant {name}: credentials revoked{' (its connections are closed)' if live else ''}")
    return EXIT_OK
