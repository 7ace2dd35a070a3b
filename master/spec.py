"""WorkloadSpec: what a tenant submits (YAML or JSON), strictly validated by pydantic v2
models, compiled to a backend `TenantConfig`. Pure functions, no I/O beyond reading a file
you name; no torch (base preset names are read from models/presets.py's source).

    from master.spec import parse_spec, compile_tenant, spec_to_dict, spec_from_dict, SpecError

    spec = parse_spec(open("examples/sft_reach.yaml", "rb").read())   # YAML or JSON bytes/str/dict
    cfg = compile_tenant(spec)           # protocol.messages.TenantConfig (signature: the master's job)
    stored = spec_to_dict(spec)          # JSON-safe; spec_from_dict(stored) == spec
    try:
        parse_spec({"tenant": "a b"})
    except SpecError as err:
        err.details["errors"]  # [{"field": "tenant", "message": "...", "value": "a b"}, ...] all at once

The models below are the single source of truth: `spec_json_schema()` is pydantic's schema
of them plus the task rules, and so are docs/workload_spec.schema.json and the field
reference in docs/workload_spec.md (`python -m master.spec` rewrites both).

Task-type rules (`TASK_RULES`) are data; a model validator of `WorkloadSpec` applies them (on
the raw document too when fields fail, so every error comes at once), and they also drive
the ``allOf``/``if``/``then`` part of the JSON Schema.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    SerializationInfo,
    ValidationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from master.spec_schema import (
    ROOT,
    Allowed,
    BySibling,
    field_rows,
    model_schema,
    reraise_details,
    spec_errors,
)
from protocol import recipes
from protocol.base_names import REGISTERED_BASE_PREFIX as REGISTERED_BASE_PREFIX
from protocol.base_names import known_presets
from protocol.messages import TenantConfig
from protocol.recipe_configs import doc as _doc
from protocol.recipe_configs import (
    Int,
    RecipeConfig,
    RLConfig,
    SFTConfig,
    Str,
    raise_rules,
    rule,
)




# The sections, and the names other modules import from here (re-exported).
from master.spec_sections import (
    BudgetSpec,
    Camera,
    DemosSpec,
    ALGORITHMS,
    ActionModuleSpec,
    ActionSpec,
    BaseAdapterSpec,
    DatasetSource,
    EnvSource,
    EvalSpec,
    HeadKind,
    InitSpec,
    ObservationSpec,
    OutputsSpec,
    PPO_HEAD_FIELDS,
    SPEC_VERSION,
    ScheduleSpec,
    SpecError,
    TARGET_METRICS,
    TENANT_PATTERN,
    TaskType,
    BASE_SCHEMA,
    SpecSection,
    check_base,
    spec_error,
    doc_factory,
    BudgetTarget,
    algorithm_model,
    report_path_problem as report_path_problem,
)

POLICY_FIELDS = ("base", "action_module", "observation", "action")
_POLICY_FIELD = ("Required by sft and rl; eval: leave it out (taken from the scored policy's export "
                 "manifest; if given it must match it). Default null")


class WorkloadSpec(SpecSection):
    """One tenant's workload: model, schema, data source, algorithm, schedule and outputs."""

    spec_version: Literal[1] = _doc("format version of this spec. Default 1: the only version so far",
                                    SPEC_VERSION)
    tenant: Annotated[Str, Allowed("letters, digits, _ and - (1-64 characters)")] = _doc(
        "tenant name, unique per deployment", pattern=f"^(?:{TENANT_PATTERN})$")
    task: TaskType = _doc("sft: supervised fine-tuning; rl: asynchronous PPO; eval: read-only evaluation; or the "
                          "kind of a recipe the master loaded (NEXUS_WORKFLOW_MODULES: docs/workload_spec.md \"Adding "
                          "a recipe\"), which follows the rules of its family (one of sft, rl, eval)")
    base: Annotated[str | None, WithJsonSchema({"anyOf": [BASE_SCHEMA, {"type": "null"}]})] = _doc(
        "frozen base model: a preset name, a base the operator registered written registered:<name> "
        "(`nexus base list`), or (the operator's own workloads only) a local save_pretrained directory "
        f"written with a '/' (./my_base). {_POLICY_FIELD}", None)
    action_module: ActionModuleSpec | None = _doc(f"the tenant's trainable head. {_POLICY_FIELD}", None)
    base_adapter: BaseAdapterSpec | None = _doc("LoRA adapters on the base, trained with the action "
                                                "module. Default null: the base stays frozen", None)
    observation: ObservationSpec | None = _doc(f"cameras, state and prompt template. {_POLICY_FIELD}", None)
    action: ActionSpec | None = _doc(f"action size and horizon. {_POLICY_FIELD}", None)
    seed: Int = _doc("seeds head init, sampling and the SFT batch order. Default 0: reproducible runs",
                     0, ge=0)
    env: EnvSource | None = _doc("simulator: required by rl and eval; sft uses it with env.demos "
                                 "(exclusive with dataset)", None)
    dataset: DatasetSource | None = _doc("sft only: a local LeRobot v3.0 dataset (exclusive with env)", None)
    # The annotation lists the built-ins' configs (the JSON Schema's); `_by_task` validates into
    # the task's declared config, a registered recipe's too, and `_dump_algorithm` dumps that.
    algorithm: Annotated[SFTConfig | RLConfig | None, BySibling("task", ALGORITHMS, algorithm_model)] = Field(
        None, validate_default=True,
        description="hyper-parameters typed by task (sft: SFTConfig, rl: RLConfig; eval: none; a registered "
                    "recipe's kind: its config model). Default null: the task's defaults")
    schedule: ScheduleSpec = doc_factory("priority, caps and budget", ScheduleSpec)
    init: InitSpec | None = _doc("sft / rl: start a new tenant's slot from weights it uploaded. Default null: "
                                 "from the seed", None)
    eval: EvalSpec | None = _doc("evaluation settings: required by eval; on sft/rl, evaluates the final "
                                 "version (needs env)", None)
    outputs: OutputsSpec = doc_factory("exports and report", OutputsSpec)

    @field_validator("base", mode="plain")
    @classmethod
    def _base(cls, value: Any) -> str | None:
        return None if value is None else check_base(value)

    @field_validator("task")
    @classmethod
    def _task(cls, value: str) -> str:
        # A tenant's text: any kind this process declared (the built-ins, and those the modules
        # of NEXUS_WORKFLOW_MODULES registered), nothing else.
        if recipes.declaration(value) is None:
            raise spec_error(f"{value!r} is not allowed; allowed: {', '.join(recipes.declared_kinds())} (a recipe "
                          f"kind of your own: the module registering it in {recipes.SETTING} of the master and "
                          "the env workers)")
        return value

    @property
    def family(self) -> str:
        """The built-in task whose rules this spec's task follows (sft, rl or eval; a built-in
        is its own): spec sections, training, target metrics and pinned reads go by it."""
        return recipes.family_of(self.task)

    @field_validator("algorithm", mode="wrap")
    @classmethod
    def _by_task(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        # The section's type depends on the task (its recipe's config); an invalid task is
        # reported on its own field, and eval takes none (the task rule reports an algorithm
        # given there).
        model = algorithm_model(info.data.get("task"))
        if model is None:
            return None
        # An omitted algorithm means the task's defaults; stored specs then say what ran.
        return model.model_validate({} if value is None else value)

    @field_serializer("algorithm")
    def _dump_algorithm(self, value: RecipeConfig | None, info: SerializationInfo) -> Any:
        # By the value's own model: a registered recipe's config is none of the annotation's.
        return None if value is None else value.model_dump(mode=info.mode)

    @model_validator(mode="wrap")
    @classmethod
    def _task_rules(cls, data: Any, handler: Any) -> WorkloadSpec:
        rules = _rule_errors(data) if isinstance(data, dict) else []
        try:
            spec = handler(data)
        except ValidationError as exc:
            if not rules:
                raise
            raise_rules(cls.__name__, reraise_details(exc) + rules)
            raise
        raise_rules(cls.__name__, rules + _cross_errors(spec))
        return spec


# ---- task-type rules -------------------------------------------------------------------
class TaskRule(BaseModel):
    """Which sections a task type needs or forbids, and which heads it can train."""

    model_config = ConfigDict(frozen=True)

    required: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    exactly_one: tuple[str, ...] = ()  # exactly one of these sections is set
    heads: tuple[str, ...] = ("mlp", "flow", "gaussian", "expert")
    demos: Literal["required", "forbidden"] = "forbidden"  # env.demos, when env is set
    why: str = ""


TASK_RULES: dict[str, TaskRule] = {
    "sft": TaskRule(required=POLICY_FIELDS, exactly_one=("dataset", "env"), demos="required",
                    why="sft learns from demonstrations: a LeRobot dataset, or an env whose scripted "
                        "expert records env.demos.episodes first"),
    "rl": TaskRule(required=(*POLICY_FIELDS, "env"), forbidden=("dataset",), heads=("gaussian",),
                   why="rl rolls out in an env and PPO needs log-probs and values from a gaussian head"),
    "eval": TaskRule(required=("env", "eval"), forbidden=("dataset", "init"),
                     why="eval runs episodes in an env with a pinned version of an existing policy "
                         "and trains nothing"),
}


def _is_set(raw: dict[str, Any], key: str) -> bool:
    return raw.get(key) is not None


def _rule_errors(raw: dict[str, Any]) -> list[InitErrorDetails]:
    """Task-type rules on the raw document (sections present or not, whatever their content):
    those of the task's family (a registered recipe's kind follows sft's, rl's or eval's)."""
    task = raw.get("task")
    known = recipes.declaration(task)
    if known is None:
        return []  # the task field's own error says what is allowed
    rule_, family = TASK_RULES[known.family], known.family
    errors: list[InitErrorDetails] = []
    for key in rule_.required:
        if not _is_set(raw, key):
            why = ("it says what the tenant's slot is (only an eval takes it from the policy it scores)"
                   if key in POLICY_FIELDS else rule_.why)
            errors.append(rule((key,), f"required for task {task!r}: {why}"))
    for key in rule_.forbidden:
        if _is_set(raw, key):
            errors.append(rule((key,), f"not allowed for task {task!r}; remove it", raw.get(key)))
    if known.config is None and _is_set(raw, "algorithm"):  # eval's recipe, say: it has no config
        errors.append(rule(("algorithm",), f"not allowed for task {task!r}; remove it", raw.get("algorithm")))
    if rule_.exactly_one:
        present = [k for k in rule_.exactly_one if _is_set(raw, k)]
        options = " or ".join(rule_.exactly_one)
        if not present:
            errors.append(rule((rule_.exactly_one[0],), f"task {task!r} needs one of {options}: {rule_.why}"))
        for key in present[1:]:
            errors.append(rule((key,), f"task {task!r} takes one of {options}, not both; remove {key} or "
                                       f"{present[0]}", raw.get(key)))
    module = raw.get("action_module")
    kind = module.get("kind") if isinstance(module, dict) else None
    if isinstance(kind, str) and kind in HeadKind.__args__ and kind not in rule_.heads:  # type: ignore[attr-defined]
        errors.append(rule(("action_module", "kind"), f"{kind!r} is not allowed for task {task!r}; allowed: "
                                                      f"{', '.join(rule_.heads)} ({rule_.why})", kind))
    env = raw.get("env")
    if isinstance(env, dict):
        has_demos = env.get("demos") is not None
        if rule_.demos == "required" and not has_demos and not _is_set(raw, "dataset"):
            errors.append(rule(("env", "demos"), f"required when task {task!r} trains from an env: record N "
                                                 "scripted-expert episodes first, e.g. demos: {episodes: 50}"))
        if rule_.demos == "forbidden" and has_demos:
            errors.append(rule(("env", "demos"), f"only task 'sft' records demos; remove it for task {task!r}",
                               env.get("demos")))
    if isinstance(env, dict) and env.get("hosted") is not None and family == "sft":
        errors.append(rule(("env", "hosted"), "a hosted env serves rl and eval workloads; sft trains from a dataset "
                                              "or the platform's scripted demos: remove env.hosted", env.get("hosted")))
    if _is_set(raw, "eval") and not _is_set(raw, "env") and "env" not in rule_.required:
        errors.append(rule(("eval",), "evaluation runs episodes in an env: set env, or remove eval"))
    return errors


def _cross_errors(spec: WorkloadSpec) -> list[InitErrorDetails]:
    """Rules across sections that need parsed values (all sections valid)."""
    errors: list[InitErrorDetails] = []
    if spec.dataset is not None and spec.observation is not None:
        names = [c.name for c in spec.observation.cameras]
        mapped = list(spec.dataset.camera_map.values())
        for key, target in spec.dataset.camera_map.items():
            if target not in names:
                errors.append(rule(("dataset", "camera_map", key),
                                   f"{target!r} is not an observation camera; allowed: {', '.join(names)}", target))
        for name in names:
            count = mapped.count(name)
            if count != 1:
                errors.append(rule(("dataset", "camera_map"), f"observation camera {name!r} is mapped {count} "
                                   "times; map exactly one dataset camera key to it", dict(spec.dataset.camera_map)))
    if spec.family == "rl" and spec.action_module is not None:
        clash = sorted(set(spec.action_module.params) & set(PPO_HEAD_FIELDS))
        if clash:
            errors.append(rule(("action_module", "params"), f"{clash} are PPO settings: set them under "
                               "algorithm (one place), not in the head params", clash))
    if spec.init is not None and spec.init.adapter and spec.base_adapter is None:
        errors.append(rule(("init", "adapter"), "a LoRA adapter to start from needs base_adapter (the adapter's "
                           "rank and target modules); set base_adapter, or remove init.adapter", spec.init.adapter))
    if isinstance(spec.algorithm, SFTConfig) and spec.algorithm.items_per_job > spec.schedule.sft_prefetch_items:
        # A job's items must all be queued before it is ready: more than the cap can never fit.
        errors.append(rule(("algorithm", "items_per_job"),
                           f"{spec.algorithm.items_per_job} exceeds schedule.sft_prefetch_items="
                           f"{spec.schedule.sft_prefetch_items}; allowed: <= sft_prefetch_items (raise the cap "
                           "or use smaller jobs)", spec.algorithm.items_per_job))
    every = spec.outputs.export_every_steps
    if spec.family == "rl" and every > 0 and every >= spec.schedule.staleness_bound:
        # Rollouts act with the newest *exported* version; with exports this sparse every rollout
        # is past the bound before the next export: all dropped, nothing trains again.
        errors.append(rule(("outputs", "export_every_steps"),
                           f"{every} is not below schedule.staleness_bound={spec.schedule.staleness_bound}: "
                           "rollouts act with the last exported version, so every one would be dropped as "
                           "stale before the next export; allowed: 0 (every job) or < staleness_bound", every))
    target = spec.schedule.budget.target
    if target is not None:
        allowed = TARGET_METRICS[spec.family]
        if target.metric not in allowed:
            errors.append(rule(("schedule", "budget", "target", "metric"),
                               f"{target.metric!r} is not measured by task {spec.task!r}; allowed: "
                               f"{', '.join(allowed) or 'none (eval ends after eval.episodes)'}", target.metric))
    return errors

class _SpecLoader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2 floats (``1e-4`` is a number, not a string) and no duplicate keys."""


_SpecLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_SpecLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_document(data: bytes | str) -> Any:
    """JSON or YAML text -> plain data (the same loader `parse_spec` uses)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError([(ROOT, f"not UTF-8 text ({exc})")]) from None
    if data.lstrip().startswith(("{", "[")):
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            pass  # maybe a YAML flow mapping; YAML's error is reported if that fails too
    try:
        return yaml.load(data, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecError([(ROOT, f"not valid YAML or JSON: {' '.join(str(exc).split())}")]) from None




def parse_spec(data: dict[str, Any] | bytes | str) -> WorkloadSpec:
    """Validate a spec (a dict, or YAML / JSON bytes or text); raise `SpecError` listing every
    problem with its field path, the value given and what is allowed."""
    raw = data if isinstance(data, dict) else load_document(data)
    if not isinstance(raw, dict):
        raise SpecError([(ROOT, f"a workload spec must be a mapping of fields, got {type(raw).__name__}")])
    try:
        return WorkloadSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(spec_errors(WorkloadSpec, exc, raw)) from None


def load_spec(path: str | Path) -> WorkloadSpec:
    """`parse_spec` of a file (YAML or JSON)."""
    return parse_spec(Path(path).read_bytes())


def spec_to_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """JSON-safe plain data (every field written, defaults included) for the workloads KV."""
    return spec.model_dump(mode="json")


def spec_from_dict(data: dict[str, Any]) -> WorkloadSpec:
    """Inverse of `spec_to_dict`, as strict as `parse_spec`."""
    return parse_spec(dict(data))


def compile_tenant(spec: WorkloadSpec) -> TenantConfig:
    """The backend config of the spec's tenant. ``signature`` and ``created_at`` stay empty:
    the master derives them (never trusted from a client). sft / rl only: an eval makes no
    slot (it scores an existing one)."""
    missing = [name for name in POLICY_FIELDS if getattr(spec, name) is None]
    if missing:
        raise SpecError([(name, f"required to compile a tenant (task {spec.task!r} gives none)") for name in missing])
    schema = {
        "cameras": [c.model_dump() for c in spec.observation.cameras],
        "state_dim": spec.observation.state_dim,
        "action_dim": spec.action.dim,
        "action_horizon": spec.action.horizon,
        "instruction_template": spec.observation.instruction_template,
    }
    head_params = dict(spec.action_module.params)
    optim: dict[str, Any] = {}
    alg = spec.algorithm
    if alg is not None:
        # Key names are models.slot.OptimConfig's fields; a registered recipe's config sets
        # those it has (the model core's defaults the rest).
        optim = {k: getattr(alg, k) for k in ("lr", "weight_decay", "grad_clip", "warmup_steps") if hasattr(alg, k)}
        if isinstance(alg, SFTConfig):
            # Cosine decay over the planned run; the master sets where it starts (the tenant's
            # version at accept: optim.schedule_start) and turns until_version into steps from there.
            optim["total_steps"] = alg.steps if alg.steps is not None else alg.until_version
        if isinstance(alg, RLConfig) and spec.action_module.kind == "gaussian":
            # The gaussian head computes the PPO loss, so these live in its config.
            head_params.update({k: getattr(alg, k) for k in PPO_HEAD_FIELDS})
    sched = spec.schedule
    return TenantConfig(
        name=spec.tenant, base=spec.base, schema=schema, head=spec.action_module.kind,
        head_params=head_params, optim=optim, seed=spec.seed,
        max_inflight_jobs=sched.max_inflight_jobs, sft_prefetch_items=sched.sft_prefetch_items,
        staleness_bound=sched.staleness_bound, priority=sched.priority,
        export_every_steps=spec.outputs.export_every_steps,
        base_adapter=_adapter_config(spec.base_adapter),
    )


def _adapter_config(adapter: BaseAdapterSpec | None) -> dict[str, Any]:
    """models.lora.AdapterConfig's fields (alpha resolved); {} for a frozen base."""
    if adapter is None:
        return {}
    return {"kind": adapter.kind, "rank": adapter.rank, "alpha": float(adapter.alpha or adapter.rank),
            "target_modules": list(adapter.target_modules), "dropout": adapter.dropout}


def dataset_errors(spec: WorkloadSpec, root: str | Path | None = None) -> list[tuple[str, str, Any]]:
    """The dataset's declared features against the spec (state and action keys, cameras), when
    its meta/info.json can be read here; [] when it cannot (the env worker checks at start)."""
    ds = spec.dataset
    if ds is None or spec.observation is None or spec.action is None:
        return []
    info_path = Path(root if root is not None else ds.root) / "meta" / "info.json"
    try:
        features = json.loads(info_path.read_text()).get("features", {})
    except (OSError, ValueError):
        return []
    return feature_errors(features, ds.state_key, ds.action_key, list(ds.camera_map), spec.observation.state_dim,
                          spec.action.dim)


def feature_errors(features: dict[str, Any], state_key: str, action_key: str, cameras: list[str],
                   state_dim: int, action_dim: int) -> list[tuple[str, str, Any]]:
    """Shared by the master (at submit) and the SFT workflow (at start)."""
    numeric = sorted(k for k, f in features.items() if isinstance(f, dict) and f.get("dtype") not in ("image", "video"))
    errors: list[tuple[str, str, Any]] = []

    def shape(key: str) -> list[int]:
        return list(features[key].get("shape", [])) if isinstance(features.get(key), dict) else []

    if state_dim > 0:
        if state_key not in features:
            errors.append(("dataset.state_key", f"the dataset has no feature {state_key!r}; allowed: one of "
                           f"{', '.join(numeric)} (or observation.state_dim: 0)", state_key))
        elif shape(state_key)[-1:] != [state_dim]:
            errors.append(("dataset.state_key", f"{state_key!r} has shape {shape(state_key)}, but "
                           f"observation.state_dim is {state_dim}", state_key))
    if action_key not in features:
        errors.append(("dataset.action_key", f"the dataset has no feature {action_key!r}; allowed: one of "
                       f"{', '.join(numeric)}", action_key))
    elif shape(action_key)[-1:] != [action_dim]:
        errors.append(("dataset.action_key", f"{action_key!r} has shape {shape(action_key)}, but action.dim is "
                       f"{action_dim}", action_key))
    visual = sorted(k for k, f in features.items() if isinstance(f, dict) and f.get("dtype") in ("image", "video"))
    for key in cameras:
        if key not in visual:
            errors.append((f"dataset.camera_map[{key}]", f"the dataset has no camera {key!r}; allowed: "
                           f"{', '.join(visual)}", key))
    return errors


# ---- JSON Schema -----------------------------------------------------------------------
def spec_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a workload spec: pydantic's schema of `WorkloadSpec` plus
    `TASK_RULES`. Cross-field checks that JSON Schema cannot say (unique camera names, the
    instruction template, camera_map coverage, warmup <= steps, items_per_job <= prefetch)
    are `parse_spec`'s alone."""
    body = model_schema(WorkloadSpec)
    defs = body.pop("$defs")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **body,
        "allOf": [_rule_schema(task, r) for task, r in TASK_RULES.items()] + [_eval_needs_env()],
        "$defs": defs,
    }


def _object(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"type": "object"}}}


def _present(name: str) -> dict[str, Any]:
    """Given and not null (a required section, or the base string)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _rule_schema(task: str, r: TaskRule) -> dict[str, Any]:
    then: dict[str, Any] = {"properties": {}}
    conditions: list[dict[str, Any]] = []
    for key in r.required:
        conditions.append(_present(key))
    for key in r.forbidden:
        then["properties"][key] = {"type": "null"}
    if r.exactly_one:
        then["oneOf"] = [_object(k) for k in r.exactly_one]
    then["properties"]["action_module"] = {"properties": {"kind": {"enum": list(r.heads)}}}
    env: dict[str, Any] = {"properties": {"demos": {"type": "object" if r.demos == "required" else "null"}}}
    if r.demos == "required":
        env["required"] = ["demos"]
    then["properties"]["env"] = env
    if task in ALGORITHMS:
        then["properties"]["algorithm"] = {"anyOf": [{"$ref": f"#/$defs/{ALGORITHMS[task].__name__}"},
                                                     {"type": "null"}]}
    else:  # a kind without a config (eval) takes no algorithm section
        then["properties"]["algorithm"] = {"type": "null"}
    if conditions:
        then["allOf"] = conditions
    return {"if": {"required": ["task"], "properties": {"task": {"const": task}}}, "then": then,
            "description": f"task {task}: {r.why}"}


def _eval_needs_env() -> dict[str, Any]:
    return {"if": {"required": ["eval"], "properties": {"eval": {"type": "object"}}},
            "then": _object("env"), "description": "evaluation runs episodes in an env"}


# ---- generated docs --------------------------------------------------------------------
SCHEMA_DOC = "docs/workload_spec.schema.json"
FIELDS_DOC = "docs/workload_spec.md"
_BEGIN = "<!-- BEGIN GENERATED FIELD REFERENCE (python -m master.spec) -->"
_END = "<!-- END GENERATED FIELD REFERENCE -->"


def schema_json_text() -> str:
    return json.dumps(spec_json_schema(), indent=2, sort_keys=False) + "\n"


def field_reference_markdown() -> str:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for path, type_text, default, doc in field_rows(WorkloadSpec):
        doc = doc.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| `{path}` | {type_text} | {default} | {doc} |")
    return "\n".join(lines) + "\n"


def render_fields_doc(text: str) -> str:
    """``text`` with the generated field reference between its markers replaced."""
    head, _, rest = text.partition(_BEGIN)
    _, _, tail = rest.partition(_END)
    return f"{head}{_BEGIN}\n{field_reference_markdown()}{_END}{tail}"


def write_docs(root: str | Path = ".") -> list[Path]:
    root = Path(root)
    schema_path, doc_path = root / SCHEMA_DOC, root / FIELDS_DOC
    schema_path.write_text(schema_json_text())
    doc_path.write_text(render_fields_doc(doc_path.read_text()))
    return [schema_path, doc_path]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated docs (schema JSON, field reference in the markdown)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=".", help="repository root (default: .)")
    args = parser.parse_args(argv)
    for path in write_docs(args.root):
        print(f"wrote {path}")
    return 0


__all__ = [
    "ALGORITHMS", "TASK_RULES", "ActionModuleSpec", "ActionSpec", "BaseAdapterSpec", "BudgetSpec", "BudgetTarget", "Camera",
    "DatasetSource", "DemosSpec", "EnvSource", "EvalSpec", "ObservationSpec", "OutputsSpec", "RLConfig",
    "SFTConfig", "ScheduleSpec", "SpecError", "TaskRule", "WorkloadSpec", "compile_tenant", "dataset_errors",
    "feature_errors", "known_presets", "load_document", "load_spec", "parse_spec", "spec_from_dict",
    "spec_json_schema", "spec_to_dict",
]


if __name__ == "__main__":
    raise SystemExit(main())
