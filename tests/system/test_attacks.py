"""The attack suite: a tenant holding valid credentials tries to reach the platform's secrets,
another tenant's data, or an unbounded resource, through the services themselves.

One real deployment (`nexus up` in operator mode). Tenant alice runs a short SFT workload of
her own to the end (a report, a policy version, a recorded dataset); tenant mallory, with her
own valid credentials, then tries every attack in the table below. Each attack asserts the
refusal it expects (the error type, and the field or op it names), and after all of them the
suite asserts that nothing changed: a hash of `auth/` (every seed and JWT), `cluster.json`,
alice's reports and datasets, and alice's records in the platform's KV buckets (tenant
config, workloads, jobs, versions) is the same before and after. No refusal names another
tenant (alice) to mallory.

docs/security.md's threat model points at each attack by its name here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec
import nats.js.errors
import numpy as np
import pytest

from transport.creds import redact_url
from transport.cluster import ClusterState
from protocol import ops
from protocol.subjects import Names
from sdk.client import AsyncClient
from tests.conftest import nexus_cmd, nexus_up, python_env, tenant_create
from tests.master.test_workloads import rl_spec, sft_spec

BASE = "tiny-qwen3-vl-64"


def nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env(NEXUS_INFER_BASE=BASE))


def _hash_tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            continue
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[rel] = "dir"
    return out


def _raw(msg_type: type, body: dict[str, Any]) -> bytes:
    """A message as a hostile client sends it: its own code skips every check of ours."""
    from protocol.wire import packb

    return packb({"kind": msg_type.KIND, "v": msg_type.VERSION, "body": body})


# The tenant that mallory never names: no message she gets may name it (issue 23 item 7).
HIDDEN = "zeta-hidden"
SESSIONS_PER_TENANT = 3
QUEUED_PER_TENANT = 4
MAX_CONNS = 6
CAMERAS = {"observation.images.top": "top", "observation.images.wrist": "wrist"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("attacks")
    with nexus_up(data_dir, NEXUS_INFER_BASE=BASE, NEXUS_ENV_MAX_SESSIONS_PER_TENANT=str(SESSIONS_PER_TENANT),
                  NEXUS_INFER_MAX_QUEUED_PER_TENANT=str(QUEUED_PER_TENANT)) as state:
        yield state, _tenants(data_dir), data_dir, _operator_base(data_dir)


def _tenants(data_dir: Path) -> dict[str, str]:
    """alice, the hidden tenant and mallory (under account limits), each's creds path."""
    mallory = ("--max-conns", str(MAX_CONNS), "--max-payload-kb", "256", "--storage-mb", "1")
    return {tenant: tenant_create(data_dir, tenant, *flags)["creds"]
            for tenant, flags in (("alice", ()), (HIDDEN, ()), ("mallory", mallory))}


def _operator_base(data_dir: Path) -> Path:
    """A base directory the operator registered (`nexus base add tiny DIR`)."""
    base_dir = data_dir / "operator-bases" / "tiny"
    base_dir.mkdir(parents=True)
    out = nexus("base", "add", "tiny", str(base_dir), "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    return base_dir


def _url(state: ClusterState) -> str:
    return redact_url(state.nats_url)


async def _records(admin: AsyncClient, names: Names) -> dict[str, bytes]:
    """Every record (its value, not its revision) of the platform's tenants, workloads,
    versions and bases buckets, and the names of every stream. Jobs are left out: a job's
    lease and expiry move on their own; the attacked job is checked field by field."""
    js = admin.bus.js
    out: dict[str, bytes] = {}
    for bucket in (names.kv_tenants, names.kv_workloads, names.kv_versions, names.kv_bases):
        kv = await js.key_value(bucket)
        for _ in range(20):
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                keys = []
            # nats-py's keys() can end its watch before the first entry arrives on a loaded host
            # (its pending count read as 0): a bucket whose stream holds messages has keys.
            if keys or (await js.stream_info(f"KV_{bucket}")).state.messages == 0:
                break
            await asyncio.sleep(0.2)
        for key in keys:
            out[f"{bucket}/{key}"] = (await kv.get(key)).value or b""
    out["streams"] = json.dumps(sorted(s.config.name for s in await js.streams_info())).encode()
    # Every object of the weights bucket (policies, uploaded starts) by name and digest: a
    # refused upload stores nothing, no refusal deletes or replaces a version.
    store = await js.object_store(names.obj_weights)
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        infos = []
    out["weights objects"] = json.dumps(sorted((i.name, i.digest) for i in infos)).encode()
    return out


def _files(data_dir: Path) -> dict[str, str]:
    """auth/ (every seed and JWT), the roles' creds, cluster.json, every report and dataset,
    every staged upload."""
    out = {f"auth/{k}": v for k, v in _hash_tree(data_dir / "auth").items()}
    for sub in ("role-creds", "reports", "datasets", "uploads"):
        out |= {f"{sub}/{k}": v for k, v in _hash_tree(data_dir / sub).items()}
    out["cluster.json"] = hashlib.sha256((data_dir / "cluster.json").read_bytes()).hexdigest()
    return out


def _item(tenant: str, job: str, seq: int = 0):
    from protocol.messages import QueuePutRequest

    b = 2
    return QueuePutRequest(tenant=tenant, job=job, seq=seq,
                           images={"top": np.zeros((b, 64, 64, 3), np.uint8), "wrist": np.zeros((b, 64, 64, 3), np.uint8)},
                           state=np.zeros((b, 4), np.float32), instructions=["reach"] * b,
                           actions=np.zeros((b, 1, 2), np.float32))


def _spec(**changes: Any) -> dict:
    """mallory's own one-step SFT spec with ``changes`` ('a__b': value sets spec['a']['b'];
    None removes the key)."""
    spec = sft_spec("mallory", steps=1)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


Attack = tuple[Callable[[], Awaitable[Any]], tuple[str, ...], str]


def _outcome(result: Any) -> dict[str, Any]:
    """What a tenant got back: an error's code, message and details, or ALLOWED."""
    from protocol.errors import NexusError
    from protocol.messages import ErrorReply

    if isinstance(result, NexusError):
        return {"code": result.code.value, "message": result.message, "details": result.details}
    if isinstance(result, ErrorReply):
        return {"code": result.code, "message": result.message, "details": result.details}
    if isinstance(result, BaseException):
        return {"code": "server_refused", "message": str(result), "details": {}}
    return {"code": "ALLOWED", "message": repr(result)[:300], "details": {}}


def test_a_tenant_with_valid_credentials_reaches_nothing_it_does_not_own(deployment, tmp_path):
    from protocol.messages import ScaleRequest
    from protocol.messages import (CheckpointCommitRequest, QueuePutRequest, CreateTenantRequest, DatasetBatch, DrainRequest,
                                   EnvCreateRequest, EnvSession, EnvStepRequest, ExportRequest, GetTenantRequest,
                                   HandbackRequest, InfoRequest, JobRecord, JobRef, JobsReply, JobsRequest,
                                   LeaseReply, LeaseRequest, ListReply, ListRequest, LoadWeightsRequest, Ok,
                                   PredictReply, PredictRequest, QueueGetReply, QueueGetRequest, ReserveRequest, SampleRequest,
                                   SubmitRequest, TenantConfig, TenantDeleted, TenantDeleteRequest, TenantQuotas,
                                   TenantQuotasRequest, TenantsReply, TrainBatchReply, UsageReply, UsageRequest,
                                   WeightsReadRequest, WeightsRef, WorkloadRecord, WorkloadRef, WorkloadReport,
                                   WorkloadsReply, WorkloadsRequest, BaseAddRequest, RegisteredBase,
                                   HostedClaimReply, HostedClaimRequest, HostedEventRequest, InitWeightsRequest,
                                   WeightsUploadRequest, WorkloadEvent)
    from protocol.policy import MAX_UPLOAD_BYTES
    from protocol.errors import NexusError
    from protocol.subjects import pool_name

    state, creds, data_dir, base_dir = deployment
    names = Names(state.prefix)
    m = names.master
    trainer = lambda op: names.role_op("trainer", op)  # noqa: E731
    obs_images = {"top": np.zeros((64, 64, 3), np.uint8), "wrist": np.zeros((64, 64, 3), np.uint8)}

    async def go():
        admin = await AsyncClient(state.nats_url, state.prefix, timeout_s=60).connect()
        a = await AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["alice"]).connect()
        mal = await AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["mallory"]).connect()
        # alice's own work, to its end: a report, a policy version, recorded demos.
        wl = await a.submit(sft_spec("alice", steps=2))
        done = await wl.wait(timeout_s=300)
        assert done.state == "completed", done
        job = await a.reserve("alice", "sft", auto=False, key="attack-1")
        await a.queue_put(_item("alice", job.job))
        session = await a.env_create("builtin/reach-v0")
        alice_cfg = await a.tenant("alice")
        alice_demos = next((data_dir / "datasets" / "tenants" / "alice").iterdir())
        # The hidden tenant is registered; mallory has her own slot, under the operator's quotas.
        await admin.create_tenant(msgspec.structs.replace(alice_cfg, name=HIDDEN))
        await mal.create_tenant(msgspec.structs.replace(alice_cfg, name="mallory", quotas=None))
        await admin.update_quotas("mallory", max_priority=2, max_inflight_jobs=2)
        mine = await admin.tenant("mallory")
        # One short of her share: the attacks below take the last one, then ask past it.
        mal_sessions = [await mal.env_create("builtin/reach-v0") for _ in range(SESSIONS_PER_TENANT - 1)]

        files_before, records_before = _files(data_dir), await _records(admin, names)
        job_before = await admin.job("alice", job.job)

        b = mal.bus

        def req(subject: str, msg: Any, expect: Any) -> Callable[[], Awaitable[Any]]:
            return lambda: b.request(subject, msg, expect, timeout_s=60)

        def raw(subject: str, msg_type: type, body: dict, expect: Any) -> Callable[[], Awaitable[Any]]:
            return lambda: b.request(subject, None, expect, timeout_s=60, raw=_raw(msg_type, body))

        def submit(spec: dict) -> Callable[[], Awaitable[Any]]:
            return req(m("submit"), SubmitRequest(spec=spec), WorkloadRecord)

        def create(**changes: Any) -> Callable[[], Awaitable[Any]]:
            cfg = msgspec.structs.replace(mine, **{"quotas": None, **changes})
            return req(m("tenant_create"), CreateTenantRequest(config=cfg, exist_ok=True), TenantConfig)

        async def past_share() -> Any:
            mal_sessions.append(await mal.env_create("builtin/reach-v0"))  # her last one: fine
            return await b.call(ops.ENV_CREATE, EnvCreateRequest(env_id="builtin/reach-v0"), timeout_s=60)

        PD, IF, QE = ("permission_denied",), ("invalid_field",), ("quota_exceeded",)
        NF, FP = ("not_found",), ("failed_precondition",)
        auth = str(data_dir / "auth")
        attacks: dict[str, Attack] = {
            # -- paths in every field that takes one ----------------------------------------
            "report_path ../auth/state.json": (submit(_spec(outputs__report_path="../auth/state.json")), IF, "report_path"),
            "report_path ../../cluster.json": (submit(_spec(outputs__report_path="../../cluster.json")), IF, "report_path"),
            "report_path absolute": (submit(_spec(outputs__report_path=f"{auth}/state.json")), IF, "report_path"),
            "report_path a/../../x": (submit(_spec(outputs__report_path="a/../../../auth/x.json")), IF, "report_path"),
            "report_path odd characters": (submit(_spec(outputs__report_path="x\n../y")), IF, "report_path"),
            "dataset.root the auth dir": (submit(_spec(env=None, dataset={"root": auth, "camera_map": CAMERAS})),
                                          PD, "dataset.root"),
            "dataset.root alice's demos": (submit(_spec(env=None, dataset={"root": str(alice_demos),
                                                                           "camera_map": CAMERAS})), PD, "dataset.root"),
            "dataset.root through ..": (submit(_spec(env=None, dataset={
                "root": str(data_dir / "datasets" / "tenants" / "mallory" / ".." / "alice"),
                "camera_map": CAMERAS})), PD, "dataset.root"),
            "dataset.root relative": (submit(_spec(env=None, dataset={"root": "../../auth", "camera_map": CAMERAS})),
                                      PD, "dataset.root"),
            "sample the data dir": (req(ops.ENV_SAMPLE.subject(names), SampleRequest(root=str(data_dir), n=1), DatasetBatch), PD, "root"),
            "sample alice's demos": (req(ops.ENV_SAMPLE.subject(names), SampleRequest(root=str(alice_demos), n=1), DatasetBatch),
                                     PD, "root"),
            "sample /etc": (req(ops.ENV_SAMPLE.subject(names), SampleRequest(root="/etc", n=1), DatasetBatch), PD, "root"),
            "base a host path": (submit(_spec(base=str(base_dir))), IF, "base"),
            "base a relative path": (submit(_spec(base="./models")), IF, "base"),
            "base the data dir": (submit(_spec(base=str(data_dir) + "/")), IF, "base"),
            "tenant_create base a host path": (create(base=str(base_dir)), IF, "config.base"),
            "register a base": (req(m("base_add"), BaseAddRequest(name="mine", path=str(data_dir)), RegisteredBase),
                                PD, "base_add"),
            # -- another tenant's names and ids in every operation -----------------------------
            "tenant_get alice": (req(m("tenant_get"), GetTenantRequest(tenant="alice"), TenantConfig), PD, ""),
            "tenant_create alice": (req(m("tenant_create"), CreateTenantRequest(config=alice_cfg, exist_ok=True),
                                        TenantConfig), PD, ""),
            "tenant_delete alice": (req(m("tenant_delete"), TenantDeleteRequest(tenant="alice"), TenantDeleted), PD, ""),
            "reserve for alice": (req(m("reserve"), ReserveRequest(
                tenant="alice", task="sft", auto=False), JobRecord), PD, ""),
            "queue_put into alice's job": (req(m("queue_put"), _item("alice", job.job, seq=1), JobRecord), PD, ""),
            "mark_ready alice's job": (req(m("mark_ready"), JobRef(tenant="alice", job=job.job), JobRecord), PD, ""),
            "job of alice": (req(m("job"), JobRef(tenant="alice", job=job.job), JobRecord), PD, ""),
            "jobs of alice": (req(m("jobs"), JobsRequest(tenant="alice"), JobsReply), PD, ""),
            "queue_get alice's items": (req(m("queue_get"), QueueGetRequest(tenant="alice", job=job.job), QueueGetReply),
                                        PD, ""),
            "queue_clear alice's job": (req(m("queue_clear"), JobRef(tenant="alice", job=job.job), JobRecord), PD, ""),
            "workload by alice's id": (req(m("workload"), WorkloadRef(workload=wl.id), WorkloadRecord), PD, ""),
            "workload_report of alice's": (req(m("workload_report"), WorkloadRef(workload=wl.id), WorkloadReport), PD, ""),
            "cancel alice's workload": (req(m("cancel"), WorkloadRef(workload=wl.id), WorkloadRecord), PD, ""),
            "workloads of alice": (req(m("workloads"), WorkloadsRequest(tenant="alice"), WorkloadsReply), PD, ""),
            "usage of alice": (req(m("usage"), UsageRequest(tenant="alice"), UsageReply), PD, ""),
            "submit as alice": (submit(sft_spec("alice", steps=1)), PD, ""),
            "weights_read alice's policy": (req(m("weights_read"), WeightsReadRequest(tenant="alice"), Ok), PD, ""),
            "train_batch alice's job": (req(trainer("train_batch"), JobRef(tenant="alice", job=job.job), TrainBatchReply),
                                        PD, ""),
            "export alice's params": (req(trainer("export_params"), ExportRequest(tenant="alice"), WeightsRef), PD, ""),
            "load alice's weights": (req(trainer("load_weights"), LoadWeightsRequest(
                tenant="mallory", object_name="alice/v00000001"), Ok), PD, ""),
            "predict on alice's head": (req(names.infer(pool_name(BASE)), PredictRequest(
                tenant="alice", images=obs_images, state=np.zeros(4, np.float32), instruction="reach", timeout_s=20),
                PredictReply), PD, ""),
            "step alice's env session": (req(ops.ENV_STEP.instance_subject(names, session.worker), EnvStepRequest(
                session=session.session, action=np.zeros(2, np.float32)), Ok), PD, ""),
            "upload weights as alice": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="alice", name="start", offset=0, data=b"x"), Ok), PD, ""),
            "claim alice's hosted workloads": (req(m("hosted_claim"), HostedClaimRequest(
                tenant="alice", process="p1"), HostedClaimReply), PD, ""),
            "hosted event as alice": (req(m("hosted_event"), HostedEventRequest(
                tenant="alice", process="p1", event=WorkloadEvent(workload=wl.id, tenant="alice", kind="done",
                                                                  state="completed")), Ok), PD, ""),
            "hosted event for alice's workload": (req(m("hosted_event"), HostedEventRequest(
                tenant="mallory", process="p1", event=WorkloadEvent(workload=wl.id, tenant="mallory", kind="done",
                                                                    state="completed")), Ok), NF, wl.id),
            "rollout turn for alice": (req(m("rollout_begin"), JobRef(tenant="alice", job=wl.id), Ok), PD, ""),
            "rollout turn on alice's workload id": (req(m("rollout_begin"), JobRef(tenant="mallory", job=wl.id), Ok),
                                                    FP, "no running workload"),
            "end alice's rollout turn": (req(m("rollout_end"), JobRef(tenant="alice", job=wl.id), Ok), PD, ""),
            "start from alice's upload": (submit(_spec(init={"weights": "alice-start"})), IF, "init"),
            # -- uploads: names, offsets and sizes ----------------------------------------------
            "upload named ../auth": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="mallory", name="../auth", offset=0, data=b"x"), Ok), IF, "name"),
            "upload named a/b": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="mallory", name="a/b", offset=0, data=b"x"), Ok), IF, "name"),
            "upload past the largest file": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="mallory", name="huge", offset=MAX_UPLOAD_BYTES, data=b"x"), Ok), IF, "largest upload"),
            "upload a slice past what is staged": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="mallory", name="gap", offset=4096, data=b"x"), Ok), IF, "offset"),
            "upload a negative offset": (raw(m("weights_upload"), WeightsUploadRequest, {
                "tenant": "mallory", "name": "neg", "offset": -1, "data": b"x", "final": False}, Ok), IF, "offset"),
            "upload a file that is not safetensors": (req(m("weights_upload"), WeightsUploadRequest(
                tenant="mallory", name="junk", offset=0, data=b"not safetensors", final=True), Ok), IF,
                "safetensors"),
            "a hosted claim running 10,000 workloads": (raw(m("hosted_claim"), HostedClaimRequest, {
                "tenant": "mallory", "process": "p1", "running": [f"w{i}" for i in range(10_000)], "capacity": 1,
                "leaving": False}, HostedClaimReply), IF, "running"),
            "a hosted claim of capacity 10^6": (raw(m("hosted_claim"), HostedClaimRequest, {
                "tenant": "mallory", "process": "p1", "running": [], "capacity": 10**6, "leaving": False},
                HostedClaimReply), IF, "capacity"),
            "a hosted process named ../x": (req(m("hosted_claim"), HostedClaimRequest(
                tenant="mallory", process="../x"), HostedClaimReply), IF, "process"),
            # -- the platform's own ops ---------------------------------------------------------
            "start a tenant from weights (the trainer's op)": (req(trainer("init_weights"), InitWeightsRequest(
                config=mine, weights="alice/upload-start"), Ok), PD, ""),
            "list every tenant": (req(m("tenants"), WorkloadsRequest(), TenantsReply), PD, ""),
            "list the registry": (req(m("list"), ListRequest(), ListReply), PD, ""),
            "lease alice's job": (req(m("lease"), LeaseRequest(trainer="x", tenant="alice", job=job.job), LeaseReply),
                                  PD, ""),
            "commit a checkpoint": (req(m("checkpoint_commit"), CheckpointCommitRequest(
                tenant="mallory", object_name="mallory/x", base_checkpoint="", trainer="x"), Ok), PD, ""),
            "hand alice's workload back": (req(m("handback"), HandbackRequest(worker="x", workloads=[wl.id]), Ok), PD, ""),
            "drain the master": (req(m("drain"), DrainRequest(reason="attack"), Ok), PD, ""),
            "a trainer's info": (req(trainer("info"), InfoRequest(), Ok), PD, ""),
            # The supervisor's subjects are not exported to tenant accounts: nothing answers.
            "scale a pool (the supervisor's op)": (req(names.supervisor("scale"), ScaleRequest(
                role="inferencer", count=8, pool="tiny-qwen3-vl-64"), Ok), ("unavailable",), ""),
            # -- its own quotas -------------------------------------------------------------------
            "set its own quotas": (req(m("tenant_quotas"), TenantQuotasRequest(
                tenant="mallory", quotas=TenantQuotas(max_inflight_jobs=64)), TenantConfig), PD, ""),
            "tenant_create with quotas": (create(quotas=TenantQuotas(max_inflight_jobs=64)), IF, "config.quotas"),
            "tenant_create priority over its ceiling": (create(priority=9), IF, "priority"),
            "tenant_create in-flight over its quota": (create(max_inflight_jobs=50), IF, "max_inflight_jobs"),
            "submit priority over its ceiling": (submit(_spec(schedule={"priority": 9})), IF, "priority"),
            "submit in-flight over its quota": (submit(_spec(schedule={"max_inflight_jobs": 50})), IF, "max_inflight_jobs"),
            # -- a workload kind, a KL weight (issue 28's recipe kinds, issue 25's KL term) ------------
            "task a path": (submit(_spec(task="../../auth/state")), IF, "allowed: sft, rl, eval"),
            "task a 300-character kind": (submit(_spec(task="k" * 300)), IF, "allowed: sft, rl, eval"),
            "queue_put with a NaN KL weight": (raw(m("queue_put"), QueuePutRequest, {
                **msgspec.structs.asdict(_item("mallory", "j-kl")), "kl_coef": float("nan")}, JobRecord), IF, "kl_coef"),
            "queue_put anchoring to version -5": (raw(m("queue_put"), QueuePutRequest, {
                **msgspec.structs.asdict(_item("mallory", "j-kl")), "kl_coef": 0.1, "anchor_version": -5}, JobRecord),
                IF, "anchor_version"),
            # -- issue 25's outcome advantages: a kind and a group size, checked at submit ---------
            "an advantage kind that is a path": (submit({**rl_spec("mallory"), "algorithm": {
                "advantage": "../auth", "episodes_per_update": 2}}), IF, "advantage"),
            "groups of 10^6 episodes": (submit({**rl_spec("mallory"), "algorithm": {
                "advantage": "group_success", "group_size": 10**6, "episodes_per_update": 10**6}}), IF, "group_size"),
            "a head switch set to a path": (submit(_spec(action_module={
                "kind": "gaussian", "params": {"value_detach": "../auth"}})), IF, "value_detach"),
            # -- sizes and rates past every limit -------------------------------------------------
            "sample 10,000 indices": (raw(ops.ENV_SAMPLE.subject(names), SampleRequest, {
                "root": "/x", "n": 1, "seed": None, "indices": list(range(10_000))}, DatasetBatch), IF, "indices"),
            "sample n=1e9": (raw(ops.ENV_SAMPLE.subject(names), SampleRequest, {
                "root": "/x", "n": 10**9, "seed": None, "indices": []}, DatasetBatch), IF, "n"),
            "an env with 100k-pixel frames": (req(ops.ENV_CREATE.subject(names), EnvCreateRequest(
                env_id="builtin/reach-v0", options={"image_size": 100_000}), EnvSession), IF, "image_height"),
            "a ManiSkill env switch set to a path": (req(ops.ENV_CREATE.subject(names), EnvCreateRequest(
                env_id="maniskill/PushCube-v1", options={"ignore_terminations": "../auth"}), EnvSession), IF,
                "ignore_terminations"),
            "an env session past its share": (past_share, QE, "env_sessions_per_tenant"),
            "an eval of 10^9 episodes": (submit({"tenant": "mallory", "task": "eval", "env": _spec()["env"],
                                                "eval": {"version": "latest", "episodes": 10**9}}), IF, "episodes"),
            "a schema of 500 cameras": (create(schema={**mine.schema, "cameras": [
                {"name": f"c{i}", "height": 8, "width": 8} for i in range(500)]}), IF, "at most 8"),
            "a 10,000-pixel camera": (submit(_spec(observation={"cameras": [{"name": "top", "height": 10_000,
                                                                              "width": 64}]})), IF, "height"),
            "a 65-character tenant name": (submit({**_spec(), "tenant": "m" * 65}), IF + PD, ""),
            "a wildcard tenant name": (req(m("jobs"), JobsRequest(tenant="alice.>"), JobsReply), IF + PD, ""),
        }

        results: dict[str, dict[str, Any]] = {}
        for what, (call, _, _) in attacks.items():
            try:
                results[what] = _outcome(await call())
            except NexusError as exc:
                results[what] = _outcome(exc)

        # Past the account's limits, as the server enforces them.
        extra = []
        try:
            for _ in range(MAX_CONNS + 1):
                extra.append(await nats.connect(_url(state), user_credentials=creds["mallory"], allow_reconnect=False,
                                                max_reconnect_attempts=0, connect_timeout=5))
            results["connections past its limit"] = _outcome("connected")
        except Exception as exc:  # nats.py raises the server's -ERR as it is
            results["connections past its limit"] = _outcome(exc)
        for nc in extra:
            await nc.close()
        heard: list[str] = []

        async def quiet(exc: Exception) -> None:  # the server's -ERR, then the reset
            heard.append(str(exc))

        big = await nats.connect(_url(state), user_credentials=creds["mallory"], allow_reconnect=False,
                                 max_reconnect_attempts=0, connect_timeout=5, error_cb=quiet)
        await big.publish(m("list"), b"y" * 300_000)
        for _ in range(100):
            if big.is_closed or not big.is_connected:
                break
            await asyncio.sleep(0.05)
        results["a message past its payload limit"] = _outcome(
            ConnectionError(f"closed by the server: {heard}") if (big.is_closed or not big.is_connected) else "still connected")
        if not big.is_closed:
            await big.close()
        await mal.put_own_object("mallory-data", "a", b"a" * 600_000)
        try:
            await mal.put_own_object("mallory-data", "b", b"b" * 600_000)
            results["storage past its quota"] = _outcome("stored")
        except NexusError as exc:
            results["storage past its quota"] = _outcome(exc)

        for s in mal_sessions:
            await mal.env_close(s)
        job_after = await admin.job("alice", job.job)
        files_after, records_after = _files(data_dir), await _records(admin, names)
        mine_after = await admin.tenant("mallory")
        for c in (mal, a, admin):
            await c.close()
        return (attacks, results, files_before, files_after, records_before, records_after,
                (job_before.state, job_before.items), (job_after.state, job_after.items), mine, mine_after)

    (attacks, results, files_before, files_after, records_before, records_after,
     job_before, job_after, mine, mine_after) = asyncio.run(go())

    allowed = [w for w, r in results.items() if r["code"] == "ALLOWED"]
    assert not allowed, {w: results[w] for w in allowed}
    wrong = {w: results[w] for w, (_, codes, needle) in attacks.items()
             if results[w]["code"] not in codes or needle not in results[w]["message"] + json.dumps(results[w]["details"])}
    assert not wrong, {w: (r["code"], r["message"][:240]) for w, r in wrong.items()}
    assert "maximum account active connections" in results["connections past its limit"]["message"].lower()
    assert results["a message past its payload limit"]["code"] == "server_refused"
    assert results["storage past its quota"]["code"] == "quota_exceeded"
    assert len(results) >= 40, len(results)
    # No refusal names a tenant mallory did not name herself.
    leaks = {w: r for w, r in results.items() if HIDDEN in r["message"] + json.dumps(r["details"], default=str)}
    assert not leaks, leaks
    # Nothing changed: the seeds, the roles' creds, cluster.json, every report and dataset,
    # every tenant's and workload's record, the streams; alice's open job; mallory's quotas.
    changed = sorted(k for k in files_before.keys() | files_after.keys() if files_before.get(k) != files_after.get(k))
    assert not changed, changed
    changed = sorted(k for k in records_before.keys() | records_after.keys()
                     if records_before.get(k) != records_after.get(k))
    assert not changed, {k: (records_before.get(k, b"<none>")[:400], records_after.get(k, b"<none>")[:400])
                         for k in changed}
    assert job_after == job_before
    assert mine_after.quotas == mine.quotas and mine_after.quotas.max_priority == 2
