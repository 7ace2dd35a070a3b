"""A bench stopped with SIGTERM takes its deployment down: `bench.chaos_deploy.stop_on_sigterm`
turns the signal into SystemExit, so the bench's `finally:` (``nexus down``, cleanup) runs.
Before, `pkill -f bench.maniskill_rl` left its deployments running (docs/results.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import time
from bench.chaos_deploy import stop_on_sigterm
stop_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("finally ran", flush=True)
"""


def test_sigterm_unwinds_through_finally():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out.strip() == "finally ran" and proc.returncode == 128 + signal.SIGTERM


def test_every_bench_that_brings_up_a_deployment_handles_sigterm():
    """Each bench module whose main brings a deployment up installs a SIGTERM handler."""
    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        text = path.read_text()
        if "def main(" in text and ("Deployment(" in text or "MtDeployment(" in text):
            if "stop_on_sigterm()" not in text and "signal.SIGTERM" not in text:
                missing.append(path.name)
    assert not missing, f"benches that leave their deployment running when killed: {missing}"
