"""The `nexus` command's typer app, its sub-apps and what every command shares: the options
(--data-dir, --nats-url, ...), the global --creds, running a command's coroutine, the client.

Command modules (sdk/cli_cluster.py, sdk/cli_tenant.py, sdk/cli_workloads.py) register on these
apps; sdk/cli.py imports them in the order `nexus --help` lists them. Nothing here imports more
than typer at import time (`nexus spec validate` must start fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

NATS_CLUSTER_SIZES = (1, 3, 5)

app = typer.Typer(name="nexus", help="vla-nexus: multi-tenant VLA post-training", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
spec_app = typer.Typer(help="the workload spec: print its JSON Schema, or validate a file", no_args_is_help=True)
workloads_app = typer.Typer(help="workloads: list (the default), watch one", invoke_without_command=True)
# One tenant at a time: show it, reset its slot, or delete it (slot, queue stream, objects and records).
tenant_app = typer.Typer(help="one tenant: show, reset, delete, or issue / revoke its credentials",
                         no_args_is_help=True)
app.add_typer(spec_app, name="spec")
app.add_typer(workloads_app, name="workloads")
app.add_typer(tenant_app, name="tenant")
# The identities `nexus up` makes, for brokers something else starts (the compose stack).
auth_app = typer.Typer(help="the deployment's identities: init (for a broker `nexus up` does not start)",
                       no_args_is_help=True)
app.add_typer(auth_app, name="auth")
# The bases tenants may name besides the presets (`registered:<name>` in a spec).
base_app = typer.Typer(help="registered bases: add (operator), list", no_args_is_help=True)
app.add_typer(base_app, name="base")


# -- shared options ---------------------------------------------------------------------------
DataDir = Annotated[Path, typer.Option(
    "--data-dir", envvar="NEXUS_DATA_DIR", show_default=False,
    help="cluster data dir holding cluster.json, logs, traces (default ./.nexus)")]
NatsUrl = Annotated[str | None, typer.Option(
    "--nats-url", envvar="NEXUS_NATS_URL", help="use this NATS server instead of the data dir's cluster")]
Prefix = Annotated[str | None, typer.Option(
    "--prefix", envvar="NEXUS_PREFIX", help="subject prefix of the deployment (default nexus)")]
Json = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
TimeoutS = Annotated[float, typer.Option("--timeout-s", help="timeout of each request to the cluster")]
DEFAULT_DATA_DIR = Path(".nexus")


def tq_max_bytes_option() -> Any:
    return typer.Option("--tq-max-bytes", metavar="BYTES", show_default=False,
                        help="byte limit of each tenant's training-queue stream; a put past it is refused "
                             "with a busy error naming the tenant (default 256 MiB)")


def check_replicas(value: int) -> int:
    if value not in NATS_CLUSTER_SIZES:
        raise typer.BadParameter(f"{value} is not one of {', '.join(map(str, NATS_CLUSTER_SIZES))}")
    return value


def print_error(text: str, prefix: str = "error: ") -> None:
    from sdk.term import err

    err(text, prefix=prefix)


# How often a Ctrl-C's cancellation is repeated until the command's task has ended.
_INTERRUPT_RECANCEL_S = 0.5


def run_command(coro: Any) -> Any:
    """Run a command's coroutine; Ctrl-C cancels it and raises KeyboardInterrupt here.

    asyncio.run cancels the main task once on SIGINT, and Python 3.11's ``wait_for`` can swallow
    that one cancellation when its inner future completes at the same moment (gh-86296): a
    `workloads watch` then polled on, deaf to Ctrl-C. So the cancellation is repeated every
    ``_INTERRUPT_RECANCEL_S`` until the task has ended."""
    import asyncio
    import signal

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(coro)
        interrupted = False

        def cancel() -> None:
            nonlocal interrupted
            interrupted = True
            if not task.done():
                task.cancel()
                loop.call_later(_INTERRUPT_RECANCEL_S, cancel)

        try:
            loop.add_signal_handler(signal.SIGINT, cancel)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / no signals here
            return await task
        try:
            return await task
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    return asyncio.run(main())


# --creds (before the command): set by the app callback; None falls back to NEXUS_CREDS, then
# to the admin's credentials file cluster.json's URL names (``?creds=``).
_CREDS: Path | None = None


@app.callback()
def _global_options(
    creds: Annotated[Path | None, typer.Option(
        "--creds", metavar="FILE", show_default=False,
        help="credentials file to log in with (a tenant's, from `nexus tenant create`); default "
             "NEXUS_CREDS, else the data dir's admin")] = None,
) -> None:
    global _CREDS
    _CREDS = creds


def creds_path() -> Path | None:
    from transport.creds import creds_from_env

    return _CREDS or creds_from_env()


def tenant_caller() -> str | None:
    """The tenant whose credentials this command logs in with (``--creds`` / NEXUS_CREDS), or
    None for the platform's (the admin's, by default). Commands that show the whole deployment
    (roles, other tenants) say so in one line for a tenant instead of an empty view."""
    from transport.creds import Credentials

    path = creds_path()
    if path is None:
        return None
    try:
        return Credentials.read(path).tenant
    except (OSError, ValueError, KeyError):
        return None  # unreadable: connecting will say what is wrong with it


OPERATOR_ONLY = ("{command} is an operator command (it shows every role and tenant) and needs the platform's "
                 "credentials; as tenant {tenant!r} use `nexus workloads`, `nexus tenant show` or "
                 "`nexus workloads watch ID`")


def cluster_client(data_dir: Path, nats_url: str | None, prefix: str | None, timeout_s: float = 10.0) -> Any:
    from sdk.client import AsyncClient, resolve_cluster

    url, prefix = resolve_cluster(data_dir, nats_url, prefix)
    return AsyncClient(url, prefix, timeout_s=timeout_s, creds=creds_path())


def as_dict(obj: Any) -> dict:
    from protocol.wire import to_body

    return to_body(obj)
