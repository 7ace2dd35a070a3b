"""Simulators in child processes: one env per child, every call with a timeout.

A simulator runs in a process of its own (``python -m envs.simproc``), never in the process
that drives it. Scene builds (a ManiSkill make takes seconds, holding the GIL) and steps
therefore never hold an env worker's event loop or its heartbeats, and the worker waits on a
pipe, not on a thread. A call past ``NEXUS_SIM_TIMEOUT_S`` kills the child (a thread could
never be stopped; a process can) and raises `SimTimeout`; a child that dies (segfault,
``os._exit``, OOM kill) raises `SimCrashed`, as does a simulator that raises (its state is
unknown: the child is stopped). Either names the env id and what happened; the env is gone
and its caller (a session, an episode) makes a new one. A simulator's own refusal of a bad
argument (an `envs.errors.EnvError`: action shape, unknown task, bad option) is the caller's
mistake: it comes back as that error and the child stays usable.

    env = await simproc.pool().make("builtin/reach-v0", {"image_size": 64})
    obs, info = await env.reset(seed=0)
    obs, reward, terminated, truncated, info = await env.step(action)
    await env.close()

Wire: a 4-byte big-endian length, then `protocol.codec.packb` of a dict (numpy arrays as the
codec's ext type); never pickle. The child is started with fork+exec of a fresh interpreter
(`asyncio.create_subprocess_exec`), so it shares no thread, lock or NATS connection with the
worker; its stdout is moved to stderr (simulators print) and the protocol runs on a private
copy of the original stdout fd. It runs torch/OpenMP with one thread, dies with its parent
(PR_SET_PDEATHSIG) and exits on EOF. A process holds at most ``NEXUS_SIM_PROCS_MAX`` children.
Successive episodes of one env reset in the same child (no start-up cost per episode).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import struct
import sys
import time
from typing import Any

import numpy as np

from envs.adapter import CameraSpec, EnvSpec, Observation, TaskSpec
from protocol.codec import packb, unpackb
from protocol.errors import (
    Busy,
    FailedPrecondition,
    NexusError,
    ProtocolError,
    error_from_code,
)

_LEN = struct.Struct(">I")
MAX_FRAME = 1 << 30  # one observation at most (4096x4096 frames of a few cameras fit)
CLOSE_GRACE_S = 5.0  # a child's close() past this is killed instead
SPAWN_POLL_S = 0.1  # how often a make waiting for a free child slot looks again
# A child runs one simulator: its numeric libraries get one thread (2-core hosts run many).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
             "NUMEXPR_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class SimFailure(FailedPrecondition):
    """The simulator itself failed (hung or crashed): its env is gone; make a new one."""

    what = "failed"


class SimTimeout(SimFailure):
    """A simulator call ran past NEXUS_SIM_TIMEOUT_S: its process was killed."""

    what = "hung"


class SimCrashed(SimFailure):
    """The simulator's process died, or the simulator raised: its process is gone."""

    what = "crashed"


def _env_error(err: dict[str, Any]) -> NexusError:
    """The child's `envs.errors` exception as the same class here (a caller catching
    ActionError or UnknownTaskError catches it across the process boundary too)."""
    from envs import errors

    message, details = str(err.get("message", "")), dict(err.get("details") or {})
    cls = getattr(errors, str(err.get("type", "")), None)
    if isinstance(cls, type) and issubclass(cls, errors.EnvError):
        return cls(message, details=details)
    return error_from_code(str(err["code"]), message, details)


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "exit status unknown"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class SimEnv:
    """One simulator in one child process; the async counterpart of `envs.EnvAdapter`
    (``spec``, ``reset``, ``step``, ``close``). One call at a time (calls queue)."""

    def __init__(self, pool: SimPool, env_id: str, proc: asyncio.subprocess.Process) -> None:
        self.pool, self.env_id, self._proc = pool, env_id, proc
        self.spec: EnvSpec | None = None  # set by make
        self._lock = asyncio.Lock()
        self._gone = False  # killed, crashed or closed: the child slot is released

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def reset(self, seed: int | None = None, task: str | int | None = None) -> tuple[Observation, dict[str, Any]]:
        r = await self._call("reset", seed=None if seed is None else int(seed),
                             task=int(task) if isinstance(task, (int, np.integer)) and not isinstance(task, bool) else task)
        return _obs(r["obs"]), r["info"]

    async def step(self, action: Any) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        started = time.monotonic()
        r = await self._call("step", action=np.asarray(action, dtype=np.float32))
        # Step latency as the caller sees it (queued behind this env's lock, the child's work,
        # the pipe): the env worker's beat carries the totals, the scaler reads their rate.
        self.pool.steps += 1
        self.pool.step_s += time.monotonic() - started
        return _obs(r["obs"]), float(r["reward"]), bool(r["terminated"]), bool(r["truncated"]), r["info"]

    async def close(self) -> None:
        """Close the simulator and end its process; one that does not close in time is killed."""
        if self._gone:
            return
        try:
            await self._call("close", timeout_s=min(self.pool.timeout_s, CLOSE_GRACE_S))
        except NexusError:
            pass  # killed already (timeout / crash); a broken simulator's close failing is no news
        await self._end(exiting=True)  # it exits after answering close

    def kill(self) -> None:
        """Kill the child now (no await): for a caller that cannot wait, e.g. at exit."""
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass
        self._release()

    def _release(self) -> None:
        if not self._gone:
            self._gone = True
            self.pool._released(self)

    async def _end(self, exiting: bool = False) -> int | None:
        """Kill the child if still running and reap it: its slot is free after this.

        ``exiting``: the child is on its way out by itself (its pipe closed, or it answered
        close): its exit is awaited first. Killing it at once would race the reaper: Popen's
        kill() polls (waitpid) first and may reap the zombie itself, and asyncio's watcher
        then reports exit code 255 instead of the real one."""
        if exiting:
            try:
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), CLOSE_GRACE_S)
            except TimeoutError:
                pass
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(self._proc.wait(), CLOSE_GRACE_S)
        except TimeoutError:
            pass  # SIGKILLed but not reaped yet (the kernel is slow): the watcher reaps it later
        self._release()
        return self._proc.returncode

    async def _call(self, op: str, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        timeout_s = self.pool.timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            if self._gone:  # (checked under the lock: a call queued behind one that killed it)
                raise SimCrashed(f"simulator {self.env_id}: its process is gone (killed, crashed or closed)",
                                 details={"env_id": self.env_id, "call": op})
            try:
                reply = await asyncio.wait_for(self._roundtrip({"op": op, **args}), timeout_s)
            except TimeoutError:
                await self._end()
                self.pool.timeouts += 1
                raise SimTimeout(f"simulator {self.env_id} {op} did not return within {timeout_s:g} s "
                                 "(NEXUS_SIM_TIMEOUT_S); its process was killed",
                                 details={"env_id": self.env_id, "call": op, "timeout_s": timeout_s}) from None
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, ProtocolError) as exc:
                rc = await self._end(exiting=not isinstance(exc, ProtocolError))
                self.pool.crashes += 1
                how = _describe_exit(rc) if not isinstance(exc, ProtocolError) else f"sent a bad reply: {exc.message}"
                raise SimCrashed(f"simulator {self.env_id} process died during {op} ({how})",
                                 details={"env_id": self.env_id, "call": op, "returncode": rc}) from None
            except BaseException:  # cancelled mid-call: the pipe is out of step, the child unusable
                self.kill()
                raise
        if reply.get("ok"):
            return reply.get("result") or {}
        err = reply.get("error") or {}
        if err.get("code"):  # the simulator refused the caller's argument: the env stays usable
            raise _env_error(err)
        await self._end()  # the simulator raised: its state is unknown, its process is stopped
        self.pool.crashes += 1
        raise SimCrashed(f"simulator {self.env_id} {op} raised {err.get('type', 'Exception')}: "
                         f"{err.get('message', '')}; its process was stopped",
                         details={"env_id": self.env_id, "call": op, "error": str(err.get("type", ""))})

    async def _roundtrip(self, msg: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        body = packb(msg)
        stdin.write(_LEN.pack(len(body)) + body)
        await stdin.drain()
        (n,) = _LEN.unpack(await stdout.readexactly(_LEN.size))
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes is over {MAX_FRAME}")
        reply = unpackb(await stdout.readexactly(n))
        if not isinstance(reply, dict):
            raise ProtocolError("reply is not a map")
        return reply


class SimPool:
    """The child processes of one process: at most ``procs_max`` at once."""

    def __init__(self, timeout_s: float, procs_max: int, plugins: tuple[str, ...] = ()) -> None:
        self.timeout_s, self.procs_max, self.plugins = timeout_s, procs_max, tuple(plugins)
        self.envs: set[SimEnv] = set()
        self._starting = 0  # children being spawned (counted against procs_max)
        self.started = self.timeouts = self.crashes = 0
        self.steps, self.step_s = 0, 0.0  # steps answered, and their seconds summed (running totals)

    @property
    def live(self) -> int:
        return len(self.envs) + self._starting

    def info(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "procs_max": self.procs_max, "procs": self.live,
                "started": self.started, "timeouts": self.timeouts, "crashes": self.crashes}

    async def make(self, env_id: str, options: dict[str, Any] | None = None, *, wait_s: float = 0.0) -> SimEnv:
        """A new simulator of ``env_id`` in a child of its own. With every child slot taken,
        wait up to ``wait_s`` for one, then refuse (`Busy`, naming NEXUS_SIM_PROCS_MAX)."""
        from envs.registry import factory_ref

        ref = factory_ref(env_id)  # an unknown id is refused here, listing the known ones: no child
        deadline = time.monotonic() + wait_s
        while self.live >= self.procs_max:
            if time.monotonic() >= deadline:
                raise Busy(f"this process runs {self.live} simulator processes, its maximum "
                           f"(NEXUS_SIM_PROCS_MAX={self.procs_max}); close a session or wait for one to end",
                           details={"procs": self.live, "procs_max": self.procs_max, "retry_after_s": 1.0,
                                    "setting": "NEXUS_SIM_PROCS_MAX"})
            await asyncio.sleep(SPAWN_POLL_S)
        self._starting += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "envs.simproc", str(os.getpid()), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=_child_env())
        finally:
            self._starting -= 1
        env = SimEnv(self, env_id, proc)
        self.envs.add(env)
        self.started += 1
        try:
            # Start-up (imports) and the scene build share the timeout: both are the make.
            r = await env._call("make", env_id=env_id, factory=ref, options=dict(options or {}),
                                plugins=list(self.plugins))
        except BaseException:
            await env._end()
            raise
        env.spec = _spec(r["spec"])
        return env

    def _released(self, env: SimEnv) -> None:
        self.envs.discard(env)


_POOL: list[SimPool] = []


def configure(plugins: tuple[str, ...] | None = None) -> SimPool:
    """The process's pool from NEXUS_SIM_* (and the env worker's NEXUS_ENV_PLUGINS, which its
    children import before a make), read now; children already running stay counted."""
    from protocol.settings import EnvWorkerSettings, SimCallSettings

    s = SimCallSettings.from_env()
    p = SimPool(s.timeout_s, s.procs_max, EnvWorkerSettings.from_env().plugins if plugins is None else plugins)
    if _POOL:
        old = _POOL[0]
        p.envs, p.started, p.timeouts, p.crashes = old.envs, old.started, old.timeouts, old.crashes
        p.steps, p.step_s = old.steps, old.step_s
        for e in p.envs:
            e.pool = p
        _POOL[0] = p
    else:
        _POOL.append(p)
    return p


def pool() -> SimPool:
    """The process's pool (one per process: its bound is the process's)."""
    return _POOL[0] if _POOL else configure()


def _child_env() -> dict[str, str]:
    # This checkout's packages first: the child imports envs (and plugins) as its parent does.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **CHILD_ENV, "PYTHONPATH": path}


def _spec(d: dict[str, Any]) -> EnvSpec:
    tup = {k: tuple(v) for k, v in d.items() if isinstance(v, list) and k not in ("cameras", "tasks")}
    return EnvSpec(**{**d, **tup, "cameras": tuple(CameraSpec(**c) for c in d["cameras"]),
                      "tasks": tuple(TaskSpec(**t) for t in d["tasks"])})


def _obs(d: dict[str, Any]) -> Observation:
    return Observation(images=dict(d["images"]), state=d["state"], instruction=d["instruction"])


# -- the child ---------------------------------------------------------------------------
def _plain_info(info: dict[str, Any]) -> dict[str, Any]:
    """An info dict the codec can carry: numpy scalars as Python values, anything else
    unencodable as its text."""
    out: dict[str, Any] = {}
    for k, v in (info or {}).items():
        if isinstance(v, np.generic):
            v = v.item()
        try:
            packb(v)
        except (NexusError, TypeError, ValueError, OverflowError):
            v = str(v)
        out[str(k)] = v
    return out


def _obs_dict(obs: Observation) -> dict[str, Any]:
    return {"images": {k: np.asarray(v) for k, v in obs.images.items()},
            "state": np.asarray(obs.state, dtype=np.float32), "instruction": str(obs.instruction)}


def _make(msg: dict[str, Any]) -> Any:
    import importlib

    import envs

    for module in msg.get("plugins") or ():
        importlib.import_module(module)
    ref, env_id, options = msg.get("factory") or "", msg["env_id"], msg.get("options") or {}
    if not ref:
        return envs.make(env_id, **options)
    module_name, _, qual = ref.partition(":")
    factory: Any = importlib.import_module(module_name)
    for part in qual.split("."):
        factory = getattr(factory, part)
    return factory(env_id=env_id, **options)


def _serve(rfd: int, wfd: int) -> None:
    from envs.errors import EnvError

    def read_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(rfd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def write(obj: dict[str, Any]) -> None:
        body = packb(obj)
        data = memoryview(_LEN.pack(len(body)) + body)
        while data:
            data = data[os.write(wfd, data):]

    env: Any = None
    while True:
        try:
            (n,) = _LEN.unpack(read_exact(_LEN.size))
            msg = unpackb(read_exact(n))
        except EOFError:
            return  # the parent closed the pipe (or died)
        op = msg.get("op")
        try:
            if op == "make":
                env = _make(msg)
                spec = dataclasses.asdict(env.spec)
                result: dict[str, Any] = {"spec": spec}
            elif op == "reset":
                obs, info = env.reset(seed=msg.get("seed"), task=msg.get("task"))
                result = {"obs": _obs_dict(obs), "info": _plain_info(info)}
            elif op == "step":
                obs, reward, terminated, truncated, info = env.step(msg["action"])
                result = {"obs": _obs_dict(obs), "reward": float(reward), "terminated": bool(terminated),
                          "truncated": bool(truncated), "info": _plain_info(info)}
            elif op == "close":
                if env is not None:
                    env.close()
                write({"ok": True, "result": {}})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            write({"ok": True, "result": result})
        except EnvError as exc:  # the caller's argument (action, task, option): the env stays usable
            write({"ok": False, "error": {"code": exc.code.value, "type": type(exc).__name__, "message": exc.message,
                                          "details": _plain_info(exc.details)}})
        except Exception as exc:  # noqa: BLE001 - the simulator broke (any error): the parent stops this process
            write({"ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}})


def _die_with_parent() -> None:
    """SIGKILL this child when the process that started it dies (Linux): a SIGKILLed worker
    leaves no simulator running (a child busy in a step never reads the pipe's EOF)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    _die_with_parent()
    # The parent is gone already when this process was re-parented: compared with the pid the
    # parent passed, never with 1 (in a container the env worker itself is pid 1).
    parent = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else None
    if parent is not None and os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the worker's terminal is the worker's
    wfd = os.dup(1)  # the protocol's channel; fd 1 (print) goes to stderr instead
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(0, wfd)


if __name__ == "__main__":
    main()
