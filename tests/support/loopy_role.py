"""A real role process with one critical background loop that a test can break, for liveness tests.

    python -m tests.support.loopy_role --nats-url URL --prefix P --instance I --data-dir D

Ops: ``fail`` (the loop raises on its next ``times`` iterations), ``stall`` (the loop blocks
without ticking), ``loop_info`` (how often the loop started and iterated).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from actors.runtime import Role, RoleConfig, op, run_role
from protocol import ops
from protocol.messages import Ok
from protocol.ops import Op
from protocol.policy import RetryPolicy
from protocol.wire import Struct, message

LOOP = "work"
LOOP_MAX_QUIET_S = 1.0


@message("test.loop.fail", 1)
class FailRequest(Struct):
    times: int


@message("test.loop.stall", 1)
class StallRequest(Struct):
    pass


@message("test.loop.info_request", 1)
class LoopInfoRequest(Struct):
    pass


@message("test.loop.info", 1)
class LoopInfo(Struct):
    starts: int
    iterations: int


# A test role's ops are no part of the platform: declared here, not in protocol/ops.py.
LOOPY_FAIL = Op("loopy", "fail", FailRequest, Ok)
LOOPY_STALL = Op("loopy", "stall", StallRequest, Ok)
LOOPY_LOOP_INFO = Op("loopy", "loop_info", LoopInfoRequest, LoopInfo)


class LoopyRole(Role):
    name = "loopy"

    @classmethod
    def op_table(cls) -> tuple[Op, ...]:
        return (LOOPY_FAIL, LOOPY_STALL, LOOPY_LOOP_INFO, *ops.ops_of(cls.name))
    # Fast back-off so a test sees the restarts and the exit in about a second.
    loop_restart = RetryPolicy("test_loop_restart", attempts=3, backoff_s=0.05, max_backoff_s=0.2)

    def __init__(self, cfg: RoleConfig) -> None:
        super().__init__(cfg)
        self.fail_next = 0
        self.stalled = asyncio.Event()
        self.starts = 0
        self.iterations = 0

    async def setup(self) -> None:
        self.spawn(self._loop, LOOP, critical=True, max_quiet_s=LOOP_MAX_QUIET_S)

    async def _loop(self) -> None:
        self.starts += 1
        while True:
            self.iterations += 1
            if self.fail_next > 0:
                self.fail_next -= 1
                raise RuntimeError("loop bug")
            if self.stalled.is_set():
                await asyncio.Event().wait()  # stuck on something that never comes, no tick
            await self.idle(LOOP, 0.05)

    @op(LOOPY_FAIL)
    async def fail_op(self, req: FailRequest) -> Ok:
        self.fail_next = req.times
        return Ok(detail=f"failing {req.times} times")

    @op(LOOPY_STALL)
    async def stall(self, req: StallRequest) -> Ok:
        self.stalled.set()
        return Ok(detail="stalling")

    @op(LOOPY_LOOP_INFO)
    async def loop_info(self, req: LoopInfoRequest) -> LoopInfo:
        return LoopInfo(starts=self.starts, iterations=self.iterations)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nats-url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--data-dir", required=True)
    a = p.parse_args()
    sys.exit(run_role(LoopyRole, RoleConfig(nats_url=a.nats_url, prefix=a.prefix, instance=a.instance,
                                            data_dir=a.data_dir, heartbeat_interval_s=0.2)))
