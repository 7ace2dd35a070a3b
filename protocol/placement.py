"""Which accelerator each worker instance runs on: `nexus up --devices` (issue 31 item 2).

    p = parse_devices("trainer=0,1 inferencer=2,3 env=4-7", visible_devices())
    p.count("inferencer")            # 2: one instance per listed device unless --roles says more
    p.device_for("env", 5)           # "5" (slot 5 of env: round-robin over 4..7, as a CUDA id)

The reference layout (the paper's 2-2-4 on one 8-GPU node) is trainers, inferencers and
simulators each on their own devices. The supervisor gives each instance one device by setting
`CUDA_VISIBLE_DEVICES` for its process: the role then sees it as ``cuda:0`` and needs no
device setting of its own. Indices name the devices the supervisor itself sees: the entries of
its own `CUDA_VISIBLE_DEVICES` when set (CUDA's own rule), otherwise the NVIDIA driver's GPUs
in order. Instance ``slot`` of a role gets its list's ``slot mod len`` entry, so a restart keeps
its device and instances added by `nexus scale` (or the scaler) share the list round-robin.
Until the trainer's data-parallel ranks are wired (docs/data_parallel.md), ``trainer=0,1``
means two trainer instances, one per device, which lease jobs independently.

Bad input (each an `InvalidField` naming ``--devices``): a role that runs no model (master,
health, monitor), a role named twice, an index that is not a whole number, a range that runs
backwards, a device listed twice (in one role or across roles), a device that is not there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import InvalidField

SETTING = "--devices"
PLACED: tuple[str, ...] = ("trainer", "inferencer", "env")  # the roles that run a model or a simulator
MAX_DEVICES = 64  # indices per deployment: a typo like env=0-9999 must not build a huge list
_RANGE = re.compile(r"^(\d+)-(\d+)$")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees (Linux)


@dataclass(frozen=True)
class Placement:
    """Per placed role, the CUDA ids (``CUDA_VISIBLE_DEVICES`` values) of its instances in slot order."""

    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def count(self, role: str) -> int | None:
        """Instances of ``role`` the list asks for (one per device); None when it names none."""
        ids = self.devices.get(role)
        return len(ids) if ids else None

    def device_for(self, role: str, slot: int) -> str | None:
        ids = self.devices.get(role)
        return ids[slot % len(ids)] if ids else None

    def per_instance(self, role: str, n: int, setting: str = "NEXUS_TRAINER_RANKS") -> "Placement":
        """``role``'s devices in groups of ``n``, one group per instance: a trainer of ``n`` ranks
        sees its ``n`` devices as cuda:0..n-1 (rank r on cuda:r). Refused, naming both settings,
        when the list does not split into such groups."""
        ids = self.devices.get(role)
        if not ids or n == 1:
            return self
        if len(ids) % n:
            raise InvalidField(SETTING, f"{role}={','.join(ids)}: {len(ids)} device(s) do not split into instances of "
                               f"{setting}={n} devices each; list a multiple of {n}")
        groups = tuple(",".join(ids[i:i + n]) for i in range(0, len(ids), n))
        return Placement({**self.devices, role: groups})

    def text(self) -> str:
        """The placement in CUDA ids, as `from_text` reads it back: a detached supervisor's
        argument (checked where it was parsed; its environment may differ from the caller's)."""
        return " ".join(f"{role}={','.join(ids)}" for role, ids in self.devices.items())

    @classmethod
    def from_text(cls, text: str) -> "Placement":
        devices: dict[str, tuple[str, ...]] = {}
        for entry in (e for e in text.split() if e):
            role, _, ids = entry.partition("=")
            if role not in PLACED or not ids:
                raise InvalidField(SETTING, f"{entry!r} is not ROLE=ID,... for a role in {', '.join(PLACED)}")
            devices[role] = tuple(ids.split(","))
        return cls(devices)


def visible_devices(environ: dict[str, str] | None = None) -> list[str]:
    """The CUDA ids this process may hand out, in index order: its own CUDA_VISIBLE_DEVICES
    entries when set (empty when set to nothing), else one per GPU the NVIDIA driver lists."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        return [str(i) for i in range(sum(1 for _ in NVIDIA_GPUS.iterdir()))]
    except OSError:
        return []


def _indices(role: str, value: str) -> list[int]:
    out: list[int] = []
    for part in (p.strip() for p in value.split(",")):
        m = _RANGE.match(part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise InvalidField(SETTING, f"{role}={value}: the range {part} runs backwards; write {hi}-{lo}")
            if hi - lo + 1 > MAX_DEVICES:
                raise InvalidField(SETTING, f"{role}={value}: {part} lists more than {MAX_DEVICES} devices")
            out.extend(range(lo, hi + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise InvalidField(SETTING, f"{role}={value}: {part!r} is not a device index or a range like 4-7")
    return out


def parse_devices(text: str, visible: list[str]) -> Placement:
    """``ROLE=LIST ...`` (entries apart by spaces or ';'; LIST: indices and ranges apart by ',')
    into CUDA ids; ``visible``: `visible_devices()`, every index checked against it."""
    devices: dict[str, tuple[str, ...]] = {}
    owner: dict[int, str] = {}
    for entry in (e for e in re.split(r"[\s;]+", text.strip()) if e):
        role, eq, value = entry.partition("=")
        if not eq or not value:
            raise InvalidField(SETTING, f"{entry!r} is not ROLE=DEVICES; e.g. trainer=0,1 inferencer=2,3 env=4-7")
        if role not in PLACED:
            raise InvalidField(SETTING, f"{role!r} runs no model or simulator; roles placed on devices: "
                                        f"{', '.join(PLACED)}")
        if role in devices:
            raise InvalidField(SETTING, f"role {role!r} named twice")
        idx = _indices(role, value)
        for i in idx:
            if i in owner:
                where = "twice" if owner[i] == role else f"for {owner[i]} and {role}"
                raise InvalidField(SETTING, f"device {i} is listed {where}: each device serves one role instance "
                                            "list (name it once)")
            owner[i] = role
        if len(owner) > MAX_DEVICES:
            raise InvalidField(SETTING, f"more than {MAX_DEVICES} devices listed")
        missing = [i for i in idx if i >= len(visible)]
        if missing:
            seen = (f"{len(visible)}: {', '.join(f'{n}->{d}' for n, d in enumerate(visible))}" if visible
                    else "none (no CUDA_VISIBLE_DEVICES, no NVIDIA driver GPUs)")
            raise InvalidField(SETTING, f"{role}: device {missing[0]} is not present; devices this machine shows: "
                                        f"{seen}")
        devices[role] = tuple(visible[i] for i in idx)
    return Placement(devices)
