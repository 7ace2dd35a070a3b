"""`transport.broker.free_port`: a port handed out once is not handed out again on this host
while remembered, whichever process asks (test workers and `nexus up` pick concurrently, and
a server binds its port only later)."""

from __future__ import annotations

import subprocess
import sys

import transport.broker as broker
from tests.conftest import python_env


def test_a_port_the_kernel_offers_again_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(broker, "_PORT_REGISTRY", tmp_path / "ports.json")
    offers = iter([40001, 40001, 40001, 40002])  # the kernel may offer a released port again
    monkeypatch.setattr(broker, "_bound_port", lambda host: next(offers))
    assert [broker.free_port(), broker.free_port()] == [40001, 40002]


def test_an_unreadable_registry_is_started_again(tmp_path, monkeypatch):
    path = tmp_path / "ports.json"
    path.write_text("{torn")
    monkeypatch.setattr(broker, "_PORT_REGISTRY", path)
    port = broker.free_port()
    assert 0 < port < 65536 and str(port) in path.read_text()


def test_two_processes_get_disjoint_ports(tmp_path):
    code = ("import transport.broker as b, pathlib, sys; b._PORT_REGISTRY = pathlib.Path(sys.argv[1]); "
            "print(' '.join(str(b.free_port()) for _ in range(150)))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ports.json")], env=python_env(),
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert [len(o) for o in outs] == [150, 150] and not outs[0] & outs[1]
