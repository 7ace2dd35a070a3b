"""A Compose override that places worker instances on named host GPUs, as `nexus up --devices` does.

    python deploy/compose/devices.py 'trainer=0,1 inferencer=2,3 env=4-7' > docker-compose.devices.yml
    docker compose -f docker-compose.yml -f docker-compose.override.yml -f docker-compose.devices.yml up -d

Compose reserves devices per service, not per replica (`--scale trainer=2` gives both replicas
the same GPU), so each listed device gets a service of its own: the role's service takes the
first (``trainer``: GPU 0) and a copy of it each further one (``trainer-1``: GPU 1, ...), each
with an NVIDIA device reservation of that one GPU (NVIDIA Container Toolkit) and, for trainers
and inferencers, their torch device set to ``cuda`` (``cuda:0`` inside the container, whichever
host GPU that is). The copies are the role's service as the given compose files define it
(anchors and merge keys resolved; later files override earlier ones, key by key), so pass the
same files (``--compose-file``, repeatable) that the deployment runs with, e.g. the host
networking file too. Don't ``--scale`` a placed role: add devices instead. The list is read as
`nexus up --devices` reads it (protocol/placement.py): indices of ``--gpus`` host GPUs
(default: this machine's, from its NVIDIA driver or CUDA_VISIBLE_DEVICES), each listed once.
The role image needs a CUDA build of torch (docker-compose.gpu.yml says how). Output: YAML on
stdout; bad input: one line on stderr naming what is wrong, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import yaml  # noqa: E402

from protocol.errors import NexusError  # noqa: E402
from protocol.placement import Placement, parse_devices, visible_devices  # noqa: E402

HERE = Path(__file__).resolve().parent
DEVICE_VAR = {"trainer": "NEXUS_TRAINER_DEVICE", "inferencer": "NEXUS_INFER_DEVICE"}


def role_services(files: list[Path]) -> dict[str, dict[str, Any]]:
    """The services of ``files`` merged as Compose merges them (a later file's keys win; a
    mapping such as ``environment`` or ``deploy`` merged one level deeper)."""
    services: dict[str, dict[str, Any]] = {}
    for f in files:
        doc = yaml.safe_load(f.read_text()) or {}
        for name, svc in (doc.get("services") or {}).items():
            into = services.setdefault(name, {})
            for key, value in (svc or {}).items():
                if isinstance(value, dict) and isinstance(into.get(key), dict):
                    into[key] = {**into[key], **value}
                else:
                    into[key] = value
    return services


def _reserve(device: str) -> dict[str, Any]:
    return {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": [device], "capabilities": ["gpu"]}]}}}


def override(placement: Placement, services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The override document: per placed role its service on the first device, a copy per further one."""
    out: dict[str, Any] = {}
    for role, ids in placement.devices.items():
        if role not in services:
            raise NexusError(f"--compose-file: no {role!r} service in the given files to place")
        env = {DEVICE_VAR[role]: "cuda"} if role in DEVICE_VAR else {}
        for k, device in enumerate(ids):
            if k == 0:
                svc: dict[str, Any] = {"deploy": _reserve(device)}
                if env:
                    svc["environment"] = dict(env)
            else:
                svc = copy.deepcopy(services[role])
                svc.pop("container_name", None)  # one name per container
                svc["deploy"] = {**(svc.get("deploy") or {}), **_reserve(device)}
                base_env = svc.get("environment") or {}
                if isinstance(base_env, list):  # KEY=VALUE entries
                    base_env = dict(e.split("=", 1) if "=" in e else (e, None) for e in base_env)
                svc["environment"] = {**base_env, **env}
            out[f"{role}-{k}" if k else role] = svc
    return {"services": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("devices", help="e.g. 'trainer=0,1 inferencer=2,3 env=4-7' (as nexus up --devices)")
    p.add_argument("--compose-file", action="append", type=Path, default=None,
                   help=f"the deployment's compose files, in order (default: {HERE / 'docker-compose.yml'})")
    p.add_argument("--gpus", type=int, default=None,
                   help="host GPUs to check the indices against (default: this machine's)")
    args = p.parse_args(argv)
    files = args.compose_file or [HERE / "docker-compose.yml"]
    visible = [str(i) for i in range(args.gpus)] if args.gpus is not None else visible_devices()
    try:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise NexusError(f"--compose-file: {', '.join(missing)} not found")
        doc = override(parse_devices(args.devices, visible), role_services(files))
    except NexusError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    sys.stdout.write("# Generated by deploy/compose/devices.py " + repr(args.devices) + ": GPU placement.\n")
    yaml.safe_dump(doc, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
