"""Every leaf field of the workload spec reaches the code that uses it.

The spec models are walked (`master.spec_schema.leaf_paths`): for each leaf, a spec with a
non-default value must compile into something different from the baseline: the tenant's
`TenantConfig` (`compile_tenant`), the workflow's `WorkflowSpec` (`compile_workflow`), the
eval pin (`policy_pin`) or the report location (`report_file`). A new field without an entry
in VALUES fails here until it is wired and listed. Pure functions, no NATS, no torch.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from master.spec import (
    RLConfig,
    POLICY_FIELDS,
    SFTConfig,
    SpecError,
    WorkloadSpec,
    compile_tenant,
    dataset_errors,
    feature_errors,
    parse_spec,
)
from master.spec_schema import leaf_paths
from master.reports import report_file
from master.workload_plan import compile_workflow, policy_pin
from protocol.messages import WorkloadRecord
from protocol.wire import to_body

CAMERAS = [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}]


def doc(kind: str) -> dict[str, Any]:
    """Baseline specs: sft from env demos, sft from a dataset, rl, eval; every optional
    section that holds leaves is present so its leaves can be varied."""
    base: dict[str, Any] = {
        "tenant": "t", "base": "tiny-qwen3-vl-64",
        "observation": {"cameras": copy.deepcopy(CAMERAS), "state_dim": 4}, "action": {"dim": 2},
    }
    if kind == "sft":
        return {**base, "task": "sft", "action_module": {"kind": "mlp"}, "base_adapter": {"kind": "lora", "rank": 4},
                "env": {"id": "builtin/reach-v0", "demos": {"episodes": 5}},
                "schedule": {"budget": {"target": {"metric": "loss", "at_most": 0.1}}}}
    if kind == "dataset":
        return {**base, "task": "sft", "action_module": {"kind": "mlp"},
                "dataset": {"root": "/d", "camera_map": {"cam.a": "top", "cam.b": "wrist"}}}
    if kind == "rl":
        return {**base, "task": "rl", "action_module": {"kind": "gaussian"}, "env": {"id": "builtin/reach-v0"},
                "schedule": {"budget": {"target": {"metric": "success_rate", "at_least": 0.9}}}}
    # An eval names the policy it scores (tenant + version) and repeats nothing of it.
    return {"tenant": "t", "task": "eval", "env": {"id": "builtin/reach-v0"}, "eval": {"version": "latest"}}


# leaf path -> (baseline, non-default value). "algorithm.*" leaves appear once per algorithm
# model; the key then carries the model name.
VALUES: dict[str, tuple[str, Any]] = {
    "tenant": ("sft", "other"),
    "task": ("eval", "rl"),  # with the rl head: see _set
    "base": ("sft", "tiny-smolvlm"),
    "action_module.kind": ("sft", "flow"),
    "action_module.params": ("sft", {"width": 32}),
    "base_adapter.rank": ("sft", 8),
    "base_adapter.alpha": ("sft", 2.0),
    "base_adapter.target_modules": ("sft", ["q_proj"]),
    "base_adapter.dropout": ("sft", 0.1),
    "observation.cameras[].name": ("sft", "front"),
    "observation.cameras[].height": ("sft", 32),
    "observation.cameras[].width": ("sft", 32),
    "observation.state_dim": ("sft", 3),
    "observation.instruction_template": ("sft", "do: {instruction}"),
    "action.dim": ("sft", 3),
    "action.horizon": ("sft", 4),
    "seed": ("sft", 7),
    "env.id": ("rl", "builtin/other-v0"),
    "env.options": ("rl", {"max_episode_steps": 9}),
    "env.hosted": ("rl", "tenant"),
    "env.demos.episodes": ("sft", 6),
    "env.demos.seed": ("sft", 11),
    "env.demos.noise": ("sft", 0.5),
    "dataset.root": ("dataset", "/other"),
    "dataset.camera_map": ("dataset", {"cam.x": "top", "cam.b": "wrist"}),
    "dataset.state_key": ("dataset", "observation.joints"),
    "dataset.action_key": ("dataset", "action.ee"),
    "SFTConfig.lr": ("sft", 1e-3),
    "SFTConfig.batch_size": ("sft", 8),
    "SFTConfig.steps": ("sft", 20),
    "SFTConfig.until_version": ("sft", 2000),
    "SFTConfig.items_per_job": ("sft", 4),
    "SFTConfig.weight_decay": ("sft", 0.0),
    "SFTConfig.grad_clip": ("sft", None),
    "SFTConfig.warmup_steps": ("sft", 5),
    "RLConfig.lr": ("rl", 1e-3),
    "RLConfig.gamma": ("rl", 0.0),  # zero is a value, not "unset"
    "RLConfig.gae_lambda": ("rl", 0.0),
    "RLConfig.clip_ratio": ("rl", 0.1),
    "RLConfig.value_coef": ("rl", 1.0),
    "RLConfig.entropy_coef": ("rl", 0.01),
    "RLConfig.normalize_advantages": ("rl", False),
    "RLConfig.epochs": ("rl", 2),
    "RLConfig.episodes_per_update": ("rl", 4),
    "RLConfig.steps_per_update": ("rl", 128),  # with episodes_per_update removed: see _set
    "RLConfig.parallel_envs": ("rl", 4),
    "RLConfig.micro_batch": ("rl", 32),
    "RLConfig.weight_decay": ("rl", 0.01),
    "RLConfig.grad_clip": ("rl", None),
    "RLConfig.warmup_steps": ("rl", 3),
    "RLConfig.value_warmup_episodes": ("rl", 32),
    "RLConfig.kl_coef": ("rl", 0.1),
    "RLConfig.kl_anchor_version": ("rl", 3),  # with kl_coef > 0: see _set
    "RLConfig.advantage": ("rl", "group_success"),  # with group_size 2: see _set
    "RLConfig.group_size": ("rl", 2),  # read under advantage group_success only: see _set
    "schedule.priority": ("sft", 3),
    "schedule.max_inflight_jobs": ("sft", 4),
    "schedule.staleness_bound": ("rl", 8),
    "schedule.sft_prefetch_items": ("sft", 32),
    "schedule.budget.max_steps": ("sft", 9),
    "schedule.budget.max_episodes": ("rl", 9),
    "schedule.budget.max_wall_s": ("rl", 60.0),
    "schedule.budget.target.metric": ("rl", "mean_return"),
    "schedule.budget.target.at_least": ("rl", 0.5),
    "schedule.budget.target.at_most": ("sft", 0.2),
    "schedule.budget.target.window": ("sft", 3),
    "eval.version": ("eval", 3),
    "eval.episodes": ("eval", 9),
    "eval.seed": ("eval", 5),
    "eval.sample": ("eval", True),
    "eval.tasks": ("eval", "all"),
    "outputs.export_every_steps": ("sft", 10),
    "outputs.report_path": ("sft", "out/report.json"),
}
# Leaves with nothing to vary, and why.
EXEMPT = {"spec_version": "one allowed value (1) so far: the format version, not a setting",
          "base_adapter.kind": "one allowed value (lora) so far",
          # Read at submit, not compiled: the master resolves the names in the tenant's own
          # uploads and a trainer loads them (master/uploads.py); tests/master/test_start_weights.py
          # runs both on a deployment, tests/models/test_start_weights_slot.py the adapter.
          "init.weights": "read at submit by master/uploads.py start_from_upload (tests/master/test_start_weights.py)",
          "init.adapter": "read at submit by master/uploads.py start_from_upload "
                          "(tests/models/test_start_weights_slot.py loads a peft adapter)"}


def _key(path: str, model: type) -> str:
    return f"{model.__name__}.{path.split('.', 1)[1]}" if path.startswith("algorithm.") else path


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    parts = [p for p in re.split(r"\.|(\[\])", path) if p]
    node = out
    for part, nxt in zip(parts, parts[1:]):
        if part == "[]":
            continue
        node = node.setdefault(part, {})
        if nxt == "[]":
            node = node[0]
    node[parts[-1]] = value
    if path == "task":  # eval -> rl: the slot's sections become required
        out.update({k: v for k, v in doc("rl").items() if k in POLICY_FIELDS})
        out.pop("eval")
    if path == "algorithm.steps_per_update":
        out["algorithm"]["episodes_per_update"] = None
    if path == "algorithm.kl_anchor_version":  # an anchor needs a KL term
        out["algorithm"]["kl_coef"] = 0.1
    if path in ("algorithm.advantage", "algorithm.group_size"):  # groups of 2 episodes, 4 an update
        out["algorithm"].update(advantage="group_success", group_size=2, episodes_per_update=4)
        out["algorithm"].pop("steps_per_update", None)
    return out


def reach(spec: WorkloadSpec) -> dict[str, Any]:
    """Everything a spec turns into outside the spec itself."""
    rec = WorkloadRecord(workload="w1", tenant=spec.tenant, task=spec.task, state="completed",
                         spec=spec.model_dump(mode="json"), created_at=0.0, updated_at=0.0)
    tenant = to_body(compile_tenant(spec)) if spec.task != "eval" else None  # an eval makes no slot
    return {"tenant": tenant, "workflow": to_body(compile_workflow(spec, "w1")),
            "pin": policy_pin(spec), "report": str(report_file("/data", rec))}


def test_every_leaf_reaches_the_code_that_uses_it():
    leaves = [(p, m) for p, m, _ in leaf_paths(WorkloadSpec)]
    keys = [_key(p, m) for p, m in leaves]
    missing = sorted(set(keys) - set(VALUES) - set(EXEMPT))
    assert not missing, f"spec leaves with no entry in VALUES (wire them, then list them): {missing}"
    stale = sorted(set(VALUES) - set(keys))
    assert not stale, f"VALUES names fields the spec no longer has: {stale}"
    dead = []
    for (path, model), key in zip(leaves, keys):
        if key in EXEMPT:
            continue
        kind, value = VALUES[key]
        baseline = parse_spec(doc(kind))
        changed = parse_spec(_set(doc(kind), path, value))
        assert getattr(_section(changed, path), path.rsplit(".", 1)[-1]) is not None or value is None
        if reach(changed) == reach(baseline):
            dead.append(key)
    assert not dead, f"spec leaves that reach nothing (parsed but unread): {dead}"


def _section(spec: WorkloadSpec, path: str) -> Any:
    node: Any = spec
    for part in path.split(".")[:-1]:
        part = part.removesuffix("[]")
        node = getattr(node, part)
        if isinstance(node, tuple):
            node = node[0]
    return node


def test_zero_gamma_and_lambda_are_honoured():
    spec = parse_spec(_set(_set(doc("rl"), "algorithm.gamma", 0), "algorithm.gae_lambda", 0))
    algo = compile_workflow(spec, "w1").algo
    assert (algo["gamma"], algo["gae_lambda"]) == (0.0, 0.0)
    assert compile_workflow(parse_spec(doc("rl")), "w1").algo["gamma"] == 0.99


def test_algorithm_types_follow_the_task():
    assert isinstance(parse_spec(doc("sft")).algorithm, SFTConfig)
    assert isinstance(parse_spec(doc("rl")).algorithm, RLConfig)
    assert parse_spec(doc("eval")).algorithm is None


def test_export_every_steps_and_report_path_compile():
    spec = parse_spec(_set(doc("sft"), "outputs.export_every_steps", 2))
    assert compile_tenant(spec).export_every_steps == 2
    rec = WorkloadRecord(workload="w9", tenant="t", task="sft", state="completed",
                         spec=spec.model_dump(mode="json"), created_at=0.0, updated_at=0.0)
    assert report_file("/data", rec) == Path("/data/reports/t/w9.json").resolve()


def test_rl_exports_as_sparse_as_the_staleness_bound_are_refused():
    """Rollouts act with the last exported version: exports every >= staleness_bound steps
    would make every rollout stale before the next export (nothing would ever train again; a
    PushCube PPO run found it, docs/results.md). Below the bound, or 0, is fine; SFT has no bound."""
    rl = _set(doc("rl"), "schedule.staleness_bound", 64)
    with pytest.raises(SpecError) as info:
        parse_spec(_set(copy.deepcopy(rl), "outputs.export_every_steps", 64))
    (err,) = info.value.details["errors"]
    assert err["field"] == "outputs.export_every_steps" and err["value"] == 64
    assert "schedule.staleness_bound=64" in err["message"] and "stale" in err["message"]
    assert parse_spec(_set(copy.deepcopy(rl), "outputs.export_every_steps", 63)).outputs.export_every_steps == 63
    assert parse_spec(_set(doc("sft"), "outputs.export_every_steps", 500)).outputs.export_every_steps == 500


def test_a_later_workload_sets_export_every_steps_as_it_sets_the_other_scheduling_fields():
    """A tenant's next workload changes how it is scheduled, optimised and exported (not what
    it is): an RL workload after an SFT one that exported every 200 steps exports as its own
    spec says (it kept the SFT's 200 once, and starved: every rollout stale)."""
    from master.policy_checks import MUTABLE_FIELDS

    assert "export_every_steps" in MUTABLE_FIELDS
    sft = compile_tenant(parse_spec(_set(doc("sft"), "outputs.export_every_steps", 200)))
    rl = compile_tenant(parse_spec(doc("rl")))
    assert {k for k in MUTABLE_FIELDS if getattr(sft, k) != getattr(rl, k)} >= {"export_every_steps"}


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up.json", "a/../../b.json", "a//b.json", "a/./b.json",
                                 "a b.json", "x/", "r\\..\\x.json"])
def test_report_path_cannot_leave_the_tenants_reports_dir(bad):
    with pytest.raises(SpecError) as info:
        parse_spec(_set(doc("sft"), "outputs.report_path", bad))
    (err,) = info.value.details["errors"]
    assert err["field"] == "outputs.report_path" and err["value"] == bad
    assert "inside the tenant's reports dir" in err["message"]


def test_report_path_symlink_out_is_refused(tmp_path):
    from master.reports import write_report

    (tmp_path / "data" / "reports" / "t").mkdir(parents=True)
    (tmp_path / "data" / "reports" / "t" / "link").symlink_to(tmp_path)
    spec = parse_spec(_set(doc("sft"), "outputs.report_path", "link/escape.json"))
    rec = WorkloadRecord(workload="w", tenant="t", task="sft", state="completed",
                         spec=spec.model_dump(mode="json"), created_at=0.0, updated_at=0.0)
    with pytest.raises(OSError):
        write_report(tmp_path / "data", rec)
    assert not (tmp_path / "escape.json").exists()


def test_dataset_keys_are_checked_against_the_dataset_features():
    features = {"observation.state": {"dtype": "float32", "shape": [8]},
                "action": {"dtype": "float32", "shape": [7]},
                "observation.images.image": {"dtype": "video", "shape": [64, 64, 3]}}
    assert feature_errors(features, "observation.state", "action", ["observation.images.image"], 8, 7) == []
    errs = {f: (m, v) for f, m, v in feature_errors(features, "observation.joints", "act", ["cam"], 8, 7)}
    assert set(errs) == {"dataset.state_key", "dataset.action_key", "dataset.camera_map[cam]"}
    assert "no feature 'observation.joints'" in errs["dataset.state_key"][0]
    assert "action, observation.state" in errs["dataset.state_key"][0]  # what is allowed
    # No state feature at all: fine when the schema has no state, an error naming the field otherwise.
    no_state = {k: v for k, v in features.items() if k != "observation.state"}
    assert feature_errors(no_state, "observation.state", "action", [], 0, 7) == []
    (err,) = feature_errors(no_state, "observation.state", "action", [], 8, 7)
    assert err[0] == "dataset.state_key" and "observation.state_dim: 0" in err[1]


def test_dataset_errors_read_the_fixture(libero_like):
    features = json.loads((libero_like / "meta/info.json").read_text())["features"]
    cams = {k: n for k, n in zip([k for k, f in features.items() if f["dtype"] in ("image", "video")],
                                 ["top", "wrist"])}
    spec_doc = _set(doc("dataset"), "dataset", {"root": str(libero_like), "camera_map": cams})
    spec_doc["observation"]["state_dim"] = features["observation.state"]["shape"][0]
    spec_doc["action"]["dim"] = features["action"]["shape"][0]
    assert dataset_errors(parse_spec(spec_doc)) == []
    spec_doc["dataset"]["state_key"] = "observation.nope"
    (err,) = dataset_errors(parse_spec(spec_doc))
    assert err[0] == "dataset.state_key"


def test_an_eval_takes_the_policy_sections_and_a_repeat_must_match():
    """What the master fills into an eval's stored spec from the scored version's manifest,
    and the field-named errors for a repeated section that differs (pure functions)."""
    from master.policy_checks import policy_mismatches, policy_sections

    manifest = {"base": "tiny-qwen3-vl-64", "head": "gaussian", "head_params": {"width": 64, "clip_ratio": 0.2},
                "schema": {"cameras": CAMERAS, "state_dim": 4, "action_dim": 2, "action_horizon": 1,
                           "instruction_template": "{instruction}"}}
    sections = policy_sections(manifest)
    assert sections["action_module"] == {"kind": "gaussian", "params": {"width": 64}}  # no loss settings
    assert sections["action"] == {"dim": 2, "horizon": 1}
    short = parse_spec(doc("eval"))
    assert policy_mismatches(short, sections, "t", 3) == []
    stored = parse_spec({**short.model_dump(mode="json"), **sections})  # the stored form parses
    assert (stored.base, stored.observation.state_dim) == ("tiny-qwen3-vl-64", 4)
    same = parse_spec({**doc("eval"), "base": "tiny-qwen3-vl-64", "action": {"dim": 2}})
    assert policy_mismatches(same, sections, "t", 3) == []
    other = parse_spec({**doc("eval"), "action_module": {"kind": "mlp", "params": {"width": 64}},
                        "observation": {"cameras": CAMERAS, "state_dim": 3}})
    errors = {path: message for path, message, _ in policy_mismatches(other, sections, "t", 3)}
    assert set(errors) == {"action_module.kind", "observation.state_dim"}
    assert errors["action_module.kind"].startswith("'mlp' differs from tenant t's policy version 3: 'gaussian'")
