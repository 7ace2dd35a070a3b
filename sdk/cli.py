"""The `nexus` command (typer + rich).

    nexus up [--data-dir DIR] [--nats-port PORT | --nats-url URL] [--nats-cluster 3] [--roles env=4,trainer=1]
             [--devices 'trainer=0,1 inferencer=2,3 env=4-7'] [--detach]
    nexus status [--json]                  nexus down [--data-dir DIR]
    nexus scale ROLE N [--drain INSTANCE] [--pool BASE] (env, inferencer, trainer; within NEXUS_SCALE_BOUNDS)
    nexus top [--once] [--json]
    nexus trace [TRACE_ID] [--workload W] [--since 10m] [--until T] [--chrome FILE] [--png FILE] [--json]
    nexus submit SPEC [SPEC...] [--wait] [--json]
    nexus workloads list [--tenant T] [--json] | watch ID [--json]     nexus tenants [--json]
    nexus tenant show [NAME] [--json] | reset [NAME] [--yes] [--json]   (a tenant: its own)
    nexus tenant delete NAME [--yes] [--json]
    nexus tenant create NAME | revoke NAME       (credentials; the server keeps running)
    nexus auth init --data-dir DIR [--resolver-dir DIR]   (the identities, for a broker run elsewhere)
    nexus --creds FILE COMMAND ...               (log in as a tenant; default: the data dir's admin)
    nexus cancel ID [--json]   nexus download TENANT [--version N] | WORKLOAD --report [--json]
    nexus logs ROLE                        nexus usage [--tenant T] [--workload W] [--json]
    nexus spec schema | validate FILE [--json]     nexus layout --nats-url URL [--replicas 3]
    nexus dataset info PATH [--json] | show PATH --index I | record --out DIR --episodes N
    nexus dataset publish SRC NAME [--data-dir DIR]    (operator: every tenant may read it)
    nexus base add NAME PATH | list [--json]      (bases a tenant names as registered:NAME)
    nexus weights upload NAME FILE [--tenant T]   (starting weights a spec's init names)
    nexus env serve MODULE:FACTORY --creds T.creds [--capacity N]   (a tenant hosts its own env)

Client commands find the cluster from ``--nats-url`` or ``<--data-dir>/cluster.json``
(default ``./.nexus/``); ``NEXUS_NATS_URL``, ``NEXUS_PREFIX``, ``NEXUS_DATA_DIR`` and (for
``nexus up``) ``NEXUS_NATS_PORT`` stand in for the flags. Exit status: 0 ok, 1 the cluster or a
role failed, 2 bad input (usage errors included), 130 interrupted (Ctrl-C: `submit --wait` and
`workloads watch` leave the workload running and say how to follow it again).

The app and the options every command shares are in sdk/cli_common.py; the commands are in
sdk/cli_cluster.py, sdk/cli_tenant.py, sdk/cli_workloads.py and (layout, weights, env) here.

Every import beyond typer is made inside the command that needs it: ``nexus submit`` and
``nexus spec validate`` must start in well under a second, so nothing here may pull in torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from sdk.cli_run import EXIT_BAD_INPUT, EXIT_OK, run_app
from sdk.cli_common import (DEFAULT_DATA_DIR, DataDir, NatsUrl, Prefix, TimeoutS, Json, cluster_client, creds_path,
                            print_error, check_replicas, run_command, tq_max_bytes_option, app)
# Imported for their commands, in the order `nexus --help` lists them.
import sdk.cli_cluster  # noqa: F401
import sdk.cli_tenant  # noqa: F401
import sdk.cli_workloads  # noqa: F401


def _add_dataset_app() -> None:
    from sdk.dataset_cli import dataset_app

    app.add_typer(dataset_app, name="dataset")


# -- layout -------------------------------------------------------------------------------------
@app.command()
def layout(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    replicas: Annotated[int, typer.Option("--replicas", callback=check_replicas,
                                          help="stream replicas: 3 on a 3-node NATS cluster")] = 1,
    tq_max_bytes: Annotated[int | None, tq_max_bytes_option()] = None,
) -> int:
    """Create streams and buckets on an existing NATS server."""
    from transport.bus import Bus
    from transport.layout import ensure_layout
    from protocol.messages import DEFAULT_TQ_MAX_BYTES, DeploymentSettings
    from protocol.subjects import Names
    from sdk.client import resolve_cluster

    url, resolved_prefix = resolve_cluster(data_dir, nats_url, prefix)

    async def go() -> None:
        from nats.js.errors import APIError

        from transport.creds import redact_url
        from protocol.errors import Unavailable

        bus = await Bus.connect(url, name="nexus-layout", reconnect_forever=False, creds=creds_path())
        try:
            settings = DeploymentSettings(replicas=replicas, tq_max_bytes=tq_max_bytes or DEFAULT_TQ_MAX_BYTES)
            await ensure_layout(bus.js, Names(resolved_prefix), replicas=replicas, settings=settings)
        except APIError as exc:  # one line (a compose layout job's log), not a traceback
            raise Unavailable(f"JetStream on {redact_url(url)} refused the layout (replicas={replicas}): "
                              f"{exc.description}; are {replicas} NATS nodes up and routed?") from None
        finally:
            await bus.close()

    run_command(go())
    from transport.creds import redact_url

    print(f"streams and buckets of prefix {resolved_prefix!r} are in place on {redact_url(url)} (replicas={replicas})")
    return EXIT_OK


# -- weights (starting weights a tenant brings: master/uploads.py) ------------------------------
weights_app = typer.Typer(help="starting weights a tenant brings: upload (a safetensors file)", no_args_is_help=True)
app.add_typer(weights_app, name="weights")


@weights_app.command("upload")
def weights_upload(
    name: Annotated[str, typer.Argument(help="the name a spec's init.weights (or init.adapter) uses: letters, "
                                             "digits, _ and - (1-64)")],
    file: Annotated[Path, typer.Argument(help="a .safetensors file: a policy from `nexus download`, or a peft "
                                              "adapter_model.safetensors")],
    tenant: Annotated[str | None, typer.Option("--tenant", help="the admin only: upload for this tenant")] = None,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 30.0,
) -> int:
    """Upload a safetensors file as starting weights NAME in the tenant's own area (a spec's
    `init: {weights: NAME}` starts a new tenant from it)."""
    from sdk.term import print_json

    if not file.is_file():
        print_error(f"file: {file} is not a readable file")
        return EXIT_BAD_INPUT

    async def go() -> str:
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.upload_weights(name, file, tenant)

    detail = run_command(go())
    if json:
        print_json({"name": name, "detail": detail})
    else:
        print(detail)
    return EXIT_OK


_add_dataset_app()

# A tenant's own env on its own machine (sdk/env_serve.py, docs/hosted_envs.md).
env_app = typer.Typer(help="a tenant-hosted env: serve it to the platform's workflows", no_args_is_help=True)
app.add_typer(env_app, name="env")


@env_app.command("serve")
def env_serve(
    factory: Annotated[str, typer.Argument(metavar="MODULE:FACTORY",
                                           help="the env factory: FACTORY(**env.options) returns an envs.EnvAdapter "
                                                "or a gymnasium.Env with image and state spaces")],
    creds: Annotated[Path | None, typer.Option(
        "--creds", metavar="FILE", show_default=False,
        help="the tenant's credentials (from `nexus tenant create`); default: the global --creds, NEXUS_CREDS")] = None,
    capacity: Annotated[int, typer.Option("--capacity", min=1, max=8,
                                          help="workloads this process runs at once")] = 1,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
) -> int:
    """Host your own env: claim your tenant's workloads whose spec says env.hosted: tenant and run
    the platform's RL / eval workflows against it, until interrupted. Run several for more episodes."""
    from sdk.client import resolve_cluster
    from sdk.env_serve import serve_main

    url, resolved = resolve_cluster(data_dir, nats_url, prefix)
    return serve_main(url, resolved, creds or creds_path(), factory, capacity=capacity)


# -- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status (0 ok, 1 failure, 2 bad input, 130 interrupted)."""
    return run_app(app, argv)

if __name__ == "__main__":
    sys.exit(main())
