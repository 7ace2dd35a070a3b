"""Every simulator call with a timeout, and a bound on the threads hung simulators hold.

A simulator (`envs.make`, ``env.reset``, ``env.step``) runs on a thread of the event loop's
default executor (``min(32, cores + 4)`` threads: 6 on 2 cores). Without a bound a simulator
that never returns held its thread for good and its caller waited forever. Now a call past
``NEXUS_SIM_TIMEOUT_S`` raises `SimTimeout` (its episode and session fail; the worker goes
on); the thread itself cannot be killed (Python has no way to stop a thread), so it stays
busy until the call returns, counted as *hung*. At ``NEXUS_SIM_MAX_HUNG`` hung calls the
process refuses new simulator calls (`Unavailable`, naming the bound) until one returns,
so hung simulators never take every executor thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from typing import Any, Callable

from protocol.errors import FailedPrecondition, Unavailable
from protocol.settings import SimCallSettings


class SimTimeout(FailedPrecondition):
    """A simulator call ran past its timeout: its session / episode is given up."""


class SimGuard:
    def __init__(self, timeout_s: float, max_hung: int) -> None:
        self.timeout_s, self.max_hung = timeout_s, max_hung
        self.hung = 0  # calls past their timeout whose thread has not returned yet
        self.timeouts = 0  # calls that ran past their timeout, ever
        self._lock = threading.Lock()

    async def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on an executor thread, at most ``timeout_s``."""
        with self._lock:
            if self.hung >= self.max_hung:
                raise Unavailable(f"{self.hung} simulator calls are hung past their {self.timeout_s:g} s timeout "
                                  f"(the bound NEXUS_SIM_MAX_HUNG={self.max_hung}); this worker takes no simulator "
                                  "call until one returns", details={"hung": self.hung, "max_hung": self.max_hung})
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        fut = loop.run_in_executor(None, functools.partial(ctx.run, fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            with self._lock:
                self.hung += 1
                self.timeouts += 1
            fut.add_done_callback(self._returned)
            raise SimTimeout(f"simulator {what} did not return within {self.timeout_s:g} s (NEXUS_SIM_TIMEOUT_S); "
                             "its thread stays busy until it does", details={"call": what,
                                                                             "timeout_s": self.timeout_s}) from None

    def _returned(self, fut: asyncio.Future) -> None:
        with self._lock:
            self.hung -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: a late failure of a given-up call is not an error to report

    def info(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "max_hung": self.max_hung, "hung": self.hung, "timeouts": self.timeouts}


_GUARD: list[SimGuard] = []


def guard() -> SimGuard:
    """The process's guard (one per process: the executor it bounds is the process's)."""
    return _GUARD[0] if _GUARD else configure()


def configure() -> SimGuard:
    """The process's guard from NEXUS_SIM_*, read now (an env worker at its start); the hung
    count of calls already given up carries over."""
    s = SimCallSettings.from_env()
    g = SimGuard(s.timeout_s, s.max_hung)
    if _GUARD:
        g.hung, g.timeouts = _GUARD[0].hung, _GUARD[0].timeouts
        _GUARD[0] = g
    else:
        _GUARD.append(g)
    return g


async def sim_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await guard().call(what, fn, *args, **kwargs)
