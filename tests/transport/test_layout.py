"""Streams and buckets are created idempotently; the compose file runs every role."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import yaml

from transport.bus import Bus
from transport.layout import ensure_layout, kv_buckets, object_buckets, stream_configs
from protocol.subjects import ROLES, Names
from tests.conftest import ROOT, nexus_cmd, python_env


def test_ensure_layout_twice_changes_nothing(nats_url, prefix):
    names = Names(prefix)

    async def go():
        bus = await Bus.connect(nats_url, name="t", reconnect_forever=False)
        try:
            await ensure_layout(bus.js, names)
            first = {c.name: (await bus.js.stream_info(c.name)).config for c in stream_configs(names)}
            await ensure_layout(bus.js, names)
            for cfg in stream_configs(names):
                info = await bus.js.stream_info(cfg.name)
                assert info.config.subjects == first[cfg.name].subjects
            for bucket in kv_buckets(names):
                await bus.js.key_value(bucket)
            for bucket in object_buckets(names):
                await bus.js.object_store(bucket)
        finally:
            await bus.close()

    asyncio.run(go())


def test_nexus_layout_command(nats_url, prefix):
    for _ in range(2):
        out = subprocess.run(nexus_cmd("layout", "--nats-url", nats_url, "--prefix", prefix),
                             capture_output=True, text=True, env=python_env(), timeout=60)
        assert out.returncode == 0, out.stderr
        assert prefix in out.stdout


def test_compose_runs_every_role_against_a_3_node_cluster():
    compose = yaml.safe_load((ROOT / "deploy/compose/docker-compose.yml").read_text())
    services = compose["services"]
    for role in ROLES:
        assert services[role]["command"] == [role], role
    assert {"nats-1", "nats-2", "nats-3", "jaeger", "layout"} <= set(services)
    assert "--replicas" in services["layout"]["entrypoint"]
    # Operator mode: the identities first (auth-init, the only one with the seeds' volume),
    # then each role logs in as its own user, from its own volume; the nodes get no seed.
    init = services["auth-init"]
    assert "nexus auth init" in init["command"][-1]
    assert "nexus-creds:/creds" in init["volumes"]
    for node in ("nats-1", "nats-2", "nats-3"):
        assert services[node]["depends_on"]["auth-init"]["condition"] == "service_completed_successfully"
        assert not any(v.startswith("nexus-creds:") for v in services[node]["volumes"]), node
        assert "nats-auth:/etc/nats/creds/auth:ro" in services[node]["volumes"], node
    for name, user in (*((r, r) for r in ROLES), ("layout", "supervisor")):
        assert services[name]["environment"]["NEXUS_CREDS"] == "/creds/role.creds", name
        creds = [v for v in services[name]["volumes"] if v.endswith(":/creds:ro")]
        assert creds == [f"creds-{user}:/creds:ro"], (name, services[name]["volumes"])
        assert f"creds-{user}:/out/{user}" in init["volumes"], name
        assert not any(v.startswith("nexus-creds:") for v in services[name]["volumes"]), name
    assert Path(ROOT / "deploy/compose/Dockerfile").exists()


def test_k8s_broker_has_auth_and_each_role_pod_mounts_only_its_own_creds():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/nexus.yaml").read_text()) if d]
    env = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nexus-env")
    assert env["data"]["NEXUS_CREDS"] == "/creds/role.creds"
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")}
    want = {f"nexus-{r}": f"nexus-creds-{r}" for r in ROLES} | {"nexus-layout": "nexus-creds-supervisor"}
    assert set(pods) == set(want)
    for name, pod in pods.items():
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert secrets == [want[name]], (name, secrets)
        creds = next(v["name"] for v in pod["volumes"] if "secret" in v)
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == creds]
        assert mounts == [{"name": creds, "mountPath": "/creds", "readOnly": True}], name
        assert all(c.get("envFrom") == [{"configMapRef": {"name": "nexus-env"}}] for c in pod["containers"]), name
    # The broker: operator mode from the nexus-nats-auth Secret (JWTs only), on every node.
    values = yaml.safe_load((ROOT / "deploy/k8s/nats-values.yaml").read_text())
    assert values["config"]["merge"]["$include"] == "auth/nats-auth.conf"
    volume = values["podTemplate"]["patch"][0]["value"]
    assert volume == {"name": "nexus-nats-auth", "secret": {"secretName": "nexus-nats-auth"}}
    for part in ("container", "reloader"):
        mount = values[part]["patch"][0]["value"]
        assert mount == {"name": "nexus-nats-auth", "mountPath": "/etc/nats-config/auth", "readOnly": True}, part
    script = (ROOT / "deploy/k8s/make-secrets.sh").read_text()
    assert "nexus auth init" in script and "nexus-nats-auth" in script and "nexus-creds-$role" in script
    assert "state.json" not in script and "admin.creds" not in script  # no seed leaves the directory
    for role in (*ROLES, "supervisor"):
        assert role in script.split("for role in ", 1)[1].split(";", 1)[0], role


def test_a_full_queue_is_busy_at_once_not_after_the_retries(nats_url, prefix):
    # JetStream answers a publish into a stream at max_bytes (discard=new) with a 503
    # (err_code 10077): final, not a leader election; js_retry must not spend its 20 s on it.
    import time

    from transport.layout import ensure_tq_stream, publish_tq
    from protocol.errors import Busy
    from protocol.messages import DeploymentSettings

    names = Names(prefix)
    settings = DeploymentSettings(replicas=1, tq_max_bytes=2**20)

    async def go():
        bus = await Bus.connect(nats_url, name="t", reconnect_forever=False)
        try:
            await ensure_tq_stream(bus.js, names, "full", settings)
            subject = names.tq_job("full", "j1")
            for k in range(64):
                started = time.monotonic()
                try:
                    await publish_tq(bus.js, names, "full", subject, b"x" * 65536, {"Nats-Msg-Id": f"m{k}"}, settings)
                except Busy as exc:
                    return k, time.monotonic() - started, exc
            return 64, 0.0, None
        finally:
            await bus.close()

    k, took_s, exc = asyncio.run(go())
    assert exc is not None and 0 < k < 64, k
    assert took_s < 5, f"the refusal took {took_s:.1f} s: retried as if transient"
    assert "'full'" in exc.message and str(2**20) in exc.message
