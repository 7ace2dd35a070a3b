"""A supervised role process (`Child`) and what starting one needs: its slot key, the user it
runs as (NEXUS_ROLE_USER) and the directories it writes. Used by `supervisor.py`."""

from __future__ import annotations

import ctypes
import os
import pwd
import signal
import subprocess
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import FailedPrecondition
from protocol.subjects import ROLES

# The role whose instances serve a pool each (`ScaleRequest.pool`).
POOLED = "inferencer"


def slot_key(role: str, slot: int) -> str:
    """A child's key in `Supervisor.children`: the role itself for its first instance (so
    one-instance deployments read as before), ``role.N`` for the others."""
    return role if slot == 0 else f"{role}.{slot}"


def slot_of(key: str) -> int:
    return int(key.rpartition(".")[2]) if "." in key else 0


# Directories under the data dir a role process writes, and which roles write them (made
# theirs when roles run as their own user). Logs are opened by the supervisor.
ROLE_WRITES: dict[str, tuple[str, ...]] = {
    "traces": ROLES,            # span files, one per instance (actors/tracing.py)
    "reports": ("master",),     # workload reports (master/workloads.py)
    "datasets": ("env",),       # recorded demonstrations (workflows/sft.py)
    "tensorboard": ("monitor",),  # per-tenant event files (actors/monitor/boards.py)
}
# The role user `nexus up` uses, when it runs as root and NEXUS_ROLE_USER is unset, if it exists.
DEFAULT_ROLE_USER = "nexus"


def resolve_role_users(roles: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """role -> (uid, gid) to start it as, from NEXUS_ROLE_USER (`{role}`: a user per role);
    empty when this process is not root (it cannot switch users: roles then share its uid),
    when the setting is ``-``, or when it is unset and no ``nexus`` user exists."""
    from protocol.settings import AuthSettings

    setting = AuthSettings.from_env().role_user
    if setting == "-" or os.geteuid() != 0:
        return {}
    out = {}
    for role in roles:
        name = role_user_name(role, setting)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            if setting is None:
                return {}  # no dedicated user: roles run as root, as before (docs/security.md)
            raise FailedPrecondition(f"NEXUS_ROLE_USER={setting!r}: no user {name!r} on this machine "
                                     f"(for role {role}); create it, or set NEXUS_ROLE_USER=-",
                                     details={"user": name, "role": role}) from None
        if entry.pw_uid == 0:
            raise FailedPrecondition(f"NEXUS_ROLE_USER={setting!r}: {name!r} is root; pick an unprivileged user")
        out[role] = (entry.pw_uid, entry.pw_gid)
    return out


def role_user_name(role: str, setting: str | None = None) -> str:
    """The user name ``role`` runs as under NEXUS_ROLE_USER ``setting`` (default: read it)."""
    if setting is None:
        from protocol.settings import AuthSettings

        setting = AuthSettings.from_env().role_user
    return (setting or DEFAULT_ROLE_USER).replace("{role}", role)


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)


def die_with_parent() -> None:
    # Linux: the child gets SIGTERM (and so drains) if the supervisor itself dies.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: orphans are cleaned up by `nexus down` from cluster.json


@dataclass
class Child:
    role: str
    instance: str
    proc: subprocess.Popen
    log_path: Path
    restarts: deque = field(default_factory=deque)
    key: str = ""  # its place in Supervisor.children (`slot_key`): the role, or role.N
    base: str = ""  # an inferencer's NEXUS_INFER_BASE when not the deployment's default
    pool: str = ""  # an inferencer's pool (`pool_name` of its base)

    def __post_init__(self) -> None:
        self.key = self.key or self.role
