"""The trainer's one torch thread (actors/trainer/torch_thread.py): calls run one at a time, in
the order asked, on one thread, with the caller's context; and the trainer sends its torch work
nowhere else (the SIGSEGVs of long runs came with torch driven from several threads at once)."""

from __future__ import annotations

import ast
import asyncio
import contextvars
import threading
import time
from pathlib import Path

import pytest

from actors.trainer.torch_thread import TorchThread

ROOT = Path(__file__).resolve().parents[2]


def test_calls_run_one_at_a_time_in_order_on_one_thread():
    running, peak, order, threads = [0], [0], [], set()
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        threads.add(threading.get_ident())
        time.sleep(0.005)
        order.append(i)
        with lock:
            running[0] -= 1
        return i * i

    async def main():
        tt = TorchThread()
        return await asyncio.gather(*(tt.run(work, i) for i in range(16)))

    assert asyncio.run(main()) == [i * i for i in range(16)]
    assert peak[0] == 1, "two torch calls ran at once"
    assert order == list(range(16)), "calls ran out of the order asked"
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_errors_reach_the_caller_and_queued_calls_are_logged():
    logged = []

    class Log:
        def error(self, event, **fields):
            logged.append((event, fields))

    def boom():
        raise ValueError("bad slot")

    async def main():
        tt = TorchThread(log=Log())
        with pytest.raises(ValueError, match="bad slot"):
            await tt.run(boom)
        tt.submit(boom)
        await tt.run(lambda: None)  # after the submitted one: ordered

    asyncio.run(main())
    assert logged == [("torch thread call failed", {"error": "ValueError: bad slot"})]


def test_the_callers_context_goes_with_the_call():
    var = contextvars.ContextVar("span", default="none")

    async def main():
        var.set("job.step")
        return await TorchThread().run(var.get)

    assert asyncio.run(main()) == "job.step"


def test_the_trainer_runs_no_torch_work_on_other_threads():
    """No worker thread of the trainer besides the torch thread: every `asyncio.to_thread` /
    executor call in actors/trainer/ would be a second thread that torch work can drift into."""
    found = []
    for path in sorted((ROOT / "actors" / "trainer").glob("*.py")):
        if path.name == "torch_thread.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("to_thread", "run_in_executor", "ThreadPoolExecutor", "Thread"):
                what = ast.unparse(node)
                # Waiting for the rank processes to form their group, and closing their pipes on
                # drain: no torch in either.
                if what not in ("asyncio.to_thread(self.ranks.close)",
                                "threading.Thread(target=join, name='trainer-ranks-join', daemon=True)"):
                    found.append(f"{path.name}:{node.lineno} {what}")
    assert not found, f"torch work may run off the torch thread: {found}"


def slot_tensor_reads(source: str) -> list[str]:
    """`.grad` reads and `memory_bytes()` calls outside `Resident.measure` (which runs on the
    torch thread): anywhere else in the trainer they may run on the event loop beside a step."""
    found = []

    class Visit(ast.NodeVisitor):
        def __init__(self) -> None:
            self.where: list[str] = []

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            self.where.append(node.name)
            self.generic_visit(node)
            self.where.pop()

        def visit_Attribute(self, node: ast.Attribute) -> None:
            if node.attr in ("grad", "memory_bytes") and self.where[-1:] != ["measure"]:
                found.append(f"{node.lineno}: {ast.unparse(node)} in {'.'.join(self.where) or 'module'}")
            self.generic_visit(node)

    Visit().visit(ast.parse(source))
    return found


def test_the_trainer_reads_slot_tensors_only_on_the_torch_thread():
    """The cause of the long runs' trainer crashes (a dump on the H200, docs/results.md): `info`
    read every param's `.grad` on the event loop while the torch thread's step set them; torch
    raised an INTERNAL ASSERT in pyobject_preservation, and later the heap was corrupt. The
    memory figures are now measured on the torch thread (`Resident.measure`) and `info` reads
    those numbers."""
    found = [f"{p.name}:{f}" for p in sorted((ROOT / "actors" / "trainer").glob("*.py"))
             for f in slot_tensor_reads(p.read_text())]
    assert not found, f"slot tensors read where the event loop may run them: {found}"
    # The check sees the old way in.
    assert slot_tensor_reads("def memory_report(self):\n    return r.slot.memory_bytes()\n")
    assert slot_tensor_reads("def info_extra(self):\n    return [p.grad for p in ps]\n")
    assert not slot_tensor_reads("def measure(self):\n    self.memory = self.slot.memory_bytes()\n")
