"""Everything knowable at submit is checked at submit and by `nexus spec validate` (issue 26,
item 2): env options and cameras against what the env renders, head params against the head's
config, one training row against the broker's max payload. Offline: the CLI in a child
process, no NATS, no simulator, no torch. Online: a real deployment refuses a bad first spec
before the tenant has a slot, so a corrected spec with another schema is accepted."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from master.spec import SpecError, load_document, parse_spec
from master.submit_checks import DEFAULT_MAX_PAYLOAD, head_options, row_bytes, run_errors
from protocol.errors import InvalidField
from protocol.policy import CHUNK_HEADROOM_BYTES
from tests.conftest import ROOT, nexus_cmd, nexus_up, python_env, tenant_create

SFT = load_document((ROOT / "examples" / "sft_reach.yaml").read_text())
RL = load_document((ROOT / "examples" / "rl_reach.yaml").read_text())


def _cams(*sizes: tuple[str, int, int]) -> list[dict[str, Any]]:
    return [{"name": n, "height": h, "width": w} for n, h, w in sizes]


def _with(doc: dict[str, Any], edit) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    edit(out)
    return out


def _big(d):  # two 512x512 cameras the env renders: 1.5 MiB a row
    d["observation"]["cameras"] = _cams(("top", 512, 512), ("wrist", 512, 512))
    d["env"]["options"]["image_size"] = 512


# name -> (spec, field named, words the message must hold)
CASES: dict[str, tuple[dict[str, Any], str, tuple[str, ...]]] = {
    "oversized row": (_with(SFT, _big), "observation.cameras",
                      ("1,573,", "1,040,384", "nats-server's default", "top 512x512", "shrink")),
    "oversized rl row": (_with(RL, _big), "observation.cameras", ("1,573,", "1,040,384")),
    "camera size": (_with(SFT, lambda d: d["observation"]["cameras"][0].update(height=50, width=70)),
                    "observation.cameras[0]", ("50x70", "renders it at 64x64", "height 64, width 64")),
    "third camera": (_with(SFT, lambda d: d["observation"]["cameras"].append(_cams(("side", 64, 64))[0])),
                     "observation.cameras[2].name", ("'side'", "top 64x64, wrist 64x64")),
    "camera the spec lacks": (_with(SFT, lambda d: d["observation"].update(cameras=_cams(("top", 64, 64)))),
                              "observation.cameras", ("'wrist'", "env.options.cameras")),
    "env option typo": (_with(SFT, lambda d: d["env"]["options"].update(image_sise=96)),
                        "env.options.image_sise", ("unknown option", "image_size", "max_episode_steps")),
    "env option value": (_with(SFT, lambda d: d["env"]["options"].update(cameras=["top", "side"])),
                         "env.options.cameras", ("('top', 'wrist')",)),
    "head param typo": (_with(SFT, lambda d: d["action_module"]["params"].update(widht=64)),
                        "action_module.params.widht", ("unknown option of head 'mlp'", "width", "use_state")),
    "head param type": (_with(RL, lambda d: d["action_module"]["params"].update(width="256")),
                        "action_module.params.width", ("'256'", "int")),
    "state dim": (_with(SFT, lambda d: d["observation"].update(state_dim=7)), "observation.state_dim",
                  ("4-long state", "allowed: 4")),
    "action dim": (_with(RL, lambda d: d["action"].update(dim=7)), "action.dim", ("2-long action",)),
    "demos without an expert": (_with(SFT, lambda d: (
        d["env"].update(id="libero/libero_goal", options={}),
        d["observation"].update(cameras=_cams(("agentview", 128, 128), ("robot0_eye_in_hand", 128, 128)), state_dim=8),
        d["action"].update(dim=7))), "env.demos", ("no scripted expert", "builtin/reach-v0")),
    "maniskill rgb camera": (_with(RL, lambda d: (
        d["env"].update(id="maniskill/PushCube-v1", options={"obs_mode": "rgb", "image_size": 64,
                                                              "control_mode": "pd_joint_delta_pos"}),
        d["observation"].update(state_dim=25), d["action"].update(dim=8))),
        "observation.cameras[0].name", ("base_camera 64x64",)),
}


def _validate(tmp_path: Path, name: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    path = tmp_path / f"{name.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = python_env()
    for var in ("NEXUS_NATS_URL", "NATS_URL"):  # nothing to connect to, and nothing asked
        env.pop(var, None)
    out = subprocess.run(nexus_cmd("spec", "validate", str(path), "--json"), capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    return out.returncode, json.loads(out.stdout), out.stderr


def test_offline_validate_refuses_what_the_run_would(tmp_path):
    for name, (doc, field, words) in CASES.items():
        parse_spec(copy.deepcopy(doc))  # each is a valid spec on its own: only the run's facts refuse it
        code, out, err = _validate(tmp_path, name, doc)
        assert code == 2 and out["valid"] is False, (name, out, err)
        fields = [e["field"] for e in out["errors"]]
        assert field in fields, (name, out["errors"])
        message = out["errors"][fields.index(field)]["message"]
        for word in words:
            assert word in message, (name, word, message)
        # The limit it used is stated (offline: nats-server's default).
        assert (out["max_payload"], out["max_payload_source"]) == (DEFAULT_MAX_PAYLOAD, "nats-server's default (offline)")


def test_examples_stay_valid_and_say_their_row_size(tmp_path):
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        code, out, err = _validate(tmp_path, path.stem, load_document(path.read_text()))
        assert code == 0 and out["valid"], (path, out, err)
        assert out["row_limit_bytes"] == DEFAULT_MAX_PAYLOAD - CHUNK_HEADROOM_BYTES
        if out["task"] != "eval":  # two 64x64 frames and a little (the ManiSkill example: one)
            frames = 1 if "maniskill" in path.stem else 2
            assert 12_288 * frames < out["row_bytes"] < 12_288 * frames + 5_424, (path, out)
    text = subprocess.run(nexus_cmd("spec", "validate", str(ROOT / "examples" / "sft_reach.yaml")),
                          capture_output=True, text=True, timeout=120, env=python_env())
    assert text.returncode == 0 and "nats-server's default" in text.stdout and "1,048,576" in text.stdout, text


def test_what_is_not_checked_here_is_said(tmp_path):
    """An env id only an env worker's plugin registers (or a typo) cannot be checked offline:
    valid, with a note naming env.id and the ids registered here; the shipped reach examples
    are checked in full (no note)."""
    plugin = copy.deepcopy(RL)
    plugin["env"] = {"id": "myco/door-v0", "options": {"doors": 2}}
    code, out, err = _validate(tmp_path, "plugin", plugin)
    assert code == 0 and out["valid"], (out, err)
    (note,) = out["unchecked"]
    assert note["field"] == "env.id" and "myco/door-v0" in note["message"], note
    assert "NEXUS_ENV_PLUGINS" in note["message"] and "builtin/reach-v0" in note["message"], note
    text = subprocess.run(nexus_cmd("spec", "validate", str(tmp_path / "plugin.yaml")), capture_output=True,
                          text=True, timeout=120, env=python_env())
    assert text.returncode == 0 and "not checked here: env.id: myco/door-v0" in text.stdout, text
    code, out, err = _validate(tmp_path, "reach", RL)
    assert code == 0 and out["unchecked"] == [], out


def test_the_row_size_is_the_encoded_row():
    """row_bytes counts frames without allocating them; it must match a real encoded row."""
    import numpy as np

    from master.submit_checks import _row
    from protocol.wire import encode

    for doc in (SFT, RL, _with(SFT, lambda d: d["observation"].update(
            cameras=_cams(("a", 300, 200), ("b", 17, 999), ("c", 1, 1)), state_dim=32))):
        spec = parse_spec(copy.deepcopy(doc))
        counted, _ = row_bytes(spec)
        real = len(encode(_row(spec, {c.name: np.zeros((1, c.height, c.width, 3), np.uint8)
                                      for c in spec.observation.cameras})))
        assert real <= counted <= real + 16 * len(spec.observation.cameras), (counted, real)
    # At the limit: a row just under it passes, the same spec with one pixel more per frame side refuses.
    spec = parse_spec(_with(SFT, lambda d: (d["observation"].update(cameras=_cams(("top", 416, 416), ("wrist", 416, 416))),
                                            d["env"]["options"].update(image_size=416))))
    assert run_errors(spec) == [] and run_errors(spec, 900_000)[0][0] == "observation.cameras"


def test_checks_need_no_torch_nor_simulator():
    code = ("import sys\nfrom master.spec import load_spec\nfrom master.submit_checks import run_errors\n"
            "for f in ('examples/sft_reach.yaml', 'examples/rl_reach.yaml'):\n"
            "    assert run_errors(load_spec(f)) == []\n"
            "import yaml\n"
            "from master.spec import parse_spec\n"
            "from master.spec import load_document\nd = load_document(open('examples/rl_reach.yaml').read())\n"
            "d['env'] = {'id': 'maniskill/PickCube-v1', 'options': {'obs_mode': 'rgb'}}\n"
            "d['observation']['cameras'] = [{'name': 'base_camera', 'height': 128, 'width': 128}]\n"
            "d['observation']['state_dim'] = 29; d['action']['dim'] = 7\n"
            "assert run_errors(parse_spec(d)) == [], run_errors(parse_spec(d))\n"
            "d['env']['id'] = 'libero/libero_spatial'\n"
            "assert run_errors(parse_spec(d))\n"
            "heavy = [m for m in ('torch', 'mani_skill', 'sapien', 'robosuite', 'mujoco', 'nats') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=python_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_static_facts_agree_with_the_real_configs():
    """The head options read from source are the dataclasses' fields; the built-in env's
    described cameras are the ones a built env renders."""
    import envs
    from models.heads import HEADS

    for kind, entry in HEADS.items():
        assert set(head_options()[kind]) == {f.name for f in dataclasses.fields(entry.config_cls)}, kind
    for options in ({}, {"cameras": ["wrist"], "image_size": [48, 80]}):
        facts = envs.registry.describe("builtin/reach-v0", options)
        with envs.make("builtin/reach-v0", **options) as env:
            assert (facts.cameras, facts.state_dim, facts.action_dim) == (
                env.spec.cameras, env.spec.state_dim, env.spec.action_dim)
    # A plugin's env id (registered in an env worker only) is not judged here.
    assert run_errors(parse_spec(_with(RL, lambda d: d["env"].update(id="test/crashy-v0", options={"x": 1})))) == []


# -- on a real deployment ------------------------------------------------------------------------
def test_a_refused_first_spec_registers_nothing(tmp_path):
    from transport.creds import redact_url
    from sdk.client import AsyncClient
    from tests.master.test_workloads import sft_spec

    tenant = "carol"
    bad = sft_spec(tenant, steps=1)
    bad["observation"]["cameras"] = _cams(("top", 512, 512), ("wrist", 512, 512))
    bad["env"]["options"] = {"image_size": 512}
    typo = sft_spec(tenant, steps=1)
    typo["env"]["options"] = {"image_sise": 96}
    good = sft_spec(tenant, steps=1)  # another schema: 64x64 frames
    with nexus_up(tmp_path, NEXUS_INFER_BASE="tiny-qwen3-vl-64") as state:
        creds = tenant_create(tmp_path, tenant)["creds"]

        async def go():
            url = redact_url(state.nats_url)
            async with AsyncClient(url, state.prefix, timeout_s=60, creds=creds) as c, \
                    AsyncClient(url, state.prefix, timeout_s=60, creds=state.creds) as operator:
                refused = []
                for spec in (bad, typo):
                    with pytest.raises((SpecError, InvalidField)) as info:
                        await c.submit(spec)
                    refused.append(info.value)
                after_refusal = (await operator.tenants(), await c.workloads(tenant))
                handle = await c.submit(good)
                rec = await c.cancel(handle.id)  # accepted is what counts; no need to train it
                return refused, after_refusal, rec, await operator.tenants()

        refused, (tenants, workloads), rec, tenants_after = asyncio.run(go())
    big, typo_err = (e.details["errors"] for e in refused)
    assert [e["field"] for e in big] == ["observation.cameras"], big
    assert "this deployment's server" in big[0]["message"] and "1,573," in big[0]["message"], big
    assert [e["field"] for e in typo_err] == ["env.options.image_sise"], typo_err
    # Nothing of the tenant was made: no slot (whose schema would lock the name), no record.
    assert [t.name for t in tenants.tenants] == [] and workloads == [], (tenants, workloads)
    assert rec.tenant == tenant and rec.state == "cancelled"
    slot = {t.name: t for t in tenants_after.tenants}[tenant]
    assert [(c["height"], c["width"]) for c in slot.schema["cameras"]] == [(64, 64), (64, 64)]
