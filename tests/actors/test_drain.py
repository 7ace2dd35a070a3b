"""Shutdown has two paths, both tested and both bounded: drain on SIGTERM, exit now on a second."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time

import pytest

from transport.bus import Bus
from actors.runtime import EXIT_NOW_STATUS
from protocol import ops
from protocol.errors import InternalError, Unavailable
from protocol.messages import InfoRequest, Ok
from protocol.policy import BROKER_RETRY_AFTER_S
from protocol.subjects import Names
from tests.conftest import python_env
from tests.support.slow_role import SLOW_BROKER_TIMEOUT, SLOW_CRASH, SLOW_SLEEP, SLOW_STUCK_THREAD, SleepRequest


@pytest.fixture
def slow_role(nats_url, layout, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.slow_role", "--nats-url", nats_url, "--prefix", layout.prefix,
         "--instance", "s1", "--data-dir", str(tmp_path), "--teardown-grace", "2"],
        env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield proc, layout
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


async def _wait_ready(bus: Bus, names: Names) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            await bus.call(ops.INFO.of("slow"), InfoRequest(), timeout_s=1)
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _ready_bus(nats_url: str, names: Names):
    """A client of the test's NATS, once the slow role answers; drained and closed after."""
    bus = await Bus.connect(nats_url, name="test", reconnect_forever=False, prefix=names.prefix)
    try:
        await _wait_ready(bus, names)
        yield bus
    finally:
        await bus.close()


def test_sigterm_drains_in_flight_work_then_exits_0(slow_role, nats_url):
    proc, names = slow_role

    async def go():
        async with _ready_bus(nats_url, names) as bus:
            pending = asyncio.ensure_future(
                bus.request(SLOW_SLEEP.subject(names), SleepRequest(1.5), Ok, timeout_s=10))
            await asyncio.sleep(0.4)  # the request is in flight now
            proc.send_signal(signal.SIGTERM)
            reply = await pending
            # After the drain began, new requests find no responder (the role unsubscribed).
            with pytest.raises(Unavailable):
                await bus.call(ops.INFO.of("slow"), InfoRequest(), timeout_s=2)
            return reply

    reply = asyncio.run(go())
    assert reply.detail == "slept 1.5"
    assert proc.wait(timeout=15) == 0
    out = proc.stdout.read()
    assert '"event": "draining"' in out and '"event": "stopped"' in out


def test_second_signal_exits_now(slow_role, nats_url):
    proc, names = slow_role

    async def go():
        bus = await Bus.connect(nats_url, name="test", reconnect_forever=False, prefix=names.prefix)
        try:
            await _wait_ready(bus, names)
            asyncio.ensure_future(
                bus.request(SLOW_SLEEP.subject(names), SleepRequest(30), Ok, timeout_s=40))
            await asyncio.sleep(0.4)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            return started
        finally:
            await bus.nc.close()

    started = asyncio.run(go())
    assert proc.wait(timeout=10) == EXIT_NOW_STATUS
    assert time.monotonic() - started < 5  # did not wait for the 30 s request


def test_a_stuck_worker_thread_does_not_keep_a_stopped_role_alive(slow_role, nats_url):
    proc, names = slow_role

    async def go():
        async with _ready_bus(nats_url, names) as bus:
            await bus.request(SLOW_STUCK_THREAD.subject(names), SleepRequest(0), Ok, timeout_s=5)

    asyncio.run(go())
    proc.send_signal(signal.SIGTERM)
    # Without the exit watchdog asyncio.run joins the stuck thread forever; with it the
    # process exits with the drain's status 2 s (the grace set above) after the teardown began.
    assert proc.wait(timeout=20) == 0
    out = proc.stdout.read()
    assert '"event": "stopped"' in out and "teardown did not finish" in out, out[-2000:]


def test_handler_bug_is_an_error_reply_not_a_crash(slow_role, nats_url):
    proc, names = slow_role

    async def go():
        async with _ready_bus(nats_url, names) as bus:
            with pytest.raises(InternalError, match="handler bug"):
                await bus.request(SLOW_CRASH.subject(names), SleepRequest(0), Ok, timeout_s=5)
            return await bus.call(ops.INFO.of("slow"), InfoRequest(), timeout_s=5)

    assert asyncio.run(go()).role == "slow"
    assert proc.poll() is None


def test_a_broker_timeout_in_a_handler_is_unavailable_with_a_retry_hint(slow_role, nats_url):
    # The caller's outage retry (workflows, SDK loops) repeats `unavailable`, not `internal`:
    # a JetStream timeout under a leader election must not fail a workload for good.
    proc, names = slow_role

    async def go():
        async with _ready_bus(nats_url, names) as bus:
            with pytest.raises(Unavailable, match="could not reach JetStream on broker_timeout") as err:
                await bus.request(SLOW_BROKER_TIMEOUT.subject(names), SleepRequest(0), Ok, timeout_s=5)
            return err.value

    exc = asyncio.run(go())
    assert not isinstance(exc, InternalError)
    assert exc.details["retry_after_s"] == BROKER_RETRY_AFTER_S
    assert proc.poll() is None


def test_drain_request_stops_one_instance(slow_role, nats_url):
    proc, names = slow_role

    async def go():
        async with _ready_bus(nats_url, names) as bus:
            from protocol.messages import DrainRequest
            return await bus.call(ops.DRAIN.of("slow"), DrainRequest("test"), instance="s1", timeout_s=5)

    assert "draining" in asyncio.run(go()).detail
    assert proc.wait(timeout=15) == 0


def test_request_to_nobody_fails_fast_and_timeouts_are_bounded(nats_url, layout):
    async def go():
        bus = await Bus.connect(nats_url, name="test", reconnect_forever=False, prefix=layout.prefix)
        try:
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="no role is serving"):
                await bus.call(ops.INFO.of("nobody"), InfoRequest(), timeout_s=5)
            return time.monotonic() - t0
        finally:
            await bus.close()

    assert asyncio.run(go()) < 5
