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
import string
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
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
from protocol.base_names import REGISTERED_BASE_PREFIX, known_presets
from protocol.errors import ErrorCode, NexusError
from protocol.messages import TenantConfig
from protocol.recipe_configs import doc as _doc
from protocol.recipe_configs import (
    CONFIGS,
    Bool,
    Float,
    Int,
    RecipeConfig,
    RLConfig,
    SFTConfig,
    Str,
    raise_rules,
    rule,
)

SPEC_VERSION = 1
TaskType = Literal["sft", "rl", "eval"]
HeadKind = Literal["mlp", "flow", "gaussian", "expert"]

# Same token rule as protocol.subjects: a tenant name becomes a subject token and a KV key.
TENANT_PATTERN = r"[A-Za-z0-9_-]{1,64}"
# Mirrors models/schema.py (camera names, size limits); the master re-checks with the model
# core at tenant creation, these only let a spec fail early with every error at once.
CAMERA_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
MAX_SIDE_PX = 4096
MAX_DIM = 1024
MAX_HORIZON = 256
# Scheduling priority: a small documented range, so one tenant cannot claim "infinity"
# (protocol.policy holds it: the master bounds a reserve's priority by the same range and the
# tenant's max_priority quota).
from protocol.policy import PRIORITY_MAX, PRIORITY_MIN  # noqa: E402
# The caps' bounds, the master's too (a tenant's quotas may lower max_inflight_jobs's).
from protocol.policy import MAX_INFLIGHT_JOBS_PER_TASK, SFT_PREFETCH_ITEMS_MAX, STALENESS_BOUND_MAX  # noqa: E402
# "suite/name-v0": env ids are resolved by the env workers' registry, not here.
ENV_ID_PATTERN = r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+"
# A base that is not a preset must be a path, spelled with a '/' (./my_model), so a typo in a
# preset name is an error instead of a missing directory found minutes later on a trainer.
BASE_PATH_PATTERN = r".*/.*"
# A base the operator registered (`nexus base add NAME PATH`, prefix REGISTERED_BASE_PREFIX): the
# master resolves the name to its directory; a tenant never names a host path (docs/security.md
# "Paths a tenant names").
REGISTERED_BASE_PATTERN = rf"{REGISTERED_BASE_PREFIX}{TENANT_PATTERN}"
VERSION_PIN_PATTERN = rf"latest|tenant:{TENANT_PATTERN}@(latest|[0-9]+)"
# PPO fields the gaussian head reads from its own config (models/heads/gaussian.py).
PPO_HEAD_FIELDS = ("clip_ratio", "value_coef", "entropy_coef")
# Metrics a budget target can name, per task: what each workflow already measures.
TARGET_METRICS = {"sft": ("loss",), "rl": ("success_rate", "mean_return"), "eval": ()}

class SpecError(NexusError, ValueError):
    """A workload spec is invalid. ``details["errors"]`` lists every problem as
    ``{"field": <path>, "message": <what is allowed>, "value": <what was given>}``."""

    code = ErrorCode.INVALID_FIELD

    def __init__(self, errors: list[tuple[str, str]] | list[dict[str, Any]]) -> None:
        items = [e if isinstance(e, dict) else {"field": e[0], "message": e[1], "value": e[2] if len(e) > 2 else None}
                 for e in errors]
        lines = "\n".join(f"  {e['field']}: {e['message']}" for e in items)
        n = len(items)
        # "field" keeps error_from_code's FieldError rebuild readable on the client side.
        super().__init__(f"invalid workload spec ({n} error{'s' if n != 1 else ''}):\n{lines}",
                         details={"field": "spec", "errors": items})
        self.errors = items


# ---- field types -----------------------------------------------------------------------
# Strict scalars (Int, Float, Str, Bool), `_doc` and the sections' base come from
# protocol/recipe_configs.py: the recipes' configs are sections of this spec too.
def _docf(text: str, factory: Any, **kw: Any) -> Any:
    return Field(default_factory=factory, description=text, **kw)


_Section = RecipeConfig


def _custom(message: str) -> Exception:
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("spec_rule", "{message}", {"message": message})


# ---- sections --------------------------------------------------------------------------
class Camera(_Section):
    """One camera of the tenant schema: its name and the frame size (pixels) it sends."""

    name: Annotated[Str, Allowed("letters, digits, _ . - (1-64 chars)")] = _doc(
        "camera name, used as the image key in every batch and request", pattern=f"^(?:{CAMERA_PATTERN})$")
    height: Int = _doc("frame height in pixels", ge=1, le=MAX_SIDE_PX)
    width: Int = _doc("frame width in pixels", ge=1, le=MAX_SIDE_PX)


class ObservationSpec(_Section):
    """What the policy sees: ordered cameras (camera i fills the base's camera slot i), the
    proprioceptive state and the prompt template."""

    cameras: tuple[Camera, ...] = _doc("ordered list of cameras (at least one)", min_length=1)
    state_dim: Int = _doc("length of the float32 state vector (0: no state)", ge=0, le=MAX_DIM)
    instruction_template: Str = _doc(
        "prompt built from the task instruction; must contain {instruction} exactly once. "
        "Default: the bare instruction, which is what the built-in tasks and LeRobot datasets carry",
        "{instruction}")

    @model_validator(mode="after")
    def _checks(self) -> ObservationSpec:
        rules: list[InitErrorDetails] = []
        seen: dict[str, int] = {}
        for i, cam in enumerate(self.cameras):
            if cam.name in seen:
                rules.append(rule(("cameras", i, "name"), f"duplicate camera name {cam.name!r} "
                                  f"(also cameras[{seen[cam.name]}]); camera names must be unique", cam.name))
            seen.setdefault(cam.name, i)
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.instruction_template) if f is not None]
        except ValueError as exc:
            names = [f"<invalid: {exc}>"]
        if names != ["instruction"]:
            rules.append(rule(("instruction_template",), "must contain '{instruction}' exactly once and no "
                              f"other {{field}}; found {names}", self.instruction_template))
        raise_rules(type(self).__name__, rules)
        return self


class ActionSpec(_Section):
    """What the policy outputs: ``horizon`` steps of a ``dim``-sized float32 action."""

    dim: Int = _doc("length of one action vector", ge=1, le=MAX_DIM)
    horizon: Int = _doc("actions predicted per observation (action chunk). Default 1: closed-loop "
                        "control, one action per step", 1, ge=1, le=MAX_HORIZON)


class ActionModuleSpec(_Section):
    """The tenant's private trainable module on top of the frozen base."""

    kind: HeadKind = _doc("mlp: regression (SFT); flow: flow-matching chunks (SFT); "
                          "gaussian: policy + value head (RL with PPO, or SFT by likelihood); "
                          "expert: a pi0-style action expert, a small transformer whose layer i attends "
                          "to the base's per-layer prefix keys and values (flow matching, SFT; "
                          "bases: paligemma, qwen3_vl)")
    params: dict[Str, Any] = _docf(
        "head options (mlp: width, depth; flow: width, depth, num_heads, beta_alpha, max_time, "
        "euler_steps; gaussian: width, init_log_std; expert: width, depth (a divisor of the base's "
        "text layers, default all of them), num_heads (a multiple of the base's KV heads), head_dim "
        "(the base's), mlp_width, beta_alpha, max_time, euler_steps); names and types checked at submit "
        "and by `nexus spec validate`, values by the model core at submit (expert: against the base's "
        "cache). Default {}: the head's own defaults", dict)


class InitSpec(_Section):
    """Starting weights the tenant uploaded (`nexus weights upload NAME FILE`): the tenant's new slot
    starts from them at version 0 instead of the seed's initialisation. Names are looked up in the
    submitting tenant's own uploads only. At submit a trainer checks every tensor against this spec's
    action module (and base_adapter): a tensor of another shape, one the module does not have, or
    one it has that the file lacks is refused, naming the tensor and both shapes. Only a tenant
    created by this submit starts from weights (a tenant that exists keeps its own)."""

    weights: Annotated[Str, Allowed("letters, digits, _ and - (1-64 characters)")] = _doc(
        "name of an upload holding the action module's tensors (a policy from `nexus download`, which "
        "also carries a LoRA tenant's adapter under peft's names)", pattern=f"^(?:{TENANT_PATTERN})$")
    adapter: Annotated[Str | None, Allowed("letters, digits, _ and - (1-64 characters)")] = _doc(
        "name of an upload holding the LoRA adapter in peft's format (adapter_model.safetensors), when "
        "weights has the action module only; needs base_adapter. Default null", None,
        pattern=f"^(?:{TENANT_PATTERN})$")


class BaseAdapterSpec(_Section):
    """Low-rank adapters (LoRA) on the frozen base's language-model linear layers, trained beside
    the action module: peft's LoraConfig semantics (A kaiming-uniform, B zeros, delta scaled by
    alpha / rank), exported in peft's format. Rows of many tenants' adapters still share one base
    forward (docs/lora.md). The master checks target_modules and rank against the base at submit."""

    kind: Literal["lora"] = _doc("adapter type; lora is the only one so far")
    rank: Int = _doc("LoRA rank r of every adapted layer: at least 1 and at most the narrowest "
                     "adapted layer's width (checked against the base at submit)", ge=1)
    alpha: Float | None = _doc("LoRA alpha: the delta is scaled by alpha / rank. Default null: alpha = "
                               "rank (scaling 1), so changing the rank does not change the step size",
                               None, gt=0)
    target_modules: tuple[Str, ...] = _doc(
        "names of the base's language-model linear layers to adapt, matched as peft matches them (a "
        "module path equal to or ending in '.<name>'), e.g. q_proj, v_proj, o_proj, gate_proj. Default "
        "[q_proj, v_proj]: peft's default for these decoders", ("q_proj", "v_proj"), min_length=1)
    dropout: Float = _doc("dropout on the adapter's input while training (peft's lora_dropout). Default "
                          "0: no noise between grouped and serial runs", 0.0, ge=0, lt=1)


class DemosSpec(_Section):
    """Record demonstrations from the env's scripted expert before SFT starts."""

    episodes: Int = _doc("scripted-expert episodes to record", ge=1, le=1_000_000)
    seed: Int = _doc("first reset seed of the recording (episode i resets with seed + i). Default 0: "
                     "reproducible data", 0, ge=0)
    noise: Float = _doc("DART: std of Gaussian noise on the action the env executes while recording "
                        "(the recorded label stays the expert's clean action), so demos show how to "
                        "recover from small errors. Default 0: plain demos; 0.5 took the built-in task "
                        "from 11 % to 68 % success (docs/results.md)", 0.0, ge=0, le=10)


class EnvSource(_Section):
    """A simulator hosted by the env workers."""

    id: Annotated[Str, Allowed("an env id 'suite/name' (e.g. builtin/reach-v0)")] = _doc(
        "env id, 'suite/name' (e.g. builtin/reach-v0)", pattern=f"^(?:{ENV_ID_PATTERN})$")
    options: dict[Str, Any] = _docf(
        "keyword options for the env (builtin/reach-v0: cameras, image_size, reward, "
        "max_episode_steps, ...), checked at submit and by `nexus spec validate` against the env's "
        "config, and the cameras it then renders against observation.cameras. Default {}: the env's "
        "defaults", dict)
    demos: DemosSpec | None = _doc("SFT only: record this many scripted-expert episodes first and train "
                                   "on them. Default null: no recording (RL and eval interact with the "
                                   "env directly)", None)
    hosted: Literal["tenant"] | None = _doc(
        "tenant: the env runs on the tenant's own machine, in its `nexus env serve --creds T.creds "
        "MODULE:FACTORY` processes (docs/hosted_envs.md); the platform's env workers never run this "
        "workload, and the id names the tenant's own env (no platform check of id or options). rl and eval "
        "only. Default null: a platform env", None)


class DatasetSource(_Section):
    """A local LeRobot v3.0 dataset and how its features map onto the tenant schema."""

    root: Str = _doc("dataset root directory (holds meta/info.json). A tenant names an absolute path "
                     "under its own <data dir>/datasets/tenants/<tenant>/, the operator's published "
                     "<data dir>/datasets/published/, the shared fixtures or a NEXUS_DATA_ROOTS directory; "
                     "the operator's own workloads may name any path (a relative one is resolved against "
                     "the working directory of the env worker that reads it)", min_length=1)
    camera_map: dict[Str, Str] = _doc("dataset camera key -> observation camera name; every "
                                      "observation camera exactly once", min_length=1)
    state_key: Str = _doc("state feature key the reader takes the state vector from (needed when "
                          "observation.state_dim > 0). Default: LeRobot's name for it",
                          "observation.state", min_length=1)
    action_key: Str = _doc("action feature key the reader takes the action labels from. Default: "
                           "LeRobot's name for it", "action", min_length=1)


# The task's algorithm section is its recipe's config (protocol/recipe_configs.py): the
# workflow reads the same model, so each knob has its one default there.
ALGORITHMS: dict[str, type[BaseModel]] = dict(CONFIGS)


class BudgetTarget(_Section):
    """A quality target: the workload completes once a metric its workflow measures reaches it."""

    metric: Literal["loss", "success_rate", "mean_return"] = _doc(
        "what to watch: loss (sft: the mean training loss of the last `window` jobs), success_rate or "
        "mean_return (rl: over the last `window` rollout episodes)")
    at_least: Float | None = _doc("done when the metric is >= this (success_rate, mean_return)", None)
    at_most: Float | None = _doc("done when the metric is <= this (loss)", None)
    window: Int = _doc("jobs (sft) or episodes (rl) the metric is averaged over; the target is judged "
                       "only once the window is full. Default 20: one lucky batch or episode does not "
                       "end the run", 20, ge=1, le=10_000)

    @model_validator(mode="after")
    def _checks(self) -> BudgetTarget:
        if (self.at_least is None) == (self.at_most is None):
            raise_rules("BudgetTarget", [rule(("at_least",), "set exactly one of at_least or at_most")])
        return self


class BudgetSpec(_Section):
    """Limits: the workload completes when the first one is reached (null: no limit)."""

    max_steps: Int | None = _doc("optimizer steps this workload trains (counted from the tenant's version "
                                 "when it is accepted, not from 0; sft: the smaller of this and "
                                 "algorithm.steps / until_version)", None, ge=1)
    max_episodes: Int | None = _doc("env episodes of this workload (rollouts, demos excluded, or eval); a "
                                    "workflow resumed on another env worker counts its predecessor's",
                                    None, ge=1)
    max_wall_s: Float | None = _doc("seconds since the workload started", None, gt=0)
    target: BudgetTarget | None = _doc("a quality target, e.g. {metric: success_rate, at_least: 0.95} "
                                       "(rl) or {metric: loss, at_most: 0.05} (sft). Default null: "
                                       "limits only", None)


class ScheduleSpec(_Section):
    """How the tenant shares the trainers (copied into the backend TenantConfig)."""

    priority: Int = _doc(f"higher is leased first; ties go round-robin; allowed {PRIORITY_MIN}..{PRIORITY_MAX}. "
                         "Default 0: equal shares", 0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    max_inflight_jobs: Int = _doc("unfinished training jobs per tenant-task, at most the tenant's quota "
                                  "max_inflight_jobs (set by the operator). Default 2: keeps a workflow "
                                  "from running far ahead of training", 2, ge=1, le=MAX_INFLIGHT_JOBS_PER_TASK)
    staleness_bound: Int = _doc("RL data more than this many policy versions old is dropped. Default "
                                "128: the reference system's bound", 128, ge=1, le=STALENESS_BOUND_MAX)
    sft_prefetch_items: Int = _doc("SFT micro-batches per tenant in ready or leased jobs (the ones "
                                   "waiting for or on a trainer); a put beyond it is retried by the "
                                   "workflow. Default 16: offline data cannot crowd out online RL",
                                   16, ge=1, le=SFT_PREFETCH_ITEMS_MAX)
    budget: BudgetSpec = _docf("limits; default none: sft ends after algorithm.steps (or at "
                               "algorithm.until_version), eval after "
                               "eval.episodes, rl runs until cancelled", BudgetSpec)


def _check_version(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _custom(f"{value!r} is too small; allowed: an integer >= 0, 'latest', "
                          "'tenant:<name>@latest' or 'tenant:<name>@<n>'")
        return value
    if isinstance(value, str) and re.fullmatch(VERSION_PIN_PATTERN, value):
        return value
    raise _custom(f"{value!r} is not allowed; allowed: an integer >= 0, 'latest', 'tenant:<name>@latest' "
                  "or 'tenant:<name>@<n>'")


_VERSION_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 0},
                             {"type": "string", "pattern": f"^(?:{VERSION_PIN_PATTERN})$"}]}


EVAL_TASKS_MAX = 90  # a LIBERO suite has at most 90 tasks (libero_90); protocol MAX_TASK_ROWS
EVAL_TASK_NAME_MAX = 200
_EVAL_TASKS_SCHEMA = {"anyOf": [
    {"type": "null"}, {"const": "all"},
    {"type": "array", "minItems": 1, "maxItems": EVAL_TASKS_MAX,
     "items": {"anyOf": [{"type": "integer", "minimum": 0},
                         {"type": "string", "minLength": 1, "maxLength": EVAL_TASK_NAME_MAX}]}}]}


def _check_eval_tasks(value: Any) -> str | list[int | str] | None:
    allowed = (f"allowed: 'all', null, or a list of 1..{EVAL_TASKS_MAX} task indices (integers >= 0) or task "
               f"names (1..{EVAL_TASK_NAME_MAX} characters)")
    if value is None or value == "all":
        return value
    if not isinstance(value, list) or not 1 <= len(value) <= EVAL_TASKS_MAX:
        raise _custom(f"{value!r} is not allowed; {allowed}")
    for item in value:
        ok_int = isinstance(item, int) and not isinstance(item, bool) and item >= 0
        ok_str = isinstance(item, str) and 1 <= len(item) <= EVAL_TASK_NAME_MAX
        if not (ok_int or ok_str):
            raise _custom(f"entry {item!r} is not allowed; {allowed}")
    return list(value)


class EvalSpec(_Section):
    """Read-only evaluation episodes on the env with a pinned policy version."""

    version: Annotated[int | str, WithJsonSchema(_VERSION_SCHEMA)] = _doc(
        "policy version: an integer, or 'latest' (this tenant's newest export; for an eval resolved "
        "at submit, or when the tenant's training workload ahead of it ends, and recorded as the "
        "workload's eval_version); 'tenant:<name>@latest' / 'tenant:<name>@<n>' scores another "
        "tenant's export under this workload's own name. A version that does not exist is an error "
        "at submit. Default 'latest'", "latest")
    episodes: Int = _doc("episodes to run. Default 50: the success rate's standard error is at most 7 "
                         "points", 50, ge=1, le=100_000)
    seed: Int = _doc("first reset seed; episode i uses seed + i. Default 0: every version is scored on "
                     "the same episodes", 0, ge=0)
    sample: Bool = _doc("sample actions (true) or take the mean (false). Default false: deterministic "
                        "scores", False)
    tasks: Annotated[str | list[int | str] | None, WithJsonSchema(_EVAL_TASKS_SCHEMA)] = _doc(
        "which of the env's tasks the episodes run: 'all' (episode i runs task i mod the env's task "
        "count: a round-robin over every task, e.g. a LIBERO suite's 10), a list of task indices or "
        f"names (episode i runs the (i mod length)-th; at most {EVAL_TASKS_MAX}), or null (each "
        "episode's task is the env's own draw from its reset seed). Either way the report's per_task "
        "table has a row per task run: episodes, successes, success rate. A name or index the env "
        "does not have fails the workload before its first episode, naming the env's tasks. "
        "Default null", None)

    @field_validator("version", mode="plain")
    @classmethod
    def _version(cls, value: Any) -> int | str:
        return _check_version(value)

    @field_validator("tasks", mode="plain")
    @classmethod
    def _tasks(cls, value: Any) -> str | list[int | str] | None:
        return _check_eval_tasks(value)


class OutputsSpec(_Section):
    """What the workload leaves behind."""

    export_every_steps: Int = _doc(
        "export (and so sync to the inferencers) a new policy version only once at least N optimizer "
        "steps of the tenant passed since its last export; commits stay per job, and the workload's "
        "last job always exports. Each workload of the tenant sets it anew (as schedule's fields). rl: "
        "below schedule.staleness_bound (rollouts act with the last export). Default 0: after every "
        "trained job", 0, ge=0)
    report_path: Str | None = _doc(
        "file name (or relative path) of the workload's final JSON report inside the tenant's own "
        "reports dir, <data dir>/reports/<tenant>/, written by the master when the workload ends; "
        "also `nexus download WORKLOAD --report`. Each '/'-separated part is letters, digits, _ . - "
        "(not '.' or '..'), at most 8 parts and 255 characters. Default null: <workload>.json",
        None, min_length=1)

    @field_validator("report_path")
    @classmethod
    def _confined(cls, value: str | None) -> str | None:
        if value is not None:
            problem = report_path_problem(value)
            if problem:
                raise _custom(f"{value!r} is not allowed ({problem}); allowed: a file name or relative path "
                              "inside the tenant's reports dir, each '/'-separated part of letters, digits, "
                              "_ . - (not '.' or '..'), e.g. sft-run.json or runs/first.json")
        return value


# A report path part: a plain file or directory name (the master writes it under the tenant's
# reports dir, never following a link; docs/security.md "Paths a tenant names").
REPORT_PART_PATTERN = r"[A-Za-z0-9_.-]{1,128}"
MAX_REPORT_PARTS = 8
MAX_REPORT_PATH = 255


def report_path_problem(value: str) -> str:
    """Why ``value`` is no report path a tenant may name ('' when it is one)."""
    if len(value) > MAX_REPORT_PATH:
        return f"longer than {MAX_REPORT_PATH} characters"
    parts = value.split("/")
    if value.startswith("/"):
        return "absolute"
    if len(parts) > MAX_REPORT_PARTS:
        return f"more than {MAX_REPORT_PARTS} parts"
    for part in parts:
        if part in ("", ".", ".."):
            return f"part {part!r}" if part else "an empty part"
        if not re.fullmatch(REPORT_PART_PATTERN, part):
            return f"part {part!r} has characters outside A-Z a-z 0-9 _ . -"
    return ""


def _check_base(value: Any) -> str:
    if not isinstance(value, str):
        from master.spec_schema import kind

        raise _custom(f"expected a string, got {kind(value)}")
    if value in known_presets() or re.fullmatch(REGISTERED_BASE_PATTERN, value) or re.fullmatch(BASE_PATH_PATTERN, value):
        return value
    raise _custom(f"{value!r} is not allowed; allowed: one of {', '.join(known_presets())}, a base the "
                  f"operator registered as {REGISTERED_BASE_PREFIX}<name> (`nexus base list`), or (operator "
                  "only) a path containing '/' (./my_base)")


_BASE_SCHEMA = {"type": "string", "anyOf": [{"enum": list(known_presets())},
                                            {"pattern": f"^(?:{REGISTERED_BASE_PATTERN})$"},
                                            {"pattern": f"^(?:{BASE_PATH_PATTERN})$"}]}


# base, action_module, observation and action say what a tenant's slot *is*: sft and rl give
# them; an eval scores an existing policy and takes them from that policy's export manifest.
POLICY_FIELDS = ("base", "action_module", "observation", "action")
_POLICY_FIELD = ("Required by sft and rl; eval: leave it out (taken from the scored policy's export "
                 "manifest; if given it must match it). Default null")


class WorkloadSpec(_Section):
    """One tenant's workload: model, schema, data source, algorithm, schedule and outputs."""

    spec_version: Literal[1] = _doc("format version of this spec. Default 1: the only version so far",
                                    SPEC_VERSION)
    tenant: Annotated[Str, Allowed("letters, digits, _ and - (1-64 characters)")] = _doc(
        "tenant name, unique per deployment", pattern=f"^(?:{TENANT_PATTERN})$")
    task: TaskType = _doc("sft: supervised fine-tuning; rl: asynchronous PPO; eval: read-only evaluation")
    base: Annotated[str | None, WithJsonSchema({"anyOf": [_BASE_SCHEMA, {"type": "null"}]})] = _doc(
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
    algorithm: Annotated[SFTConfig | RLConfig | None, BySibling("task", ALGORITHMS)] = Field(
        None, validate_default=True,
        description="hyper-parameters typed by task (sft: SFTConfig, rl: RLConfig; eval: none). "
                    "Default null: the task's defaults")
    schedule: ScheduleSpec = _docf("priority, caps and budget", ScheduleSpec)
    init: InitSpec | None = _doc("sft / rl: start a new tenant's slot from weights it uploaded. Default null: "
                                 "from the seed", None)
    eval: EvalSpec | None = _doc("evaluation settings: required by eval; on sft/rl, evaluates the final "
                                 "version (needs env)", None)
    outputs: OutputsSpec = _docf("exports and report", OutputsSpec)

    @field_validator("base", mode="plain")
    @classmethod
    def _base(cls, value: Any) -> str | None:
        return None if value is None else _check_base(value)

    @field_validator("algorithm", mode="wrap")
    @classmethod
    def _by_task(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        # The section's type depends on the task; an invalid task is reported on its own field,
        # and eval takes none (the task rule reports an algorithm given there).
        model = ALGORITHMS.get(info.data.get("task"))
        if model is None:
            return None
        # An omitted algorithm means the task's defaults; stored specs then say what ran.
        return model.model_validate({} if value is None else value)

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
    "eval": TaskRule(required=("env", "eval"), forbidden=("dataset", "algorithm", "init"),
                     why="eval runs episodes in an env with a pinned version of an existing policy "
                         "and trains nothing"),
}


def _is_set(raw: dict[str, Any], key: str) -> bool:
    return raw.get(key) is not None


def _rule_errors(raw: dict[str, Any]) -> list[InitErrorDetails]:
    """Task-type rules on the raw document (sections present or not, whatever their content)."""
    task = raw.get("task")
    rule_ = TASK_RULES.get(task) if isinstance(task, str) else None
    if rule_ is None:
        return []  # the task field's own error says what is allowed
    errors: list[InitErrorDetails] = []
    for key in rule_.required:
        if not _is_set(raw, key):
            why = ("it says what the tenant's slot is (only an eval takes it from the policy it scores)"
                   if key in POLICY_FIELDS else rule_.why)
            errors.append(rule((key,), f"required for task {task!r}: {why}"))
    for key in rule_.forbidden:
        if _is_set(raw, key):
            errors.append(rule((key,), f"not allowed for task {task!r}; remove it", raw.get(key)))
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
    if isinstance(env, dict) and env.get("hosted") is not None and task == "sft":
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
    if spec.task == "rl" and spec.action_module is not None:
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
    if spec.task == "rl" and every > 0 and every >= spec.schedule.staleness_bound:
        # Rollouts act with the newest *exported* version; with exports this sparse every rollout
        # is past the bound before the next export: all dropped, nothing trains again.
        errors.append(rule(("outputs", "export_every_steps"),
                           f"{every} is not below schedule.staleness_bound={spec.schedule.staleness_bound}: "
                           "rollouts act with the last exported version, so every one would be dropped as "
                           "stale before the next export; allowed: 0 (every job) or < staleness_bound", every))
    target = spec.schedule.budget.target
    if target is not None:
        allowed = TARGET_METRICS[spec.task]
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
        # Key names are models.slot.OptimConfig's fields.
        optim = {"lr": alg.lr, "weight_decay": alg.weight_decay, "grad_clip": alg.grad_clip,
                 "warmup_steps": alg.warmup_steps}
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
