"""The trainer's one torch thread: every torch call of a trainer process (a grouped step, a slot
built, restored, checkpointed, exported, loaded, moved; a base loaded) runs here, one at a
time, in the order asked.

    torch_thread = TorchThread()
    out = await torch_thread.run(slot.checkpoint)   # awaits, off the event loop
    torch_thread.submit(slot.offload)               # ordered before any later run()

Why one thread: long multi-tenant runs lost their trainer to SIGSEGVs inside
``libtorch_python.so`` in a non-main thread (docs/results.md) while steps ran in one
``asyncio.to_thread`` worker and a slot's checkpoint, export or restore ran in another, and
the event loop's own thread built slots on the shared base meanwhile. Torch's Python bindings
and ``torch.compile``'s caches are not made for several threads driving one model at once;
one thread removes that whole class of race instead of guarding each pair. What it costs: a
checkpoint or export no longer overlaps a step (both are short beside the step on this
trainer: the step is the device's work, they are copies). Rank processes (ranks.py) have
their own thread each and are unaffected.

The caller's context (its OpenTelemetry span) goes with each call, as with ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self, log: Any = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-torch")
        self.log = log

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the torch thread; its result or its exception."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        """Queue ``fn(*args)`` without waiting (a slot moved off the device between steps); an
        error is logged, never lost silently."""
        fut = self._pool.submit(functools.partial(contextvars.copy_context().run, fn, *args))
        fut.add_done_callback(self._report)
        return fut

    def _report(self, fut: Future) -> None:
        exc = fut.exception()
        if exc is not None and self.log is not None:
            self.log.error("torch thread call failed", error=f"{type(exc).__name__}: {exc}")
