"""A real role process with one slow op, for drain and shutdown tests.

    python -m tests.support.slow_role --nats-url URL --prefix P --instance I [--max-concurrency N --max-pending M]
                              [--teardown-grace S]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading

from actors.runtime import Role, RoleConfig, op, run_role
from protocol import ops
from protocol.messages import Ok
from protocol.ops import Op
from protocol.wire import Struct, message


@message("test.sleep", 1)
class SleepRequest(Struct):
    seconds: float


# A test role's ops are no part of the platform: declared here, not in protocol/ops.py.
SLOW_SLEEP = Op("slow", "sleep", SleepRequest, Ok)
SLOW_STUCK_THREAD = Op("slow", "stuck_thread", SleepRequest, Ok)
SLOW_BROKER_TIMEOUT = Op("slow", "broker_timeout", SleepRequest, Ok)
SLOW_CRASH = Op("slow", "crash", SleepRequest, Ok)


class SlowRole(Role):
    name = "slow"

    @classmethod
    def op_table(cls) -> tuple[Op, ...]:
        return (SLOW_SLEEP, SLOW_STUCK_THREAD, SLOW_BROKER_TIMEOUT, SLOW_CRASH, *ops.ops_of(cls.name))

    @op(SLOW_SLEEP)
    async def sleep(self, req: SleepRequest) -> Ok:
        await asyncio.sleep(req.seconds)
        return Ok(detail=f"slept {req.seconds}")

    @op(SLOW_STUCK_THREAD)
    async def stuck_thread(self, req: SleepRequest) -> Ok:
        # A worker thread that never returns (a device call that hangs): asyncio.run would
        # wait for it at exit forever; the runtime's exit watchdog must end the process.
        self.spawn(asyncio.to_thread(threading.Event().wait), "stuck")
        return Ok(detail="a thread is stuck")

    @op(SLOW_BROKER_TIMEOUT)
    async def broker_timeout(self, req: SleepRequest) -> Ok:
        # A real JetStream call that times out, as one to a stream without a leader does:
        # the API request gets no answer within the context's (here tiny) timeout.
        await self.bus.nc.jetstream(timeout=1e-6).account_info()
        return Ok(detail="the call was answered")

    @op(SLOW_CRASH)
    async def crash(self, req: SleepRequest) -> Ok:
        raise RuntimeError("handler bug")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nats-url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-pending", type=int, default=0)
    p.add_argument("--teardown-grace", type=float, default=0.0)
    a = p.parse_args()
    if a.teardown_grace:
        import actors.runtime

        actors.runtime.EXIT_TEARDOWN_GRACE_S = a.teardown_grace  # a short bound for the test
    sys.exit(run_role(SlowRole, RoleConfig(nats_url=a.nats_url, prefix=a.prefix, instance=a.instance,
                                           data_dir=a.data_dir, heartbeat_interval_s=0.2,
                                           max_concurrency=a.max_concurrency, max_pending=a.max_pending)))
