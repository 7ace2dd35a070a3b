"""Every path a tenant names is confined to that tenant, and no message names another tenant.

Unit level (fast): where a report goes and how it is written and read back (never through a
link, never another workload's), whose datasets a caller may read, publishing a dataset.
On a real deployment (`nexus up` in operator mode, `nexus tenant create`): a tenant's
report_path attempts at the platform's files (auth/, cluster.json) are refused or land under
reports/<tenant>/ and leave those files byte-identical; another tenant's datasets are refused,
a published one is read; a base path from a tenant is refused, a registered base accepted;
refusals name none of the deployment's other tenants.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from actors.identity import PLATFORM, Caller
from actors.paths import confine
from transport.cluster import ClusterState
from transport.datasets import data_roots, publish_dataset, published_datasets, tenant_datasets
from master.reports import read_report, report_file, write_report
from protocol import ops
from protocol.errors import InvalidField, NexusError, NotFound, PermissionDenied
from protocol.messages import DatasetBatch, SampleRequest, WorkloadRecord
from sdk.client import AsyncClient
from tests.conftest import nexus_cmd, nexus_up, python_env, tenant_create
from tests.master.test_workloads import sft_spec, rl_spec

BASE = "tiny-qwen3-vl-64"
ALICE = Caller(account="AALICE", tenant_tag="alice")


def _rec(tenant: str, workload: str, report_path: str | None = None) -> WorkloadRecord:
    outputs = {"report_path": report_path} if report_path else {}
    return WorkloadRecord(workload=workload, tenant=tenant, task="sft", state="completed",
                          spec={"outputs": outputs}, created_at=0.0, updated_at=0.0)


def _platform_files(data_dir: Path) -> dict[str, str]:
    out = {}
    for path in sorted([*(data_dir / "auth").rglob("*"), data_dir / "cluster.json"]):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(data_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# -- reports, unit level -------------------------------------------------------------------
def test_reports_live_under_the_tenants_reports_dir(tmp_path):
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "state.json").write_text("seeds")
    (tmp_path / "cluster.json").write_text("{}")
    before = _platform_files(tmp_path)
    assert report_file(tmp_path, _rec("alice", "w1")) == tmp_path.resolve() / "reports" / "alice" / "w1.json"
    for rel in ("auth/state.json", "cluster.json", "runs/first.json"):
        path = write_report(tmp_path, _rec("alice", "w1", rel))
        assert path == tmp_path.resolve() / "reports" / "alice" / rel
        assert read_report(tmp_path, _rec("alice", "w1", rel))["workload"] == "w1"
    assert _platform_files(tmp_path) == before
    # A stored record whose path breaks the rule (written before it, or by hand) is refused too.
    for bad in ("../auth/state.json", "/etc/x", "a//b"):
        with pytest.raises(ValueError, match="outputs.report_path"):
            write_report(tmp_path, _rec("alice", "w2", bad))
    with pytest.raises(ValueError, match="no tenant name"):
        write_report(tmp_path, _rec("../x", "w2"))


def test_a_planted_link_is_never_followed(tmp_path):
    (tmp_path / "cluster.json").write_text("platform")
    mine = tmp_path / "reports" / "alice"
    mine.mkdir(parents=True)
    (mine / "out").symlink_to(tmp_path)  # a directory link out
    (mine / "c.json").symlink_to(tmp_path / "cluster.json")  # a file link at the name itself
    (tmp_path / "reports" / "bob").symlink_to(tmp_path)  # a tenant's whole dir a link
    with pytest.raises(OSError):
        write_report(tmp_path, _rec("alice", "w1", "out/cluster.json"))
    write_report(tmp_path, _rec("alice", "w1", "c.json"))  # replaces the link, not its target
    assert (tmp_path / "cluster.json").read_text() == "platform"
    assert not (mine / "c.json").is_symlink()
    with pytest.raises(OSError):
        write_report(tmp_path, _rec("bob", "w1"))
    with pytest.raises(FileNotFoundError):
        read_report(tmp_path, _rec("bob", "cluster"))
    (mine / "d.json").symlink_to(tmp_path / "cluster.json")
    with pytest.raises(FileNotFoundError):  # read back: a link is no report
        read_report(tmp_path, _rec("alice", "w1", "d.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json", "reports"]


def test_a_report_read_back_is_the_workloads_own(tmp_path):
    write_report(tmp_path, _rec("alice", "w1", "same.json"))
    with pytest.raises(FileNotFoundError):  # w2's report was never written: w1's is not handed back
        read_report(tmp_path, _rec("alice", "w2", "same.json"))
    (tmp_path / "reports" / "alice" / "dir.json").mkdir()
    with pytest.raises(OSError):
        write_report(tmp_path, _rec("alice", "w3", "dir.json"))
    with pytest.raises(FileNotFoundError):
        read_report(tmp_path, _rec("alice", "w3", "dir.json"))
    # No temp file is left behind by a failed write.
    assert sorted(p.name for p in (tmp_path / "reports" / "alice").iterdir()) == ["dir.json", "same.json"]


# -- datasets, unit level ------------------------------------------------------------------
def test_a_tenants_reports_are_bounded_oldest_first(tmp_path):
    """Past the bound, the oldest report files go; a link is removed, never its target."""
    from master.reports import _prune_reports

    d = tmp_path / "reports" / "t"
    (d / "sub").mkdir(parents=True)
    outside = tmp_path / "keep.json"
    outside.write_text("x")
    for i in range(5):
        p = d / ("sub" if i % 2 else "") / f"r{i}.json"
        p.write_text("r")
        os.utime(p, (i, i))
    (d / "link").symlink_to(outside)
    os.utime(d / "link", (10, 10), follow_symlinks=False)
    assert _prune_reports(d, keep=3) == 3
    assert sorted(p.name for p in d.rglob("*") if not p.is_dir()) == ["link", "r3.json", "r4.json"]
    assert outside.read_text() == "x"


def test_a_tenant_reads_its_own_and_the_published_datasets_only(tmp_path):
    own, other = tenant_datasets(tmp_path, "alice") / "d", tenant_datasets(tmp_path, "bob") / "d"
    pub = published_datasets(tmp_path) / "p"
    for d in (own, other, pub):
        d.mkdir(parents=True)
    (own / "to-bob").symlink_to(other)
    roots = data_roots(tmp_path, "alice")
    assert confine(str(own), "dataset.root", roots, ALICE) and confine(str(pub), "dataset.root", roots, ALICE)
    for bad in (str(other), str(own / "to-bob"), str(own / ".." / ".." / "bob" / "d"), str(tmp_path / "datasets"),
                str(tmp_path / "auth")):
        with pytest.raises(PermissionDenied) as info:
            confine(bad, "dataset.root", roots, ALICE)
        assert "'bob'" not in info.value.message.replace(repr(bad), "") and "/bob" not in \
            info.value.message.replace(bad, "")
    # A caller that is no tenant has no tenant dir; the platform is not confined.
    assert tenant_datasets(tmp_path, "alice") not in [Path(r) for r in data_roots(tmp_path)]
    assert confine(str(other), "dataset.root", roots, PLATFORM) == str(other)
    with pytest.raises(InvalidField):
        tenant_datasets(tmp_path, "../x")


def _dataset(root: Path) -> Path:
    from envs.lerobot import RecordConfig, record

    record(RecordConfig(out=root, episodes=1, use_videos=False, env_kwargs={"image_size": 32}))
    return root


def test_publish_copies_read_only_and_refuses_links_out(tmp_path):
    src = _dataset(tmp_path / "src")
    target = publish_dataset(src, "reach", tmp_path / "data")
    assert target == published_datasets(tmp_path / "data") / "reach"
    assert json.loads((target / "meta" / "info.json").read_text()) == json.loads((src / "meta" / "info.json").read_text())
    files = [p for p in target.rglob("*") if p.is_file()]
    assert files and all(not (p.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) for p in files)
    with pytest.raises(ValueError, match="already published"):
        publish_dataset(src, "reach", tmp_path / "data")
    (src / "secret").symlink_to(tmp_path / "data")
    with pytest.raises(ValueError, match="link out of the dataset"):
        publish_dataset(src, "reach2", tmp_path / "data")
    (src / "secret").unlink()
    for bad in ("../x", "a/b", "", "x" * 65):
        with pytest.raises(InvalidField):
            publish_dataset(src, bad, tmp_path / "data")
    with pytest.raises(ValueError, match="no LeRobot dataset root"):
        publish_dataset(tmp_path / "data", "nothing", tmp_path / "data")
    # The CLI: an operator's act on the data dir; a bad name is one clear line and exit 2.
    out = subprocess.run(nexus_cmd("dataset", "publish", str(src), "reach", "--data-dir", str(tmp_path / "data"),
                                   "--overwrite"), capture_output=True, text=True, env=python_env(), timeout=120)
    assert out.returncode == 0 and "published" in out.stdout, out.stderr
    out = subprocess.run(nexus_cmd("dataset", "publish", str(src), "../x", "--data-dir", str(tmp_path / "data")),
                         capture_output=True, text=True, env=python_env(), timeout=120)
    assert out.returncode == 2 and "name" in out.stderr and "A-Z a-z 0-9 _ -" in out.stderr, out.stderr


# -- the deployment ------------------------------------------------------------------------
def nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=python_env(NEXUS_INFER_BASE=BASE))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("paths")
    with nexus_up(data_dir, NEXUS_INFER_BASE=BASE) as state:
        creds = {t: tenant_create(data_dir, t)["creds"] for t in ("alice", "bob", "zed-secret-name")}
        yield state, creds, data_dir


def _url(state: ClusterState) -> str:
    from transport.creds import redact_url

    return redact_url(state.nats_url)


def test_report_paths_a_tenant_names_stay_in_its_reports_dir(deployment):
    state, creds, data_dir = deployment
    before = _platform_files(data_dir)
    mine = data_dir / "reports" / "alice"
    mine.mkdir(parents=True, exist_ok=True)
    # Links planted in the tenant's reports dir (as if something had made them): never followed.
    (mine / "evil").symlink_to(data_dir / "auth")
    (mine / "cluster-link.json").symlink_to(data_dir / "cluster.json")

    async def go():
        refused, ended = {}, {}
        async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["alice"]) as a:
            for bad in ("../auth/state.json", "/abs/report.json", "a/../../cluster.json", "evil/../x.json"):
                spec = sft_spec("alice", steps=1)
                spec["outputs"] = {"report_path": bad}
                try:
                    await a.submit(spec)
                    refused[bad] = "ACCEPTED"
                except NexusError as exc:
                    refused[bad] = exc
            for rel in ("auth/state.json", "cluster.json", "evil/state.json", "cluster-link.json"):
                spec = sft_spec("alice", steps=1)
                spec["outputs"] = {"report_path": rel}
                h = await a.submit(spec)
                rec = await a.cancel(h.id)  # terminal: the master writes the report now
                try:
                    ended[rel] = (rec.state, await a.download_report(h.id, data_dir.parent / f"dl-{h.id}"))
                except NexusError as exc:
                    ended[rel] = (rec.state, exc)
        return refused, ended

    refused, ended = asyncio.run(go())
    for bad, exc in refused.items():
        assert isinstance(exc, NexusError) and exc.details["errors"][0]["field"] == "outputs.report_path", (bad, exc)
        assert "inside the tenant's reports dir" in exc.details["errors"][0]["message"]
    assert {rel: state for rel, (state, _) in ended.items()} == dict.fromkeys(ended, "cancelled")
    # Plain names land under reports/alice/ and download back.
    for rel in ("auth/state.json", "cluster.json", "cluster-link.json"):
        path = ended[rel][1]
        assert isinstance(path, Path), (rel, path)
        assert json.loads(path.read_text()) == json.loads((mine / rel).read_text())
        assert not (mine / rel).is_symlink()
    # Through the planted directory link: not written, and the download says so (no old file).
    assert isinstance(ended["evil/state.json"][1], NotFound), ended["evil/state.json"]
    assert "evil/state.json" in ended["evil/state.json"][1].message
    assert str(data_dir) not in ended["evil/state.json"][1].message  # no host path to a tenant
    assert _platform_files(data_dir) == before  # every NATS seed, accounts.conf, cluster.json untouched


def test_datasets_of_another_tenant_are_refused_published_ones_read(deployment, tmp_path):
    state, creds, data_dir = deployment
    src = _dataset(tmp_path / "demos")
    bobs = tenant_datasets(data_dir, "bob") / "w1"
    bobs.parent.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(src, bobs)
    out = nexus("dataset", "publish", str(src), "reach-demos", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    published = published_datasets(data_dir) / "reach-demos"

    async def go():
        got = {}
        async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["alice"]) as a:
            for what, root in {"bob's recorded demos": str(bobs), "the data dir": str(data_dir),
                               "the datasets dir": str(data_dir / "datasets"), "published": str(published)}.items():
                try:
                    got[what] = await a.bus.call(ops.ENV_SAMPLE, SampleRequest(root=root, n=2), timeout_s=60)
                except NexusError as exc:
                    got[what] = exc
            spec = sft_spec("alice", steps=1)
            spec.pop("env")
            spec["dataset"] = {"root": str(bobs), "camera_map": {"observation.images.top": "top",
                                                                  "observation.images.wrist": "wrist"}}
            try:
                got["dataset.root of bob's"] = await a.submit(spec)
            except NexusError as exc:
                got["dataset.root of bob's"] = exc
        return got

    got = asyncio.run(go())
    for what in ("bob's recorded demos", "the data dir", "the datasets dir"):
        assert isinstance(got[what], PermissionDenied), (what, got[what])
        assert "outside the data roots" in got[what].message
        roots = got[what].details["roots"]
        assert str(tenant_datasets(data_dir, "alice").resolve()) in roots
        assert not [r for r in roots if "/bob" in r or "zed-secret-name" in r], roots
    assert isinstance(got["dataset.root of bob's"], PermissionDenied), got["dataset.root of bob's"]
    assert "dataset.root" in got["dataset.root of bob's"].message
    batch = got["published"]
    assert isinstance(batch, DatasetBatch), batch
    assert len(batch.index) == 2


def test_a_tenant_names_presets_and_registered_bases_never_paths(deployment, tmp_path):
    state, creds, data_dir = deployment
    base_dir = tmp_path / "my-base"
    base_dir.mkdir()
    out = nexus("base", "add", "tinyb", str(base_dir), "--data-dir", str(data_dir), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["path"] == str(base_dir.resolve())
    # A tenant may list the names, never the host paths; and may not register one.
    out = nexus("--creds", creds["bob"], "base", "list", "--json", "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    listed = json.loads(out.stdout)
    assert "registered:tinyb" in listed["names"] and BASE in listed["presets"] and listed["bases"] == []
    assert str(base_dir) not in out.stdout
    out = nexus("--creds", creds["bob"], "base", "add", "evil", "/etc", "--data-dir", str(data_dir))
    assert out.returncode != 0 and "permission denied" in out.stderr, out.stdout + out.stderr

    async def go():
        got = {}
        async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["bob"]) as b:
            for what, base in {"a path": str(base_dir), "a relative path": "./my-base",
                               "an unregistered name": "registered:nope"}.items():
                spec = sft_spec("bob", steps=1)
                spec["base"] = base
                try:
                    got[what] = await b.submit(spec)
                except NexusError as exc:
                    got[what] = exc
            from tests.support.tq_helpers import tenant

            for what, base in {"config path": str(base_dir), "config registered": "registered:tinyb"}.items():
                try:
                    got[what] = await b.create_tenant(tenant("bob", base=base))
                except NexusError as exc:
                    got[what] = exc
            rl = rl_spec("bob-rl")
            rl["tenant"] = "bob"
            rl["base"] = "registered:tinyb"
            # An inferencer serves the preset only: refused naming the base as bob named it. The
            # master skips that check when no inferencer answers info within 2 s (a loaded CI
            # machine: the spec was then refused for its schema alone); a refused submit stores
            # nothing, so it is asked again, a bounded number of times.
            for _ in range(3):
                try:
                    got["rl on registered"] = await b.submit(rl)
                    break
                except NexusError as exc:
                    got["rl on registered"] = exc
                    if "registered:tinyb" in exc.message:
                        break
                    await asyncio.sleep(2.0)
        return got

    got = asyncio.run(go())
    for what in ("a path", "a relative path", "an unregistered name", "config path"):
        exc = got[what]
        assert isinstance(exc, InvalidField), (what, exc)
        assert exc.details["field"] in ("base", "config.base"), (what, exc.details)
        assert BASE in exc.message and "registered:tinyb" in exc.message, exc.message
        assert str(base_dir) not in exc.message.replace(repr(str(base_dir)), ""), exc.message
    cfg = got["config registered"]
    assert not isinstance(cfg, Exception), cfg
    assert cfg.base == str(base_dir.resolve())  # the backend loads the directory
    rl = got["rl on registered"]
    assert isinstance(rl, NexusError) and "registered:tinyb" in rl.message and str(base_dir) not in rl.message, rl
    assert "no inferencer serves 'registered:tinyb'" in rl.message, rl.message


def test_refusals_name_no_other_tenant(deployment):
    state, creds, data_dir = deployment

    out = nexus("tenant", "create", "carol", "--data-dir", str(data_dir), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    carol = json.loads(out.stdout)["creds"]

    async def go():
        got = {}
        async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=carol) as c:
            # An eval by a tenant with no slot yet: the refusal names only the tenant asked about
            # (it listed every tenant of the deployment once).
            ev = {"tenant": "carol", "task": "eval", "env": {"id": "builtin/reach-v0"},
                  "eval": {"version": "latest", "episodes": 1}}
            try:
                await c.submit(copy.deepcopy(ev))
            except NexusError as exc:
                got["eval"] = exc
        async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["alice"]) as a:
            # Another tenant's workload id: denied without being told whose it is.
            async with AsyncClient(_url(state), state.prefix, timeout_s=60, creds=creds["zed-secret-name"]) as z:
                h = await z.submit(sft_spec("zed-secret-name", steps=1))
                await z.cancel(h.id)
            for op in ("workload", "cancel", "download_report"):
                try:
                    if op == "download_report":
                        await a.download_report(h.id, "/nonexistent-never-written")
                    else:
                        await getattr(a, op)(h.id)
                except NexusError as exc:
                    got[op] = exc
        return got

    got = asyncio.run(go())
    assert set(got) == {"eval", "workload", "cancel", "download_report"}, got
    assert isinstance(got["eval"], NotFound) and "'carol' does not exist" in got["eval"].message, got["eval"]
    for what, exc in got.items():
        assert "zed-secret-name" not in exc.message and "zed-secret-name" not in json.dumps(exc.details), (what, exc)
        assert "bob" not in exc.message and "alice" not in got["eval"].message, (what, exc.message)
    assert isinstance(got["workload"], PermissionDenied) and "not one of the caller's workloads" in got["workload"].message
