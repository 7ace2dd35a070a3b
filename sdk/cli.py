"""The `nexus` command.

    nexus up [--data-dir DIR] [--nats-port PORT | --nats-url URL] [--nats-cluster 3] [--detach]
    nexus status [--json]
    nexus down [--data-dir DIR]

Client commands find the cluster from ``--nats-url`` or ``<--data-dir>/cluster.json``
(default ``./.nexus/``). Exit status: 0 ok, 1 the cluster or a role failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from actors.broker import PortTaken, port_is_free
from actors.supervisor import ClusterState, Supervisor, SupervisorConfig, pid_alive
from protocol.errors import NexusError, Unavailable
from protocol.subjects import DEFAULT_PREFIX
from sdk.client import AsyncClient, resolve_cluster
from sdk.dataset_cli import add_dataset_commands

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _err(text: str) -> None:
    print(f"error: {text}", file=sys.stderr)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=Path(".nexus"),
                   help="cluster data dir holding cluster.json, logs, traces (default ./.nexus)")
    p.add_argument("--nats-url", help="use this NATS server instead of the data dir's cluster")
    p.add_argument("--prefix", help=f"subject prefix of the deployment (default {DEFAULT_PREFIX})")


def _add_tq_max_bytes(p: argparse.ArgumentParser) -> None:
    from protocol.messages import DEFAULT_TQ_MAX_BYTES

    p.add_argument("--tq-max-bytes", type=int, default=DEFAULT_TQ_MAX_BYTES, metavar="BYTES",
                   help="byte limit of each tenant's training-queue stream; a put past it is refused "
                        f"with a busy error naming the tenant (default {DEFAULT_TQ_MAX_BYTES >> 20} MiB)")


# -- up / down -------------------------------------------------------------------------
def cmd_up(args: argparse.Namespace) -> int:
    data_dir = args.data_dir.resolve()
    state = ClusterState.read(data_dir)
    if state is not None and pid_alive(state.supervisor_pid):
        _err(f"a cluster is already running from {data_dir} (supervisor pid {state.supervisor_pid}); "
             f"stop it with `nexus down --data-dir {args.data_dir}`")
        return EXIT_FAILED
    if not args.nats_url and not port_is_free("127.0.0.1", args.nats_port):
        _err(str(PortTaken(f"port {args.nats_port} on 127.0.0.1 is taken; pick another with "
                           f"--nats-port PORT (or use the server there with --nats-url "
                           f"nats://127.0.0.1:{args.nats_port})").message))
        return EXIT_BAD_INPUT
    try:
        cfg = SupervisorConfig(data_dir=data_dir, nats_port=args.nats_port, nats_url=args.nats_url,
                               prefix=args.prefix or DEFAULT_PREFIX, ready_timeout_s=args.ready_timeout_s,
                               nats_cluster=args.nats_cluster, tq_max_bytes=args.tq_max_bytes)
    except (ValueError, NexusError) as exc:
        _err(str(exc))
        return EXIT_BAD_INPUT
    if not args.detach:
        return asyncio.run(Supervisor(cfg).run())
    return _up_detached(args, cfg)


def _up_detached(args: argparse.Namespace, cfg: SupervisorConfig) -> int:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    (cfg.data_dir / "logs").mkdir(exist_ok=True)
    log_path = cfg.data_dir / "logs" / "supervisor.log"
    cmd = [sys.executable, "-m", "actors.supervisor", "--data-dir", str(cfg.data_dir),
           "--nats-port", str(cfg.nats_port), "--prefix", cfg.prefix,
           "--nats-cluster", str(cfg.nats_cluster), "--tq-max-bytes", str(cfg.tq_max_bytes)]
    if cfg.nats_url:
        cmd += ["--nats-url", cfg.nats_url]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + args.ready_timeout_s + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _err(f"the cluster failed to start (status {proc.returncode}); last lines of {log_path}:")
            print(_tail(log_path), file=sys.stderr)
            return EXIT_FAILED
        state = ClusterState.read(cfg.data_dir)
        if state is not None and state.supervisor_pid == proc.pid and state.ready:
            print(f"vla-nexus is up (supervisor pid {proc.pid})")
            print(f"  nats    {state.nats_url}")
            print(f"  logs    {state.logs_dir}/ (supervisor.log, <role>.log)")
            traces = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or f"{state.traces_dir}/"
            print(f"  traces  {traces}")
            print(f"  stop    nexus down --data-dir {args.data_dir}")
            return EXIT_OK
        time.sleep(0.2)
    _err(f"the cluster did not become ready in time; see {log_path}")
    proc.terminate()
    return EXIT_FAILED


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def cmd_down(args: argparse.Namespace) -> int:
    data_dir = args.data_dir.resolve()
    state = ClusterState.read(data_dir)
    if state is None:
        print(f"no cluster running from {data_dir}")
        return EXIT_OK
    if pid_alive(state.supervisor_pid):
        os.kill(state.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout_s
        while pid_alive(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_alive(state.supervisor_pid):
            print(f"vla-nexus stopped ({data_dir})")
            return EXIT_OK
        _err(f"supervisor did not stop within {args.timeout_s:g} s; killing what is left")
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
    (data_dir / "cluster.json").unlink(missing_ok=True)
    print(f"vla-nexus stopped ({data_dir}; cleaned up after a supervisor that had died)")
    return EXIT_OK


# -- status ------------------------------------------------------------------------------
def _fmt_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = [header] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _client(args: argparse.Namespace) -> AsyncClient:
    url, prefix = resolve_cluster(args.data_dir, args.nats_url, args.prefix)
    return AsyncClient(url, prefix, timeout_s=getattr(args, "timeout_s", 10.0))


def _workload_rows(workloads, jobs) -> list[dict]:
    depth: dict[str, int] = {}
    for j in jobs:
        if j.state in ("reserved", "filling", "ready", "leased"):
            depth[j.tenant] = depth.get(j.tenant, 0) + 1
    out = []
    for w in workloads:
        m = w.metrics
        out.append({"workload": w.workload, "tenant": w.tenant, "task": w.task, "state": w.state,
                    "version": w.step, "episodes": w.episodes, "loss": m.get("loss"),
                    "success_rate": m.get("success_rate", m.get("eval_success_rate")),
                    "queue_depth": depth.get(w.tenant, 0), "message": w.message})
    return out


def cmd_status(args: argparse.Namespace) -> int:
    async def fetch():
        async with _client(args) as client:
            try:
                status = await client.status()
            except NexusError as exc:  # no monitor: say so, still show the workloads
                _err(f"roles unknown: {exc.message}")
                status = None
            try:
                workloads, jobs = await client.workloads(), await client.jobs()
            except NexusError:  # no master yet: roles only
                workloads, jobs = [], []
            if status is None and not workloads:
                raise Unavailable("neither the monitor nor the master answers; is the cluster up?")
            return status, workloads, jobs

    status, workloads, jobs = asyncio.run(fetch())
    if status is None:
        from protocol.messages import ClusterStatus

        status = ClusterStatus(roles=[], metrics={}, generated_at=time.time())
    rows = [dataclasses.asdict(r) for r in status.roles]
    wrows = _workload_rows(workloads, jobs)
    if args.json:
        sys.stdout.write(orjson.dumps({"roles": rows, "workloads": wrows, "metrics": status.metrics,
                                       "generated_at": status.generated_at},
                                      option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    _table(("ROLE", "INSTANCE", "PID", "STATE", "UPTIME", "LAST HEARTBEAT"), [
        (r["role"], r["instance"], str(r["pid"]), r["state"], _fmt_age(r["uptime_s"]),
         f"{_fmt_age(r['last_heartbeat_age_s'])} ago") for r in rows])
    alive = sum(r["state"] == "alive" for r in rows)
    print(f"\n{alive} alive, {len(rows) - alive} not alive")
    if wrows:
        print()
        _table(("WORKLOAD", "TENANT", "TASK", "STATE", "VERSION", "LOSS", "SUCCESS", "QUEUE"), [
            (w["workload"], w["tenant"], w["task"], w["state"], str(w["version"]),
             "-" if w["loss"] is None else f"{w['loss']:.4f}",
             "-" if w["success_rate"] is None else f"{w['success_rate']:.0%}", str(w["queue_depth"]))
            for w in wrows])
    return EXIT_OK


def cmd_submit(args: argparse.Namespace) -> int:
    from master.spec import SpecError, load_spec

    try:
        load_spec(args.spec)  # validate locally first: exit 2 with every field error
    except SpecError as exc:
        _print_spec_errors(exc, args.spec)
        return EXIT_BAD_INPUT
    except OSError as exc:
        _err(f"cannot read {args.spec}: {exc.strerror}")
        return EXIT_BAD_INPUT
    text = Path(args.spec).read_text()

    async def go() -> int:
        async with _client(args) as client:
            handles = [await client.submit(text)]
            for extra in args.more:
                handles.append(await client.submit(Path(extra).read_text()))
            for h in handles:
                print(f"submitted {h.id} (tenant {h.tenant})")
            if not args.wait:
                return EXIT_OK
            recs = await asyncio.gather(*(h.wait(progress=True, timeout_s=args.wait_timeout_s) for h in handles))
            bad = [r for r in recs if r.state != "completed"]
            for r in recs:
                print(f"{r.workload} {r.tenant}: {r.state} {r.message}")
            return EXIT_FAILED if bad else EXIT_OK

    return asyncio.run(go())


def _print_spec_errors(exc, source: str) -> None:
    errors = exc.details.get("errors") or [{"field": exc.details.get("field", "?"), "message": exc.message}]
    _err(f"{source}: invalid workload spec ({len(errors)} error{'s' if len(errors) != 1 else ''}):")
    for e in errors:
        print(f"  {e['field']}: {e['message']}", file=sys.stderr)


def cmd_tenants(args: argparse.Namespace) -> int:
    async def go():
        async with _client(args) as client:
            return await client.tenants()

    reply = asyncio.run(go())
    rows = [{"tenant": t.name, "base": t.base, "head": t.head, "signature": t.signature,
             "version": reply.versions.get(t.name, 0), "priority": t.priority} for t in reply.tenants]
    if args.json:
        print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return EXIT_OK
    _table(("TENANT", "BASE", "HEAD", "VERSION", "SIGNATURE"),
           [(r["tenant"], r["base"], r["head"], str(r["version"]), r["signature"][:19]) for r in rows])
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    async def go():
        async with _client(args) as client:
            return await client.cancel(args.workload)

    rec = asyncio.run(go())
    print(f"{rec.workload}: {rec.state}")
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    if args.report:  # the name is a workload id: fetch its final report instead of a policy
        async def report():
            async with _client(args) as client:
                return await client.download_report(args.tenant, args.out)

        print(asyncio.run(report()))
        return EXIT_OK

    async def go():
        async with _client(args) as client:
            return await client.download_policy(args.tenant, args.version, args.out)

    weights, manifest = asyncio.run(go())
    print(f"{weights}\n{manifest}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    state = ClusterState.read(args.data_dir.resolve())
    logs_dir = Path(state.logs_dir) if state else args.data_dir / "logs"
    path = logs_dir / f"{args.role}.log"
    if not path.exists():
        known = sorted(p.stem for p in logs_dir.glob("*.log")) if logs_dir.exists() else []
        _err(f"no log {path}; logs here: {', '.join(known) or 'none'}")
        return EXIT_BAD_INPUT
    lines = path.read_text(errors="replace").splitlines()
    for line in lines[-args.lines:]:
        if args.tenant and f'"tenant": "{args.tenant}"' not in line:
            continue
        print(line)
    return EXIT_OK


def cmd_spec(args: argparse.Namespace) -> int:
    from master.spec import SpecError, load_spec, schema_json_text

    if args.action == "schema":
        print(schema_json_text())
        return EXIT_OK
    if not args.file:
        _err("nexus spec validate needs a FILE")
        return EXIT_BAD_INPUT
    try:
        spec = load_spec(args.file)
    except SpecError as exc:
        _print_spec_errors(exc, args.file)
        return EXIT_BAD_INPUT
    except OSError as exc:
        _err(f"cannot read {args.file}: {exc.strerror}")
        return EXIT_BAD_INPUT
    print(f"{args.file}: valid {spec.task} workload for tenant {spec.tenant}")
    return EXIT_OK


def cmd_layout(args: argparse.Namespace) -> int:
    from actors.bus import Bus
    from actors.layout import ensure_layout
    from protocol.messages import DeploymentSettings
    from protocol.subjects import Names

    url, prefix = resolve_cluster(args.data_dir, args.nats_url, args.prefix)

    async def go() -> None:
        bus = await Bus.connect(url, name="nexus-layout", reconnect_forever=False)
        try:
            settings = DeploymentSettings(replicas=args.replicas, tq_max_bytes=args.tq_max_bytes)
            await ensure_layout(bus.js, Names(prefix), replicas=args.replicas, settings=settings)
        finally:
            await bus.close()

    asyncio.run(go())
    print(f"streams and buckets of prefix {prefix!r} are in place on {url} (replicas={args.replicas})")
    return EXIT_OK


# -- entry point ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus", description="vla-nexus: multi-tenant VLA post-training")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="start nats-server and every role under a supervisor")
    _add_cluster_flags(up)
    up.add_argument("--nats-port", type=int, default=4222, help="port of the embedded nats-server (default 4222)")
    up.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3, 5), metavar="N",
                    help="start N nats-servers as one JetStream cluster (3: streams and buckets R3, "
                         "a node can be lost); node 1 on --nats-port, the rest on free ports (default 1)")
    _add_tq_max_bytes(up)
    up.add_argument("--detach", action="store_true", help="return once every role is live")
    up.add_argument("--ready-timeout-s", type=float, default=60.0)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the cluster started from --data-dir")
    down.add_argument("--data-dir", type=Path, default=Path(".nexus"))
    down.add_argument("--timeout-s", type=float, default=90.0)
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="table of live roles")
    _add_cluster_flags(status)
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.add_argument("--timeout-s", type=float, default=5.0)
    status.set_defaults(func=cmd_status)

    submit = sub.add_parser("submit", help="submit workload spec file(s) (YAML or JSON)")
    _add_cluster_flags(submit)
    submit.add_argument("spec", help="workload spec file")
    submit.add_argument("more", nargs="*", help="more spec files, submitted together")
    submit.add_argument("--wait", action="store_true", help="show live progress until every workload ends")
    submit.add_argument("--wait-timeout-s", type=float, default=3600.0)
    submit.add_argument("--timeout-s", type=float, default=30.0)
    submit.set_defaults(func=cmd_submit)

    tenants = sub.add_parser("tenants", help="table of tenants")
    _add_cluster_flags(tenants)
    tenants.add_argument("--json", action="store_true")
    tenants.set_defaults(func=cmd_tenants)

    cancel = sub.add_parser("cancel", help="cancel a workload")
    _add_cluster_flags(cancel)
    cancel.add_argument("workload")
    cancel.set_defaults(func=cmd_cancel)

    download = sub.add_parser("download", help="download a tenant's policy (safetensors + manifest)")
    _add_cluster_flags(download)
    download.add_argument("tenant")
    download.add_argument("--version", type=int, help="default: the latest export")
    download.add_argument("--out", type=Path, default=Path("."))
    download.add_argument("--report", action="store_true",
                          help="TENANT is a workload id: download its final report JSON instead")
    download.set_defaults(func=cmd_download)

    logs = sub.add_parser("logs", help="a role's JSON log lines")
    logs.add_argument("role", help="health, monitor, master, trainer, inferencer, env or supervisor")
    logs.add_argument("--data-dir", type=Path, default=Path(".nexus"))
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("--tenant", help="only lines about this tenant")
    logs.set_defaults(func=cmd_logs)

    spec = sub.add_parser("spec", help="the workload spec: print its JSON Schema, or validate a file")
    spec.add_argument("action", choices=("schema", "validate"))
    spec.add_argument("file", nargs="?")
    spec.set_defaults(func=cmd_spec)

    layout = sub.add_parser("layout", help="create streams and buckets on an existing NATS server")
    _add_cluster_flags(layout)
    layout.add_argument("--replicas", type=int, default=1, choices=(1, 3, 5),
                        help="stream replicas: 3 on a 3-node NATS cluster")
    _add_tq_max_bytes(layout)
    layout.set_defaults(func=cmd_layout)

    add_dataset_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NexusError as exc:
        _err(exc.message)
        return EXIT_BAD_INPUT if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
