"""Start one role as this process.

    python -m actors.run ROLE [--nats-url URL] [--prefix P] [--data-dir DIR] [--instance ID]

ROLE is one of health, monitor, master, trainer, inferencer, env. Flags fall back to the
NEXUS_NATS_URL / NEXUS_PREFIX / NEXUS_DATA_DIR environment variables. Every NEXUS_* variable
the role reads (protocol.settings) is checked before the role is built: a bad one is a line
``error: NEXUS_X='...': must be ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys
from pathlib import Path

from actors.runtime import RoleConfig, run_role
from protocol.errors import NexusError
from protocol.settings import SettingsError, role_settings, unknown_variables
from protocol.subjects import ROLES

# Imported lazily: a trainer should not pay for the env worker's simulators and back.
ROLE_CLASSES: dict[str, str] = {
    "health": "actors.health.health:HealthManager",
    "monitor": "actors.monitor.monitor:Monitor",
    "master": "master.service:Master",
    "trainer": "actors.trainer.trainer:Trainer",
    "inferencer": "actors.inferencer.inferencer:Inferencer",
    "env": "actors.env_worker.env_worker:EnvWorker",
}
assert set(ROLE_CLASSES) == set(ROLES)


def load_role(role: str) -> type:
    module, _, cls = ROLE_CLASSES[role].partition(":")
    return getattr(importlib.import_module(module), cls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=sorted(ROLE_CLASSES))
    p.add_argument("--nats-url")
    p.add_argument("--prefix")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--instance")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    # A crash in native code (a SIGSEGV in torch has taken a trainer down twice, silently) leaves
    # every thread's Python stack in the role's log instead of nothing.
    faulthandler.enable(all_threads=True)
    for line in unknown_variables():
        print(f"warning: {line}", file=sys.stderr)
    try:
        role_settings(args.role)  # every group the role reads, all problems at once
    except SettingsError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    try:
        cfg = RoleConfig.from_env(
            nats_url=args.nats_url, prefix=args.prefix, data_dir=args.data_dir,
            instance=args.instance, log_level=args.log_level,
        )
    except (NexusError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_role(load_role(args.role), cfg)


if __name__ == "__main__":
    sys.exit(main())
