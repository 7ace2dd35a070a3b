"""The process `nexus up` becomes:

    python -m actors.supervisor --data-dir .nexus --nats-port 4222     # what --detach runs
    python -m actors.supervisor --data-dir .nexus --nats-cluster 3     # 3 nats-servers, R3

See `supervisor.py` for what it does, in order."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from actors.supervisor.supervisor import Supervisor
from protocol.messages import DEFAULT_TQ_MAX_BYTES
from protocol.placement import Placement
from protocol.subjects import DEFAULT_PREFIX
from transport.cluster import SupervisorConfig, scale_bounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actors.supervisor")
    p.add_argument("--data-dir", type=Path, default=Path(".nexus"))
    p.add_argument("--nats-port", type=int, default=4222)
    p.add_argument("--nats-url")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3, 5))
    p.add_argument("--tq-max-bytes", type=int, default=DEFAULT_TQ_MAX_BYTES)
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--roles", default="", help="instances per role, e.g. env=4,inferencer=2,trainer=1")
    p.add_argument("--devices", default="", help="CUDA ids per worker role, as `nexus up --devices` resolved them "
                   "(e.g. 'trainer=0,1 env=2')")
    p.add_argument("--ready-timeout-s", type=float, default=SupervisorConfig.ready_timeout_s)
    args = p.parse_args(argv)
    from protocol.scaling import parse_counts

    cfg = SupervisorConfig(data_dir=args.data_dir, nats_port=args.nats_port,
                           nats_url=args.nats_url, prefix=args.prefix,
                           nats_cluster=args.nats_cluster, tq_max_bytes=args.tq_max_bytes,
                           counts=parse_counts(args.roles), bounds=scale_bounds(),
                           placement=Placement.from_text(args.devices), ready_timeout_s=args.ready_timeout_s)
    return asyncio.run(Supervisor(cfg).run())


if __name__ == "__main__":
    sys.exit(main())
