"""`nexus up`, `down`, `scale`, `status`, `top` and `trace`: the deployment and what runs on it.
Registered on the app of sdk/cli_common.py; `nexus` (sdk/cli.py) imports this module."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from sdk.cli_run import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from sdk.cli_common import (DEFAULT_DATA_DIR, OPERATOR_ONLY, DataDir, Json, NatsUrl, Prefix, TimeoutS, as_dict,
                            cluster_client, print_error, check_replicas, run_command, tenant_caller,
                            tq_max_bytes_option, app)


# -- up / down ----------------------------------------------------------------------------------
@app.command()
def up(
    data_dir: DataDir = DEFAULT_DATA_DIR,
    nats_url: NatsUrl = None,
    prefix: Prefix = None,
    nats_port: Annotated[int, typer.Option("--nats-port", envvar="NEXUS_NATS_PORT",
                                           help="port of the embedded nats-server")] = 4222,
    nats_cluster: Annotated[int, typer.Option(
        "--nats-cluster", metavar="N", callback=check_replicas,
        help="start N nats-servers as one JetStream cluster (3: streams and buckets R3, a node can be "
             "lost); node 1 on --nats-port, the rest on free ports")] = 1,
    tq_max_bytes: Annotated[int | None, tq_max_bytes_option()] = None,
    detach: Annotated[bool, typer.Option("--detach", help="return once every role is live")] = False,
    ready_timeout_s: Annotated[float, typer.Option("--ready-timeout-s")] = 60.0,
    roles: Annotated[str, typer.Option(
        "--roles", metavar="ROLE=N,...",
        help="instances per role, e.g. env=4,inferencer=2,trainer=1 (a role not named: 1; env, inferencer and "
             "trainer scale within NEXUS_SCALE_BOUNDS, the others run once)")] = "",
    devices: Annotated[str, typer.Option(
        "--devices", metavar="'ROLE=LIST ...'",
        help="GPUs per worker role, e.g. 'trainer=0,1 inferencer=2,3 env=4-7': each instance gets one "
             "(CUDA_VISIBLE_DEVICES), a role named here runs one instance per device unless --roles says "
             "otherwise (then round-robin); indices are of the devices this machine shows")] = "",
) -> int:
    """Start nats-server and every role under a supervisor."""
    from transport.broker import PortTaken, port_is_free
    from transport.cluster import ClusterState, SupervisorConfig, pid_alive, scale_bounds
    from protocol.errors import NexusError
    from protocol.messages import DEFAULT_TQ_MAX_BYTES
    from protocol.subjects import DEFAULT_PREFIX

    resolved = data_dir.resolve()
    state = ClusterState.read(resolved)
    if state is not None and pid_alive(state.supervisor_pid):
        print_error(f"a cluster is already running from {resolved} (supervisor pid {state.supervisor_pid}); "
                    f"stop it with `nexus down --data-dir {data_dir}`")
        return EXIT_FAILED
    if not nats_url and not port_is_free("127.0.0.1", nats_port):
        print_error(PortTaken(f"port {nats_port} on 127.0.0.1 is taken; pick another with --nats-port PORT (or use "
                              f"the server there with --nats-url nats://127.0.0.1:{nats_port})").message)
        return EXIT_BAD_INPUT
    from protocol.placement import parse_devices, visible_devices
    from protocol.scaling import parse_counts
    from protocol.settings import SettingsError, check_supervised_roles, unknown_variables

    try:
        cfg = SupervisorConfig(data_dir=resolved, nats_port=nats_port, nats_url=nats_url,
                               prefix=prefix or DEFAULT_PREFIX, ready_timeout_s=ready_timeout_s,
                               nats_cluster=nats_cluster,
                               tq_max_bytes=DEFAULT_TQ_MAX_BYTES if tq_max_bytes is None else tq_max_bytes,
                               counts=parse_counts(roles), bounds=scale_bounds(),
                               placement=parse_devices(devices, visible_devices()))
    except SettingsError as exc:
        for line in exc.lines:
            print_error(line)
        return EXIT_BAD_INPUT
    except (ValueError, NexusError) as exc:
        print_error(exc.message if isinstance(exc, NexusError) else str(exc))
        return EXIT_BAD_INPUT

    for line in unknown_variables():
        print_error(line, prefix="warning: ")
    try:  # every role's NEXUS_* variables, before anything starts
        check_supervised_roles(cfg.roles)
    except SettingsError as exc:
        for line in exc.lines:
            print_error(line)
        return EXIT_BAD_INPUT
    if not detach:
        return _up_foreground(cfg)
    return _up_detached(data_dir, cfg, ready_timeout_s)


def _up_foreground(cfg: Any) -> int:
    """Become the supervisor: exec ``python -m actors.supervisor`` in this process (its pid, its
    terminal, so Ctrl-C drains it and its exit status is `nexus up`'s) with the flags that
    rebuild ``cfg``, checked here. The SDK never imports a role's module."""
    from transport.cluster import supervisor_command

    cmd = supervisor_command(cfg)
    sys.stdout.flush()  # exec drops this process's buffers: the warnings above would be lost
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return EXIT_FAILED  # not reached: execv returns only by raising


def _up_detached(shown_dir: Path, cfg: Any, ready_timeout_s: float) -> int:
    import subprocess

    from transport.cluster import ClusterState, supervisor_command

    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    (cfg.data_dir / "logs").mkdir(exist_ok=True)
    log_path = cfg.data_dir / "logs" / "supervisor.log"
    cmd = supervisor_command(cfg)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + ready_timeout_s + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print_error(f"the cluster failed to start (status {proc.returncode}); last lines of {log_path}:")
            print(_tail(log_path), file=sys.stderr)
            return EXIT_FAILED
        state = ClusterState.read(cfg.data_dir)
        if state is not None and state.supervisor_pid == proc.pid and state.ready:
            traces = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or f"{state.traces_dir}/"
            print(f"vla-nexus is up (supervisor pid {proc.pid})")
            from transport.creds import redact_url

            print(f"  nats    {redact_url(state.nats_url)}" + (f" (admin credentials: {state.creds})" if state.creds else ""))
            print(f"  logs    {state.logs_dir}/ (supervisor.log, <role>.log)")
            print(f"  traces  {traces}")
            print(f"  metrics {_metrics_where()}")
            print(f"  stop    nexus down --data-dir {shown_dir}")
            return EXIT_OK
        time.sleep(0.2)
    print_error(f"the cluster did not become ready in time; see {log_path}")
    proc.terminate()
    return EXIT_FAILED


def _metrics_where() -> str:
    """The monitor's Prometheus endpoint, as its settings place it (or asked, for a free port)."""
    from protocol.settings import MonitorSettings

    port = MonitorSettings.from_env().metrics_port
    if port:
        return f"http://127.0.0.1:{port}/metrics (Prometheus; nexus top for a live view)"
    return "a free port on 127.0.0.1: nexus top shows it"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@app.command()
def down(
    data_dir: DataDir = DEFAULT_DATA_DIR,
    timeout_s: Annotated[float, typer.Option("--timeout-s")] = 90.0,
) -> int:
    """Stop the cluster started from --data-dir (roles drain first)."""
    from transport.cluster import ClusterState, pid_alive

    resolved = data_dir.resolve()
    state = ClusterState.read(resolved)
    if state is None:
        print(f"no cluster running from {resolved}")
        return EXIT_OK
    if pid_alive(state.supervisor_pid):
        os.kill(state.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while pid_alive(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_alive(state.supervisor_pid):
            print(f"vla-nexus stopped ({resolved})")
            return EXIT_OK
        print_error(f"supervisor did not stop within {timeout_s:g} s; killing what is left")
        os.kill(state.supervisor_pid, signal.SIGKILL)
    # Stale state (supervisor gone): stop what it left behind, then forget it.
    brokers = state.broker_pids or ([state.broker_pid] if state.broker_pid else [])
    leftovers = [r.pid for r in state.roles] + brokers
    for pid in leftovers:
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    for pid in leftovers:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    (resolved / "cluster.json").unlink(missing_ok=True)
    print(f"vla-nexus stopped ({resolved}; cleaned up after a supervisor that had died)")
    return EXIT_OK


@app.command()
def scale(
    role: Annotated[str, typer.Argument(help="env, inferencer or trainer")],
    count: Annotated[int, typer.Argument(help="instances wanted, within NEXUS_SCALE_BOUNDS")],
    data_dir: DataDir = DEFAULT_DATA_DIR,
    reason: Annotated[str, typer.Option("--reason", help="recorded in the supervisor's log")] = "",
    drain: Annotated[list[str] | None, typer.Option(
        "--drain", metavar="INSTANCE", help="scaling in: drain this instance first (repeatable); "
                                            "default the newest slots")] = None,
    pool: Annotated[str, typer.Option(
        "--pool", metavar="BASE", help="inferencer: the pool (base) the instances started serve, or the surplus "
                                       "drains from: a registered base (NAME or registered:NAME), a preset, or a "
                                       "pool served now; N stays the role's total")] = "",
    json: Json = False,
    timeout_s: Annotated[float, typer.Option(
        "--timeout-s", help="how long to wait for new instances to be ready / surplus ones to drain")] = 180.0,
) -> int:
    """Run N instances of a role on the running deployment: new ones join once ready, surplus ones drain."""
    from transport.cluster import ClusterState, pid_alive
    from protocol.errors import InvalidField
    from protocol.messages import Ok, ScaleRequest
    from protocol.scaling import check_count, parse_bounds
    from protocol.subjects import Names
    from sdk.term import print_json

    tenant = tenant_caller()
    if tenant is not None:
        print_error(OPERATOR_ONLY.format(command="nexus scale", tenant=tenant))
        return EXIT_BAD_INPUT
    state = ClusterState.read(data_dir.resolve())
    if state is None or not pid_alive(state.supervisor_pid):
        print_error(f"no running deployment from {data_dir.resolve()} (`nexus scale` talks to the supervisor "
                    f"`nexus up` started; on Kubernetes scale the Deployment or its ScaledObject bounds)")
        return EXIT_FAILED
    # Checked here too, so a refusal needs no round trip; the supervisor checks again.
    check_count(role, count, parse_bounds(",".join(f"{r}={b}" for r, b in state.bounds.items())))
    if pool and role != "inferencer":
        raise InvalidField("--pool", f"role {role} has no pools: only inferencers serve one (a base each)")

    async def go():
        async with cluster_client(data_dir, None, state.prefix, timeout_s) as client:
            return await client.bus.request(Names(state.prefix).supervisor("scale"),
                                            ScaleRequest(role=role, count=count, reason=reason, drain=drain or [],
                                                         pool=pool), Ok,
                                            timeout_s=timeout_s)

    reply = run_command(go())
    if json:
        print_json({"role": role, "count": count, **({"pool": pool} if pool else {}), "detail": reply.detail})
    else:
        print(reply.detail)
    return EXIT_OK


def _counts_line(data_dir: Path, rows: list[dict]) -> str | None:
    """`role live/wanted` per role from cluster.json's counts (None: no local supervisor)."""
    from transport.cluster import ClusterState

    state = ClusterState.read(data_dir.resolve())
    if state is None or not state.counts:
        return None
    live = {r: sum(1 for x in rows if x["role"] == r and x["state"] == "alive") for r in state.counts}
    parts = [f"{r} {live[r]}/{n}" + (f" ({state.bounds[r]})" if r in state.bounds else "")
             for r, n in state.counts.items()]
    line = "instances (alive/wanted, bounds MIN:MAX): " + ", ".join(parts)
    if state.pools:  # each inferencer serves one base (`nexus scale inferencer N --pool BASE`)
        line += "\ninferencers per pool: " + ", ".join(f"{p} {n}" for p, n in state.pools.items())
    return line


# -- status / workloads / tenants ---------------------------------------------------------------
def _fmt_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def workload_rows(workloads: list, jobs: list) -> list[dict]:
    """What `nexus status` and `nexus workloads list` show (and print with --json) per workload."""
    depth: dict[str, int] = {}
    for j in jobs:
        if j.state in ("reserved", "filling", "ready", "leased"):
            depth[j.tenant] = depth.get(j.tenant, 0) + 1
    from protocol.messages import workload_steps
    from sdk.progress import steps_text

    out = []
    for w in workloads:
        m = w.metrics
        # steps: this workload's own (against budget_steps), not the tenant's version.
        out.append({"workload": w.workload, "tenant": w.tenant, "task": w.task, "state": w.state,
                    "version": w.step, "steps": workload_steps(w) if w.family != "eval" else None,
                    "budget_steps": w.budget_steps or None, "steps_text": steps_text(w),
                    "episodes": w.episodes, "loss": m.get("loss"),
                    "success_rate": m.get("success_rate", m.get("eval_success_rate")),
                    "queue_depth": depth.get(w.tenant, 0), "message": w.message})
    return out


def workloads_table(wrows: list[dict]) -> None:
    from sdk.term import table

    table(("WORKLOAD", "TENANT", "TASK", "STATE", "STEPS", "VERSION", "LOSS", "SUCCESS", "QUEUE"), [
        (w["workload"], w["tenant"], w["task"], w["state"], w["steps_text"], w["version"],
         "-" if w["loss"] is None else f"{w['loss']:.4f}",
         "-" if w["success_rate"] is None else f"{w['success_rate']:.0%}", w["queue_depth"])
        for w in wrows])


# Finished workloads `nexus status` lists (the newest); the rest are counted in one line.
STATUS_FINISHED_SHOWN = 20


@app.command()
def status(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    json: Json = False, timeout_s: TimeoutS = 5.0,
) -> int:
    """Live roles from the monitor, and a table of workloads: version, loss or success, queue depth."""
    from protocol.errors import NexusError, Unavailable
    from protocol.messages import ClusterStatus
    from sdk.term import print_json, table

    async def fetch():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            try:
                st = await client.status()
            except NexusError as exc:  # no monitor: say so, still show the workloads
                print_error(f"roles unknown: {exc.message}")
                st = None
            try:  # every page (the client follows the master's cursor)
                workloads, jobs = await client.workloads(), await client.jobs()
            except NexusError as exc:  # no master yet: roles only, and say so (never an empty table)
                print_error(f"workloads unknown: {exc.message}")
                if st is None:
                    raise Unavailable("neither the monitor nor the master answers; is the cluster up?") from None
                workloads, jobs = [], []
            return st, workloads, jobs

    tenant = tenant_caller()
    if tenant is not None:
        # A tenant sees no roles (the monitor is the platform's): its own workloads only,
        # and one line saying why, never "0 alive" as if the deployment were down.
        async def fetch():  # noqa: F811 (the tenant's view: the master's listing alone)
            from protocol.errors import NotFound

            async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
                try:
                    return None, await client.workloads(), await client.jobs()
                except NotFound:  # no record before its first submit: nothing to list yet
                    return None, [], []

    st, workloads, jobs = run_command(fetch())
    # Every pending / running workload, and the newest finished ones; the rest are counted.
    finished = [w for w in workloads if w.state in ("completed", "failed", "cancelled")]
    hidden = {w.workload for w in finished[:-STATUS_FINISHED_SHOWN]} if len(finished) > STATUS_FINISHED_SHOWN else set()
    more = len(hidden)
    if not json:
        workloads = [w for w in workloads if w.workload not in hidden]
    if st is None:
        st = ClusterStatus(roles=[], metrics={}, generated_at=time.time())
    rows = [as_dict(r) for r in st.roles]
    wrows = workload_rows(workloads, jobs)
    if json:
        from transport.cluster import ClusterState

        cs = ClusterState.read(data_dir.resolve()) if tenant is None else None
        print_json({"roles": rows, "workloads": wrows, "metrics": st.metrics, "generated_at": st.generated_at,
                    **({"counts": cs.counts, "bounds": cs.bounds, "pools": cs.pools} if cs is not None else {})})
        return EXIT_OK
    if tenant is not None:
        print(f"roles: shown to the operator only; the workloads of tenant {tenant!r}:" if wrows else
              f"roles: shown to the operator only; tenant {tenant!r} has no workloads yet")
    else:
        table(("ROLE", "INSTANCE", "PID", "STATE", "UPTIME", "LAST HEARTBEAT"), [
            (r["role"], r["instance"], r["pid"], r["state"], _fmt_age(r["uptime_s"]),
             f"{_fmt_age(r['last_heartbeat_age_s'])} ago") for r in rows])
        alive = sum(r["state"] == "alive" for r in rows)
        print(f"\n{alive} alive, {len(rows) - alive} not alive")
        counts = _counts_line(data_dir, rows)
        if counts:
            print(counts)
    if wrows:
        print()
        workloads_table(wrows)
    if more:
        print(f"... and {more} more finished workloads (`nexus workloads list` shows every one)")
    return EXIT_OK


@app.command()
def top(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
    json: Json = False, timeout_s: TimeoutS = 5.0,
) -> int:
    """A live view from the monitor, once a second: roles, busy fraction, tenants' queues and learning; q quits."""
    from sdk.term import console, print_json
    from sdk.top import build_view, fetch, live, render

    tenant = tenant_caller()
    if tenant is not None:
        print_error(OPERATOR_ONLY.format(command="nexus top", tenant=tenant))
        return EXIT_BAD_INPUT

    async def go():
        async with cluster_client(data_dir, nats_url, prefix, timeout_s) as client:
            if once or json:
                return build_view(await fetch(client))
            await live(client)
            return None

    view = run_command(go())
    if json:
        print_json(view)
    elif view is not None:
        console().print(render(view))
    return EXIT_OK


@app.command("trace")
def trace_cmd(
    trace_id: Annotated[str, typer.Argument(help="a trace id (or a unique prefix of one)")] = "",
    workload: Annotated[str, typer.Option("--workload", help="the traces of this workload")] = "",
    since: Annotated[str, typer.Option("--since", help="traces with a span after this: 10m (ago) or an ISO time")] = "",
    until: Annotated[str, typer.Option("--until", help="traces with a span before this: 1m (ago) or an ISO time")] = "",
    chrome: Annotated[Path | None, typer.Option(
        "--chrome", help="also write the selected spans as Chrome / Perfetto trace-event JSON to this file")] = None,
    png: Annotated[Path | None, typer.Option(
        "--png", help="also draw the selected spans' timeline (as Perfetto shows it) to this PNG")] = None,
    data_dir: DataDir = DEFAULT_DATA_DIR, json: Json = False,
) -> int:
    """Latency breakdown of the local traces (DATA_DIR/traces): per stage count, p50/p90/p99, share of the critical path."""
    from sdk.term import console, print_json
    from sdk.trace_view import as_json, load_spans, parse_when, render, select, write_chrome

    now = time.time()
    spans = select(load_spans(data_dir / "traces"), trace_id=trace_id, workload=workload,
                   since=parse_when(since, now) if since else None, until=parse_when(until, now) if until else None)
    if not spans:
        print_error(f"no spans in {data_dir / 'traces'} match (window {since or '-'} .. {until or 'now'})")
        return EXIT_FAILED
    if chrome is not None:
        write_chrome(spans, chrome)
    if png is not None:
        from sdk.trace_png import write_png
        from sdk.trace_view import chrome_events

        write_png(chrome_events(spans), png)
    title = f"trace {trace_id}" if trace_id else f"workload {workload}" if workload else "traces"
    if json:
        print_json({**as_json(spans), **({"chrome": str(chrome)} if chrome else {}), **({"png": str(png)} if png else {})})
    else:
        console().print(render(spans, title))
        if chrome is not None:
            print(f"timeline: {chrome} (open in https://ui.perfetto.dev or chrome://tracing)")
        if png is not None:
            print(f"timeline picture: {png}")
    return EXIT_OK
