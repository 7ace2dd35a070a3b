"""`nexus up --devices` (protocol/placement.py, issue 31 item 2): the list parses into one CUDA id
per instance, bad lists are refused before anything starts naming what is wrong, and a role named
there runs one instance per device unless --roles says otherwise. That every instance's process
really gets its device is checked on a real deployment (tests/system/test_scaling.py)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from transport.cluster import SupervisorConfig
from protocol.errors import InvalidField
from protocol.placement import Placement, parse_devices, visible_devices
from sdk.cli import main as nexus_main

EIGHT = [str(i) for i in range(8)]


def test_the_papers_layout_parses_into_one_device_per_instance() -> None:
    p = parse_devices("trainer=0,1 inferencer=2,3 env=4-7", EIGHT)
    assert p.devices == {"trainer": ("0", "1"), "inferencer": ("2", "3"), "env": ("4", "5", "6", "7")}
    assert [p.device_for("env", s) for s in range(6)] == ["4", "5", "6", "7", "4", "5"]  # round-robin past the list
    assert p.device_for("master", 0) is None and p.count("master") is None and p.count("env") == 4
    assert Placement.from_text(p.text()) == p  # what a detached supervisor is handed
    # ';' separates entries too; indices are positions among the devices this machine shows.
    q = parse_devices("trainer=1;env=0", ["GPU-a", "GPU-b"])
    assert q.devices == {"trainer": ("GPU-b",), "env": ("GPU-a",)} and Placement.from_text(q.text()) == q


@pytest.mark.parametrize("text, why", [
    ("master=0", "'master' runs no model or simulator; roles placed on devices: trainer, inferencer, env"),
    ("trainer=0 trainer=1", "role 'trainer' named twice"),
    ("trainer=0,0", "device 0 is listed twice"),
    ("trainer=0,1 env=1-2", "device 1 is listed for trainer and env"),
    ("env=7-4", "the range 7-4 runs backwards; write 4-7"),
    ("env=x", "'x' is not a device index or a range like 4-7"),
    ("trainer", "'trainer' is not ROLE=DEVICES"),
    ("env=0-999", "lists more than 64 devices"),
    ("trainer=8", "device 8 is not present; devices this machine shows: 8: 0->0"),
])
def test_bad_lists_are_refused_naming_the_problem(text: str, why: str) -> None:
    with pytest.raises(InvalidField, match="--devices") as exc:
        parse_devices(text, EIGHT)
    assert why in str(exc.value), str(exc.value)


def test_visible_devices_follow_cuda_visible_devices_when_set() -> None:
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []  # set to nothing: no device at all
    with pytest.raises(InvalidField, match="device 0 is not present; devices this machine shows: none"):
        parse_devices("trainer=0", [])


def test_a_placed_role_runs_one_instance_per_device_unless_roles_says_otherwise() -> None:
    p = parse_devices("trainer=0,1 env=2", EIGHT)
    cfg = SupervisorConfig(placement=p)
    assert cfg.counts["trainer"] == 2 and cfg.counts["env"] == 1 and cfg.counts["inferencer"] == 1
    cfg = SupervisorConfig(placement=p, counts={"env": 3})  # three env workers share device 2
    assert cfg.counts["env"] == 3 and [p.device_for("env", s) for s in range(3)] == ["2"] * 3
    with pytest.raises(InvalidField, match="--roles: trainer=9 is past its max bound 8"):
        SupervisorConfig(placement=parse_devices("trainer=0", EIGHT), counts={"trainer": 9})
    with pytest.raises(ValueError, match="--devices: \\['env'\\] not started by this supervisor"):
        SupervisorConfig(roles=("master", "trainer"), placement=p.__class__({"env": ("2",)}))


def test_up_refuses_a_bad_device_list_before_starting(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = nexus_main(["up", "--detach", "--data-dir", str(tmp_path), "--devices", "trainer=0 env=2"])
    assert code == 2 and "--devices: env: device 2 is not present; devices this machine shows: 2: 0->0, 1->1" \
        in out.getvalue(), out.getvalue()
    assert not (tmp_path / "cluster.json").exists() and not (tmp_path / "logs").exists()


# -- Compose: one service per listed device (deploy/compose/devices.py) ---------------------------
COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"


def _devices_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compose_devices", COMPOSE / "devices.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compose_override_gives_each_listed_device_a_service_of_its_own() -> None:
    tool = _devices_tool()
    files = [COMPOSE / "docker-compose.yml", COMPOSE / "docker-compose.host.yml"]
    doc = tool.override(parse_devices("trainer=0,1 env=2-4", EIGHT), tool.role_services(files))
    svc = doc["services"]
    assert set(svc) == {"trainer", "trainer-1", "env", "env-1", "env-2"}

    def gpu(s: dict) -> list[str]:
        return [d for r in s["deploy"]["resources"]["reservations"]["devices"] for d in r["device_ids"]]

    assert [gpu(svc[n]) for n in ("trainer", "trainer-1", "env", "env-1", "env-2")] == [["0"], ["1"], ["2"], ["3"], ["4"]]
    assert svc["trainer"]["environment"] == {"NEXUS_TRAINER_DEVICE": "cuda"} and "environment" not in svc["env"]
    # A copy is the role's service as the given files define it (the host file's networking too).
    base = tool.role_services(files)["trainer"]
    copy = svc["trainer-1"]
    assert copy["command"] == ["trainer"] and copy["volumes"] == base["volumes"]
    assert copy.get("network_mode") == base.get("network_mode") == "host"
    assert copy["environment"]["NEXUS_TRAINER_DEVICE"] == "cuda" and copy["environment"]["NEXUS_PREFIX"] == "nexus"


def test_compose_override_refuses_bad_input_with_one_line(tmp_path) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(COMPOSE / "devices.py"), *args], capture_output=True, text=True,
                              timeout=60)

    r = run("trainer=0 env=0", "--gpus", "2")
    assert r.returncode == 2 and r.stdout == "" and "device 0 is listed for trainer and env" in r.stderr, r.stderr
    r = run("trainer=0", "--gpus", "1", "--compose-file", str(tmp_path / "nope.yml"))
    assert r.returncode == 2 and "nope.yml not found" in r.stderr, r.stderr
    (tmp_path / "c.yml").write_text("services:\n  master: {image: x}\n")
    r = run("trainer=0", "--gpus", "1", "--compose-file", str(tmp_path / "c.yml"))
    assert r.returncode == 2 and "no 'trainer' service" in r.stderr, r.stderr


def _compose_cli() -> list[str]:
    import shutil
    import subprocess

    try:
        if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0:
            return ["docker", "compose"]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return ["docker-compose"] if shutil.which("docker-compose") else []


@pytest.mark.skipif(not _compose_cli(), reason="neither `docker compose` nor `docker-compose` is installed "
                    "(.ci/run installs it)")
def test_compose_accepts_the_override_beside_the_deployments_files(tmp_path) -> None:
    """Compose itself reads the three files together (config only: no engine, nothing started)."""
    import subprocess
    import sys

    out = tmp_path / "docker-compose.devices.yml"
    r = subprocess.run([sys.executable, str(COMPOSE / "devices.py"), "trainer=0,1 inferencer=2 env=3", "--gpus", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out.write_text(r.stdout)
    cfg = subprocess.run([*_compose_cli(), "-f", str(COMPOSE / "docker-compose.yml"), "-f", str(out), "config"],
                         capture_output=True, text=True, timeout=120, cwd=COMPOSE)
    assert cfg.returncode == 0, cfg.stderr
    import yaml

    services = yaml.safe_load(cfg.stdout)["services"]
    assert services["trainer-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
    assert services["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
    assert services["trainer-1"]["command"] == ["trainer"]


def test_a_trainer_of_n_ranks_gets_n_devices_per_instance(monkeypatch) -> None:
    """NEXUS_TRAINER_RANKS=2 with trainer=0-3: two trainers, each seeing its two devices (rank r
    on cuda:r); a list that does not split into groups of 2 is refused naming both settings."""
    monkeypatch.setenv("NEXUS_TRAINER_RANKS", "2")
    cfg = SupervisorConfig(placement=parse_devices("trainer=0-3 inferencer=4 env=5-7", EIGHT))
    assert cfg.counts["trainer"] == 2 and cfg.counts["env"] == 3
    assert [cfg.placement.device_for("trainer", s) for s in range(3)] == ["0,1", "2,3", "0,1"]
    assert cfg.placement.device_for("env", 1) == "6"  # other roles: one device each, as before
    with pytest.raises(InvalidField, match="--devices") as exc:
        SupervisorConfig(placement=parse_devices("trainer=0-2", EIGHT))
    assert "3 device(s) do not split into instances of NEXUS_TRAINER_RANKS=2 devices each" in str(exc.value)
    monkeypatch.setenv("NEXUS_TRAINER_RANKS", "1")
    assert SupervisorConfig(placement=parse_devices("trainer=0-2", EIGHT)).counts["trainer"] == 3
