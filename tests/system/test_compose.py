"""`docker compose up` for real: images built here, 3 NATS nodes, every role in a container.

One deployment for the module (deploy/compose/docker-compose.yml + docker-compose.host.yml,
host networking: every connection on 127.0.0.0/8), scaled ``--scale trainer=2 --scale env=4``:

* the images build without a registry (deploy/compose/build-images.sh, cached by tag/layer);
* NATS runs in operator mode: the auth-init job put the identities in the creds volume, the
  host logs in with the admin's credentials copied out of it, an anonymous client is refused,
  and `nexus tenant create` (run in the volume) issues a tenant's own credentials, with which
  that tenant's workload is submitted;
* every role container turns healthy (its own probe) and `nexus status` from the host lists
  them alive; the layout job made every stream and bucket R3;
* an SFT and an RL workload on the built-in task complete although one NATS node container
  (the SFT queue's stream leader) and one trainer container are SIGKILLed mid-run, their
  restart policies bring both back, and the job audit finds nothing lost or trained twice;
* spans from at least four role containers reach the OTLP/HTTP receiver this test runs;
* a bad setting, missing credentials, no reachable broker, or a cluster missing a node makes a
  container exit non-zero with one line;
* `down -v` leaves no container, volume or network of the project behind.

Skipped (with the reason) where no Docker daemon answers; .ci/run installs docker.io,
docker-compose and debootstrap when missing and starts dockerd, so CI runs it. The kills are
of the container's process from the host (what a crash or the OOM killer does): `docker kill`
marks a container as stopped by hand, and restart policies then leave it down.

    python -m pytest tests/system/test_compose.py -q -s     # -s prints the build, start and run times
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from protocol import ops
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.conftest import ROOT, nexus_cmd, python_env

COMPOSE_DIR = ROOT / "deploy/compose"
FILES = ("-f", str(COMPOSE_DIR / "docker-compose.yml"), "-f", str(COMPOSE_DIR / "docker-compose.host.yml"))
SCALE = {"trainer": 2, "env": 4}
ROLE_SERVICES = ("health", "monitor", "master", "trainer", "inferencer", "env")
NATS_SERVICES = ("nats-1", "nats-2", "nats-3")
ROLE_IMAGE = "vla-nexus/role:latest"
# Where auth-init puts the identities in the creds volume (the compose file's NEXUS_CREDS).
CREDS_IN_VOLUME = "/creds/auth"
ROLE_CREDS_IN_VOLUME = "/creds/role-creds"  # each platform process's own user (AuthStore.role_creds)
# Bounds that only stop a broken stack from hanging the suite; the real figures are printed.
BUILD_BOUND_S = 900.0
UP_BOUND_S = 300.0
HEALTHY_BOUND_S = 420.0
PROGRESS_BOUND_S = 300.0
COMPLETE_BOUND_S = 480.0
RESTART_BOUND_S = 120.0
POLL_S = 2.0
CMD_TIMEOUT_S = 120.0


def _run(cmd: list[str], timeout: float = CMD_TIMEOUT_S, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _docker_ready() -> str:
    """Why the test cannot run here ('' when it can)."""
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install docker.io; .ci/run does)"
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode != 0:
            return "no Docker daemon answers (dockerd is not running; .ci/run starts it)"
    except subprocess.TimeoutExpired:
        return "the Docker daemon does not answer `docker info` within 20 s"
    if not _compose():
        return "neither `docker compose` (v2) nor `docker-compose` is installed"
    return ""


def _compose() -> list[str]:
    """Compose v2 where the plugin is installed, else Debian's docker-compose (1.29)."""
    try:
        if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0:
            return ["docker", "compose"]
    except (OSError, subprocess.TimeoutExpired):
        pass  # no docker CLI: try docker-compose below
    return ["docker-compose"] if shutil.which("docker-compose") else []


_WHY_NOT = _docker_ready()
# Per test (the first one includes the images' build and `up`); the suite's 300 s is too short.
pytestmark = [pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT), pytest.mark.timeout(1500)]


# -- an OTLP/HTTP receiver on loopback ------------------------------------------------------
@dataclass
class Spans:
    """What reached the receiver: span counts per (service.name, service.instance.id)."""

    counts: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def services(self) -> set[str]:
        with self.lock:
            return {s for s, _ in self.counts}

    def instances(self) -> set[str]:
        with self.lock:
            return {i for _, i in self.counts}


def start_otlp_receiver() -> tuple[ThreadingHTTPServer, Spans]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    spans = Spans()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            with spans.lock:
                for rs in req.resource_spans:
                    attrs = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                    key = (attrs.get("service.name", ""), attrs.get("service.instance.id", ""))
                    spans.counts[key] += sum(len(ss.spans) for ss in rs.scope_spans)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args) -> None:  # quiet: one line per export otherwise
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, spans


# -- the deployment -------------------------------------------------------------------------
@dataclass
class Stack:
    compose: list[str]
    project: str
    env: dict[str, str]
    plain_url: str      # the three nodes, no credentials
    spans: Spans
    nats_url: str = ""  # the same, logging in with the admin's credentials (`login`)
    times: dict[str, float] = field(default_factory=dict)
    down_done: bool = False

    def cmd(self, *args: str, timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.compose, "-p", self.project, *FILES, *args], timeout=timeout, env=self.env, check=check)

    def containers(self, service: str) -> list[str]:
        return self.cmd("ps", "-q", service).stdout.split()

    def inspect(self, container: str) -> dict:
        return json.loads(_run(["docker", "inspect", container]).stdout)[0]

    def logs(self, *services: str, tail: int = 15) -> str:
        return self.cmd("logs", "--no-color", "--tail", str(tail), *services, check=False).stdout[-6000:]

    def nexus(self, *args: str, timeout: float = 60.0, check: bool = True,
              creds: str | None = None) -> subprocess.CompletedProcess:
        """`nexus` on the host: as the admin, or (``creds``) with a tenant's credentials."""
        login = ["--creds", creds] if creds else []
        url = self.plain_url if creds else self.nats_url
        return _run(nexus_cmd(*login, *args, "--nats-url", url), timeout=timeout, env=python_env(), check=check)

    def in_volume(self, *args: str, timeout: float = CMD_TIMEOUT_S) -> str:
        """A command in a one-off auth-init container (the creds volume mounted read-write)."""
        return self.cmd("run", "--rm", "-T", "--no-deps", "auth-init", *args, timeout=timeout).stdout

    def login(self, tmp: str) -> None:
        """Copy the admin's credentials out of the creds volume; `nats_url` names them."""
        from transport.creds import Credentials

        path = os.path.join(tmp, "admin.creds")
        with open(path, "w") as f:
            f.write(self.in_volume("cat", f"{CREDS_IN_VOLUME}/admin.creds"))
        os.chmod(path, 0o600)
        self.nats_url = Credentials.read(path).url(self.plain_url)

    def tenant_creds(self, tenant: str, tmp: str) -> str:
        """`nexus tenant create TENANT` in the volume (pushed to the running nodes); the
        tenant's credentials file, copied out to the host."""
        self.in_volume("nexus", "tenant", "create", tenant, "--data-dir", "/creds", "--nats-url", self.plain_url)
        path = os.path.join(tmp, f"{tenant}.creds")
        with open(path, "w") as f:
            f.write(self.in_volume("cat", f"{CREDS_IN_VOLUME}/tenants/{tenant}.creds"))
        os.chmod(path, 0o600)
        return path

    def creds_volume(self) -> str:
        return f"{self.project}_nexus-creds"

    def down(self) -> None:
        if not self.down_done:
            self.cmd("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)
            self.down_done = True


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from transport.broker import free_port

    t0 = time.monotonic()
    build = _run(["bash", str(COMPOSE_DIR / "build-images.sh")], timeout=BUILD_BOUND_S,
                 env={**os.environ, "PYTHON": sys.executable})
    times = {"build_s": time.monotonic() - t0}
    print(f"\n{build.stdout}", end="")
    server, spans = start_otlp_receiver()
    ports = [free_port() for _ in range(9)]
    env = dict(os.environ)
    for i in range(3):
        env[f"NATS_PORT_{i + 1}"], env[f"NATS_CLUSTER_PORT_{i + 1}"], env[f"NATS_HTTP_PORT_{i + 1}"] = (
            str(ports[i]), str(ports[3 + i]), str(ports[6 + i]))
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
    env["NEXUS_TRACE_SAMPLE_RATIO"] = "0.25"  # fewer spans to export on 2 shared cores
    st = Stack(_compose(), f"nexustest{uuid.uuid4().hex[:8]}", env,
               ",".join(f"nats://127.0.0.1:{p}" for p in ports[:3]), spans, times=times)
    t1 = time.monotonic()
    try:
        scale = [a for role, n in SCALE.items() for a in ("--scale", f"{role}={n}")]
        st.cmd("up", "-d", "--no-build", *scale, timeout=UP_BOUND_S)
        times["up_s"] = time.monotonic() - t1
        st.login(str(tmp_path_factory.mktemp("compose-creds")))
        print(f"{' '.join(st.compose)} up: {times['up_s']:.0f} s (project {st.project})")
        yield st
    finally:
        st.down()
        server.shutdown()
        times["total_s"] = time.monotonic() - t0
        print("times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))


def _wait(what: str, fn, bound_s: float, st: Stack, services: tuple[str, ...] = ()):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < bound_s:
        last = fn()
        if last and last[0]:
            return time.monotonic() - t0, last[1]
        time.sleep(POLL_S)
    raise AssertionError(f"{what} not within {bound_s:g} s (last: {last and last[1]!r})\n{st.logs(*services)}")


def _alive(st: Stack) -> dict[str, int]:
    proc = st.nexus("status", "--json", "--timeout-s", "5", check=False)
    if proc.returncode != 0:
        return {}
    counts: dict[str, int] = defaultdict(int)
    for r in json.loads(proc.stdout)["roles"]:
        if r["state"] == "alive":
            counts[r["role"]] += 1
    return dict(counts)


def _all_healthy(st: Stack) -> tuple[bool, str]:
    states = {}
    for service in ROLE_SERVICES:
        for c in st.containers(service):
            state = st.inspect(c)["State"]
            states[f"{service}/{c[:6]}"] = state.get("Health", {}).get("Status", state["Status"])
    want = {s: SCALE.get(s, 1) for s in ROLE_SERVICES}
    alive = _alive(st)
    ok = (len(states) == sum(want.values()) and all(v == "healthy" for v in states.values())
          and all(alive.get(s, 0) >= n for s, n in want.items()))
    return ok, f"containers {states}; alive per `nexus status`: {alive}"


def test_roles_healthy_and_layout_r3(stack):
    took, _ = _wait("every role container healthy", lambda: _all_healthy(stack), HEALTHY_BOUND_S, stack)
    stack.times["healthy_s"] = took
    print(f"healthy: {took:.0f} s after up")
    layout = stack.containers("layout")
    assert layout and stack.inspect(layout[0])["State"]["ExitCode"] == 0

    from transport.bus import Bus
    from transport.layout import bucket_streams, stream_configs
    from protocol.subjects import Names

    async def replicas() -> dict[str, int]:
        bus = await Bus.connect(stack.nats_url, name="test-compose", reconnect_forever=False)
        try:
            names = Names("nexus")
            return {s: (await bus.js.stream_info(s)).config.num_replicas
                    for s in [c.name for c in stream_configs(names)] + bucket_streams(names)}
        finally:
            await bus.close()

    got = asyncio.run(replicas())
    assert got and all(n == 3 for n in got.values()), got


def test_nats_runs_in_operator_mode(stack):
    """The cluster refuses a client without credentials; the auth-init job ran once, and a
    second run keeps the identities (the roles' credentials still work after it)."""
    from transport.bus import Bus
    from protocol.errors import Unauthenticated

    with pytest.raises(Unauthenticated, match="no credentials"):
        asyncio.run(Bus.connect(stack.plain_url, name="test-anonymous", reconnect_forever=False))
    init = stack.containers("auth-init")
    assert init and stack.inspect(init[0])["State"]["ExitCode"] == 0
    before = stack.in_volume("cat", f"{ROLE_CREDS_IN_VOLUME}/trainer.creds")
    again = stack.cmd("run", "--rm", "-T", "--no-deps", "auth-init").stdout
    assert "kept" in again, again
    assert stack.in_volume("cat", f"{ROLE_CREDS_IN_VOLUME}/trainer.creds") == before


def test_each_container_mounts_only_its_own_credentials(stack):
    """A role container sees its own user's credentials (creds-<role>) and the data volume,
    never the seeds (nexus-creds) or another role's; a NATS node mounts only the public JWTs."""
    seeds = f"{stack.project}_nexus-creds"
    for service in ROLE_SERVICES:
        for cid in stack.containers(service):
            mounts = {m.get("Name", "") for m in stack.inspect(cid)["Mounts"] if m.get("Type") == "volume"}
            assert mounts == {f"{stack.project}_nexus-data", f"{stack.project}_creds-{service}"}, (service, mounts)
            listed = _run(["docker", "exec", cid, "ls", "-A", "/creds"]).stdout.split()
            assert listed == ["role.creds"], (service, listed)
            user = _run(["docker", "exec", cid, "python", "-c",
                         "from transport.creds import Credentials; print(Credentials.read('/creds/role.creds').user)"]).stdout
            assert user.strip() == service, (service, user)
    for node in NATS_SERVICES:
        for cid in stack.containers(node):
            mounts = {m.get("Name", "") for m in stack.inspect(cid)["Mounts"] if m.get("Type") == "volume"}
            assert seeds not in mounts and f"{stack.project}_nats-auth" in mounts, (node, mounts)


# -- workloads through a NATS node kill and a trainer kill -----------------------------------
def _specs(tag: str) -> list[dict]:
    from bench.chaos_config import workload_specs

    sft, rl, *_ = workload_specs("small", tag)  # the chaos test's small workloads, made shorter
    sft["env"]["demos"]["episodes"] = 10
    sft["algorithm"].update(steps=32, warmup_steps=5)
    rl["schedule"]["budget"] = {"max_steps": 32}
    return [sft, rl]


def _sigkill(st: Stack, container: str) -> int:
    """SIGKILL the container's process from the host, as a crash would; its restart count."""
    info = st.inspect(container)
    os.kill(info["State"]["Pid"], signal.SIGKILL)
    return info["RestartCount"]


async def _records(st: Stack, ids: list[str]) -> list:
    from sdk.client import AsyncClient

    async with AsyncClient(st.nats_url, "nexus", timeout_s=10.0) as client:
        return [await client.workload(w) for w in ids]


async def _audit(st: Stack, tenants: list[str]):
    """The chaos suite's job audit (bench/chaos_audit.py) over the deployment's records."""
    from actors.trainer.slots import get_object
    from bench.chaos_audit import audit_jobs
    from protocol.codec import unpackb
    from protocol.messages import CheckpointGetRequest, WeightsRef
    from protocol.subjects import Names
    from protocol.wire import decode
    from sdk.client import AsyncClient

    from transport.bus import js_retry, retry_through_outage

    names = Names("nexus")
    async with AsyncClient(st.nats_url, "nexus", timeout_s=15.0) as client:
        jobs = [j for j in await client.jobs() if j.tenant in tenants]
        # Through a leader election as the roles do (js_retry): right after the node kill the
        # JetStream API once timed out here (stream info of the versions bucket), after the
        # workloads had completed.
        kv = await js_retry(client.bus.js.key_value, names.kv_versions)
        store = await js_retry(client.bus.js.object_store, names.obj_checkpoints)
        versions, checkpoints = {}, {}
        for t in tenants:
            versions[t] = decode((await js_retry(kv.get, t)).value, WeightsRef).version
            ref = await retry_through_outage(client.bus.call, ops.MASTER_CHECKPOINT_GET,
                                             CheckpointGetRequest(tenant=t), timeout_s=15.0)
            blob = unpackb(await get_object(store, ref.object_name))
            checkpoints[t] = {"applied": list(blob.get("applied", [])), "version": blob.get("version")}
    return audit_jobs(jobs, versions, checkpoints), jobs


def _stream_leader(st: Stack, stream: str) -> str:
    from transport.bus import Bus

    async def go() -> str:
        bus = await Bus.connect(st.nats_url, name="test-compose", reconnect_forever=False)
        try:
            return (await bus.js.stream_info(stream)).cluster.leader
        finally:
            await bus.close()

    return asyncio.run(go())


def test_workloads_complete_through_nats_node_and_trainer_kills(stack, tmp_path):
    from protocol.subjects import Names

    specs = _specs(uuid.uuid4().hex[:6])
    paths = []
    for spec in specs:
        paths.append(tmp_path / f"{spec['tenant']}.yaml")
        paths[-1].write_text(yaml.safe_dump(spec))
    # The RL tenant submits on its own credentials (its own account); the admin submits the SFT.
    tenant_creds = stack.tenant_creds(specs[1]["tenant"], str(tmp_path))
    t0 = time.monotonic()
    ids = []
    for path, creds in ((paths[0], None), (paths[1], tenant_creds)):
        out = stack.nexus("submit", str(path), "--json", timeout=90, creds=creds)
        ids += [w["workload"] for w in json.loads(out.stdout)]
    assert len(ids) == 2
    # The tenant's own login sees its workload and nothing of the other tenant's.
    mine = json.loads(stack.nexus("workloads", "list", "--json", creds=tenant_creds).stdout)
    assert {w["tenant"] for w in mine} == {specs[1]["tenant"]}, mine

    def progressed():
        recs = asyncio.run(_records(stack, ids))
        return all(r.step >= 1 for r in recs), [(r.tenant, r.state, r.step) for r in recs]

    took, seen = _wait("both workloads training", progressed, PROGRESS_BOUND_S, stack, ("master", "trainer"))
    print(f"training after {took:.0f} s: {seen}")

    # Mid-run: the NATS node leading the SFT tenant's training-queue stream, and one trainer.
    leader = _stream_leader(stack, Names("nexus").tq_stream(specs[0]["tenant"]))
    assert leader in NATS_SERVICES, leader
    nats_c = stack.containers(leader)[0]
    trainer_c = stack.containers("trainer")[0]
    before = {nats_c: _sigkill(stack, nats_c), trainer_c: _sigkill(stack, trainer_c)}
    killed_at = time.monotonic()
    print(f"SIGKILLed {leader} (leader of the SFT queue) and trainer {trainer_c[:12]}")

    def restarted():
        states = {c: stack.inspect(c) for c in before}
        ok = all(s["RestartCount"] > before[c] and s["State"]["Running"] for c, s in states.items())
        return ok, {c[:12]: (s["RestartCount"], s["State"]["Status"]) for c, s in states.items()}

    took, _ = _wait("killed containers restarted by their policy", restarted, RESTART_BOUND_S, stack)
    print(f"both containers restarted {took:.0f} s after the kill")

    def completed():
        recs = asyncio.run(_records(stack, ids))
        bad = [r for r in recs if r.state in ("failed", "cancelled")]
        assert not bad, [(r.tenant, r.state, r.message) for r in bad]
        return all(r.state == "completed" for r in recs), [(r.tenant, r.state, r.step) for r in recs]

    took, seen = _wait("both workloads completed", completed, COMPLETE_BOUND_S, stack, ("master", "trainer", "env"))
    stack.times["workloads_s"] = time.monotonic() - t0
    print(f"completed {time.monotonic() - killed_at:.0f} s after the kills "
          f"({stack.times['workloads_s']:.0f} s after submit): {seen}")

    findings, jobs = asyncio.run(_audit(stack, [s["tenant"] for s in specs]))
    assert jobs, "no job records"
    assert findings.lost == 0, {t: a.lost for t, a in findings.tenants.items()}
    assert findings.twice == 0, {t: a.twice for t, a in findings.tenants.items()}
    assert findings.checkpoint_mismatches == 0, {t: a.checkpoint for t, a in findings.tenants.items()}
    # The restarted node is a cluster member again: the SFT queue has 3 current replicas.
    _wait("every NATS node back in the cluster", lambda: (_nodes_current(stack), ""),
          RESTART_BOUND_S, stack, NATS_SERVICES)


def _nodes_current(st: Stack) -> bool:
    from transport.bus import Bus
    from protocol.subjects import Names

    async def go() -> bool:
        bus = await Bus.connect(st.nats_url, name="test-compose", reconnect_forever=False)
        try:
            info = await bus.js.stream_info(Names("nexus").stream_events)
            peers = info.cluster.replicas or []
            return len(peers) == 2 and all(p.current and not p.offline for p in peers)
        finally:
            await bus.close()

    return asyncio.run(go())


def test_spans_from_four_role_containers(stack):
    def four():
        roles = {s for s in stack.spans.services() if s.startswith("nexus-")}
        return len(roles) >= 4 and len(stack.spans.instances()) >= 4, sorted(roles)

    took, roles = _wait("spans from four role containers", four, 60.0, stack)
    print(f"spans from {roles} ({len(stack.spans.instances())} instances)")


def _layout_fails_in_one_line(what: str, url: str, timeout: float, creds_volume: str = "") -> None:
    """The layout job's command in the role image, against ``url`` (logging in as the
    supervisor's user from ``creds_volume``): non-zero, one `error:` line."""
    t0 = time.monotonic()
    login = (["-v", f"{creds_volume}:/creds:ro", "-e", f"NEXUS_CREDS={ROLE_CREDS_IN_VOLUME}/supervisor.creds"]
             if creds_volume else [])
    proc = _run(["docker", "run", "--rm", "--network", "host", *login, ROLE_IMAGE,
                 "nexus", "layout", "--replicas", "3", "--nats-url", url], check=False, timeout=timeout)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), (what, proc.returncode, lines)
    print(f"{what}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s: {lines[0]}")


def test_bad_setting_no_broker_or_missing_node_exits_with_one_line(stack):
    from transport.broker import free_port

    bad = _run(["docker", "run", "--rm", "--network", "host", "-e", "NEXUS_HEARTBEAT_INTERVAL_S=abc",
                "-e", f"NEXUS_NATS_URL={stack.plain_url}", ROLE_IMAGE, "trainer"], check=False)
    assert bad.returncode == 2, bad
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "NEXUS_HEARTBEAT_INTERVAL_S" in lines[0], lines

    # A role whose credentials file is not there (a creds volume not mounted), or with none.
    for what, creds, says in (("missing credentials file", ["-e", "NEXUS_CREDS=/creds/role.creds"],
                               "/creds/role.creds"),
                              ("no credentials", [], "no credentials")):
        t0 = time.monotonic()
        proc = _run(["docker", "run", "--rm", "--network", "host", *creds,
                     "-e", f"NEXUS_NATS_URL={stack.plain_url}", ROLE_IMAGE, "trainer"], check=False, timeout=90)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], (what, proc.returncode, lines)
        print(f"{what}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s: {lines[0]}")

    _layout_fails_in_one_line("no broker", f"nats://127.0.0.1:{free_port()}", 90)

    # A cluster whose third node never comes: the layout job (R3) exits with one line.
    env = dict(stack.env)
    for key in [k for k in env if k.startswith("NATS_")]:
        env[key] = str(free_port())
    half = Stack(stack.compose, f"{stack.project}half", env, "", stack.spans)
    try:
        half.cmd("up", "-d", "--no-build", "nats-1", "nats-2", timeout=UP_BOUND_S)  # auth-init first
        _layout_fails_in_one_line("2 of 3 nodes", f"nats://127.0.0.1:{env['NATS_PORT_1']},"
                                  f"nats://127.0.0.1:{env['NATS_PORT_2']}", 180, half.creds_volume())
    finally:
        half.down()


def test_down_leaves_nothing(stack):
    stack.down()
    for project in (stack.project, f"{stack.project}half"):  # and the 2-node cluster's
        label = f"label=com.docker.compose.project={project}"
        left = {kind: _run(["docker", kind, "ls", "-q", "--filter", label, *(["-a"] if kind == "container" else [])]
                           ).stdout.split() for kind in ("container", "volume", "network")}
        assert left == {"container": [], "volume": [], "network": []}, (project, left)
