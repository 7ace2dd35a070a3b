"""deploy/k8s validated against the Kubernetes and KEDA schemas, offline.

Kubernetes: the upstream OpenAPI of release 1.30 as JSON Schema (strict: an unknown field
fails), vendored from the kubernetes-validate wheel by deploy/k8s/schemas/vendor.py and
trimmed to the definitions the kinds used here reach. KEDA: a schema written by hand from
the ScaledObject types @kubernetes-models/keda publishes (its file says what it covers), with
`behavior` resolved against the real autoscaling/v2 definition. Then what the schemas cannot
say: each ScaledObject targets a Deployment of the manifests, its bounds are the
NEXUS_SCALE_BOUNDS defaults, each Prometheus query reads a metric the monitor exports, and each
scaled pod's grace period covers its drain plus the bounded teardown.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from actors.runtime import EXIT_TEARDOWN_GRACE_S, RoleConfig
from protocol.scaling import DEFAULT_BOUNDS, SCALABLE
from tests.conftest import ROOT

K8S = ROOT / "deploy/k8s"
SCHEMAS = K8S / "schemas"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _validators() -> dict[str, jsonschema.protocols.Validator]:
    k8s = json.loads((SCHEMAS / "k8s-v1.30.0-strict.json").read_text())
    defs = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": k8s["$defs"]}
    registry = Registry().with_resource("k8s", Resource.from_contents(defs))
    out = {}
    for kind, schema in k8s["kinds"].items():
        schema = {**schema, "$defs": k8s["$defs"]}  # its "#/$defs/..." refs resolve in itself
        out[kind] = jsonschema.Draft202012Validator(schema, registry=registry)
    keda = json.loads((SCHEMAS / "keda-scaledobject-v1alpha1.json").read_text())
    out["ScaledObject"] = jsonschema.Draft202012Validator(keda, registry=registry)
    return out


def _errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_every_manifest_validates_against_its_schema():
    validators = _validators()
    docs = _docs("nexus.yaml") + _docs("autoscaling.yaml")
    kinds = [d["kind"] for d in docs]
    assert kinds.count("ScaledObject") == 3 and kinds.count("Deployment") == 6, kinds
    assert kinds.count("Service") == 1 and kinds.count("NetworkPolicy") == 1, kinds
    for doc in docs:
        assert doc["kind"] in validators, f"no schema for {doc['kind']}"
        errors = _errors(validators[doc["kind"]], doc)
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}: {errors}"


def test_the_schemas_catch_what_they_claim_to():
    """A checker that cannot fail proves nothing: misspelt fields, wrong types, a missing
    target, a bad fallback and a bad HPA behaviour must each fail."""
    validators = _validators()
    dep = next(d for d in _docs("nexus.yaml") if d["kind"] == "Deployment")
    so = _docs("autoscaling.yaml")[0]
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 90  # misspelt
    assert any("terminationGracePeriodSecond" in e for e in _errors(validators["Deployment"], bad))
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replicas"] = "two"
    assert _errors(validators["Deployment"], bad)
    for mutate in (lambda s: s["spec"].pop("scaleTargetRef"),
                   lambda s: s["spec"].update(maxReplicas=3),  # the HPA's name, not KEDA's
                   lambda s: s["spec"].update(minReplicaCount="1"),
                   lambda s: s["spec"]["fallback"].update(behavior="sometimes"),
                   lambda s: s["spec"]["triggers"][0]["metadata"].update(threshold=4),  # metadata are strings
                   lambda s: s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
                   .update(stabilizationWindowSecond=300),
                   lambda s: s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
                   ["policies"][0].pop("type")):
        bad = json.loads(json.dumps(so))
        mutate(bad)
        assert _errors(validators["ScaledObject"], bad), bad


def _exported_metrics() -> set[str]:
    """The nexus_* families the monitor exports, from docs/observability.md's signal tables
    (tests/actors/test_observability.py checks those tables against a real scrape)."""
    text = (ROOT / "docs/observability.md").read_text()
    return {f"nexus_{m}" for m in re.findall(r"^\| `([a-z_]+)`", text, flags=re.M)}


def test_scaled_objects_target_the_roles_with_their_bounds_and_real_metrics():
    deployments = {d["metadata"]["name"]: d for d in _docs("nexus.yaml") if d["kind"] == "Deployment"}
    exported = _exported_metrics()
    assert {"nexus_queue_depth", "nexus_batch_wait_seconds"} <= exported
    seen = set()
    for so in _docs("autoscaling.yaml"):
        spec = so["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        role = target["spec"]["template"]["spec"]["containers"][0]["args"][0]
        assert role in SCALABLE
        seen.add(role)
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (DEFAULT_BOUNDS[role].min, DEFAULT_BOUNDS[role].max)
        assert spec["minReplicaCount"] <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"]
        assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
        for trig in spec["triggers"]:
            assert trig["type"] == "prometheus"  # KEDA's prometheus scaler: these three are required
            md = trig["metadata"]
            assert {"serverAddress", "query", "threshold"} <= set(md), md
            float(md["threshold"])
            used = set(re.findall(r"nexus_[a-z_]+", md["query"]))
            assert used and used <= exported, f"{role}: {used - exported} not exported by the monitor"
    assert seen == set(SCALABLE)


def test_scaled_pods_get_time_to_drain_before_sigkill():
    need = RoleConfig.__dataclass_fields__["drain_timeout_s"].default + EXIT_TEARDOWN_GRACE_S
    for d in _docs("nexus.yaml"):
        if d["kind"] != "Deployment":
            continue
        role = d["spec"]["template"]["spec"]["containers"][0]["args"][0]
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        if role in SCALABLE:
            assert grace >= need, f"{role}: grace {grace} s < drain {need:g} s: a scale-in would SIGKILL mid-drain"


@pytest.mark.parametrize("name", ["nexus.yaml", "autoscaling.yaml"])
def test_manifests_parse(name):
    assert _docs(name)


def test_prometheus_can_reach_the_monitor_and_nothing_else_can():
    """The triggers read what Prometheus scraped from the monitor: its endpoint listens on the
    pod's address (not loopback), the Service reaches its named port, and the NetworkPolicy on
    the same pods admits the monitoring namespace alone on that port."""
    docs = _docs("nexus.yaml")
    mon = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nexus-monitor")
    box = mon["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in box.get("env", [])}
    assert env["NEXUS_METRICS_HOST"] == "0.0.0.0"
    port = {p["name"]: p["containerPort"] for p in box["ports"]}["metrics"]
    assert int(env["NEXUS_METRICS_PORT"]) == port
    labels = mon["spec"]["template"]["metadata"]["labels"]
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "nexus-monitor")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["metrics"]
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    pol = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = pol["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [port]
    (peer,) = rule["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    # the namespace the triggers' Prometheus lives in, per autoscaling.yaml's serverAddress
    for so in _docs("autoscaling.yaml"):
        for trig in so["spec"]["triggers"]:
            assert ".monitoring.svc" in trig["metadata"]["serverAddress"]
