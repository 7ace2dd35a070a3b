"""The monitor's signals over time, end to end: real roles feed it while an SFT, an RL and an
eval workload run; the Prometheus endpoint is scraped over HTTP and parsed with
prometheus_client's own parsers; the TensorBoard files are read with tensorboard's reader;
`nexus top --once` / `--json` draw from the snapshot op. One deployment for the module."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from actors.monitor.series import OTHER_TENANT, SIGNALS, SeriesStore
from protocol import ops
from protocol.errors import InvalidField
from protocol.messages import MonitorSnapshot, SnapshotRequest
from sdk.client import AsyncClient
from tests.conftest import RoleProcs, nexus_cmd, python_env
from tests.master.test_workloads import eval_spec, rl_spec, sft_spec

TENANTS = ("o-sft", "o-rl")  # the eval is a workload of o-sft (it scores o-sft's policy)


class _Procs(RoleProcs):
    def start_all(self, roles: list[tuple[str, dict[str, str]]]) -> None:
        """Start every role at once, then wait for each: the imports overlap (module < 60 s)."""
        started = []
        for role, env in roles:
            self._n += 1
            instance = f"{role}-{self._n}"
            log = open(self.data_dir / f"{instance}.log", "ab")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.run", role, "--nats-url", self.nats_url, "--prefix", self.prefix,
                 "--data-dir", str(self.data_dir), "--instance", instance],
                env=python_env(NEXUS_HEARTBEAT_INTERVAL_S="0.3", NEXUS_HEALTH_TIMEOUT_S="1.2", **env),
                stdout=log, stderr=subprocess.STDOUT)
            self.procs.append((role, instance, proc))
            started.append((role, instance, proc))
        for role, instance, proc in started:
            self.wait_ready(role, instance, proc)


@pytest.fixture(scope="module")
def deployment(nats_server, tmp_path_factory):
    from tests.conftest import make_layout

    url = nats_server.auth.platform().url(nats_server.url)  # the roles' own login
    names = make_layout(url, f"t{uuid.uuid4().hex[:10]}")
    procs = _Procs(url, names.prefix, tmp_path_factory.mktemp("observe"))
    t0 = time.monotonic()
    try:
        procs.start_all([("monitor", {"NEXUS_METRICS_PORT": "0", "NEXUS_METRICS_HOST": "127.0.0.3"}), ("health", {}), ("master", {}), ("trainer", {}),
                         ("env", {}), ("inferencer", {"NEXUS_INFER_BASE": "tiny-qwen3-vl-64"})])

        async def run():
            c = await AsyncClient(procs.nats_url, procs.prefix, timeout_s=30).connect()
            try:
                sft = await c.submit(sft_spec("o-sft"))
                rl = await c.submit(rl_spec("o-rl"))
                recs = await asyncio.gather(sft.wait(timeout_s=300), rl.wait(timeout_s=300))
                ev = await c.submit(eval_spec("o-sft", episodes=2))
                recs.append(await ev.wait(timeout_s=300))
                info = await c.info("monitor")
                return recs, info
            finally:
                await c.close()

        t1 = time.monotonic()
        recs, info = asyncio.run(run())
        print(f"roles up in {t1 - t0:.1f} s, workloads in {time.monotonic() - t1:.1f} s")
        assert [r.state for r in recs] == ["completed"] * 3, [(r.state, r.message) for r in recs]
        procs.recs = recs  # type: ignore[attr-defined]
        procs.metrics_url = info.extra["metrics_url"]  # type: ignore[attr-defined]
        time.sleep(1.0)  # a few more beats: rates need two of them after the work
        yield procs
    finally:
        procs.stop_all()


def _scrape(url: str, accept: str = "") -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers.get("Content-Type", ""), resp.read().decode()


def _samples(families) -> dict[str, list]:
    """Samples by sample name (a counter's carry ``_total``; its family's name does not)."""
    out: dict[str, list] = {}
    for fam in families:
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_prometheus_endpoint_serves_every_signal(deployment):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
    from prometheus_client.parser import text_string_to_metric_families

    url = deployment.metrics_url
    assert url.startswith("http://127.0.0.3:") and url.endswith("/metrics")  # NEXUS_METRICS_HOST, as set
    ctype, text = _scrape(url)
    assert ctype.startswith("text/plain")
    print("\n".join(line for line in text.splitlines() if "o-sft" in line or "trainer" in line))
    fams = list(text_string_to_metric_families(text))
    names = {f.name for f in fams}
    # The classic parser names a counter family without its _total suffix.
    assert {f"nexus_{s}" for s in SIGNALS} <= names, sorted({f"nexus_{s}" for s in SIGNALS} - names)
    samples = _samples(fams)

    def value(name: str, **labels: str) -> float:
        hits = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
        assert hits, (name, labels, samples[name])
        return hits[-1]

    # control
    for t in TENANTS:
        assert value("nexus_queue_depth", tenant=t) == 0  # everything trained
        assert value("nexus_jobs_in_flight", tenant=t) == 0
        assert value("nexus_ready_jobs", tenant=t) == 0
        assert value("nexus_priority", tenant=t) == 0  # the default (the scaler weighs backlogs by it)
    value("nexus_infer_queued", role="inferencer")
    assert value("nexus_group_size", role="inferencer") >= 1
    assert value("nexus_batch_wait_seconds", role="inferencer") >= 0
    assert value("nexus_env_step_seconds", role="env") > 0  # the RL workload's simulator steps, timed
    # learning: the SFT ran 3 steps (versions 1..3), the RL reported success and return
    assert value("nexus_policy_version", tenant="o-sft") == 3
    assert value("nexus_loss", tenant="o-sft") > 0
    rl = deployment.recs[1]  # the RL workload's record: its last reported figures
    assert value("nexus_success_rate", tenant="o-rl") == pytest.approx(rl.metrics["success_rate"]), rl.metrics
    assert value("nexus_mean_return", tenant="o-rl") == pytest.approx(rl.metrics["mean_return"]), rl.metrics
    # system
    for role in ("health", "monitor", "master", "trainer", "inferencer", "env"):
        assert value("nexus_role_up", role=role) == 1
        assert value("nexus_memory_bytes", role=role) > 1e6
    for role in ("trainer", "inferencer"):
        value("nexus_busy_fraction", role=role)  # served; that the work shows in it: the snapshot test
        assert value("nexus_device_memory_bytes", role=role) > 0
    assert value("nexus_weight_sync_seconds", tenant="o-sft") >= 0
    assert value("nexus_role_restarts_total", role="trainer") == 0
    # The same endpoint in OpenMetrics, as Prometheus asks for it; it parses with that parser too.
    ctype, om = _scrape(url, "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and om.rstrip().endswith("# EOF")
    om_names = {f.name for f in parse_openmetrics(om)}
    assert {f"nexus_{s}" for s in SIGNALS} <= om_names


def test_snapshot_keeps_history_per_version(deployment):
    async def go():
        c = await AsyncClient(deployment.nats_url, deployment.prefix, timeout_s=10).connect()
        try:
            subject = ops.MONITOR_SNAPSHOT.subject(c.names)
            snap = await c.bus.request(subject, SnapshotRequest(history=50, family="learning"), MonitorSnapshot,
                                       timeout_s=10)
            system = await c.bus.request(subject, SnapshotRequest(history=600, family="system"), MonitorSnapshot,
                                         timeout_s=10)
            with pytest.raises(InvalidField, match="history"):
                await c.bus.request(subject, SnapshotRequest(history=10**9), MonitorSnapshot, timeout_s=10)
            return snap, system
        finally:
            await c.close()

    snap, system = asyncio.run(go())
    assert {s.family for s in snap.series} == {"learning"}
    # The trainer trained and the inferencer served during the run: their busy fraction was
    # above zero at some beat (after the work it falls back to 0).
    for role in ("trainer", "inferencer"):
        busy = [v for s in system.series if s.signal == "busy_fraction" and s.labels.get("role") == role
                for v in s.values]
        assert busy and max(busy) > 0, (role, busy)
    loss = next(s for s in snap.series if s.signal == "loss" and s.labels == {"tenant": "o-sft"})
    assert loss.versions == [1, 2, 3] and len(loss.values) == 3 and loss.at == sorted(loss.at)


def test_tensorboard_event_files_per_tenant(deployment):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = deployment.data_dir / "tensorboard"
    deadline = time.monotonic() + 10
    while True:  # the writers flush every 2 s
        sft = EventAccumulator(str(root / "o-sft")).Reload()
        rl = EventAccumulator(str(root / "o-rl")).Reload()
        ev = sft  # the eval of o-sft writes eval/* into o-sft's board
        tags = (set(sft.Tags()["scalars"]), set(rl.Tags()["scalars"]), set(ev.Tags()["scalars"]))
        if ("learning/loss" in tags[0] and "learning/success_rate" in tags[1]
                and any(t.startswith("eval/") for t in tags[2])) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [e.step for e in sft.Scalars("learning/loss")] == [1, 2, 3]
    assert all(e.value > 0 for e in sft.Scalars("learning/loss"))
    assert "control/queue_depth" in tags[0]
    assert {"learning/success_rate", "learning/mean_return"} <= tags[1]
    assert "eval/success_rate" in tags[2], tags[2]
    # Each job's training metrics beside its loss, by the version it trained: the SFT head's and
    # PPO's (the monitor writes what the trainer publishes as `train` metrics).
    assert {"learning/l1", "learning/grad_norm", "learning/lr"} <= tags[0], tags[0]
    assert {"learning/policy_loss", "learning/value_loss", "learning/entropy", "learning/approx_kl",
            "learning/clip_frac"} <= tags[1], tags[1]
    assert [e.step for e in sft.Scalars("learning/l1")] == [1, 2, 3]


def test_nexus_top_once_and_json(deployment):
    flags = ["--nats-url", deployment.nats_url, "--prefix", deployment.prefix]
    out = subprocess.run(nexus_cmd("top", "--json", *flags), capture_output=True, text=True, env=python_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["metrics_url"] == deployment.metrics_url
    roles = {r["role"]: r for r in view["roles"]}
    assert set(roles) == {"health", "monitor", "master", "trainer", "inferencer", "env"}
    assert roles["trainer"]["busy_fraction"] is not None and roles["inferencer"]["busy_fraction"] is not None
    tenants = {t["tenant"]: t for t in view["tenants"]}
    assert tenants["o-sft"]["policy_version"] == 3 and tenants["o-sft"]["loss"] > 0
    assert tenants["o-sft"]["queue_depth"] == 0
    assert tenants["o-rl"]["success_rate"] is not None
    out = subprocess.run(nexus_cmd("top", "--once", *flags), capture_output=True, text=True, env=python_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    print(out.stdout)  # with -s: the frame docs/observability.md shows
    for word in ("roles", "tenants", "trainer", "inferencer", "o-sft", "o-rl", "BUSY", "QUEUE", "LOSS"):
        assert word in out.stdout, (word, out.stdout)


def test_series_store_bounds():
    """Cardinality and memory bounds of the store itself (no deployment needed)."""
    s = SeriesStore(points=4, retain_s=100.0, series_max=10, tenant_cap=2)
    s.record_tenants("queue_depth", {"a": 1, "b": 2, "c": 3, "d": 4}, at=1.0)
    depth = {lab["tenant"]: v for sig, lab, v, _, _ in s.latest() if sig.name == "queue_depth"}
    assert depth == {"a": 1.0, "b": 2.0, OTHER_TENANT: 7.0}  # additive: c + d summed
    s.record("loss", 0.5, at=1.0, tenant="c")
    s.record("loss", 0.25, at=1.0, tenant="d")
    loss = {lab["tenant"]: v for sig, lab, v, _, _ in s.latest() if sig.name == "loss"}
    assert loss == {OTHER_TENANT: 0.25}  # not additive: the last
    for i in range(10):  # the ring keeps the newest 4 points
        s.record("loss", float(i), at=2.0 + i, version=i, tenant="a")
    [snap] = [x for x in s.snapshot(history=10) if x.signal == "loss" and x.labels["tenant"] == "a"]
    assert snap.values == [6.0, 7.0, 8.0, 9.0] and snap.versions == [6, 7, 8, 9]
    s.record("loss", 1.0, at=500.0, tenant="a")  # points older than retain_s go, room or not
    [snap] = [x for x in s.snapshot(history=10) if x.signal == "loss" and x.labels["tenant"] == "a"]
    assert snap.at == [500.0]
    for i in range(20):  # past series_max the least recently updated series go
        s.record("memory_bytes", 1.0, role="env", instance=f"e{i}")
    assert len(s) == 10 and s.evicted == 15
    assert s.forget(role="env", instance="e19") == 1
    s2 = SeriesStore(points=4, retain_s=100.0, series_max=100, tenant_cap=1)
    s2.record("loss", 1.0, tenant="a")
    s2.record("loss", 1.0, tenant="b")  # over the cap
    assert s2.drop_tenant("a") == 1 and s2.drop_tenant("nope") == 0
    s2.record("loss", 2.0, tenant="b")  # a's place is b's now
    assert {lab["tenant"] for _, lab, *_ in s2.latest()} == {"b", OTHER_TENANT}
    with pytest.raises(ValueError, match="labels"):
        s.record("loss", 1.0, role="x", instance="y")


def test_real_prometheus_scrapes_the_endpoint(deployment, tmp_path):
    """Debian's `prometheus` scrapes the monitor (skipped where the binary is not installed)."""
    import shutil
    import urllib.parse

    from transport.broker import free_port

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`)")
    target = deployment.metrics_url.removeprefix("http://").removesuffix("/metrics")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: vla-nexus\n    static_configs: [{{targets: ['{target}']}}]\n")
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())["data"]["result"]

    try:
        deadline, got = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            try:
                got = query('nexus_policy_version{tenant="o-sft"}')
                if got:
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        assert got and float(got[0]["value"][1]) == 3, (got, (tmp_path / "prometheus.log").read_text()[-2000:])
        assert float(query('up{job="vla-nexus"}')[0]["value"][1]) == 1
        busy = query('nexus_busy_fraction{role="trainer"}')
        assert busy, "the trainer's busy fraction did not reach Prometheus"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_grafana_dashboard_and_prometheus_config_name_real_signals():
    """deploy/compose's provisioned dashboard queries only families the monitor serves, and its
    prometheus.yml passes promtool (where installed)."""
    import re
    import shutil

    from tests.conftest import ROOT

    served = {f"nexus_{n}" + ("_total" if s.kind == "counter" else "") for n, s in SIGNALS.items()}
    dash = json.loads((ROOT / "deploy/compose/grafana/dashboards/vla-nexus.json").read_text())
    queried = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"nexus_[a-z_]+", t["expr"])}
    assert queried and queried <= served, queried - served
    assert served <= queried, served - queried  # every signal has a panel
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/compose/prometheus.yml")],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
