"""What a deployment started by `nexus up` looks like from outside: its cluster.json, and
the supervisor's typed config (which `nexus up` checks before starting it).

    state = ClusterState.read(Path(".nexus"))     # None when no deployment ran from there
    if state is not None and pid_alive(state.supervisor_pid): ...
    cfg = SupervisorConfig(data_dir=Path(".nexus"), counts={"env": 4})   # ValueError naming the field
    cmd = supervisor_command(cfg); os.execv(cmd[0], cmd)   # `nexus up` in the foreground

Here, on the transport floor, because the supervisor (actors/supervisor/supervisor.py, which writes
cluster.json and runs the config) and the SDK (whose commands read cluster.json to find the
deployment, and whose `nexus up` builds the config) both need it, and the SDK never imports a
role's module: it starts the supervisor as ``python -m actors.supervisor`` (`supervisor_command`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from protocol.messages import DEFAULT_TQ_MAX_BYTES, DeploymentSettings
from protocol.policy import GLOBAL_RESTART, ROLE_RESTART, RestartBudget
from protocol.placement import Placement
from protocol.scaling import DEFAULT_BOUNDS, Bounds, check_count
from protocol.subjects import DEFAULT_PREFIX, ROLES, Names

STATE_FILE = "cluster.json"
# The module `nexus up` runs (a string, not an import: the SDK never imports a role's module).
SUPERVISOR_MODULE = "actors.supervisor"


def scale_bounds() -> dict[str, Bounds]:
    """The workers' bounds from NEXUS_SCALE_BOUNDS (`nexus up` and its supervisor read them here)."""
    from protocol.settings import ScaleSettings

    return ScaleSettings.from_env().parsed()


@dataclass
class ChildRecord:
    role: str
    instance: str
    pid: int
    log: str


@dataclass
class ClusterState:
    """What client commands read from ``<data-dir>/cluster.json``."""

    nats_url: str  # comma-separated on a NATS cluster (every node's URL)
    prefix: str
    data_dir: str
    supervisor_pid: int
    broker_pid: int | None  # the (first) embedded nats-server; kept for older readers
    logs_dir: str
    traces_dir: str
    started_at: float
    ready: bool = False
    roles: list[ChildRecord] = field(default_factory=list)
    broker_pids: list[int] = field(default_factory=list)  # every embedded nats-server
    # The admin's credentials file (transport/auth.py) when the embedded broker runs with
    # accounts; nats_url then names that file too (``?creds=``), so a client on this machine
    # that reads cluster.json (mode 0600, beside admin.creds) is the admin by default.
    creds: str = ""
    # Instances wanted per role (`--roles`, `nexus scale`) and the workers' bounds (MIN:MAX).
    counts: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, str] = field(default_factory=dict)
    # Live inferencers per pool (each serves one base; `nexus scale inferencer N --pool`).
    pools: dict[str, int] = field(default_factory=dict)

    def write(self, data_dir: Path) -> None:
        tmp = data_dir / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2))
        tmp.replace(data_dir / STATE_FILE)  # atomic: readers never see half a file

    @classmethod
    def read(cls, data_dir: Path) -> ClusterState | None:
        path = Path(data_dir) / STATE_FILE
        try:
            raw = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        roles = [ChildRecord(**r) for r in raw.pop("roles", [])]
        return cls(**raw, roles=roles)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class SupervisorConfig:
    data_dir: Path = Path(".nexus")
    nats_port: int = 4222
    nats_url: str | None = None  # use an existing server instead of starting one
    # nats-server processes to start: 1 (one server, R1) or 3 / 5 (a JetStream cluster on
    # this machine, streams and buckets replicated on 3 / 5 nodes). Node 1 listens on
    # nats_port, the others on free ports (all listed in cluster.json).
    nats_cluster: int = 1
    tq_max_bytes: int = DEFAULT_TQ_MAX_BYTES  # byte limit of each tenant's training-queue stream
    prefix: str = DEFAULT_PREFIX
    roles: tuple[str, ...] = ROLES
    ready_timeout_s: float = 60.0
    drain_timeout_s: float = 60.0
    restart: RestartBudget = ROLE_RESTART
    global_restart: RestartBudget = GLOBAL_RESTART
    # Instances per role (`nexus up --roles env=4,...`; a role not named: 1) and the workers'
    # bounds (NEXUS_SCALE_BOUNDS, protocol/scaling.py) every count must stay within.
    counts: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, Bounds] = field(default_factory=lambda: dict(DEFAULT_BOUNDS))
    # Devices per worker role (`nexus up --devices`, protocol/placement.py): each instance gets
    # one through CUDA_VISIBLE_DEVICES; a role listed there and not in counts runs one per device.
    placement: Placement = field(default_factory=Placement)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        Names(self.prefix)
        unknown = [r for r in self.roles if r not in ROLES]
        if unknown:
            raise ValueError(f"roles: unknown {unknown}; allowed: {list(ROLES)}")
        named = [r for r in self.counts if r not in self.roles]
        if named:
            raise ValueError(f"--roles: {named} not started by this supervisor; roles: {list(self.roles)}")
        placed = [r for r in self.placement.devices if r not in self.roles]
        if placed:
            raise ValueError(f"--devices: {placed} not started by this supervisor; roles: {list(self.roles)}")
        # A trainer of N data-parallel ranks (NEXUS_TRAINER_RANKS, which its processes inherit
        # from here) gets N of the trainer's listed devices.
        from protocol.settings import TrainerSettings

        self.placement = self.placement.per_instance("trainer", TrainerSettings.from_env().ranks)
        self.counts = {r: self.counts.get(r, self.placement.count(r) or 1) for r in self.roles}
        for role, n in self.counts.items():
            if role in self.bounds:
                check_count(role, n, self.bounds, field="--roles")  # InvalidField (a ValueError)
            elif n != 1:
                raise ValueError(f"--roles: {role}={n}: {role} runs exactly once")
        if not 0 < self.nats_port < 65536:
            raise ValueError(f"nats_port: {self.nats_port} is not a TCP port (1-65535)")
        if self.nats_cluster not in (1, 3, 5):
            raise ValueError(f"nats_cluster: {self.nats_cluster} nodes; use 1, 3 or 5")
        if self.nats_cluster > 1 and self.nats_url:
            raise ValueError("nats_cluster: cannot start a cluster and use nats_url at once; pick one")
        DeploymentSettings(replicas=self.nats_cluster, tq_max_bytes=self.tq_max_bytes)  # checks tq_max_bytes


def supervisor_command(cfg: SupervisorConfig, python: str | None = None) -> list[str]:
    """``python -m actors.supervisor`` with the flags that rebuild ``cfg`` there (its roles are
    every role, its bounds NEXUS_SCALE_BOUNDS, its restart budgets the defaults: as `nexus up`
    makes them)."""
    import sys

    python = python or sys.executable
    cmd = [python, "-m", SUPERVISOR_MODULE, "--data-dir", str(cfg.data_dir),
           "--nats-port", str(cfg.nats_port), "--prefix", cfg.prefix,
           "--nats-cluster", str(cfg.nats_cluster), "--tq-max-bytes", str(cfg.tq_max_bytes),
           "--roles", ",".join(f"{r}={n}" for r, n in cfg.counts.items()),
           "--devices", cfg.placement.text(), "--ready-timeout-s", repr(cfg.ready_timeout_s)]
    if cfg.nats_url:
        cmd += ["--nats-url", cfg.nats_url]
    return cmd
