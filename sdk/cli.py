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

Every import beyond typer is made inside the command that needs it: ``nexus submit`` and
``nexus spec validate`` must start in well under a second, so nothing here may pull in torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from sdk.cli_run import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, run_app

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


def _add_dataset_app() -> None:
    from sdk.dataset_cli import dataset_app

    app.add_typer(dataset_app, name="dataset")


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


def _tq_max_bytes_option() -> Any:
    return typer.Option("--tq-max-bytes", metavar="BYTES", show_default=False,
                        help="byte limit of each tenant's training-queue stream; a put past it is refused "
                             "with a busy error naming the tenant (default 256 MiB)")


def _replicas(value: int) -> int:
    if value not in NATS_CLUSTER_SIZES:
        raise typer.BadParameter(f"{value} is not one of {', '.join(map(str, NATS_CLUSTER_SIZES))}")
    return value


def _err(text: str, prefix: str = "error: ") -> None:
    from sdk.term import err

    err(text, prefix=prefix)


# How often a Ctrl-C's cancellation is repeated until the command's task has ended.
_INTERRUPT_RECANCEL_S = 0.5


def _run(coro: Any) -> Any:
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


def _creds() -> Path | None:
    from transport.creds import creds_from_env

    return _CREDS or creds_from_env()


def _tenant_caller() -> str | None:
    """The tenant whose credentials this command logs in with (``--creds`` / NEXUS_CREDS), or
    None for the platform's (the admin's, by default). Commands that show the whole deployment
    (roles, other tenants) say so in one line for a tenant instead of an empty view."""
    from transport.creds import Credentials

    path = _creds()
    if path is None:
        return None
    try:
        return Credentials.read(path).tenant
    except (OSError, ValueError, KeyError):
        return None  # unreadable: connecting will say what is wrong with it


OPERATOR_ONLY = ("{command} is an operator command (it shows every role and tenant) and needs the platform's "
                 "credentials; as tenant {tenant!r} use `nexus workloads`, `nexus tenant show` or "
                 "`nexus workloads watch ID`")


def _client(data_dir: Path, nats_url: str | None, prefix: str | None, timeout_s: float = 10.0) -> Any:
    from sdk.client import AsyncClient, resolve_cluster

    url, prefix = resolve_cluster(data_dir, nats_url, prefix)
    return AsyncClient(url, prefix, timeout_s=timeout_s, creds=_creds())


def _asdict(obj: Any) -> dict:
    from protocol.wire import to_body

    return to_body(obj)


# -- up / down ----------------------------------------------------------------------------------
@app.command()
def up(
    data_dir: DataDir = DEFAULT_DATA_DIR,
    nats_url: NatsUrl = None,
    prefix: Prefix = None,
    nats_port: Annotated[int, typer.Option("--nats-port", envvar="NEXUS_NATS_PORT",
                                           help="port of the embedded nats-server")] = 4222,
    nats_cluster: Annotated[int, typer.Option(
        "--nats-cluster", metavar="N", callback=_replicas,
        help="start N nats-servers as one JetStream cluster (3: streams and buckets R3, a node can be "
             "lost); node 1 on --nats-port, the rest on free ports")] = 1,
    tq_max_bytes: Annotated[int | None, _tq_max_bytes_option()] = None,
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
        _err(f"a cluster is already running from {resolved} (supervisor pid {state.supervisor_pid}); "
             f"stop it with `nexus down --data-dir {data_dir}`")
        return EXIT_FAILED
    if not nats_url and not port_is_free("127.0.0.1", nats_port):
        _err(PortTaken(f"port {nats_port} on 127.0.0.1 is taken; pick another with --nats-port PORT (or use "
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
            _err(line)
        return EXIT_BAD_INPUT
    except (ValueError, NexusError) as exc:
        _err(exc.message if isinstance(exc, NexusError) else str(exc))
        return EXIT_BAD_INPUT

    for line in unknown_variables():
        _err(line, prefix="warning: ")
    try:  # every role's NEXUS_* variables, before anything starts
        check_supervised_roles(cfg.roles)
    except SettingsError as exc:
        for line in exc.lines:
            _err(line)
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
            _err(f"the cluster failed to start (status {proc.returncode}); last lines of {log_path}:")
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
    _err(f"the cluster did not become ready in time; see {log_path}")
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
        _err(f"supervisor did not stop within {timeout_s:g} s; killing what is left")
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

    tenant = _tenant_caller()
    if tenant is not None:
        _err(OPERATOR_ONLY.format(command="nexus scale", tenant=tenant))
        return EXIT_BAD_INPUT
    state = ClusterState.read(data_dir.resolve())
    if state is None or not pid_alive(state.supervisor_pid):
        _err(f"no running deployment from {data_dir.resolve()} (`nexus scale` talks to the supervisor `nexus up` "
             f"started; on Kubernetes scale the Deployment or its ScaledObject bounds)")
        return EXIT_FAILED
    # Checked here too, so a refusal needs no round trip; the supervisor checks again.
    check_count(role, count, parse_bounds(",".join(f"{r}={b}" for r, b in state.bounds.items())))
    if pool and role != "inferencer":
        raise InvalidField("--pool", f"role {role} has no pools: only inferencers serve one (a base each)")

    async def go():
        async with _client(data_dir, None, state.prefix, timeout_s) as client:
            return await client.bus.request(Names(state.prefix).supervisor("scale"),
                                            ScaleRequest(role=role, count=count, reason=reason, drain=drain or [],
                                                         pool=pool), Ok,
                                            timeout_s=timeout_s)

    reply = _run(go())
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
                    "version": w.step, "steps": workload_steps(w) if w.task != "eval" else None,
                    "budget_steps": w.budget_steps or None, "steps_text": steps_text(w),
                    "episodes": w.episodes, "loss": m.get("loss"),
                    "success_rate": m.get("success_rate", m.get("eval_success_rate")),
                    "queue_depth": depth.get(w.tenant, 0), "message": w.message})
    return out


def _workloads_table(wrows: list[dict]) -> None:
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            try:
                st = await client.status()
            except NexusError as exc:  # no monitor: say so, still show the workloads
                _err(f"roles unknown: {exc.message}")
                st = None
            try:  # every page (the client follows the master's cursor)
                workloads, jobs = await client.workloads(), await client.jobs()
            except NexusError as exc:  # no master yet: roles only, and say so (never an empty table)
                _err(f"workloads unknown: {exc.message}")
                if st is None:
                    raise Unavailable("neither the monitor nor the master answers; is the cluster up?") from None
                workloads, jobs = [], []
            return st, workloads, jobs

    tenant = _tenant_caller()
    if tenant is not None:
        # A tenant sees no roles (the monitor is the platform's): its own workloads only,
        # and one line saying why, never "0 alive" as if the deployment were down.
        async def fetch():  # noqa: F811 (the tenant's view: the master's listing alone)
            from protocol.errors import NotFound

            async with _client(data_dir, nats_url, prefix, timeout_s) as client:
                try:
                    return None, await client.workloads(), await client.jobs()
                except NotFound:  # no record before its first submit: nothing to list yet
                    return None, [], []

    st, workloads, jobs = _run(fetch())
    # Every pending / running workload, and the newest finished ones; the rest are counted.
    finished = [w for w in workloads if w.state in ("completed", "failed", "cancelled")]
    hidden = {w.workload for w in finished[:-STATUS_FINISHED_SHOWN]} if len(finished) > STATUS_FINISHED_SHOWN else set()
    more = len(hidden)
    if not json:
        workloads = [w for w in workloads if w.workload not in hidden]
    if st is None:
        st = ClusterStatus(roles=[], metrics={}, generated_at=time.time())
    rows = [_asdict(r) for r in st.roles]
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
        _workloads_table(wrows)
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

    tenant = _tenant_caller()
    if tenant is not None:
        _err(OPERATOR_ONLY.format(command="nexus top", tenant=tenant))
        return EXIT_BAD_INPUT

    async def go():
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            if once or json:
                return build_view(await fetch(client))
            await live(client)
            return None

    view = _run(go())
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
        _err(f"no spans in {data_dir / 'traces'} match (window {since or '-'} .. {until or 'now'})")
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            workloads = await client.workloads(tenant)
            try:
                jobs = await client.jobs(tenant)
            except NotFound:  # a tenant with no slot (nothing trained yet, or reset) has no jobs
                jobs = []
            return workloads, jobs

    workloads, jobs = _run(fetch())
    wrows = workload_rows(workloads, jobs)
    if json:
        print_json(wrows)
    elif wrows:
        _workloads_table(wrows)
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            await client.workload(workload)  # unknown or not the caller's: one error, before any bar
            return await watch(client, [workload], out=sys.stderr, live=sys.stderr.isatty(),
                               timeout_s=wait_timeout_s)

    try:
        recs = _run(go())
    except NotFound as exc:
        _err(f"{exc.message}; `nexus workloads list` shows the workloads you can watch")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _interrupted([workload])
    return _print_final(recs, json)


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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.tenants()

    rows = [{**r, "registered": True} for r in _tenant_rows(_run(fetch()))]
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

    if _tenant_caller() is not None:
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.usage(tenant, workload)

    rows = usage_rows(_run(fetch()))
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.add_base(name, path)

    rec = _run(go())
    if json:
        print_json(_asdict(rec))
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.bases()

    reply = _run(go())
    if json:
        print_json(_asdict(reply))
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            shown = await client.tenant_show(name)
            return shown, await client.workloads(shown.tenant)

    shown, workloads = _run(fetch())
    config = shown.config
    out = {"tenant": shown.tenant, "config": _asdict(config) if config is not None else None,
           "version": shown.version, "quotas": _asdict(shown.quotas), "quotas_default": shown.quotas_default,
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.reset_tenant(name)

    gone = _run(go())
    if json:
        print_json(_asdict(gone))
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
        _err(f"{what}; confirm with --yes")
        return EXIT_BAD_INPUT
    if not typer.confirm(question):
        _err(declined)
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            try:
                return await client.delete_tenant(name)
            except NotFound:
                # Credentials issued (`tenant create`) but nothing submitted yet: the master
                # has no record, the auth store still has the account; that one goes below.
                if name not in AuthStore(Path(data_dir).resolve()).tenants():
                    raise
                return TenantDeleted(tenant=name, at=time.time(), removed={})

    gone = _run(go())
    gone.removed.update(_remove_tenant_account(data_dir, name, timeout_s))
    if json:
        print_json(_asdict(gone))
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
        _run(_push_and_wait(store, url, name, old, accepted=False, timeout_s=timeout_s))
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
        _err("--defaults: give it alone (it drops every quota of the tenant's own)")
        return EXIT_BAD_INPUT

    async def go():
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            if defaults:
                return await client.set_quotas(name, None)
            if changes:
                return await client.update_quotas(name, **changes)
            return await client.tenant(name)

    config = _run(go())
    quotas = _asdict(config.quotas) if config.quotas is not None else None
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
        _err(f"--storage-mb: must be > 0, got {storage_mb:g}")
        return EXIT_BAD_INPUT
    try:
        ttl_s = duration_s(expires_in)
    except ValueError as exc:
        _err(f"--expires-in: {exc}")
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
        _run(_push_and_wait(store, url, name, path, accepted=True, timeout_s=timeout_s))
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
        _run(_push_and_wait(store, url, name, old, accepted=False, timeout_s=timeout_s))
    if json:
        print_json({"tenant": name, "revoked": True, "live": live})
    else:
        print(f"tenant {name}: credentials revoked{' (its connections are closed)' if live else ''}")
    return EXIT_OK


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
        _err(f"cannot read {path}: {exc.strerror}")
    return None, EXIT_BAD_INPUT


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
        spec, code = _load_spec_or_exit(path)  # the row size: the master's, with its server's max payload
        if code != EXIT_OK:
            return code
        texts.append(Path(path).read_text())

    from sdk.progress import budget_text, watch
    from sdk.term import print_json

    submitted: list[str] = []  # what a Ctrl-C leaves running (and says how to follow)

    async def go() -> int:
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
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
        return _run(go())
    except KeyboardInterrupt:
        return _interrupted(submitted)


def _print_final(recs: list, json: bool) -> int:
    """The end of `submit --wait` and `workloads watch`: each record (or a line per workload),
    and the exit status: 0 when every one completed, 1 when one failed or was cancelled."""
    from sdk.term import print_json

    if json:
        print_json([_asdict(r) for r in recs])
    else:
        for r in recs:
            print(f"{r.workload} {r.tenant}: {r.state} {r.message}".rstrip())
    return EXIT_OK if all(r.state == "completed" for r in recs) else EXIT_FAILED


def _interrupted(workloads: list[str]) -> int:
    """Ctrl-C while following workloads: they run on (only the watching stopped); one line
    says how to get back to them."""
    if not workloads:
        _err("interrupted", prefix="")
    elif len(workloads) == 1:
        _err(f"interrupted: workload {workloads[0]} keeps running; follow it again with "
             f"`nexus workloads watch {workloads[0]}`", prefix="")
    else:
        _err(f"interrupted: workloads {', '.join(workloads)} keep running; follow one again with "
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
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.cancel(workload)

    rec = _run(go())
    if json:
        print_json(_asdict(rec))
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
            async with _client(data_dir, nats_url, prefix, timeout_s) as client:
                return await client.download_report(tenant, out)

        path = _run(fetch_report())
        if json:
            print_json({"workload": tenant, "report": str(path)})
        else:
            print(path)
            _print_task_table(Path(path))
        return EXIT_OK

    async def go():
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.download_policy(tenant, version, out)

    weights, manifest = _run(go())
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


# -- logs / spec / layout -----------------------------------------------------------------------
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
        _err(f"no log {path}; logs here: {', '.join(known) or 'none'}")
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


@app.command()
def layout(
    data_dir: DataDir = DEFAULT_DATA_DIR, nats_url: NatsUrl = None, prefix: Prefix = None,
    replicas: Annotated[int, typer.Option("--replicas", callback=_replicas,
                                          help="stream replicas: 3 on a 3-node NATS cluster")] = 1,
    tq_max_bytes: Annotated[int | None, _tq_max_bytes_option()] = None,
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

        bus = await Bus.connect(url, name="nexus-layout", reconnect_forever=False, creds=_creds())
        try:
            settings = DeploymentSettings(replicas=replicas, tq_max_bytes=tq_max_bytes or DEFAULT_TQ_MAX_BYTES)
            await ensure_layout(bus.js, Names(resolved_prefix), replicas=replicas, settings=settings)
        except APIError as exc:  # one line (a compose layout job's log), not a traceback
            raise Unavailable(f"JetStream on {redact_url(url)} refused the layout (replicas={replicas}): "
                              f"{exc.description}; are {replicas} NATS nodes up and routed?") from None
        finally:
            await bus.close()

    _run(go())
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
        _err(f"file: {file} is not a readable file")
        return EXIT_BAD_INPUT

    async def go() -> str:
        async with _client(data_dir, nats_url, prefix, timeout_s) as client:
            return await client.upload_weights(name, file, tenant)

    detail = _run(go())
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
    return serve_main(url, resolved, creds or _creds(), factory, capacity=capacity)


# -- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit status (0 ok, 1 failure, 2 bad input, 130 interrupted)."""
    return run_app(app, argv)

if __name__ == "__main__":
    sys.exit(main())
