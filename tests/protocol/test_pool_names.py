"""Inference pools come from a base's full identity: a preset keeps its name, a local directory
gets `<folder>-<hash of its resolved path>`; two folders of the same name never share a pool."""

from __future__ import annotations

import os

from protocol.subjects import Names, canonical_base, check_token, pool_name


def test_presets_keep_their_name():
    assert pool_name("tiny-qwen3-vl") == "tiny-qwen3-vl"
    assert canonical_base("tiny-qwen3-vl") == "tiny-qwen3-vl"
    assert Names("nexus").infer(pool_name("qwen3-vl-4b")) == "nexus.infer.qwen3-vl-4b"


def test_same_folder_name_in_two_places_gets_two_pools(tmp_path):
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    pa, pb = pool_name(str(a)), pool_name(str(b))
    assert pa != pb
    assert pa.startswith("model-") and pb.startswith("model-")
    for p in (pa, pb):
        assert check_token("pool", p) == p and len(p) <= 64


def test_one_directory_spelled_many_ways_is_one_pool(tmp_path, monkeypatch):
    d = tmp_path / "a" / "model"
    d.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path / "a")
    spellings = [str(d), str(d) + "/", "model", "./model", "./model/", "../a/model", str(tmp_path / "link" / "model")]
    pools = {pool_name(s) for s in spellings}
    assert len(pools) == 1, pools
    assert {canonical_base(s) for s in spellings} == {str(d.resolve())}
    # Another working directory, another relative meaning: the absolute spelling still agrees.
    monkeypatch.chdir(tmp_path)
    assert pool_name(str(d)) in pools and pool_name("a/model") in pools


def test_a_long_folder_name_still_makes_a_valid_token(tmp_path):
    d = tmp_path / ("x" * 120 + ".v2 final")
    d.mkdir()
    p = pool_name(str(d))
    assert check_token("pool", p) == p and len(p) <= 64
    assert p != pool_name(str(tmp_path / ("x" * 120 + ".v2 other")))


def test_a_bare_name_that_is_a_directory_here_is_that_directory(tmp_path, monkeypatch):
    (tmp_path / "mybase").mkdir()
    monkeypatch.chdir(tmp_path)
    assert canonical_base("mybase") == str((tmp_path / "mybase").resolve())
    assert pool_name("mybase") == pool_name(str(tmp_path / "mybase"))
    # A preset wins over a directory of the same name, as models.BaseConfig decides.
    (tmp_path / "tiny-qwen3-vl").mkdir()
    assert pool_name("tiny-qwen3-vl") == "tiny-qwen3-vl"
    assert os.path.isdir("tiny-qwen3-vl")


def test_the_master_stores_a_directory_base_by_its_identity(roles, tmp_path):
    import asyncio
    import msgspec

    from sdk.client import AsyncClient
    from tests.support.tq_helpers import tenant

    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    roles.start("master")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            ta = await c.create_tenant(msgspec.structs.replace(tenant("dir-a"), base=str(a) + "/"))
            tb = await c.create_tenant(msgspec.structs.replace(tenant("dir-b"), base=str(b)))
            return ta, tb
        finally:
            await c.close()

    ta, tb = asyncio.run(go())
    # Every process derives the same pool from the stored form, whatever its working directory.
    assert ta.base == str(a.resolve()) and tb.base == str(b.resolve())
    assert pool_name(ta.base) == pool_name(str(a)) != pool_name(tb.base)
