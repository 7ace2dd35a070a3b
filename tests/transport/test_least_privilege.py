"""Least privilege inside the platform, on a real `nexus up` (operator mode).

Each role logs in as its own user of the platform account whose JWT allows only the
subjects `transport.permissions` derives for it; the server refuses the rest ("Permissions
Violation"); no role process is handed the platform's or the admin's credentials; SFT, RL
and eval workloads run end to end on those lists with no violation in any log. When the
tests run as root and the interpreter is usable by ``nobody`` (CI's image), the roles run as
``nobody`` (NEXUS_ROLE_USER) and cannot read ``auth/state.json``, the seeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
import pytest
import yaml

from transport import nats_jwt
from transport.auth import AuthStore
from transport.creds import Credentials, redact_url
from transport.permissions import PROCESSES, role_permissions
from transport.cluster import ClusterState
from protocol import ops
from protocol.subjects import ROLES, Names
from sdk.client import AsyncClient
from tests.conftest import nexus_cmd, nexus_up, python_env
from tests.master.test_workloads import eval_spec, rl_spec, sft_spec

ROLE_USER = "nobody"


def _nobody_can_run_us() -> bool:
    """Root, and ``nobody`` can start this interpreter and import the code (a venv under
    /root, 0700, it cannot)."""
    if os.geteuid() != 0:
        return False
    try:
        pwd.getpwnam(ROLE_USER)
        out = subprocess.run([sys.executable, "-c", "import actors.run"], user=ROLE_USER, cwd="/",
                             env=python_env(), capture_output=True, timeout=60)
    except (KeyError, OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


FENCED = _nobody_can_run_us()


def nexus(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env(NEXUS_INFER_BASE="tiny-qwen3-vl-64", **env))


@pytest.fixture(scope="module")
def deployment():
    # Not under pytest's 0700 tmp dir: the role user must be able to enter the data dir.
    data_dir = Path(tempfile.mkdtemp(prefix="nexus-lp-", dir="/tmp"))
    os.chmod(data_dir, 0o755)
    try:
        with nexus_up(data_dir, NEXUS_INFER_BASE="tiny-qwen3-vl-64", NEXUS_ROLE_USER=ROLE_USER if FENCED else "-") as state:
            yield state
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _violations(state: ClusterState) -> list[str]:
    """Lines of the roles' logs where the server refused one of them something."""
    return [f"{role}: {line}" for role in ROLES for line in
            (Path(state.logs_dir) / f"{role}.log").read_text(errors="replace").splitlines()
            if "permissions violation" in line.lower()]


def test_each_role_logs_in_as_its_own_user_with_only_its_permissions(deployment):
    store = AuthStore(Path(deployment.data_dir), prefix=deployment.prefix)
    keys = set()
    for role in PROCESSES:
        creds = Credentials.read(store.role_creds(role))
        claims = nats_jwt.decode_claims(nats_jwt.parse_creds(creds.text)[0])["nats"]
        want = role_permissions(role, deployment.prefix)
        assert {k: claims[k] for k in ("pub", "sub", "resp")} == want, role
        assert creds.user == role and creds.tenant is None
        keys.add(creds.user_key)
        pub = want["pub"]["allow"]
        assert ">" not in pub and "_INBOX.>" not in pub, role  # replies go through resp only
        if role not in ("master", "supervisor"):
            assert "$JS.API.>" not in pub and not any(s.startswith("$JS.API.STREAM.DELETE") for s in pub), role
    assert len(keys) == len(PROCESSES)  # one user each
    # A tenant's ops on another tenant's work are the master's business; the env worker may
    # not even ask for quotas, nor the health manager for anything of the master's.
    names = Names(deployment.prefix)
    assert ops.MASTER_TENANT_QUOTAS.subject(names) not in role_permissions("env", deployment.prefix)["pub"]["allow"]
    # Every running role was handed its own file: not the platform's, not the admin's.
    for child in deployment.roles:
        env = _environ(child.pid)
        assert env["NEXUS_CREDS"] == str(store.role_creds(child.role)), child.role
        assert not any(v.endswith(("platform.creds", "admin.creds", "state.json")) for v in env.values()), child.role
        assert Credentials.read(Path(env["NEXUS_CREDS"])).user == child.role


def test_the_server_refuses_a_role_outside_its_list(deployment):
    store = AuthStore(Path(deployment.data_dir), prefix=deployment.prefix)
    names = Names(deployment.prefix)
    url = redact_url(deployment.nats_url)

    async def go():
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        env = await nats.connect(url, error_cb=on_error, allow_reconnect=False,
                                 **Credentials.read(store.role_creds("env")).connect_options())
        admin = await nats.connect(url, **Credentials.read(store.admin_creds).connect_options())
        try:
            # Allowed: the env worker asks the master about a job (a real answer, an error reply).
            ok = await env.request(ops.MASTER_JOB.subject(names), b"{}", timeout=10)
            assert ok.data
            # Refused by the server: an op not in its list, a stream delete, a bucket write.
            for subject in (ops.MASTER_TENANT_QUOTAS.subject(names), "$JS.API.STREAM.DELETE." + names.stream_intake,
                            f"$KV.{names.kv_tenants}.evil"):
                with pytest.raises(nats.errors.TimeoutError):
                    await env.request(subject, b"{}", timeout=1.0)
            # ...and a subscription to what is not its own (the tenants' deletions are not).
            await env.subscribe(ops.MASTER_SUBMIT.subject(names))
            await env.flush()
            await asyncio.sleep(0.5)
            # Nothing changed: the intake stream is still there.
            info = await admin.jetstream().stream_info(names.stream_intake)
            assert info.config.name == names.stream_intake
            return errors
        finally:
            await env.close()
            await admin.close()

    errors = asyncio.run(go())
    said = " ".join(errors).lower()  # nats.py lower-cases the server's -ERR
    assert f'permissions violation for publish to "{ops.MASTER_TENANT_QUOTAS.subject(names)}"' in said, errors
    assert "permissions violation for publish to \"$js.api.stream.delete." in said, errors
    assert f'permissions violation for subscription to "{ops.MASTER_SUBMIT.subject(names)}"' in said, errors


def test_each_role_user_can_probe_its_own_instance(deployment):
    """The container health check (deploy/compose/probe.py) asks the role's own instance for
    `info` with the role's own credentials."""
    store = AuthStore(Path(deployment.data_dir), prefix=deployment.prefix)

    async def go():
        out = {}
        for child in deployment.roles:
            async with AsyncClient(redact_url(deployment.nats_url), deployment.prefix, timeout_s=10,
                                   creds=store.role_creds(child.role)) as c:
                out[child.role] = (await c.info(child.role, child.instance)).state
        return out

    assert asyncio.run(go()) == {r: "ready" for r in ROLES}


@pytest.mark.skipif(not FENCED, reason="needs root and an interpreter the role user can run; "
                                       "otherwise roles share the supervisor's uid (docs/security.md)")
def test_role_processes_run_as_the_role_user_and_cannot_read_the_seeds(deployment):
    uid = pwd.getpwnam(ROLE_USER).pw_uid
    data = Path(deployment.data_dir)
    for child in deployment.roles:
        status = Path(f"/proc/{child.pid}/status").read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert set(uids) == {str(uid)}, (child.role, uids)
    probe = ("import sys\nfrom pathlib import Path\n"
             "for p in sys.argv[1:]:\n"
             "    try:\n        Path(p).read_bytes(); print('read', p)\n"
             "    except PermissionError:\n        print('denied', p)\n")
    store = AuthStore(data, prefix=deployment.prefix)
    out = subprocess.run([sys.executable, "-c", probe, str(store.state_path), str(store.admin_creds),
                          str(store.platform_creds), str(store.role_creds("env"))],
                         user=ROLE_USER, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.splitlines() == [f"denied {store.state_path}", f"denied {store.admin_creds}",
                                       f"denied {store.platform_creds}", f"read {store.role_creds('env')}"], out
    assert (store.root.stat().st_mode & 0o777) == 0o700 and store.root.stat().st_uid == 0


def test_workloads_run_end_to_end_on_the_role_lists(deployment, tmp_path):
    async def go():
        c = await AsyncClient(deployment.nats_url, deployment.prefix, timeout_s=30,
                              creds=deployment.creds).connect()
        try:
            sft = await c.submit(sft_spec("lp-sft"))
            rl = await c.submit(yaml.safe_dump(rl_spec("lp-rl")))
            ev = await c.submit(json.dumps(eval_spec("lp-sft")))
            recs = await asyncio.gather(*(h.wait(timeout_s=300) for h in (sft, rl, ev)))
            files = await sft.download_policy(out_dir=tmp_path)
            return recs, files
        finally:
            await c.close()

    (sft, rl, ev), (weights, _) = asyncio.run(go())
    assert [r.state for r in (sft, rl, ev)] == ["completed"] * 3, [(r.state, r.message) for r in (sft, rl, ev)]
    assert weights.stat().st_size > 0
    assert _violations(deployment) == []
    assert {c.role for c in deployment.roles} == set(ROLES)
    if FENCED:  # what the roles wrote is theirs; the report landed in the role user's dir
        assert any((Path(deployment.data_dir) / "reports").iterdir())
