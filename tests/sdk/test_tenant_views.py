"""Views and messages as a tenant meets them (issue 26), on a real deployment, from the CLI with
the tenant's own credentials: operator views say so in one line instead of looking empty,
`nexus tenants` lists a tenant from `tenant create` on, and a refusal says what was refused in
words."""

from __future__ import annotations

import json

import pytest

from tests.conftest import nexus_run, nexus_up, tenant_create


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("views")
    with nexus_up(data_dir) as state:
        yield data_dir, state


def test_a_new_tenant_is_listed_before_its_first_submit(deployment):
    data_dir, _ = deployment
    tenant_create(data_dir, "fresh")
    out = nexus_run("tenants", "--data-dir", str(data_dir), "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["tenant"]: r for r in json.loads(out.stdout)}
    assert rows["fresh"]["registered"] is False and rows["fresh"]["workloads"] == []
    plain = nexus_run("tenants", "--data-dir", str(data_dir))
    assert "fresh" in plain.stdout and "(no workload yet)" in plain.stdout


def test_operator_views_say_so_to_a_tenant(deployment):
    data_dir, _ = deployment
    creds = tenant_create(data_dir, "viewer")["creds"]
    top = nexus_run("--creds", creds, "top", "--once", "--data-dir", str(data_dir))
    assert top.returncode == 2 and not top.stdout
    assert top.stderr.count("\n") == 1 and "operator command" in top.stderr and "'viewer'" in top.stderr, top.stderr
    status = nexus_run("--creds", creds, "status", "--data-dir", str(data_dir))
    assert status.returncode == 0, status.stderr
    assert "roles: shown to the operator only; tenant 'viewer' has no workloads yet" in status.stdout
    assert "alive" not in status.stdout and not status.stderr, status.stdout + status.stderr


def test_a_refusal_says_what_was_refused_in_words(deployment):
    data_dir, _ = deployment
    creds = tenant_create(data_dir, "nosy")["creds"]
    out = nexus_run("--creds", creds, "tenant", "show", "someone-else", "--data-dir", str(data_dir))
    assert out.returncode != 0
    assert "tenant 'nosy' may not see the record of tenant 'someone-else'" in out.stderr, out.stderr
