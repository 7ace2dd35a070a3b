from __future__ import annotations

import pytest

from protocol.errors import InvalidField
from protocol.subjects import ROLES, Names


def test_default_prefix_and_examples():
    n = Names()
    assert n.master("submit") == "nexus.master.submit"
    assert n.workloads_submit == "nexus.workloads.submit"
    assert n.workload_events("w1") == "nexus.workloads.events.w1"
    assert n.tq_job("acme", "j1") == "nexus.tq.acme.j1"
    assert n.infer("qwen3-vl-4b") == "nexus.infer.qwen3-vl-4b"
    assert n.heartbeat("trainer", "t-1") == "nexus.health.heartbeat.trainer.t-1"
    assert n.kv_services == "nexus_services"
    assert set(ROLES) == {"master", "trainer", "inferencer", "env", "health", "monitor"}


def test_two_prefixes_share_no_names():
    a, b = Names("prod"), Names("dev")
    def all_names(n):
        return {n.master("x"), n.workloads_submit, n.infer("p"), n.kv_tenants, n.kv_services,
                n.obj_weights, n.stream_intake, n.tq_stream("t"), n.heartbeat_all, n.metrics_all}
    assert not all_names(a) & all_names(b)


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "x" * 65, "ü"])
def test_bad_tokens_rejected(bad):
    with pytest.raises(InvalidField, match="not a valid name"):
        Names(bad)
    with pytest.raises(InvalidField, match="tenant"):
        Names().tq_stream(bad)
