"""The sections of a workload spec (`master.spec.WorkloadSpec`): observation, action, action
module, init, base adapter, env, dataset, schedule, eval, outputs; their patterns and bounds,
and `SpecError`. `master.spec` composes them and re-exports the names others import."""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from master.spec_schema import (
    Allowed,
)
from protocol.base_names import REGISTERED_BASE_PREFIX, known_presets
from protocol import recipes
from protocol.errors import ErrorCode, NexusError
from protocol.policy import RECIPE_KIND_PATTERN
from protocol.recipes import FAMILIES
from protocol.recipe_configs import doc as _doc
from protocol.recipe_configs import (
    CONFIGS,
    Bool,
    Float,
    Int,
    RecipeConfig,
    Str,
    raise_rules,
    rule,
)

SPEC_VERSION = 1
# A spec's task: sft, rl, eval or the kind of a recipe a module registered (`protocol.recipes`;
# the master imports the modules NEXUS_WORKFLOW_MODULES names at start). The field's validator
# (master/spec.py) refuses a kind this process has not declared, naming the ones it has; the
# JSON Schema can only say what a kind name looks like.
TaskType = Annotated[Str, WithJsonSchema({"type": "string", "pattern": f"^{RECIPE_KIND_PATTERN}$",
                                          "examples": list(FAMILIES)})]
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
# Metrics a budget target can name, per task family (a recipe's kind follows its family's):
# what each workflow already measures.
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
def doc_factory(text: str, factory: Any, **kw: Any) -> Any:
    return Field(default_factory=factory, description=text, **kw)


SpecSection = RecipeConfig


def spec_error(message: str) -> Exception:
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("spec_rule", "{message}", {"message": message})


# ---- sections --------------------------------------------------------------------------
class Camera(SpecSection):
    """One camera of the tenant schema: its name and the frame size (pixels) it sends."""

    name: Annotated[Str, Allowed("letters, digits, _ . - (1-64 chars)")] = _doc(
        "camera name, used as the image key in every batch and request", pattern=f"^(?:{CAMERA_PATTERN})$")
    height: Int = _doc("frame height in pixels", ge=1, le=MAX_SIDE_PX)
    width: Int = _doc("frame width in pixels", ge=1, le=MAX_SIDE_PX)


class ObservationSpec(SpecSection):
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


class ActionSpec(SpecSection):
    """What the policy outputs: ``horizon`` steps of a ``dim``-sized float32 action."""

    dim: Int = _doc("length of one action vector", ge=1, le=MAX_DIM)
    horizon: Int = _doc("actions predicted per observation (action chunk). Default 1: closed-loop "
                        "control, one action per step", 1, ge=1, le=MAX_HORIZON)


class ActionModuleSpec(SpecSection):
    """The tenant's private trainable module on top of the frozen base."""

    kind: HeadKind = _doc("mlp: regression (SFT); flow: flow-matching chunks (SFT); "
                          "gaussian: policy + value head (RL with PPO, or SFT by likelihood); "
                          "expert: a pi0-style action expert, a small transformer whose layer i attends "
                          "to the base's per-layer prefix keys and values (flow matching, SFT; "
                          "bases: paligemma, qwen3_vl)")
    params: dict[Str, Any] = doc_factory(
        "head options (mlp: width, depth; flow: width, depth, num_heads, beta_alpha, max_time, "
        "euler_steps; gaussian: width, init_log_std, value_detach (the value loss trains the value net only, "
        "not the trunk it shares with the policy); expert: width, depth (a divisor of the base's "
        "text layers, default all of them), num_heads (a multiple of the base's KV heads), head_dim "
        "(the base's), mlp_width, beta_alpha, max_time, euler_steps); names and types checked at submit "
        "and by `nexus spec validate`, values by the model core at submit (expert: against the base's "
        "cache). Default {}: the head's own defaults", dict)


class InitSpec(SpecSection):
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


class BaseAdapterSpec(SpecSection):
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


class DemosSpec(SpecSection):
    """Record demonstrations from the env's scripted expert before SFT starts."""

    episodes: Int = _doc("scripted-expert episodes to record", ge=1, le=1_000_000)
    seed: Int = _doc("first reset seed of the recording (episode i resets with seed + i). Default 0: "
                     "reproducible data", 0, ge=0)
    noise: Float = _doc("DART: std of Gaussian noise on the action the env executes while recording "
                        "(the recorded label stays the expert's clean action), so demos show how to "
                        "recover from small errors. Default 0: plain demos; 0.5 took the built-in task "
                        "from 11 % to 68 % success (docs/results.md)", 0.0, ge=0, le=10)


class EnvSource(SpecSection):
    """A simulator hosted by the env workers."""

    id: Annotated[Str, Allowed("an env id 'suite/name' (e.g. builtin/reach-v0)")] = _doc(
        "env id, 'suite/name' (e.g. builtin/reach-v0)", pattern=f"^(?:{ENV_ID_PATTERN})$")
    options: dict[Str, Any] = doc_factory(
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


class DatasetSource(SpecSection):
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
# workflow reads the same model, so each knob has its one default there. ALGORITHMS: the
# built-in kinds' (what the generated docs and JSON Schema list); `algorithm_model`: any
# declared kind's, a registered recipe's too (what a spec is validated with).
ALGORITHMS: dict[str, type[BaseModel]] = dict(CONFIGS)


def algorithm_model(task: Any) -> type[BaseModel] | None:
    """The config model of ``task`` (None: it takes no algorithm section, or it is no kind)."""
    known = recipes.declaration(task)
    return known.config if known is not None else None


class BudgetTarget(SpecSection):
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


class BudgetSpec(SpecSection):
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


class ScheduleSpec(SpecSection):
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
    budget: BudgetSpec = doc_factory("limits; default none: sft ends after algorithm.steps (or at "
                               "algorithm.until_version), eval after "
                               "eval.episodes, rl runs until cancelled", BudgetSpec)


def _check_version(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise spec_error(f"{value!r} is too small; allowed: an integer >= 0, 'latest', "
                          "'tenant:<name>@latest' or 'tenant:<name>@<n>'")
        return value
    if isinstance(value, str) and re.fullmatch(VERSION_PIN_PATTERN, value):
        return value
    raise spec_error(f"{value!r} is not allowed; allowed: an integer >= 0, 'latest', 'tenant:<name>@latest' "
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
        raise spec_error(f"{value!r} is not allowed; {allowed}")
    for item in value:
        ok_int = isinstance(item, int) and not isinstance(item, bool) and item >= 0
        ok_str = isinstance(item, str) and 1 <= len(item) <= EVAL_TASK_NAME_MAX
        if not (ok_int or ok_str):
            raise spec_error(f"entry {item!r} is not allowed; {allowed}")
    return list(value)


class EvalSpec(SpecSection):
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


class OutputsSpec(SpecSection):
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
                raise spec_error(f"{value!r} is not allowed ({problem}); allowed: a file name or relative path "
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


def check_base(value: Any) -> str:
    if not isinstance(value, str):
        from master.spec_schema import kind

        raise spec_error(f"expected a string, got {kind(value)}")
    if value in known_presets() or re.fullmatch(REGISTERED_BASE_PATTERN, value) or re.fullmatch(BASE_PATH_PATTERN, value):
        return value
    raise spec_error(f"{value!r} is not allowed; allowed: one of {', '.join(known_presets())}, a base the "
                  f"operator registered as {REGISTERED_BASE_PREFIX}<name> (`nexus base list`), or (operator "
                  "only) a path containing '/' (./my_base)")


BASE_SCHEMA = {"type": "string", "anyOf": [{"enum": list(known_presets())},
                                            {"pattern": f"^(?:{REGISTERED_BASE_PATTERN})$"},
                                            {"pattern": f"^(?:{BASE_PATH_PATTERN})$"}]}


# base, action_module, observation and action say what a tenant's slot *is*: sft and rl give
# them; an eval scores an existing policy and takes them from that policy's export manifest.
