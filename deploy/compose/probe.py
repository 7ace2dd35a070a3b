#!/usr/bin/env python3
"""Health check of a role container: its own instance answers `info` and says ``ready``.

The entrypoint (nexus-role) writes ``ROLE INSTANCE`` to /tmp/nexus-role; this asks that
instance (``<prefix>.svc.<role>.<instance>.info``, one request, a few seconds at most) over
the role's own NEXUS_NATS_URL / NEXUS_PREFIX / NEXUS_CREDS. Exit 0: healthy; 1: not, with one
line saying why (``docker inspect`` shows it).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

# Imported before the clock starts: about a CPU second, far more wall time on a busy machine.
from transport.creds import creds_from_env
from protocol.settings import RoleSettings
from sdk.client import AsyncClient

ROLE_FILE = Path("/tmp/nexus-role")
# Connect, then the request: each within this, both within twice it; the HEALTHCHECK timeout
# (60 s) covers the imports too.
PROBE_TIMEOUT_S = 8.0


async def probe() -> str:
    role, instance = ROLE_FILE.read_text().split()
    settings = RoleSettings.from_env()
    async with AsyncClient(settings.nats_url, settings.prefix, timeout_s=PROBE_TIMEOUT_S,
                           creds=creds_from_env()) as client:
        info = await client.info(role, instance)
    if info.state != "ready":
        raise RuntimeError(f"{role} {instance} is {info.state}")
    return f"{role} {instance} ready"


def main() -> int:
    try:
        print(asyncio.run(asyncio.wait_for(probe(), 2 * PROBE_TIMEOUT_S)))
        return 0
    except FileNotFoundError:
        print(f"unhealthy: {ROLE_FILE} missing (the role has not started)")
    except Exception as exc:  # any failure is "unhealthy", said in one line
        print(f"unhealthy: {type(exc).__name__}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
