"""Starting weights a tenant brings (issue 30 item 6), on a real deployment (`nexus up`,
operator mode) with each tenant's own credentials.

The round trip: tenant A trains one step and downloads its policy; tenant B uploads that file
(`nexus weights upload`) and submits a spec with ``init: {weights: NAME}``; B's version 0
through the inferencer's predict gives exactly A's trained actions (and not the seed's, which
A's version 0 shows). The refusals: an upload of the wrong shape names the tensor and both
shapes (and an unknown tensor), and the submit creates nothing; a file that is not
safetensors, a path as a name, another tenant's area (by name or by --tenant) are refused and
leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
from protocol import ops
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import nexus_run, nexus_up, tenant_create
from tests.master.test_workloads import sft_spec

BASE = "tiny-qwen3-vl-64"
A, B, M = "sw-alice", "sw-bob", "sw-mallory"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("startw")
    with nexus_up(data_dir, NEXUS_INFER_BASE=BASE) as state:
        creds = {t: tenant_create(data_dir, t)["creds"] for t in (A, B, M)}
        yield data_dir, state, creds


def as_tenant(deployment, tenant: str, *args: str, timeout: float = 300):
    data_dir, _, creds = deployment
    return nexus_run("--creds", creds[tenant], *args, "--data-dir", str(data_dir), timeout=timeout)


def write_spec(path: Path, tenant: str, init: dict | None = None, steps: int = 1) -> str:
    spec = sft_spec(tenant, steps=steps)
    spec["env"]["demos"] = {"episodes": 1}  # one recorded episode is enough to train a step
    if init is not None:
        spec["init"] = init
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def predict_all(deployment, calls: list[tuple[str, int]]) -> list[np.ndarray]:
    """Each (tenant, pinned version)'s mean actions for one fixed observation, each on its own login."""
    from transport.creds import redact_url
    from sdk.client import AsyncClient

    _, state, creds = deployment
    rng = np.random.default_rng(7)
    images = {cam: rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for cam in ("top", "wrist")}
    obs_state = rng.standard_normal(4).astype(np.float32)

    async def go():
        out = []
        for tenant, version in calls:
            async with AsyncClient(redact_url(state.nats_url), state.prefix, timeout_s=60,
                                   creds=creds[tenant]) as c:
                reply = await c.predict(tenant, images, obs_state, "reach the target", version=version,
                                        sample=False, timeout_s=60)
                assert reply.version == version
                out.append(np.asarray(reply.actions))
        return out

    return asyncio.run(go())


def init_weights_as(deployment, tenant: str, obj: str) -> str:
    """The trainer's ``init_weights`` (the master's, at submit) asked directly by a tenant: the
    error it gets (it is the platform's op only)."""
    from transport.creds import redact_url
    from protocol.errors import NexusError
    from protocol.messages import InitWeightsRequest, TenantConfig
    from sdk.client import AsyncClient

    _, state, creds = deployment

    async def go() -> str:
        async with AsyncClient(redact_url(state.nats_url), state.prefix, timeout_s=20, creds=creds[tenant]) as c:
            cfg = TenantConfig(name=tenant, base=BASE, schema={})
            try:
                await c.bus.call(ops.TRAINER_INIT_WEIGHTS, InitWeightsRequest(
config=cfg, weights=obj), timeout_s=20)
            except NexusError as exc:
                return str(exc)
            return "ALLOWED"

    return asyncio.run(go())


def test_round_trip_and_refusals(deployment, tmp_path):
    data_dir = deployment[0]
    # A trains one step and downloads its policy (version 1).
    out = as_tenant(deployment, A, "submit", write_spec(tmp_path / "a.yaml", A), "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    out = as_tenant(deployment, A, "download", A, "--out", str(tmp_path / "dl"), "--json")
    assert out.returncode == 0, out.stderr
    policy = Path(json.loads(out.stdout)["weights"])
    assert policy.name == f"{A}-v1.safetensors"

    # B brings it as its start: uploaded into B's own area, named in B's spec.
    up = as_tenant(deployment, B, "weights", "upload", "from-alice", str(policy))
    assert up.returncode == 0, up.stderr
    assert "uploaded from-alice" in up.stdout and "tensors" in up.stdout
    out = as_tenant(deployment, B, "submit", write_spec(tmp_path / "b.yaml", B, {"weights": "from-alice"}))
    assert out.returncode == 0, out.stdout + out.stderr

    a_seed, a_trained, b_start = predict_all(deployment, [(A, 0), (A, 1), (B, 0)])
    assert not np.array_equal(a_seed, a_trained)  # the step changed A: B's seed (same as A's) is not it
    np.testing.assert_array_equal(b_start, a_trained)

    # A file of the wrong shape: each misfit tensor named with both shapes; no tenant created.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(policy))
    name = sorted(k for k, v in tensors.items() if v.dim() == 2)[0]
    rows, cols = tensors[name].shape
    tensors[name] = tensors[name].new_zeros((rows, cols + 3))
    tensors["extra.bias"] = tensors[name].new_zeros((5,))
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    assert as_tenant(deployment, M, "weights", "upload", "bad", str(bad)).returncode == 0
    out = as_tenant(deployment, M, "submit", write_spec(tmp_path / "m.yaml", M, {"weights": "bad"}))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "init.weights" in out.stderr, out.stderr
    assert f"tensor '{name}': uploaded shape ({rows}, {cols + 3}), the spec's action module has ({rows}, {cols})" \
        in out.stderr, out.stderr
    assert "tensor 'extra.bias' (shape (5,)) is not in the spec's action module" in out.stderr, out.stderr
    shown = as_tenant(deployment, M, "tenant", "show", "--json")
    assert shown.returncode != 0 and f"unknown tenant '{M}'" in shown.stderr, shown.stdout + shown.stderr

    # Fenced: names resolve in the caller's own area only (B's "from-alice" is not M's).
    out = as_tenant(deployment, M, "submit", write_spec(tmp_path / "m2.yaml", M, {"weights": "from-alice"}))
    assert out.returncode != 0 and "has no upload named 'from-alice'" in out.stderr, out.stdout + out.stderr
    out = as_tenant(deployment, M, "weights", "upload", "x", str(policy), "--tenant", B)
    assert out.returncode != 0 and "permission denied" in out.stderr, out.stdout + out.stderr

    assert "permission denied" in init_weights_as(deployment, M, f"{B}/upload-from-alice")

    # A path as a name, in the command and in a spec: refused, naming the field.
    out = as_tenant(deployment, M, "weights", "upload", "../../cluster", str(policy))
    assert out.returncode == 2 and "name" in out.stderr, out.stdout + out.stderr
    out = as_tenant(deployment, M, "submit", write_spec(tmp_path / "m3.yaml", M, {"weights": "../sw-bob/x"}))
    assert out.returncode == 2 and "init.weights" in out.stderr, out.stdout + out.stderr

    # Not safetensors: refused clearly, nothing stored or staged.
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\0" * 64)
    out = as_tenant(deployment, M, "weights", "upload", "junk", str(junk))
    assert out.returncode == 2 and "not a safetensors file" in out.stderr, out.stdout + out.stderr
    assert not list((data_dir / "uploads").rglob("*.part"))
    out = as_tenant(deployment, M, "submit", write_spec(tmp_path / "m4.yaml", M, {"weights": "junk"}))
    assert out.returncode != 0 and "has no upload named 'junk'" in out.stderr, out.stdout + out.stderr
    # nothing left behind anywhere: no staged part, not even the tenant's staging folder
    assert not list(data_dir.rglob("*.part")) and not (data_dir / "uploads" / M).exists()
