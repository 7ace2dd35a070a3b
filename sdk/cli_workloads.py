"""`nexus workloads ...`, `submit`, `cancel`, `download`, `logs` and `spec ...`: a workload from
its spec to its results. Registered on the apps of sdk/cli_common.py; `nexus` (sdk/cli.py) imports
this module."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from sdk.cli_run import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from sdk.cli_cluster import workloads_table, workload_rows
from sdk.cli_common import (DEFAULT_DATA_DIR, DataDir, Json, NatsUrl, Prefix, TimeoutS, as_dict, cluster_client,
                            print_error, run_command, app, spec_app, workloads_app)


@workloads_app.command("list")
def workloads_list(
    tenant: Annotated[str, typer.Option("--tenant", help="only this tenant's workloads")] = "",
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Every workload (or one tenant's): state, version, loss or success, queue depth."""
    from protocol.errors import NotFound
    from sdk.term import print_json

    async def fetch():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            workloads = await client.workloads(tenant)
            try:
                jobs = await client.jobs(tenant)
            except NotFound:  # a tenant with no slot (nothing trained yet, or reset) has no jobs
                jobs = []
            return workloads, jobs

    workloads, jobs = run_command(fetch())
    wrows = workload_rows(workloads, jobs)
    if json:
        print_json(wrows)
    elif wrows:
        workloads_table(wrows)
    else:
        print("no workloads" + (f" for tenant {tenant}" if tenant else ""))
    return EXIT_OK


@workloads_app.callback()
def _workloads_default(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option("--tenant", help="only this tenant's workloads")] = "",
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> None:
    """`nexus workloads [OPTIONS]` is `nexus workloads list [OPTIONS]`."""
    if ctx.invoked_subcommand is None:
        ctx.exit(workloads_list(tenant=tenant, data_dir=data_dir, nats_url=nats_url, prefix=prefix, json=json,
                                timeout_s=timeout_s))


@workloads_app.command("watch")
def workloads_watch(
    workload: Annotated[str, typer.Argument(help="workload id (from `nexus submit` or `nexus workloads list`)")],
    wait_timeout_s: Annotated[float, typer.Option("--wait-timeout-s")] = 3600.0,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Follow a workload with the live progress bar `nexus submit --wait` shows, until it ends:
    exit 0 when it completed, 1 when it failed or was cancelled (a finished one: at once).
    Ctrl-C stops watching only (exit 130); the workload keeps running."""
    from protocol.errors import NotFound
    from sdk.progress import watch

    async def go() -> list:
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            await client.workload(workload)  # unknown or not the caller's: one error, before any bar
            return await watch(client, [workload], out=sys.stderr, live=sys.stderr.isatty(),
                               timeout_s=wait_timeout_s)

    try:
        recs = run_command(go())
    except NotFound as exc:
        print_error(f"{exc.message}; `nexus workloads list` shows the workloads you can watch")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _interrupted([workload])
    return _print_final(recs, json)


# -- submit / cancel / download -----------------------------------------------------------------
def _print_spec_errors(exc: Any, source: str) -> None:
    from sdk.term import err, err_detail

    errors = _spec_errors(exc)
    err(f"{source}: invalid workload spec ({len(errors)} error{'s' if len(errors) != 1 else ''}):")
    for e in errors:
        err_detail(f"  {e.get('field', '?')}: {e.get('message', '')}")


def _spec_errors(exc: Any) -> list[dict]:
    return list(exc.details.get("errors") or [{"field": exc.details.get("field", "?"), "message": exc.message}])


def _load_spec_or_exit(path: str, max_payload: int | None = None) -> tuple[Any, int]:
    """(spec, EXIT_OK), or (None, EXIT_BAD_INPUT) with every field error printed: the spec's
    own and what its run would refuse (master/submit_checks.py; a row against ``max_payload``
    when given, else the master checks it with its server's)."""
    from master.spec import SpecError, load_spec

    try:
        return _checked_spec(load_spec(path), max_payload), EXIT_OK
    except SpecError as exc:
        _print_spec_errors(exc, path)
    except OSError as exc:
        print_error(f"cannot read {path}: {exc.strerror}")
    return None, EXIT_BAD_INPUT


def _kind_for_master(path: str) -> str:
    """The spec's task when it is a well-formed kind this process has not declared (a recipe
    registered by a module the master loads), else "".

    Such a spec is not validated here but by the master at submit: the kinds that count are
    the ones the master loaded (NEXUS_WORKFLOW_MODULES of the cluster), and this machine needs
    neither the recipe's module nor what it imports. Loading the modules here instead would
    refuse a valid spec wherever the CLI's environment differs from the cluster's."""
    from master.spec import SpecError, load_document
    from protocol import recipes

    try:
        raw = load_document(Path(path).read_bytes())
    except (OSError, SpecError):
        return ""  # the full check says what is wrong with the file
    task = raw.get("task") if isinstance(raw, dict) else None
    return task if recipes.valid_kind(task) and recipes.declaration(task) is None else ""


def _deferred_note(kind: str) -> str:
    from protocol import recipes

    return (f"task {kind!r} is no kind this CLI knows (built-in: {', '.join(recipes.FAMILIES)}): the master checks "
            f"the spec at submit, against the recipes it loaded ({recipes.SETTING})")


def _checked_spec(spec: Any, max_payload: int | None) -> Any:
    """``spec``, or SpecError listing what its run would refuse (master/submit_checks.py)."""
    from master.spec import SpecError
    from master.submit_checks import run_errors

    errors = run_errors(spec, max_payload)
    if errors:
        raise SpecError(errors)
    return spec


@app.command()
def submit(
    specs: Annotated[list[str], typer.Argument(metavar="SPEC [SPEC...]",
                                               help="workload spec file(s), YAML or JSON, submitted together")],
    wait: Annotated[bool, typer.Option("--wait", help="show live progress until every workload ends")] = False,
    wait_timeout_s: Annotated[float, typer.Option("--wait-timeout-s")] = 3600.0,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 30.0,
) -> int:
    """Submit workload spec file(s); an invalid spec exits 2 listing every field error."""
    texts = []
    for path in specs:  # validate every file locally first: exit 2 with every field error
        deferred = _kind_for_master(path)
        if deferred:  # a recipe's kind registered where the master runs: the master checks it
            print(f"{path}: {_deferred_note(deferred)}", file=sys.stderr, flush=True)
            texts.append(Path(path).read_text())
            continue
        spec, code = _load_spec_or_exit(path)  # the row size: the master's, with its server's max payload
        if code != EXIT_OK:
            return code
        texts.append(Path(path).read_text())

    from sdk.progress import budget_text, watch
    from sdk.term import print_json

    submitted: list[str] = []  # what a Ctrl-C leaves running (and says how to follow)

    async def go() -> int:
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            handles = []
            for text in texts:
                handles.append(await client.submit(text))
                submitted.append(handles[-1].id)
            # Each record as accepted: where its budget counts from (a tenant outlives its
            # workloads: the same spec again trains its steps again, from the tenant's version).
            accepted = [await client.workload(h.id) for h in handles]
            if not json:
                for h, rec in zip(handles, accepted):
                    budget = budget_text(rec)
                    follow = "" if wait else f"; follow it with `nexus workloads watch {h.id}`"
                    print(f"submitted {h.id} (tenant {h.tenant})" + (f": {budget}" if budget else "") + follow,
                          flush=True)
                    if (rec.spec.get("env") or {}).get("hosted") and rec.state == "pending":
                        print(f"  {rec.message}", flush=True)  # whether a hosted env process is connected
            if not wait:
                if json:
                    print_json([{"workload": h.id, "tenant": h.tenant, "start_version": r.start_version,
                                 "budget_steps": r.budget_steps} for h, r in zip(handles, accepted)])
                return EXIT_OK
            recs = await watch(client, [h.id for h in handles], out=sys.stderr, live=sys.stderr.isatty(),
                               timeout_s=wait_timeout_s)
            return _print_final(recs, json)

    try:
        return run_command(go())
    except KeyboardInterrupt:
        return _interrupted(submitted)


def _print_final(recs: list, json: bool) -> int:
    """The end of `submit --wait` and `workloads watch`: each record (or a line per workload),
    and the exit status: 0 when every one completed, 1 when one failed or was cancelled."""
    from sdk.term import print_json

    if json:
        print_json([as_dict(r) for r in recs])
    else:
        for r in recs:
            print(f"{r.workload} {r.tenant}: {r.state} {r.message}".rstrip())
    return EXIT_OK if all(r.state == "completed" for r in recs) else EXIT_FAILED


def _interrupted(workloads: list[str]) -> int:
    """Ctrl-C while following workloads: they run on (only the watching stopped); one line
    says how to get back to them."""
    if not workloads:
        print_error("interrupted", prefix="")
    elif len(workloads) == 1:
        print_error(f"interrupted: workload {workloads[0]} keeps running; follow it again with "
                    f"`nexus workloads watch {workloads[0]}`", prefix="")
    else:
        print_error(f"interrupted: workloads {', '.join(workloads)} keep running; follow one again with "
                    f"`nexus workloads watch <id>`", prefix="")
    return 130


@app.command()
def cancel(
    workload: Annotated[str, typer.Argument(help="workload id")],
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 10.0,
) -> int:
    """Cancel a workload."""
    from sdk.term import print_json

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.cancel(workload)

    rec = run_command(go())
    if json:
        print_json(as_dict(rec))
    elif rec.state == "cancelled" and rec.message == "cancelled by request":
        print(f"{rec.workload}: cancelled")
    else:  # it had ended before the cancel: nothing was changed
        print(f"{rec.workload}: already {rec.state} ({rec.message}); nothing to cancel")
    return EXIT_OK


@app.command()
def download(
    tenant: Annotated[str, typer.Argument(help="tenant name")],
    version: Annotated[int | None, typer.Option("--version", help="default: the latest export")] = None,
    out: Annotated[Path, typer.Option("--out", help="directory to write into")] = Path("."),
    report: Annotated[bool, typer.Option(
        "--report", help="TENANT is a workload id: download its final report JSON instead")] = False,
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 30.0,
) -> int:
    """Download a tenant's policy (safetensors + manifest), or with --report a workload's report."""
    from sdk.term import print_json

    if report:  # the name is a workload id: fetch its final report instead of a policy
        async def fetch_report():
            async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
                return await client.download_report(tenant, out)

        path = run_command(fetch_report())
        if json:
            print_json({"workload": tenant, "report": str(path)})
        else:
            print(path)
            _print_task_table(Path(path))
        return EXIT_OK

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.download_policy(tenant, version, out)

    weights, manifest = run_command(go())
    if json:
        print_json({"tenant": tenant, "weights": str(weights), "manifest": str(manifest)})
    else:
        print(f"{weights}\n{manifest}")
    return EXIT_OK


def _print_task_table(report_path: Path) -> None:
    """An evaluation's per-task table from a downloaded report (none: nothing printed)."""
    import json as _json

    from sdk.term import TASK_TABLE_HEADER, table, task_rows

    try:
        per_task = _json.loads(report_path.read_text()).get("per_task") or []
    except (OSError, ValueError, AttributeError):
        return
    if per_task:
        table(TASK_TABLE_HEADER, task_rows(per_task))


# -- logs / spec --------------------------------------------------------------------------------
@app.command()
def logs(
    role: Annotated[str, typer.Argument(help="health, monitor, master, trainer, inferencer, env or supervisor")],
    data_dir: DataDir = DEFAULT_DATA_DIR,
    lines: Annotated[int, typer.Option("-n", "--lines", help="last N lines")] = 50,
    tenant: Annotated[str | None, typer.Option("--tenant", help="only lines about this tenant")] = None,
) -> int:
    """A role's JSON log lines."""
    from transport.cluster import ClusterState

    state = ClusterState.read(data_dir.resolve())
    logs_dir = Path(state.logs_dir) if state else data_dir / "logs"
    path = logs_dir / f"{role}.log"
    if not path.exists():
        known = sorted(p.stem for p in logs_dir.glob("*.log")) if logs_dir.exists() else []
        print_error(f"no log {path}; logs here: {', '.join(known) or 'none'}")
        return EXIT_BAD_INPUT
    for line in _last_lines(path, lines, tenant):
        print(line)
    return EXIT_OK


def _last_lines(path: Path, n: int, tenant: str | None) -> list[str]:
    """The last ``n`` lines of a log, filtered first (``--tenant``: lines whose JSON ``tenant``
    field is it), so ``-n 20 --tenant acme`` shows acme's last 20 lines however many other lines
    follow them. Read as a stream: a log may be large."""
    import collections
    import json as _json

    keep: collections.deque[str] = collections.deque(maxlen=max(0, n))
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if tenant:
                if f'"{tenant}"' not in line:  # cheap pre-filter before parsing
                    continue
                try:
                    if _json.loads(line).get("tenant") != tenant:
                        continue
                except (ValueError, AttributeError):
                    continue
            keep.append(line)
    return list(keep)


@spec_app.command("schema")
def spec_schema() -> int:
    """Print the workload spec's JSON Schema."""
    from master.spec import schema_json_text

    print(schema_json_text())
    return EXIT_OK


@spec_app.command("validate")
def spec_validate(
    file: Annotated[str, typer.Argument(metavar="FILE", help="workload spec file (YAML or JSON)")],
    json: Json = False,
) -> int:
    """Check a spec file offline, as a submit would: exit 0 if valid, 2 listing every field
    error (the spec's own, env options and cameras, head params, and one training row against
    nats-server's default max payload, which the output names); what only the env's simulator
    knows (a plugin's env id, LIBERO camera names, ...) is listed as not checked here."""
    from master.submit_checks import DEFAULT_MAX_PAYLOAD, row_bytes, unchecked
    from protocol.policy import CHUNK_HEADROOM_BYTES
    from sdk.term import print_json

    limit = {"max_payload": DEFAULT_MAX_PAYLOAD, "max_payload_source": "nats-server's default (offline)",
             "row_limit_bytes": DEFAULT_MAX_PAYLOAD - CHUNK_HEADROOM_BYTES}
    # Offline, the kinds are this process's (the built-ins): a recipe's kind is refused here,
    # its message naming NEXUS_WORKFLOW_MODULES; `nexus submit` leaves it to the master.
    if json:
        from master.spec import SpecError, load_spec

        try:
            spec = _checked_spec(load_spec(file), DEFAULT_MAX_PAYLOAD)
        except SpecError as exc:
            print_json({"file": file, "valid": False, "errors": _spec_errors(exc), **limit})
            return EXIT_BAD_INPUT
        except OSError as exc:
            print_json({"file": file, "valid": False, "errors": [{"field": "", "message": f"cannot read: {exc.strerror}"}]})
            return EXIT_BAD_INPUT
        row = row_bytes(spec)[0] if spec.observation is not None and spec.action is not None else None
        notes = [{"field": f, "message": m} for f, m in unchecked(spec)]
        print_json({"file": file, "valid": True, "task": spec.task, "tenant": spec.tenant, "row_bytes": row,
                    "unchecked": notes, **limit})
        return EXIT_OK
    spec, code = _load_spec_or_exit(file, DEFAULT_MAX_PAYLOAD)
    if code == EXIT_OK:
        row = (f"; one training row {row_bytes(spec)[0]:,} bytes of {limit['row_limit_bytes']:,}"
               if spec.task != "eval" and spec.observation is not None and spec.action is not None else "")
        print(f"{file}: valid {spec.task} workload for tenant {spec.tenant}{row} (max payload "
              f"{DEFAULT_MAX_PAYLOAD:,} bytes: nats-server's default, checked offline)")
        for field, why in unchecked(spec):  # known only where the env runs: no error, but said
            print(f"  not checked here: {field}: {why}")
    else:
        print(f"(checked offline; max payload {DEFAULT_MAX_PAYLOAD:,} bytes: nats-server's default)", file=sys.stderr)
    return code
