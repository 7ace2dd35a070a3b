"""A tenant sees and fixes itself, from the user's side: `nexus --creds <tenant's> ...` on a real
deployment (`nexus up`, operator mode), never the admin's credentials.

`tenant show` of itself (schema, version, quotas, workloads) and never of another tenant; a
spec whose schema differs from the tenant's slot is refused naming each field with the stored
and the asked value and `nexus tenant reset`; the reset is refused while a workload of the
tenant runs (naming it), never reaches another tenant, and afterwards a spec with another
schema trains (the workload records and usage of before stay); `nexus workloads watch` of a
finished workload prints its final line and exits 0, of an unknown id fails clearly, and a
Ctrl-C leaves the workload running and says how to get back.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import nexus_cmd, nexus_run, nexus_up, python_env, tenant_create
from tests.master.test_workloads import sft_spec

BASE = "tiny-qwen3-vl-64"
ME, OTHER = "selfie", "neighbour"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("self")
    with nexus_up(data_dir, NEXUS_INFER_BASE=BASE):
        creds = {t: tenant_create(data_dir, t)["creds"] for t in (ME, OTHER)}
        yield data_dir, creds


def as_tenant(deployment, tenant: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`nexus --creds <tenant's creds> ARGS --data-dir D`: the tenant's own login."""
    data_dir, creds = deployment
    return nexus_run("--creds", creds[tenant], *args, "--data-dir", str(data_dir), timeout=timeout)


def write_spec(path: Path, spec: dict) -> str:
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.fixture(scope="module")
def trained(deployment, tmp_path_factory):
    """ME's first workload: a 2-step SFT, submitted and waited for on ME's credentials."""
    spec = write_spec(tmp_path_factory.mktemp("specs") / "first.yaml", sft_spec(ME, steps=2))
    out = as_tenant(deployment, ME, "submit", spec, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    (workload,) = re.findall(r"submitted (w\S+) \(tenant selfie\)", out.stdout)
    return workload


def test_a_tenant_shows_itself_and_no_other(deployment, trained):
    shown = as_tenant(deployment, ME, "tenant", "show", "--json")  # no name: the caller's own
    assert shown.returncode == 0, shown.stderr
    me = json.loads(shown.stdout)
    assert me["tenant"] == ME and me["config"]["name"] == ME and me["config"]["head"] == "mlp"
    assert me["config"]["schema"]["state_dim"] == 4 and me["config"]["schema"]["action_dim"] == 2
    assert me["version"] == 2  # the 2-step SFT's exported policy
    assert [w["workload"] for w in me["workloads"]] == [trained] and me["workloads"][0]["state"] == "completed"
    assert me["quotas"]["max_inflight_jobs"] >= 1 and me["quotas_default"] is True

    text = as_tenant(deployment, ME, "tenant", "show", ME)
    assert text.returncode == 0, text.stderr
    assert f"tenant {ME}: base" in text.stdout and "head mlp, version 2" in text.stdout
    assert "state_dim 4" in text.stdout and "top 64x64" in text.stdout and "quotas" in text.stdout
    assert trained in text.stdout

    # Another tenant's record: refused, naming the op and the tenant; nothing of it shown.
    for who, whom in ((ME, OTHER), (OTHER, ME)):
        out = as_tenant(deployment, who, "tenant", "show", whom, "--json")
        assert out.returncode != 0 and not out.stdout, out.stdout
        assert out.stderr.startswith("error: permission denied") and f"'{whom}'" in out.stderr, out.stderr
        assert "tenant_show" in out.stderr


def test_watch_a_finished_workload_and_an_unknown_one(deployment, trained):
    out = as_tenant(deployment, ME, "workloads", "watch", trained)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1].startswith(f"{trained} {ME}: completed"), out.stdout
    assert "2/2 steps" in out.stderr  # the progress line `submit --wait` shows

    unknown = as_tenant(deployment, ME, "workloads", "watch", "w0000000000abcdef")
    assert unknown.returncode == 2 and not unknown.stdout
    assert unknown.stderr.startswith("error: unknown workload 'w0000000000abcdef'"), unknown.stderr
    assert "nexus workloads list" in unknown.stderr
    # Another tenant's workload is not the caller's to watch (and whose it is goes unsaid).
    theirs = as_tenant(deployment, OTHER, "workloads", "watch", trained)
    assert theirs.returncode != 0 and "permission denied" in theirs.stderr and ME not in theirs.stderr


def test_schema_conflict_then_reset_to_a_new_schema(deployment, trained, tmp_path):
    # The schema the tenant moves to (the reach env fixes the state and action lengths, which
    # submit checks against the env): chunks of 3 actions, a template of its own.
    chunked = sft_spec(ME, steps=2)
    chunked["action"]["horizon"] = 3
    chunked["observation"]["instruction_template"] = "robot: {instruction}"
    chunked_path = write_spec(tmp_path / "chunked.yaml", chunked)

    # 1. The conflict names each differing field, both values, and the way out.
    refused = as_tenant(deployment, ME, "submit", chunked_path)
    assert refused.returncode != 0, refused.stdout
    err = refused.stderr
    assert re.search(r"observation\.instruction_template: stored .*asked 'robot: \{instruction\}'", err), err
    assert re.search(r"action\.horizon: stored 1 .*asked 3", err), err
    assert "nexus tenant reset selfie" in err and "another tenant name" in err

    # 2. While a workload of the tenant runs, the reset is refused naming it (and changes nothing).
    long_path = write_spec(tmp_path / "long.yaml", sft_spec(ME, steps=10_000))
    started = as_tenant(deployment, ME, "submit", long_path)
    assert started.returncode == 0, started.stderr
    (running,) = re.findall(r"submitted (w\S+) \(tenant selfie\)", started.stdout)
    assert f"nexus workloads watch {running}" in started.stdout  # the way back, said at submit
    busy = as_tenant(deployment, ME, "tenant", "reset", "--yes")
    assert busy.returncode != 0 and running in busy.stderr and "cancel" in busy.stderr, busy.stderr
    assert json.loads(as_tenant(deployment, ME, "tenant", "show", "--json").stdout)["config"] is not None

    # 3. Ctrl-C while watching: the workload keeps running, one line says how to get back.
    data_dir, creds = deployment
    watcher = subprocess.Popen(nexus_cmd("--creds", creds[ME], "workloads", "watch", running, "--data-dir",
                                         str(data_dir)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=python_env())
    first = watcher.stderr.readline()  # the first progress line: it is watching
    assert running in first, first
    watcher.send_signal(signal.SIGINT)
    rest_out, rest_err = watcher.communicate(timeout=60)
    assert watcher.returncode == 130, (rest_out, rest_err)
    assert f"keeps running; follow it again with `nexus workloads watch {running}`" in rest_err, rest_err
    status = json.loads(as_tenant(deployment, ME, "workloads", "--json").stdout)
    assert {w["workload"]: w["state"] for w in status}[running] in ("pending", "running")

    # 4. A tenant resets only itself; once its workload ended, its own reset goes through.
    theirs = as_tenant(deployment, ME, "tenant", "reset", OTHER, "--yes")
    assert theirs.returncode != 0 and "permission denied" in theirs.stderr and f"'{OTHER}'" in theirs.stderr
    no_yes = as_tenant(deployment, ME, "tenant", "reset")  # no terminal to ask on: --yes is required
    assert no_yes.returncode == 2 and "--yes" in no_yes.stderr
    cancelled = as_tenant(deployment, ME, "cancel", running)
    assert cancelled.returncode == 0, cancelled.stderr
    usage_before = {r["workload"] for r in json.loads(as_tenant(deployment, ME, "usage", "--json").stdout)}
    reset = as_tenant(deployment, ME, "tenant", "reset", "--yes", "--json")
    assert reset.returncode == 0, reset.stderr
    gone = json.loads(reset.stdout)
    assert gone["tenant"] == ME and gone["reset"] is True and gone["removed"]["slot"] == 1
    assert gone["removed"]["objects"] >= 1  # its exported versions and checkpoints
    after = json.loads(as_tenant(deployment, ME, "tenant", "show", "--json").stdout)
    assert after["config"] is None and after["version"] == 0
    assert [w["workload"] for w in after["workloads"]] == [trained, running]  # the records stay

    # 5. The spec with the other schema now registers it and trains.
    done = as_tenant(deployment, ME, "submit", chunked_path, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"submitted \S+ \(tenant selfie\): from version 0, 2 more steps", done.stdout), done.stdout
    now = json.loads(as_tenant(deployment, ME, "tenant", "show", "--json").stdout)
    assert now["config"]["schema"]["action_horizon"] == 3
    assert now["config"]["schema"]["instruction_template"] == "robot: {instruction}"
    assert now["version"] == 2 and len(now["workloads"]) == 3
    usage_after = {r["workload"] for r in json.loads(as_tenant(deployment, ME, "usage", "--json").stdout)}
    assert trained in usage_before and usage_before <= usage_after  # usage of before the reset stays
    # A tenant with no slot lists its workloads all the same (the other one: none; its login works).
    listed = as_tenant(deployment, OTHER, "workloads", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr


def test_schema_conflict_names_every_field_with_both_values():
    """Without a cluster: cameras and template differ; each is named with the stored and the
    asked value, the way out is said once (on the last), and an equal schema passes."""
    import msgspec

    from master.spec import SpecError
    from master.policy_checks import check_same_policy
    from models.schema import TenantSchema
    from protocol.messages import TenantConfig

    schema = {"cameras": [{"name": "top", "height": 64, "width": 64}], "state_dim": 4, "action_dim": 2,
              "action_horizon": 1, "instruction_template": "{instruction}"}
    stored = TenantConfig(name="acme", base=BASE, schema=schema, head="mlp",
                          signature=TenantSchema.from_dict(schema).signature())
    check_same_policy(msgspec.structs.replace(stored, signature=""), stored, same_tenant=True)  # same: passes
    asked = msgspec.structs.replace(stored, signature="", schema={
        **schema, "cameras": [*schema["cameras"], {"name": "wrist", "height": 32, "width": 32}],
        "instruction_template": "robot: {instruction}"})
    with pytest.raises(SpecError) as info:
        check_same_policy(asked, stored, same_tenant=True)
    errors = {e["field"]: e["message"] for e in info.value.errors}
    assert list(errors) == ["observation.cameras", "observation.instruction_template"], errors
    assert errors["observation.cameras"].startswith("stored [{'name': 'top', 'height': 64, 'width': 64}]")
    assert "'wrist', 'height': 32" in errors["observation.cameras"]
    assert "stored '{instruction}'" in errors["observation.instruction_template"]
    assert "asked 'robot: {instruction}'" in errors["observation.instruction_template"]
    assert "nexus tenant reset acme" in errors["observation.instruction_template"]
    assert "nexus tenant reset" not in errors["observation.cameras"]  # said once
