"""`nexus logs ROLE --tenant T -n N`: the tenant filter comes before the count (issue 26: it
took the last N lines, then filtered, and showed nothing when other tenants logged more)."""

from __future__ import annotations

import json

from tests.conftest import nexus_run


def test_tenant_filter_before_the_count(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [json.dumps({"event": f"acme {i}", "tenant": "acme"}) for i in range(5)]
    lines += [json.dumps({"event": f"other {i}", "tenant": "other"}) for i in range(50)]
    lines += ["not json", json.dumps({"event": "mentions acme in text", "note": "acme"})]
    (logs / "master.log").write_text("\n".join(lines) + "\n")
    out = nexus_run("logs", "master", "--data-dir", str(tmp_path), "-n", "3", "--tenant", "acme")
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["event"] for x in out.stdout.splitlines()] == ["acme 2", "acme 3", "acme 4"]
    out = nexus_run("logs", "master", "--data-dir", str(tmp_path), "-n", "2")
    assert out.returncode == 0 and out.stdout.splitlines() == lines[-2:]
