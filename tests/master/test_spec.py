"""WorkloadSpec: strict parsing with field paths, JSON Schema agreement, examples, compile, round trip.

Pure functions, no NATS: `pytest tests/master/test_spec.py` runs in a few seconds (the model-core
import for the compile checks is the slowest part).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from master.spec import (
    RLConfig,
    SFTConfig,
    SpecError,
    WorkloadSpec,
    compile_tenant,
    field_reference_markdown,
    load_document,
    load_spec,
    parse_spec,
    render_fields_doc,
    schema_json_text,
    spec_from_dict,
    spec_json_schema,
    spec_to_dict,
)
from protocol.errors import ErrorCode, NexusError
from protocol.messages import TenantConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["sft_reach.yaml", "rl_reach.yaml", "eval_reach.yaml", "sft_lerobot.yaml", "sft_maniskill_pickcube.yaml",
            "eval_maniskill_pickcube.yaml", "sft_maniskill_pushcube.yaml", "eval_maniskill_pushcube.yaml",
            "hosted_env/rl_reach_dot.yaml"]
DELETE = object()


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = spec_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def minimal(task: str = "sft") -> dict[str, Any]:
    """The smallest valid spec of each task type (everything else defaulted)."""
    if task == "eval":  # names the policy it scores; its base, head and schema come from it
        return {"tenant": "t-sft", "task": "eval", "env": {"id": "builtin/reach-v0"}, "eval": {"version": "latest"}}
    spec: dict[str, Any] = {
        "tenant": f"t-{task}",
        "task": task,
        "base": "tiny-qwen3-vl-64",
        "action_module": {"kind": "gaussian" if task == "rl" else "mlp"},
        "observation": {"cameras": [{"name": "top", "height": 64, "width": 64},
                                    {"name": "wrist", "height": 64, "width": 64}], "state_dim": 4},
        "action": {"dim": 2},
        "env": {"id": "builtin/reach-v0"},
    }
    if task == "sft":
        spec["env"]["demos"] = {"episodes": 5}
    return spec


def mutate(doc: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Copy of ``doc`` with dotted paths set (or removed with DELETE); ``[i]`` indexes lists."""
    out = copy.deepcopy(doc)
    for path, value in changes.items():
        parts = [int(p) if p.isdigit() else p for p in re.split(r"\.|\[(\d+)\]", path) if p]
        node = out
        for part in parts[:-1]:
            node = node[part]
        if value is DELETE:
            del node[parts[-1]]
        else:
            node[parts[-1]] = value
    return out


def errors_of(data: Any) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return {e["field"]: e["message"] for e in info.value.details["errors"]}


# ---- examples, docs, schema file ------------------------------------------------------
@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_valid_for_parse_spec_and_json_schema(name, validator):
    path = ROOT / "examples" / name
    spec = load_spec(path)
    assert isinstance(spec, WorkloadSpec)
    validator.validate(load_document(path.read_bytes()))
    validator.validate(spec_to_dict(spec))  # the stored form is valid too


def test_examples_say_what_the_brief_asks():
    sft = load_spec(ROOT / "examples/sft_reach.yaml")
    assert (sft.task, sft.base, sft.action_module.kind) == ("sft", "tiny-qwen3-vl-64", "mlp")
    assert sft.env.id == "builtin/reach-v0"
    assert sft.env.demos.episodes > 0
    assert [(c.name, c.height, c.width) for c in sft.observation.cameras] == [("top", 64, 64), ("wrist", 64, 64)]
    assert (sft.observation.state_dim, sft.action.dim) == (4, 2)
    rl = load_spec(ROOT / "examples/rl_reach.yaml")
    assert rl.action_module.kind == "gaussian" and isinstance(rl.algorithm, RLConfig)
    ev = load_spec(ROOT / "examples/eval_reach.yaml")
    assert (ev.eval.version, ev.eval.episodes, ev.algorithm) == ("latest", 50, None)
    assert ev.tenant == "sft-reach" and ev.base is ev.action_module is ev.observation is ev.action is None
    lr = load_spec(ROOT / "examples/sft_lerobot.yaml")
    # A fresh clone runs it: it names the dataset its own header records and publishes.
    assert lr.dataset.root == ".nexus/datasets/published/reach-demos"
    assert (len(lr.observation.cameras), lr.observation.state_dim, lr.action.dim) == (2, 4, 2)


def test_the_lerobot_example_fits_the_dataset_its_header_records(tmp_path):
    """examples/sft_lerobot.yaml's header records its dataset with `nexus dataset record`: the
    features that writes are the ones the spec maps (keys and shapes), so the submit's
    feature check passes on it."""
    import shlex

    from master.spec import feature_errors
    from sdk.dataset_cli import main as dataset_cli

    lr = load_spec(ROOT / "examples/sft_lerobot.yaml")
    line = next(ln for ln in (ROOT / "examples/sft_lerobot.yaml").read_text().splitlines()
                if "nexus dataset record" in ln)
    argv = shlex.split(line.lstrip("# "))[2:]  # record --out ... as written, but 1 episode into tmp
    argv[argv.index("--out") + 1] = str(tmp_path / "reach")
    argv[argv.index("--episodes") + 1] = "1"
    assert dataset_cli(argv) == 0
    features = json.loads((tmp_path / "reach/meta/info.json").read_text())["features"]
    cams = {c.name: c for c in lr.observation.cameras}
    for key, name in lr.dataset.camera_map.items():
        assert features[key]["shape"][:2] == [cams[name].height, cams[name].width], key
    raw = {k: {"dtype": f["dtype"], "shape": f["shape"]} for k, f in features.items()}
    assert feature_errors(raw, lr.dataset.state_key, lr.dataset.action_key, list(lr.dataset.camera_map),
                          lr.observation.state_dim, lr.action.dim) == []


def _doc_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "docs/workload_spec.md").read_text()
    examples = text.split("## Examples", 1)[1].split("## Field reference", 1)[0]
    return re.findall(r"```(yaml|json)\n(.*?)```", examples, flags=re.S)


def test_docs_examples_valid_for_both(validator):
    blocks = _doc_blocks()
    assert len(blocks) == 4
    for _, body in blocks:
        parse_spec(body)
        validator.validate(load_document(body))


def test_generated_docs_are_current():
    # Regenerate with `python -m master.spec` when this fails.
    assert (ROOT / "docs/workload_spec.schema.json").read_text() == schema_json_text()
    doc = (ROOT / "docs/workload_spec.md").read_text()
    assert render_fields_doc(doc) == doc
    assert field_reference_markdown() in doc


def test_json_schema_shape():
    schema = spec_json_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"tenant", "task"}
    # sft and rl need the slot's sections; an eval takes them from the policy it scores.
    for task in ("sft", "rl"):
        rule_ = next(r["then"] for r in schema["allOf"] if r.get("if", {}).get("properties", {}).get("task") == {"const": task})
        assert {"base", "action_module", "observation", "action"} <= {c["required"][0] for c in rule_["allOf"]}
    for name, body in schema["$defs"].items():
        assert body["additionalProperties"] is False, name
        for prop, sub in body["properties"].items():
            assert sub.get("description"), f"{name}.{prop} has no description"
    assert schema["$defs"]["ScheduleSpec"]["properties"]["staleness_bound"]["default"] == 128
    assert schema["$defs"]["ScheduleSpec"]["properties"]["max_inflight_jobs"]["default"] == 2
    assert schema["$defs"]["ScheduleSpec"]["properties"]["sft_prefetch_items"]["default"] == 16


# ---- field-path errors ------------------------------------------------------------------
def test_unknown_field_names_path_and_allowed_fields():
    errs = errors_of(mutate(minimal(), {"schedule": {"budget": {"max_stepz": 3}}}))
    assert list(errs) == ["schedule.budget.max_stepz"]
    assert "max_steps, max_episodes, max_wall_s" in errs["schedule.budget.max_stepz"]
    errs = errors_of(mutate(minimal(), {"colour": "red"}))
    assert "unknown field" in errs["colour"] and "tenant" in errs["colour"]


def test_missing_field():
    errs = errors_of(mutate(minimal(), {"observation.state_dim": DELETE, "tenant": DELETE}))
    assert set(errs) == {"observation.state_dim", "tenant"}
    assert errs["tenant"].startswith("required field is missing")


def test_wrong_type_in_list_item():
    errs = errors_of(mutate(minimal(), {"observation.cameras[1].height": "64"}))
    assert errs == {"observation.cameras[1].height": "expected an integer, got a string ('64')"}
    errs = errors_of(mutate(minimal(), {"observation.state_dim": True}))
    assert "expected an integer, got a boolean" in errs["observation.state_dim"]


def test_bad_enum_lists_allowed_values():
    errs = errors_of(mutate(minimal(), {"task": "dpo", "action_module.kind": "diffusion"}))
    # The built-ins first, then any kind a loaded recipe module declared; the setting named.
    assert errs["task"].startswith("'dpo' is not allowed; allowed: sft, rl, eval")
    assert "NEXUS_WORKFLOW_MODULES" in errs["task"]
    assert errs["action_module.kind"] == "'diffusion' is not allowed; allowed: mlp, flow, gaussian, expert"


def test_several_errors_at_once():
    bad = mutate(minimal("rl"), {
        "tenant": "a b", "base": "tiny-qwen3-vl-46", "observation.cameras[0].width": 0,
        "algorithm": {"lr": -1, "batch_size": 32}, "schedule": {"budget": {"max_steps": 0}},
        "action_module.kind": "mlp", "env": DELETE,
    })
    with pytest.raises(SpecError) as info:
        parse_spec(bad)
    err = info.value
    fields = [e["field"] for e in err.details["errors"]]
    assert set(fields) == {"tenant", "base", "observation.cameras[0].width", "algorithm.batch_size",
                           "algorithm.lr", "schedule.budget.max_steps", "env", "action_module.kind"}
    assert "tiny-qwen3-vl-64" in err.details["errors"][fields.index("base")]["message"]  # lists presets
    assert isinstance(err, NexusError) and isinstance(err, ValueError)
    assert err.code is ErrorCode.INVALID_FIELD
    assert f"({len(fields)} errors)" in err.message and all(f in err.message for f in fields)


def test_yaml_json_bytes_str_and_dict_agree():
    doc = minimal()
    as_yaml, as_json = yaml.safe_dump(doc), json.dumps(doc)
    specs = [parse_spec(doc), parse_spec(as_yaml), parse_spec(as_yaml.encode()), parse_spec(as_json),
             parse_spec(as_json.encode())]
    assert all(s == specs[0] for s in specs)


def test_yaml_details():
    # 1e-4 is a number (YAML 1.2), not the string PyYAML's default loader makes of it.
    spec = parse_spec(yaml.safe_dump(minimal()) + "algorithm: {lr: 1e-4}\n")
    assert spec.algorithm.lr == 1e-4
    assert "duplicate key 'task'" in errors_of("task: sft\ntask: rl\n")["<root>"]
    assert "not valid YAML or JSON" in errors_of(b"tenant: [")["<root>"]
    assert "must be a mapping" in errors_of("- a\n- b\n")["<root>"]
    assert "not UTF-8" in errors_of(b"\xff\xfe")["<root>"]


def test_cross_field_rules():
    errs = errors_of(mutate(minimal(), {"observation.cameras[1].name": "top"}))
    assert "duplicate camera name 'top'" in errs["observation.cameras[1].name"]
    errs = errors_of(mutate(minimal(), {"observation.instruction_template": "do {task}"}))
    assert "{instruction}" in errs["observation.instruction_template"]
    errs = errors_of(mutate(minimal(), {"algorithm": {"steps": 10, "warmup_steps": 20}}))
    assert "allowed: <= steps" in errs["algorithm.warmup_steps"]
    errs = errors_of(mutate(minimal("rl"), {"algorithm": {"episodes_per_update": 4, "steps_per_update": 100}}))
    assert "not both" in errs["algorithm.steps_per_update"]
    errs = errors_of(mutate(minimal("rl"), {"action_module.params": {"clip_ratio": 0.1}}))
    assert "under algorithm" in errs["action_module.params"]
    for bad in (-1, 10**7, "many"):  # a tenant's own field, still bounded
        assert "algorithm.value_warmup_episodes" in errors_of(
            mutate(minimal("rl"), {"algorithm": {"value_warmup_episodes": bad}}))
    for bad in (-0.1, "0.1", float("nan"), float("inf"), None, True):
        assert "algorithm.kl_coef" in errors_of(mutate(minimal("rl"), {"algorithm": {"kl_coef": bad}}))
    for bad in (-1, 1.5, "3"):
        assert "algorithm.kl_anchor_version" in errors_of(
            mutate(minimal("rl"), {"algorithm": {"kl_coef": 0.1, "kl_anchor_version": bad}}))
    errs = errors_of(mutate(minimal("rl"), {"algorithm": {"kl_anchor_version": 3}}))
    assert "kl_coef is 0" in errs["algorithm.kl_anchor_version"]
    ok = parse_spec(mutate(minimal("rl"), {"algorithm": {"kl_coef": 0.1, "kl_anchor_version": 0}})).algorithm
    assert (ok.kl_coef, ok.kl_anchor_version) == (0.1, 0) and parse_spec(minimal("rl")).algorithm.kl_coef == 0.0
    two_tops = {"root": "/d", "camera_map": {"cam.a": "top", "cam.b": "top"}}
    lerobot = mutate(minimal(), {"env": DELETE, "dataset": two_tops})
    errs = errors_of(lerobot)
    assert "'wrist' is mapped 0 times" in errs["dataset.camera_map"]


def test_version_pins():
    for ok in ("latest", 3, 0, "tenant:sft-reach@latest", "tenant:a_b@12"):
        assert parse_spec(mutate(minimal("eval"), {"eval.version": ok})).eval.version == ok
    for bad in ("newest", -1, "tenant:a b@latest", "tenant:x@new", 1.5, True):
        assert "eval.version" in errors_of(mutate(minimal("eval"), {"eval.version": bad}))


def test_defaults_and_normalisation():
    sft = parse_spec(minimal("sft"))
    assert sft.algorithm == SFTConfig()
    sched = sft.schedule
    assert (sched.max_inflight_jobs, sched.staleness_bound, sched.sft_prefetch_items) == (2, 128, 16)
    rl = parse_spec(minimal("rl"))
    assert rl.algorithm.episodes_per_update == 16 and rl.algorithm.steps_per_update is None
    by_steps = parse_spec(mutate(minimal("rl"), {"algorithm": {"steps_per_update": 256}}))
    assert by_steps.algorithm.episodes_per_update is None
    assert parse_spec(minimal("eval")).algorithm is None
    assert parse_spec(mutate(minimal(), {"base": "./my_base"})).base == "./my_base"


# ---- task-type rules and JSON Schema agreement -------------------------------------------
INVALID = [
    # (task, changes, field parse_spec must name)
    ("sft", {"colour": 1}, "colour"),
    ("sft", {"tenant": DELETE}, "tenant"),
    ("sft", {"tenant": "x" * 65}, "tenant"),
    ("sft", {"observation.cameras[1].height": "64"}, "observation.cameras[1].height"),
    ("sft", {"observation.cameras": []}, "observation.cameras"),
    ("sft", {"action_module.kind": "diffusion"}, "action_module.kind"),
    ("sft", {"base": "tiny-qwen3-vl-46"}, "base"),
    ("sft", {"env.id": "reach"}, "env.id"),
    ("sft", {"schedule": {"max_inflight_jobs": 0}}, "schedule.max_inflight_jobs"),
    ("sft", {"algorithm": {"gamma": 0.9}}, "algorithm.gamma"),  # a PPO field on sft
    ("sft", {"env.demos": DELETE}, "env.demos"),
    ("sft", {"env": DELETE}, "dataset"),
    ("sft", {"dataset": {"root": "/d", "camera_map": {"k": "top"}}}, "env"),
    ("sft", {"spec_version": 2}, "spec_version"),
    ("rl", {"env": DELETE}, "env"),
    ("rl", {"action_module.kind": "mlp"}, "action_module.kind"),
    ("rl", {"env.demos": {"episodes": 3}}, "env.demos"),
    ("rl", {"dataset": {"root": "/d", "camera_map": {"k": "top"}}}, "dataset"),
    ("rl", {"algorithm": {"batch_size": 8}}, "algorithm.batch_size"),
    ("sft", {"observation": DELETE}, "observation"),
    ("rl", {"base": DELETE}, "base"),
    ("rl", {"action_module": None}, "action_module"),
    ("eval", {"eval": DELETE}, "eval"),
    ("eval", {"algorithm": {"lr": 1e-3}}, "algorithm"),
    ("eval", {"env": DELETE}, "env"),
    ("eval", {"eval.episodes": 0}, "eval.episodes"),
    ("sft", {"eval": {"episodes": 5}, "env": DELETE,
             "dataset": {"root": "/d", "camera_map": {"a": "top", "b": "wrist"}}}, "eval"),
]


@pytest.mark.parametrize(("task", "changes", "field"), INVALID, ids=[f"{t}-{f}" for t, _, f in INVALID])
def test_invalid_fails_both(task, changes, field, validator):
    doc = mutate(minimal(task), changes)
    assert field in errors_of(doc)
    assert not validator.is_valid(doc), f"JSON Schema accepted {changes}"


VALID = [
    ("sft", {}),
    ("rl", {}),
    ("eval", {}),
    ("sft", {"env": DELETE, "dataset": {"root": "/d", "camera_map": {"a": "top", "b": "wrist"}}}),
    ("sft", {"action_module.kind": "flow", "action.horizon": 8, "algorithm": None, "eval": None}),
    ("rl", {"algorithm": {"steps_per_update": 512, "grad_clip": None}, "schedule": {"budget": {"max_wall_s": 60}}}),
    ("eval", {"action_module": {"kind": "gaussian"}, "eval.version": 7, "dataset": None,
              "outputs": {"report_path": "r.json"}}),  # a repeated section: the master checks it
    ("eval", {"eval.version": "tenant:sft-reach@3"}),  # another tenant's policy, under this name
]


@pytest.mark.parametrize(("task", "changes"), VALID)
def test_valid_passes_both(task, changes, validator):
    doc = mutate(minimal(task), changes)
    spec = parse_spec(doc)
    validator.validate(doc)
    validator.validate(spec_to_dict(spec))


# ---- compile and round trip ---------------------------------------------------------------
def test_compile_tenant_sft():
    spec = load_spec(ROOT / "examples/sft_reach.yaml")
    cfg = compile_tenant(spec)
    assert isinstance(cfg, TenantConfig)
    assert (cfg.name, cfg.base, cfg.head, cfg.seed) == ("sft-reach", "tiny-qwen3-vl-64", "mlp", 0)
    assert cfg.schema == {
        "cameras": [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}],
        "state_dim": 4, "action_dim": 2, "action_horizon": 1, "instruction_template": "{instruction}",
    }
    assert cfg.optim == {"lr": 1e-3, "weight_decay": 0.01, "grad_clip": 1.0, "warmup_steps": 50,
                         "total_steps": 600}
    assert cfg.head_params == {"width": 256, "depth": 2, "image_channels": 16, "image_pool": "keypoints",
                               "instruction_encoder": True}
    assert (cfg.max_inflight_jobs, cfg.sft_prefetch_items, cfg.staleness_bound, cfg.priority) == (2, 16, 128, 0)
    assert cfg.signature == ""  # the master derives it


def test_compile_tenant_rl_moves_ppo_fields_into_the_gaussian_head():
    spec = parse_spec(mutate(minimal("rl"), {"algorithm": {"clip_ratio": 0.1, "entropy_coef": 0.01},
                                             "action_module.params": {"width": 64},
                                             "schedule": {"priority": 3, "staleness_bound": 8}}))
    cfg = compile_tenant(spec)
    assert cfg.head == "gaussian"
    assert cfg.head_params == {"width": 64, "clip_ratio": 0.1, "value_coef": 0.5, "entropy_coef": 0.01}
    assert cfg.optim == {"lr": 3e-4, "weight_decay": 0.0, "grad_clip": 0.5, "warmup_steps": 0}
    assert (cfg.priority, cfg.staleness_bound) == (3, 8)
    with pytest.raises(SpecError, match="base: required to compile a tenant"):
        compile_tenant(parse_spec(minimal("eval")))  # an eval makes no slot


@pytest.mark.parametrize("name", EXAMPLES)
def test_compiled_configs_are_accepted_by_the_model_core(name):
    # The same checks the master runs at tenant_create (master/service.py: _check_config).
    from models.heads import head_config
    from models.schema import TenantSchema
    from models.slot import OptimConfig

    spec = load_spec(ROOT / "examples" / name)
    if spec.task == "eval":
        return  # an eval makes no slot: it scores an existing one
    cfg = compile_tenant(spec)
    TenantSchema.from_dict(cfg.schema).signature()
    head_config(cfg.head, cfg.head_params)
    OptimConfig(**cfg.optim)


@pytest.mark.parametrize("name", EXAMPLES)
def test_round_trip_is_json_safe(name):
    spec = load_spec(ROOT / "examples" / name)
    stored = json.loads(json.dumps(spec_to_dict(spec)))
    assert spec_from_dict(stored) == spec
    assert spec_to_dict(spec_from_dict(stored)) == stored


def test_spec_from_dict_is_strict():
    stored = spec_to_dict(parse_spec(minimal()))
    stored["schedule"]["surprise"] = 1
    with pytest.raises(SpecError, match=r"schedule\.surprise"):
        spec_from_dict(stored)


# ---- pydantic models: errors carry path, value and what is allowed; schema from the models -----
def error_list(data: Any) -> list[dict[str, Any]]:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return info.value.details["errors"]


def test_each_error_names_field_value_and_what_is_allowed():
    errs = {e["field"]: e for e in error_list(mutate(minimal("rl"), {
        "schedule": {"priority": 99, "max_inflight_jobs": 0},
        "observation.cameras[0].width": 5000,
        "task": "rl", "algorithm": {"gamma": 1.5, "colour": 1},
        "eval": {"version": "newest"},
        "outputs": {"report_path": "/abs.json"},
    }))}
    assert errs["schedule.priority"] == {"field": "schedule.priority", "value": 99,
                                         "message": "99 is too large; allowed: >= -10 and <= 10"}
    assert errs["schedule.max_inflight_jobs"]["message"] == "0 is too small; allowed: >= 1 and <= 64"
    assert errs["observation.cameras[0].width"]["value"] == 5000
    assert "<= 4096" in errs["observation.cameras[0].width"]["message"]
    assert errs["algorithm.gamma"]["message"] == "1.5 is too large; allowed: >= 0 and <= 1"
    assert errs["algorithm.colour"]["message"].startswith("unknown field; allowed in algorithm: lr, gamma,")
    assert "'latest'" in errs["eval.version"]["message"] and errs["eval.version"]["value"] == "newest"
    assert errs["outputs.report_path"]["value"] == "/abs.json"
    assert len(errs) == 7  # every error at once, each once


def test_field_errors_and_task_rules_come_together():
    # A wrong type deep in a section and a task rule on another section: both reported.
    errs = {e["field"]: e["message"] for e in error_list(mutate(minimal("rl"), {
        "observation.cameras[1].height": "64", "action_module.kind": "mlp", "env": DELETE}))}
    assert set(errs) == {"observation.cameras[1].height", "action_module.kind", "env"}


def test_a_list_whose_items_fail_is_not_called_short():
    errs = {e["field"] for e in error_list(mutate(minimal(), {"observation.cameras[0].height": "x",
                                                             "observation.cameras[1].width": "y"}))}
    assert errs == {"observation.cameras[0].height", "observation.cameras[1].width"}


def test_strict_scalars():
    for path, bad in (("observation.state_dim", "4"), ("observation.state_dim", 4.5), ("seed", True),
                      ("algorithm", {"lr": "1e-3"}), ("env.demos.noise", float("nan")),
                      ("eval", {"sample": 1})):
        doc = mutate(minimal(), {path: bad})
        assert error_list(doc), (path, bad)


def test_priority_is_bounded_and_documented():
    assert parse_spec(mutate(minimal(), {"schedule": {"priority": -10}})).schedule.priority == -10
    assert parse_spec(mutate(minimal(), {"schedule": {"priority": 10}})).schedule.priority == 10
    schema = spec_json_schema()["$defs"]["ScheduleSpec"]["properties"]["priority"]
    assert (schema["minimum"], schema["maximum"]) == (-10, 10)
    assert "-10..10" in schema["description"]


def test_budget_target_rules():
    ok = parse_spec(mutate(minimal(), {"schedule": {"budget": {"target": {"metric": "loss", "at_most": 0.05}}}}))
    assert ok.schedule.budget.target.at_most == 0.05 and ok.schedule.budget.target.window == 20
    both = error_list(mutate(minimal(), {"schedule": {"budget": {"target": {"metric": "loss"}}}}))
    assert [e["field"] for e in both] == ["schedule.budget.target.at_least"]
    wrong = error_list(mutate(minimal(), {"schedule": {"budget": {"target": {"metric": "success_rate",
                                                                             "at_least": 0.9}}}}))
    assert wrong[0]["field"] == "schedule.budget.target.metric" and "allowed: loss" in wrong[0]["message"]


def test_schema_is_generated_from_the_models():
    from master.spec import BudgetTarget, OutputsSpec, ScheduleSpec

    schema = spec_json_schema()
    defs = schema["$defs"]
    for model in (ScheduleSpec, OutputsSpec, BudgetTarget, SFTConfig, RLConfig):
        assert set(defs[model.__name__]["properties"]) == set(model.model_fields)
        for name, info in model.model_fields.items():
            assert defs[model.__name__]["properties"][name]["description"] == info.description
    assert set(schema["properties"]) == set(WorkloadSpec.model_fields)


def test_known_presets_match_the_model_core_without_importing_torch():
    import subprocess
    import sys

    from master.spec import known_presets
    from models.presets import PRESETS

    assert known_presets() == tuple(sorted(PRESETS))
    code = ("import sys; from sdk.cli import main; rc = main(['spec', 'validate', 'examples/rl_reach.yaml']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("bad", [[], list(range(91)), [-1], [True], ["x" * 201], [""], [1.5], "some", {"a": 1}, 3])
def test_eval_tasks_refuses_what_is_not_a_bounded_list_of_indices_or_names(bad):
    """`eval.tasks` is tenant input: at most 90 entries, each an index >= 0 or a 1-200 character
    name; anything else is one error naming the field and what is allowed."""
    errs = errors_of(mutate(minimal("eval"), {"eval.tasks": bad}))
    assert list(errs) == ["eval.tasks"] and "allowed: 'all', null, or a list of 1..90" in errs["eval.tasks"], errs


@pytest.mark.parametrize("good", [None, "all", [0], list(range(90)), [3, "open the drawer"]])
def test_eval_tasks_takes_all_null_or_indices_and_names(good):
    assert parse_spec(mutate(minimal("eval"), {"eval.tasks": good})).eval.tasks == good
