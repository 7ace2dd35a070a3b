"""What each platform process may publish and subscribe to: its user JWT's permissions.

Every role logs in as its own user of the PLATFORM account (`transport.auth.AuthStore`
issues ``role-creds/<role>.creds``), and that user's JWT carries NATS ``pub`` / ``sub``
allow lists and a ``resp`` (reply) permission. The lists are derived from the code: a role
subscribes to its own ops (``<p>.<role>.*``, ``<p>.svc.<role>.*.*``) and the broadcasts it
listens to, publishes the subjects it sends or requests, and answers requests through
``resp`` (only the reply subject of a request it received, once, within `REPLY_TTL_S`),
never by a blanket ``_INBOX.>`` publish. JetStream:

* reads (stream info, message get, consumers) for every role that reads a bucket;
* writes only into the buckets it owns (``$KV.<bucket>.<keys>``, ``$O.<bucket>.>``);
* stream create / update / delete / purge only for the master and the supervisor (which
  make the layout and the tenants' queues); the trainer may purge only the object
  buckets it overwrites (nats.py's object put / delete purge the old chunks).

A subject missing from a list fails quietly on the role's side (a publish dropped, a
request timing out, a "Permissions Violation" in its log); `tests/transport/test_least_privilege.py`
runs the whole cluster on these lists. ::

    perms = role_permissions("trainer", "nexus")   # {"pub": {...}, "sub": {...}, "resp": {...}}
"""

from __future__ import annotations

from typing import Any

from protocol import ops
from protocol.subjects import ROLES, Names

# Users besides the roles that `nexus up` issues: the supervisor (layout, restarts, the
# ready check) logs in as its own.
SUPERVISOR = "supervisor"
PROCESSES: tuple[str, ...] = (*ROLES, SUPERVISOR)

# A reply may be sent this long after its request arrived (nats-server's allow_responses
# ttl). Longer than the slowest op (a trainer's train_batch, up to 600 s).
REPLY_TTL_S = 3600
# Replies per request: every op answers once.
REPLY_MAX = 1

_INBOX = "_INBOX.>"  # where nats.py's requests and JetStream consumers take their answers

# JetStream reads: account info, stream info and lookup, message get (KV get, the
# training-queue reader), consumers (object get and KV watch are ordered consumers).
JS_READ: tuple[str, ...] = ("$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES",
                            "$JS.API.STREAM.LIST", "$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>",
                            "$JS.API.CONSUMER.>")
# Flow control of the ordered consumers an object get reads through (answered by nats.py).
JS_FLOW = "$JS.FC.>"
# Every JetStream API call: only the master and the supervisor.
JS_ALL = "$JS.API.>"

# The master's ops each role (or its workflows, on the env worker) calls.
TRAINER_MASTER_OPS = (ops.MASTER_LEASE, ops.MASTER_LEASE_RENEW, ops.MASTER_LEASE_RELEASE, ops.MASTER_JOB_UPDATE,
                      ops.MASTER_CHECKPOINT_COMMIT, ops.MASTER_CHECKPOINT_GET, ops.MASTER_TENANT_GET,
                      ops.MASTER_USAGE_REPORT)
# The env worker's workflow loops (workflows/, on the SDK's primitives) and its hand-back.
ENV_MASTER_OPS = (ops.MASTER_HANDBACK, ops.MASTER_USAGE_REPORT, ops.MASTER_TENANT_GET, ops.MASTER_RESERVE,
                  ops.MASTER_QUEUE_PUT, ops.MASTER_MARK_READY, ops.MASTER_JOB, ops.MASTER_ROLLOUT_BEGIN,
                  ops.MASTER_ROLLOUT_END)


def _kv(bucket: str, keys: str = ">") -> str:
    return f"$KV.{bucket}.{keys}"


def _stream_of_kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _common(n: Names, role: str) -> tuple[list[str], list[str]]:
    """(pub, sub) of every role (`actors.runtime.Role`): its own ops, beats, metrics, and
    its record in the services bucket; and `info` of its own instances (the container health
    probe, deploy/compose/probe.py, asks its instance as the role's user)."""
    pub = [f"{n.prefix}.health.heartbeat.{role}.*", n.metrics_all, ops.INFO.of(role).instance_pattern(n),
           "$JS.API.INFO", f"$JS.API.STREAM.INFO.{_stream_of_kv(n.kv_services)}", _kv(n.kv_services, f"{role}.*")]
    sub = [n.role_ops(role), f"{n.prefix}.svc.{role}.*.*", _INBOX]
    return pub, sub


def role_permissions(role: str, prefix: str) -> dict[str, Any]:
    """The ``pub`` / ``sub`` / ``resp`` claims of ``role``'s user (one of `PROCESSES`)."""
    n = Names(prefix)
    p = n.prefix
    if role not in PROCESSES:
        raise ValueError(f"role: unknown {role!r}; allowed: {list(PROCESSES)}")
    if role == SUPERVISOR:
        # ensure_layout creates the streams and buckets; the ready check reads the services
        # bucket and asks the monitor; the health manager asks it for restarts; `nexus scale
        # trainer 0` asks the master whether jobs still wait.
        pub = [JS_ALL, _kv(n.kv_services), ops.MONITOR_STATUS.subject(n), ops.MASTER_JOBS.subject(n)]
        sub = [f"{p}.supervisor.*", _INBOX]
    else:
        pub, sub = _common(n, role)
        if role == "health":
            pub += [ops.INFO.instance_pattern(n), n.supervisor("restart"), f"{p}.health.events.*.*",
                    n.supervisor("scale"), f"{p}.scale.decisions.*"]  # its scaler (NEXUS_SCALER)
            sub += [n.heartbeat_all]
        elif role == "monitor":
            sub += [n.heartbeat_all, n.health_events_all, n.metrics_all, n.workload_events_all,
                    n.tenant_deleted_all, n.scale_decisions_all]
        elif role == "inferencer":
            pub += [ops.MASTER_USAGE_REPORT.subject(n), *JS_READ, JS_FLOW]
            sub += [f"{p}.infer.*", n.weights_all, n.tenant_deleted_all, n.tenant_updated_all]
        elif role == "trainer":
            pub += [*(o.subject(n) for o in TRAINER_MASTER_OPS), n.weights_all, *JS_READ, JS_FLOW,
                    _kv(n.kv_versions, "*"), f"$O.{n.obj_weights}.>", f"$O.{n.obj_checkpoints}.>",
                    f"$JS.API.STREAM.PURGE.OBJ_{n.obj_weights}", f"$JS.API.STREAM.PURGE.OBJ_{n.obj_checkpoints}"]
            sub += [n.sched_ready, n.tenant_deleted_all]
        elif role == "env":
            pub += [*(o.subject(n) for o in ENV_MASTER_OPS), ops.TRAINER_EXPORT_PARAMS.subject(n),
                    f"{p}.infer.*", f"{p}.workloads.events.*", *JS_READ, JS_FLOW]
        elif role == "master":
            from transport.layout import kv_buckets, object_buckets

            pub += [JS_ALL, "$JS.ACK.>", JS_FLOW, *(_kv(b) for b in kv_buckets(n)),
                    *(f"$O.{b}.>" for b in object_buckets(n)),
                    f"{p}.tq.>", n.sched_ready, f"{p}.tenants.>", f"{p}.workloads.events.*",
                    f"{p}.tenant_events.>", ops.ENV_START_WORKFLOW.subject(n), ops.INFO.instance_pattern(n),
                    ops.ENV_STOP_WORKFLOW.instance_pattern(n), ops.TRAINER_INIT_WEIGHTS.subject(n),
                    ops.MASTER_USAGE_REPORT.subject(n)]
            sub += [n.health_events_all, n.weights_all, n.workload_events_all]
    return {"pub": {"allow": _unique(pub)}, "sub": {"allow": _unique(sub)},
            "resp": {"max": REPLY_MAX, "ttl": REPLY_TTL_S * 1_000_000_000}}


def _unique(subjects: list[str]) -> list[str]:
    return list(dict.fromkeys(subjects))
