"""One trace per RL update, across processes (W3C context in NATS headers and in the training
queue's stream): env worker -> inferencer (predict) and env worker -> master -> trainer ->
inferencer (weight load), with the stage spans of a predict and of a training job; `nexus
trace` on the spans written; a malformed context starts a new root and fails nothing.

One deployment for the module (sampling ratio 1.0): one RL update of two episodes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import numpy as np
import pytest

from actors.tracing import JOB_STAGES, PREDICT_STAGES
from protocol import ops
from protocol.messages import GetTenantRequest, PredictReply, PredictRequest, TenantConfig
from protocol.subjects import pool_name
from protocol.wire import decode, encode
from sdk.client import AsyncClient
from sdk.sync_client import Client
from sdk.trace_view import load_spans, select
from tests.conftest import module_roles, nexus_cmd, python_env
from tests.master.test_workloads import BASE_SPEC, rl_spec

TENANT = "tt-rl"
SAMPLED = {"NEXUS_TRACE_SAMPLE_RATIO": "1.0"}


@pytest.fixture(scope="module")
def deployment(nats_server, tmp_path_factory):
    procs = module_roles(nats_server, tmp_path_factory, "trace-tree")
    try:
        t0 = time.monotonic()
        _start_all(procs, [("health", {}), ("master", {}), ("trainer", {}), ("env", {}),
                           ("inferencer", {"NEXUS_INFER_BASE": "tiny-qwen3-vl-64"})])
        t1 = time.monotonic()
        spec = rl_spec(TENANT)
        spec["schedule"] = {"budget": {"max_episodes": 2}}  # one update: two episodes, one job
        with Client(procs.nats_url, procs.prefix, timeout_s=30) as c:
            rec = c.submit(spec).wait(timeout_s=300)
        print(f"roles up in {t1 - t0:.1f} s, the RL update in {time.monotonic() - t1:.1f} s")
        assert rec.state == "completed", (rec.state, rec.message)
        procs.workload = rec.workload  # type: ignore[attr-defined]
        procs.traces = procs.data_dir / "traces"  # type: ignore[attr-defined]
        _wait_for(procs.traces, lambda spans: {"inferencer.weights_load", "job.sync"} <= {s.name for s in spans})
        yield procs
    finally:
        procs.stop_all()


def _start_all(procs, roles):
    """Start every role at once, then wait for each: their start-ups overlap."""
    started = []
    wait = procs.wait_ready
    procs.wait_ready = lambda *args, **kwargs: started.append(args)  # the waits come after
    try:
        for role, env in roles:
            procs.start(role, **SAMPLED, **env)
    finally:
        del procs.wait_ready
    for args in started:
        wait(*args, timeout_s=120)


def _wait_for(traces, done, timeout_s: float = 15.0):
    """The span processors flush every 0.5 s: wait until the spans wanted are on disk."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = load_spans(traces) if traces.is_dir() else []
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.3)


def _update_trace(deployment):
    spans = load_spans(deployment.traces)
    roots = [s for s in spans
             if s.name == "workflow.rl.update" and s.attributes.get("nexus.workload") == deployment.workload]
    assert len(roots) == 1, [(s.name, s.attributes) for s in roots]
    return roots[0], [s for s in spans if s.trace_id == roots[0].trace_id]


def _one(spans, pred, what):
    hits = [s for s in spans if pred(s)]
    assert hits, f"no span: {what}; have {sorted({s.name for s in spans})}"
    return hits[0]


def test_one_rl_update_is_one_trace_across_processes(deployment):
    root, spans = _update_trace(deployment)
    by_id = {s.span_id: s for s in spans}
    parent = lambda s: by_id.get(s.parent_id)  # noqa: E731
    assert root.parent_id == "" and root.service == "nexus-env"
    # env worker -> inferencer: a predict's CLIENT span in the env worker is the parent of the
    # inferencer's SERVER span, whose children are the stages.
    predict = _one(spans, lambda s: s.name == "inferencer.predict" and s.attributes.get("nexus.tenant") == TENANT,
                   "inferencer.predict")
    client = parent(predict)
    assert predict.kind == "SERVER" and predict.service == "nexus-inferencer"
    assert client is not None and client.kind == "CLIENT" and client.service == "nexus-env", client
    assert client.attributes["messaging.system"] == "nats"
    assert client.attributes["messaging.destination.name"].endswith(".infer." + pool_name("tiny-qwen3-vl-64"))
    assert (predict.trace_id, predict.span_id) in client.links  # the reply carried the server span back
    episode = parent(client)
    assert episode is not None and episode.name == "workflow.episode" and parent(episode) is root
    stages = {s.name: s for s in spans if s.parent_id == predict.span_id}
    assert set(PREDICT_STAGES) <= set(stages), sorted(stages)
    assert predict.attributes["nexus.workload"] == deployment.workload
    # The group forward is linked to the requests it served (one forward, many callers).
    forwards = [s for s in load_spans(deployment.traces) if s.name == "inferencer.forward"]
    assert any((predict.trace_id, predict.span_id) in f.links for f in forwards)

    # env worker -> master -> trainer: the queue_put's context is stored with the micro-batch.
    puts = {s.span_id: s for s in spans if s.name == "master.queue_put"}
    assert puts, sorted({s.name for s in spans})
    put = next(iter(puts.values()))
    assert put.kind == "SERVER" and put.service == "nexus-master" and parent(put).service == "nexus-env"
    assert put.attributes["nexus.tenant"] == TENANT and put.attributes["nexus.job"]
    publish = _one(spans, lambda s: s.kind == "PRODUCER" and s.parent_id == put.span_id, "tq publish")
    assert publish.name.endswith(".tq.{tenant}.{job}"), publish.name  # templated: no tenant id in it
    job = _one(spans, lambda s: s.name == "trainer.job", "trainer.job")
    assert job.kind == "CONSUMER" and job.service == "nexus-trainer"
    assert parent(job) is not None and parent(job).kind == "PRODUCER" and parent(job).parent_id in puts  # first put's
    assert job.attributes["nexus.job"] == put.attributes["nexus.job"] == publish.attributes["nexus.job"]
    job_stages = {s.name for s in spans if s.parent_id == job.span_id}
    assert set(JOB_STAGES) - {"job.announce"} <= job_stages, sorted(job_stages)

    # trainer -> inferencer: the announcement (child of the export) is the weight load's parent.
    announce = _one(spans, lambda s: s.name == "job.announce", "job.announce")
    assert announce.kind == "PRODUCER" and parent(announce).name == "job.export" and parent(parent(announce)) is job
    load = _one(spans, lambda s: s.name == "inferencer.weights_load", "inferencer.weights_load")
    assert load.kind == "CONSUMER" and load.service == "nexus-inferencer" and load.parent_id == announce.span_id
    assert load.attributes["nexus.tenant"] == TENANT and load.attributes["nexus.loaded"] is True
    # Four processes (and their roles) in one trace.
    assert {"nexus-env", "nexus-inferencer", "nexus-master", "nexus-trainer"} <= {s.service for s in spans}
    # Templated destinations everywhere: no tenant id in any span name of any process.
    assert not [s.name for s in load_spans(deployment.traces) if TENANT in s.name]


def test_nexus_trace_prints_the_breakdown_and_writes_chrome_json(deployment, tmp_path):
    root, spans = _update_trace(deployment)
    data_dir = str(deployment.data_dir)
    out = tmp_path / "timeline.json"
    # The deployment is live: a late span of the workload (a master's event publish) may land
    # between reads, so the CLI's count is bounded by the spans read before and after it.
    spans_before = len(select(load_spans(deployment.traces), workload=deployment.workload))
    run = subprocess.run(nexus_cmd("trace", "--workload", deployment.workload, "--data-dir", data_dir,
                                   "--chrome", str(out)), capture_output=True, text=True, env=python_env(), timeout=60)
    spans_after = len(select(load_spans(deployment.traces), workload=deployment.workload))
    assert run.returncode == 0, run.stderr
    print(run.stdout)
    assert f"workload {deployment.workload}:" in run.stdout and "CRITICAL PATH" in run.stdout
    for stage in (*PREDICT_STAGES, *(s for s in JOB_STAGES), "trainer.job", "inferencer.predict"):
        assert stage in run.stdout, stage
    chrome = json.loads(out.read_text())
    complete = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e["ph"] == "M"}
    assert len(names) >= 4 and spans_before <= len(complete) <= spans_after, (spans_before, len(complete), spans_after)
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in complete)
    assert any(e["ph"] == "f" for e in chrome["traceEvents"])  # a hop between processes is drawn

    # By trace id (a prefix will do), as JSON: the shares of the critical path add up to 1.
    run = subprocess.run(nexus_cmd("trace", root.trace_id[:12], "--data-dir", data_dir, "--json"),
                         capture_output=True, text=True, env=python_env(), timeout=60)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["traces"] == 1 and report["spans"] == len(spans)
    assert sum(r["share"] for r in report["stages"]) == pytest.approx(1.0)
    # A time window: the last hour holds the update; a window long ago holds nothing; a bad time is named.
    run = subprocess.run(nexus_cmd("trace", "--since", "1h", "--data-dir", data_dir, "--json"),
                         capture_output=True, text=True, env=python_env(), timeout=60)
    assert run.returncode == 0 and json.loads(run.stdout)["traces"] >= 1, run.stderr
    run = subprocess.run(nexus_cmd("trace", "--since", "2000-01-01T00:00", "--until", "2000-01-02T00:00",
                                   "--data-dir", data_dir), capture_output=True, text=True, env=python_env(), timeout=60)
    assert run.returncode == 1 and "no spans" in run.stderr, run.stderr
    run = subprocess.run(nexus_cmd("trace", "--since", "yesterday", "--data-dir", data_dir), capture_output=True,
                         text=True, env=python_env(), timeout=60)
    assert run.returncode == 2 and "'yesterday' is neither a duration ago" in run.stderr, run.stderr
    # An unknown id says so and lists the nearest ids.
    wrong = "f" * 32
    run = subprocess.run(nexus_cmd("trace", wrong, "--data-dir", data_dir), capture_output=True, text=True,
                         env=python_env(), timeout=60)
    assert run.returncode != 0 and f"no trace {wrong!r}" in run.stderr and "nearest:" in run.stderr, run.stderr
    assert any(s.trace_id in run.stderr for s in load_spans(deployment.traces))
    run = subprocess.run(nexus_cmd("trace", "--workload", "no-such-wl", "--data-dir", data_dir),
                         capture_output=True, text=True, env=python_env(), timeout=60)
    assert run.returncode != 0 and "no trace of workload 'no-such-wl'" in run.stderr, run.stderr
    assert deployment.workload in run.stderr  # the nearest workloads named


def test_malformed_or_missing_context_starts_a_new_root_and_fails_nothing(deployment):
    def request(workload: str) -> PredictRequest:
        return PredictRequest(tenant=TENANT, images={c["name"]: np.zeros((64, 64, 3), np.uint8)
                                                     for c in BASE_SPEC["observation"]["cameras"]},
                              state=np.zeros(4, np.float32), instruction="reach", timeout_s=30, workload=workload)

    bad = [{"traceparent": "00-not-a-trace-id-01"}, {"traceparent": "zz" * 40, "tracestate": "garbage==,,"},
           {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}]  # all-zero ids are invalid too

    async def go():
        c = await AsyncClient(deployment.nats_url, deployment.prefix, timeout_s=30).connect()
        try:
            subject = c.names.infer(pool_name("tiny-qwen3-vl-64"))
            replies = []
            for headers in [*bad, None]:  # None: no context at all
                msg = await c.bus.nc.request(subject, encode(request("bad-ctx" if headers else "no-ctx")),
                                             timeout=30, headers=headers)
                replies.append(decode(msg.data, PredictReply))
            # A role op (the runtime's path) with a malformed context is answered too.
            msg = await c.bus.nc.request(ops.MASTER_TENANT_GET.subject(c.names), encode(GetTenantRequest(tenant=TENANT)),
                                         timeout=10, headers=bad[0])
            return replies, decode(msg.data, TenantConfig)
        finally:
            await c.close()

    replies, cfg = asyncio.run(go())
    assert all(isinstance(r, PredictReply) and len(r.actions) for r in replies)
    assert cfg.name == TENANT
    spans = _wait_for(deployment.traces, lambda spans: sum(
        s.name == "inferencer.predict" and s.attributes.get("nexus.workload") in ("bad-ctx", "no-ctx")
        for s in spans) >= 4)
    mine = [s for s in spans
            if s.name == "inferencer.predict" and s.attributes.get("nexus.workload") in ("bad-ctx", "no-ctx")]
    assert len(mine) == 4 and all(s.parent_id == "" for s in mine)  # each a new root
    assert len({s.trace_id for s in mine}) == 4
    # Logged once per kind and place, not once per request.
    inferencer = next(i for r, i, _ in deployment.procs if r == "inferencer")
    log = deployment.log(inferencer)
    assert log.count("malformed trace context") == 1, log[-2000:]
    missing = [ln for ln in log.splitlines() if "missing trace context" in ln and '"inferencer.predict"' in ln]
    assert len(missing) == 1, missing
    master = next(i for r, i, _ in deployment.procs if r == "master")
    assert deployment.log(master).count("malformed trace context") == 1


def test_every_span_name_is_documented():
    from tests.conftest import ROOT

    doc = (ROOT / "docs" / "observability.md").read_text()
    names = [*PREDICT_STAGES, *JOB_STAGES, "inferencer.predict", "inferencer.forward", "inferencer.weights_load",
             "trainer.job", "trainer.round", "master.intake", "workflow.<kind>.update", "workflow.episode"]
    assert not [n for n in names if f"`{n}`" not in doc]


def test_destinations_are_templated_without_tenant_or_job_ids():
    from protocol.subjects import Names, subject_template

    n = Names("nx")
    assert subject_template(n.tq_job("acme", "j1")) == "nx.tq.{tenant}.{job}"
    assert subject_template(n.weights("acme")) == "nx.weights.{tenant}"
    assert subject_template(ops.ENV_STEP.instance_subject(n, "env-3")) == "nx.svc.env.{instance}.step"
    assert subject_template(n.workload_events("w1")) == "nx.workloads.events.{workload}"
    assert subject_template(n.tenant_deleted("acme")) == "nx.tenants.deleted.{tenant}"
    assert subject_template("_INBOX.abc.def") == "_INBOX.{id}"
    assert subject_template(ops.MASTER_LEASE.subject(n)) == "nx.master.lease"  # nothing to template


def test_critical_path_shares_follow_the_deepest_running_span():
    from sdk.trace_view import GAP, Span, breakdown

    def span(name, sid, parent, start, end):
        return Span(name=name, trace_id="t" * 32, span_id=sid, parent_id=parent, start=start, end=end, kind="INTERNAL",
                    service="s", instance="i")

    # A root [0, 4]; its child [1, 2]; an async grandchild [5, 6] that starts after both ended
    # (a trainer's job after the master's publish): 1 s of the timeline runs nothing.
    rows = {r.name: r for r in breakdown([span("root", "a", "", 0, 4), span("pub", "b", "a", 1, 2),
                                          span("job", "c", "b", 5, 6)])}
    assert rows["root"].share == pytest.approx(3 / 6) and rows["pub"].share == pytest.approx(1 / 6)
    assert rows["job"].share == pytest.approx(1 / 6) and rows[GAP].share == pytest.approx(1 / 6)
    assert rows["root"].count == 1 and rows["root"].p50_ms == pytest.approx(4000)


def test_a_spec_on_the_intake_stream_joins_its_publishers_trace(deployment):
    # A plain NATS client publishes a spec (here a bad one: rejected, cheaply) with its own
    # W3C context; the master's intake span is that context's child, marked as an error.
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def go():
        c = await AsyncClient(deployment.nats_url, deployment.prefix, timeout_s=30).connect()
        try:
            await c.bus.js.publish(c.names.workloads_submit, json.dumps({"tenant": TENANT, "task": "nope"}).encode(),
                                   headers={"traceparent": f"00-{trace_id}-{span_id}-01"}, timeout=10)
        finally:
            await c.close()

    asyncio.run(go())
    spans = _wait_for(deployment.traces, lambda spans: any(s.trace_id == trace_id for s in spans))
    intake = [s for s in spans if s.trace_id == trace_id and s.name == "master.intake"]
    assert len(intake) == 1 and intake[0].parent_id == span_id and intake[0].kind == "CONSUMER", intake
    assert intake[0].error and intake[0].attributes["nexus.workload"].startswith("i")
    assert intake[0].attributes["messaging.destination.name"].endswith(".workloads.submit")


def test_sdk_calls_are_the_parents_of_env_session_ops_and_predicts(deployment):
    # A user's own tracer on the SDK client: env session ops and a predict become children of
    # the user's spans in the env worker and the inferencer.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def go():
        c = await AsyncClient(deployment.nats_url, deployment.prefix, timeout_s=30, tracer=tracer).connect()
        try:
            with tracer.start_as_current_span("user.session") as root:
                session = await c.env_create(BASE_SPEC["env"]["id"])
                obs = await c.env_reset(session, seed=1)
                await c.env_step(session, np.zeros(2, np.float32))
                await c.env_close(session)
                await c.predict(TENANT, obs.images, obs.state, obs.instruction, workload="sdk-call")
                return format(root.get_span_context().trace_id, "032x")
        finally:
            await c.close()

    trace_id = asyncio.run(go())
    clients = {format(s.context.span_id, "016x"): s for s in exporter.get_finished_spans() if s.kind.name == "CLIENT"}
    want = {"env.create", "env.reset", "env.step", "env.close", "inferencer.predict"}
    spans = _wait_for(deployment.traces, lambda spans: want <= {s.name for s in spans if s.trace_id == trace_id})
    server = {s.name: s for s in spans if s.trace_id == trace_id and s.name in want}
    assert set(server) == want, sorted(server)
    for name, s in server.items():
        assert s.kind == "SERVER" and s.parent_id in clients, (name, s.parent_id)  # the SDK's span, another process
    assert server["env.step"].attributes["messaging.destination.name"] == f"{deployment.prefix}.svc.env.{{instance}}.step"
    assert server["env.create"].service == "nexus-env" and server["inferencer.predict"].service == "nexus-inferencer"
    provider.shutdown()
