"""A preloaded role spawner for the tests (a "zygote", as Android and gunicorn's preload call it).

Starting a role with ``python -m actors.run`` costs about 4 s of CPU before it does anything:
importing torch and transformers (transformers alone scans every model folder it ships to build
its lazy import table). The default suite starts a few hundred role processes on a 2-core
machine, so imports were most of its CPU time. This process imports the model core once, then
forks each role process from itself: a fork costs milliseconds and the child shares the parent's
imported pages copy-on-write.

The children are real, independent role processes: their own pid, environment, working
directory, log file, event loop, NATS connections and signal handlers; `actors.run.main` runs
in them exactly as ``python -m actors.run`` would run it. What differs from a fresh interpreter
is only what was imported before the fork. The zygote stays single-threaded (checked at start)
and never runs an event loop, so a fork never copies a held lock or a running thread; each child
reseeds Python's, numpy's and torch's global generators so no two roles share a random stream.

Protocol: one JSON request per connection on a Unix socket, a 4-byte length before each message.
  {"op": "spawn", "argv": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": N}
  {"op": "status", "pid": N} -> {"returncode": int | null}
The zygote reaps its children and keeps their exit codes; it exits when its parent (the pytest
process) is gone or on SIGTERM, killing the children still running.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

REQUEST_TIMEOUT_S = 30.0  # one request: a fork, or a status lookup


def _send(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("zygote connection closed")
        head += chunk
    (n,) = struct.unpack("!I", head)
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("zygote connection closed")
        buf += chunk
    return json.loads(buf)


def _preload() -> None:
    import threading

    import numpy  # noqa: F401
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401
    from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401

    import actors.env_worker.env_worker  # noqa: F401
    import actors.health.health  # noqa: F401
    import actors.inferencer.inferencer  # noqa: F401
    import actors.monitor.monitor  # noqa: F401
    import actors.run  # noqa: F401
    import actors.trainer.trainer  # noqa: F401
    import master.service  # noqa: F401
    import models.group  # noqa: F401
    import models.heads  # noqa: F401
    import models.presets  # noqa: F401
    import models.schema  # noqa: F401
    import models.slot  # noqa: F401

    # A fork copies only the calling thread: a helper thread started by an import would leave
    # its locks held in every child. None does today; if one ever does, fail loudly here.
    assert threading.active_count() == 1, f"zygote preload started threads: {threading.enumerate()}"


def _child(req: dict[str, Any], listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: become the role process. Never returns."""
    code = 1
    try:
        listener.close()
        conn.close()
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["actors.run", *req["argv"]]
        import random

        import numpy as np
        import torch

        random.seed()
        np.random.seed()
        torch.seed()
        from actors.run import main

        try:
            code = main(req["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the role's own crash: traceback to its log, exit 1 as python would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def serve(path: str) -> None:
    parent = os.getppid()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    exited: dict[int, int] = {}
    running: set[int] = set()
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches pytest; it stops us itself
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while not stop and os.getppid() == parent:
        for _ in sel.select(timeout=0.2):
            conn, _addr = listener.accept()
            conn.settimeout(REQUEST_TIMEOUT_S)
            try:
                req = _recv(conn)
                if req["op"] == "spawn":
                    pid = os.fork()
                    if pid == 0:
                        _child(req, listener, conn)
                    running.add(pid)
                    _send(conn, {"pid": pid})
                elif req["op"] == "status":
                    _reap(running, exited)
                    _send(conn, {"returncode": exited.get(req["pid"])})
                else:
                    _send(conn, {"error": f"unknown op {req['op']!r}"})
            except (OSError, ValueError, KeyError, ConnectionError) as exc:
                print(f"zygote: bad request: {exc!r}", file=sys.stderr, flush=True)
            finally:
                conn.close()
        _reap(running, exited)
    for pid in running:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listener.close()
    Path(path).unlink(missing_ok=True)


def _reap(running: set[int], exited: dict[int, int]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        running.discard(pid)
        exited[pid] = os.waitstatus_to_exitcode(status)


# -- the pytest side -------------------------------------------------------------------------
class Zygote:
    """Starts the zygote process and asks it for role processes."""

    def __init__(self, path: Path, env: dict[str, str]) -> None:
        import subprocess

        self.path = str(path)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", self.path], env=env,
                                     stdout=subprocess.PIPE, stderr=None, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(REQUEST_TIMEOUT_S)
            s.connect(self.path)
            _send(s, obj)
            reply = _recv(s)
        if "error" in reply:
            raise RuntimeError(f"zygote: {reply['error']}")
        return reply

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log: Path) -> "ForkedProc":
        pid = self.request({"op": "spawn", "argv": argv, "env": env, "cwd": cwd, "log": str(log)})["pid"]
        return ForkedProc(self, pid, argv)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


class ForkedProc:
    """The part of `subprocess.Popen` the tests use, for a role forked by the zygote."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.request({"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
