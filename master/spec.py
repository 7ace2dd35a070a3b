"""WorkloadSpec: what a tenant submits (YAML or JSON), strictly validated, compiled to a
backend `TenantConfig`. Pure functions, no I/O beyond reading a file you name; no torch
(the list of base presets is read lazily from `models.presets` once per process).

    from master.spec import parse_spec, compile_tenant, spec_to_dict, spec_from_dict, SpecError

    spec = parse_spec(open("examples/sft_reach.yaml", "rb").read())   # YAML or JSON bytes/str/dict
    cfg = compile_tenant(spec)           # protocol.messages.TenantConfig (signature: the master's job)
    stored = spec_to_dict(spec)          # JSON-safe; spec_from_dict(stored) == spec
    try:
        parse_spec({"tenant": "a b"})
    except SpecError as err:
        err.details["errors"]            # [{"field": "tenant", "message": "..."}, ...] every problem at once

The dataclasses below are the single source of truth: `spec_json_schema()` is derived from
them (see `master.spec_schema`), and so are docs/workload_spec.schema.json and the field
reference in docs/workload_spec.md (`python -m master.spec_schema` rewrites both).

Task-type rules (`TASK_RULES`) are data too; they drive both `parse_spec` and the
``allOf``/``if``/``then`` part of the JSON Schema.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from master.spec_schema import (
    ROOT,
    Errors,
    field_rows,
    json_schema_for,
    parse_into,
    spec_field,
    to_plain,
)
from protocol.errors import ErrorCode, NexusError
from protocol.messages import TenantConfig

SPEC_VERSION = 1
TaskType = Literal["sft", "rl", "eval"]
HeadKind = Literal["mlp", "flow", "gaussian"]

# Same token rule as protocol.subjects: a tenant name becomes a subject token and a KV key.
TENANT_PATTERN = r"[A-Za-z0-9_-]{1,64}"
# Mirrors models/schema.py (camera names, size limits); the master re-checks with the model
# core at tenant creation, these only let a spec fail early with every error at once.
CAMERA_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"
MAX_SIDE_PX = 4096
MAX_DIM = 1024
MAX_HORIZON = 256
# "suite/name-v0": env ids are resolved by the env workers' registry, not here.
ENV_ID_PATTERN = r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+"
# A base that is not a preset must be a path, spelled with a '/' (./my_model), so a typo in a
# preset name is an error instead of a missing directory found minutes later on a trainer.
BASE_PATH_PATTERN = r".*/.*"
VERSION_PIN_PATTERN = rf"latest|tenant:{TENANT_PATTERN}@(latest|[0-9]+)"
# PPO fields the gaussian head reads from its own config (models/heads/gaussian.py).
PPO_HEAD_FIELDS = ("clip_ratio", "value_coef", "entropy_coef")


@functools.cache
def known_presets() -> tuple[str, ...]:
    from models.presets import PRESETS  # lazy: importing models pulls in torch

    return tuple(sorted(PRESETS))


class SpecError(NexusError, ValueError):
    """A workload spec is invalid. ``details["errors"]`` lists every problem as
    ``{"field": <path>, "message": <what is allowed>}``."""

    code = ErrorCode.INVALID_FIELD

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        items = [{"field": f, "message": m} for f, m in errors]
        lines = "\n".join(f"  {f}: {m}" for f, m in errors)
        n = len(errors)
        # "field" keeps error_from_code's FieldError rebuild readable on the client side.
        super().__init__(f"invalid workload spec ({n} error{'s' if n != 1 else ''}):\n{lines}",
                         details={"field": "spec", "errors": items})
        self.errors = items


# ---- sections --------------------------------------------------------------------------
@dataclass(frozen=True)
class Camera:
    """One camera of the tenant schema: its name and the frame size (pixels) it sends."""

    name: str = spec_field(doc="camera name, used as the image key in every batch and request",
                           pattern=CAMERA_PATTERN, pattern_text="letters, digits, _ . - (1-64 chars)")
    height: int = spec_field(doc="frame height in pixels", ge=1, le=MAX_SIDE_PX)
    width: int = spec_field(doc="frame width in pixels", ge=1, le=MAX_SIDE_PX)


@dataclass(frozen=True)
class ObservationSpec:
    """What the policy sees: ordered cameras (camera i fills the base's camera slot i), the
    proprioceptive state and the prompt template."""

    cameras: tuple[Camera, ...] = spec_field(doc="ordered list of cameras (at least one)", min_items=1)
    state_dim: int = spec_field(doc="length of the float32 state vector (0: no state)", ge=0, le=MAX_DIM)
    instruction_template: str = spec_field(
        "{instruction}",
        doc="prompt built from the task instruction; must contain {instruction} exactly once. "
            "Default: the bare instruction, which is what the built-in tasks and LeRobot datasets carry",
    )

    def _checks(self) -> Iterator[tuple[str, str]]:
        seen: dict[str, int] = {}
        for i, cam in enumerate(self.cameras):
            if cam.name in seen:
                yield f"cameras[{i}].name", f"duplicate camera name {cam.name!r} (also cameras[{seen[cam.name]}])"
            seen.setdefault(cam.name, i)
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.instruction_template) if f is not None]
        except ValueError as exc:
            names = [f"<invalid: {exc}>"]
        if names != ["instruction"]:
            yield "instruction_template", (f"must contain '{{instruction}}' exactly once and no other "
                                           f"{{field}}; found {names}")


@dataclass(frozen=True)
class ActionSpec:
    """What the policy outputs: ``horizon`` steps of a ``dim``-sized float32 action."""

    dim: int = spec_field(doc="length of one action vector", ge=1, le=MAX_DIM)
    horizon: int = spec_field(1, doc="actions predicted per observation (action chunk). Default 1: "
                                     "closed-loop control, one action per step", ge=1, le=MAX_HORIZON)


@dataclass(frozen=True)
class ActionModuleSpec:
    """The tenant's private trainable module on top of the frozen base."""

    kind: HeadKind = spec_field(doc="mlp: regression (SFT); flow: flow-matching chunks (SFT); "
                                    "gaussian: policy + value head (RL with PPO, or SFT by likelihood)")
    params: dict[str, Any] = spec_field(
        {}, doc="head options (mlp: width, depth; flow: width, depth, num_heads, beta_alpha, max_time, "
                "euler_steps; gaussian: width, init_log_std), checked by the model core at tenant "
                "creation. Default {}: the head's own defaults")


@dataclass(frozen=True)
class DemosSpec:
    """Record demonstrations from the env's scripted expert before SFT starts."""

    episodes: int = spec_field(doc="scripted-expert episodes to record", ge=1, le=1_000_000)
    seed: int = spec_field(0, doc="first reset seed of the recording. Default 0: reproducible data", ge=0)
    noise: float = spec_field(0.0, doc="DART: std of Gaussian noise on the action the env executes while "
                                       "recording (the recorded label stays the expert's clean action), so "
                                       "demos show how to recover from small errors. Default 0: plain "
                                       "demos; 0.5 took the built-in task from 11 % to 68 % success "
                                       "(docs/results.md)", ge=0, le=10)


@dataclass(frozen=True)
class EnvSource:
    """A simulator hosted by the env workers."""

    id: str = spec_field(doc="env id, 'suite/name' (e.g. builtin/reach-v0)", pattern=ENV_ID_PATTERN,
                         pattern_text="an env id 'suite/name' (e.g. builtin/reach-v0)")
    options: dict[str, Any] = spec_field(
        {}, doc="keyword options for the env (builtin/reach-v0: cameras, image_size, reward, "
                "max_episode_steps, ...), checked by the env worker. Default {}: the env's defaults")
    demos: DemosSpec | None = spec_field(
        None, doc="SFT only: record this many scripted-expert episodes first and train on them. "
                  "Default null: no recording (RL and eval interact with the env directly)")


@dataclass(frozen=True)
class DatasetSource:
    """A local LeRobot v3.0 dataset and how its features map onto the tenant schema."""

    root: str = spec_field(doc="dataset root directory (holds meta/info.json); a relative path is "
                               "resolved against the master's working directory", min_length=1)
    camera_map: dict[str, str] = spec_field(
        doc="dataset camera key -> observation camera name; every observation camera exactly once",
        min_items=1)
    state_key: str = spec_field("observation.state", doc="state feature key. Default: LeRobot's name for it",
                                min_length=1)
    action_key: str = spec_field("action", doc="action feature key. Default: LeRobot's name for it",
                                 min_length=1)


@dataclass(frozen=True)
class SFTAlgorithm:
    """Supervised fine-tuning of the action module (task sft)."""

    lr: float = spec_field(1e-4, doc="peak AdamW learning rate. Default 1e-4: the model core's "
                                     "default, stable for small heads on a frozen base", gt=0, le=1)
    batch_size: int = spec_field(32, doc="samples per micro-batch (one optimizer step each). Default 32: "
                                         "fits one queue message for 2 cameras at 64x64", ge=1, le=1024)
    steps: int = spec_field(1000, doc="optimizer steps to train; also the length of the cosine LR decay. "
                                      "Default 1000: a few minutes for the tiny bases on CPU", ge=1)
    items_per_job: int = spec_field(1, doc="micro-batches per training-queue job. The trainer commits, "
                                           "exports and announces once per job, so more items per job "
                                           "mean less overhead per step and fewer, larger version jumps. "
                                           "Default 1: a new version after every step", ge=1, le=256)
    weight_decay: float = spec_field(0.01, doc="AdamW weight decay. Default 0.01: the model core's default",
                                     ge=0)
    grad_clip: float | None = spec_field(1.0, doc="global gradient-norm clip (null: none). Default 1.0: "
                                                  "guards the first steps of a fresh head", gt=0)
    warmup_steps: int = spec_field(0, doc="linear LR warmup steps. Default 0: heads start small and "
                                          "AdamW's bias correction already damps early steps", ge=0)

    def _checks(self) -> Iterator[tuple[str, str]]:
        if self.warmup_steps > self.steps:
            yield "warmup_steps", f"{self.warmup_steps} exceeds steps={self.steps}; must be <= steps"


@dataclass(frozen=True)
class PPOAlgorithm:
    """Asynchronous PPO (task rl): producers roll out, compute GAE, and queue micro-batches."""

    lr: float = spec_field(3e-4, doc="AdamW learning rate (constant after warmup). Default 3e-4: the "
                                     "usual PPO Adam rate", gt=0, le=1)
    gamma: float = spec_field(0.99, doc="discount. Default 0.99: episodes of tens of steps", ge=0, le=1)
    gae_lambda: float = spec_field(0.95, doc="GAE lambda. Default 0.95: the PPO paper's value", ge=0, le=1)
    clip_ratio: float = spec_field(0.2, doc="PPO surrogate clip. Default 0.2: the PPO paper's value",
                                   gt=0, le=1)
    value_coef: float = spec_field(0.5, doc="value-loss weight. Default 0.5: the gaussian head's default",
                                   ge=0)
    entropy_coef: float = spec_field(0.0, doc="entropy bonus. Default 0: the learnt log-std explores "
                                              "enough on continuous control", ge=0)
    normalize_advantages: bool = spec_field(True, doc="standardise advantages over each rollout "
                                                      "(zero mean, unit std) before queueing. Default true: "
                                                      "the usual PPO practice; rewards of any scale then "
                                                      "give steps of one size")
    epochs: int = spec_field(1, doc="passes over each rollout. Default 1: async RL trains each queued "
                                    "job once; more passes reuse data beyond what staleness allows",
                             ge=1, le=64)
    episodes_per_update: int | None = spec_field(
        None, doc="episodes rolled out per update (one job). Default null: 16 episodes, unless "
                  "steps_per_update is set (set at most one)", ge=1)
    steps_per_update: int | None = spec_field(
        None, doc="env steps rolled out per update instead of whole episodes. Default null: count "
                  "episodes", ge=1)
    parallel_envs: int = spec_field(1, doc="episodes rolled out at once, each in its own env session; "
                                           "their predict requests share the inferencer's group forwards. "
                                           "Default 1: one episode at a time", ge=1, le=256)
    micro_batch: int = spec_field(64, doc="samples per queued micro-batch (one optimizer step each). "
                                          "Default 64: a few steps per update", ge=1, le=1024)
    weight_decay: float = spec_field(0.0, doc="AdamW weight decay. Default 0: the usual choice for RL, "
                                              "where data shifts under the policy", ge=0)
    grad_clip: float | None = spec_field(0.5, doc="global gradient-norm clip (null: none). Default 0.5: "
                                                  "the usual PPO max_grad_norm", gt=0)
    warmup_steps: int = spec_field(0, doc="linear LR warmup steps. Default 0: the clip ratio already "
                                          "bounds early updates", ge=0)

    DEFAULT_EPISODES_PER_UPDATE = 16  # enough episodes to estimate advantages, few enough for small jobs

    def __post_init__(self) -> None:
        # Neither set: collect by episodes. Normalised here so a stored spec says what ran.
        if self.episodes_per_update is None and self.steps_per_update is None:
            object.__setattr__(self, "episodes_per_update", self.DEFAULT_EPISODES_PER_UPDATE)

    def _checks(self) -> Iterator[tuple[str, str]]:
        if self.episodes_per_update is not None and self.steps_per_update is not None:
            yield "steps_per_update", "set either episodes_per_update or steps_per_update, not both"


ALGORITHMS: dict[str, type] = {"sft": SFTAlgorithm, "rl": PPOAlgorithm}


def _algorithm_for(parent: dict[str, Any]) -> type | None:
    # The algorithm section's type depends on the task; eval takes none (a rule says so).
    return ALGORITHMS.get(parent.get("task")) if isinstance(parent.get("task"), str) else None


@dataclass(frozen=True)
class BudgetSpec:
    """Hard limits: the workload completes when the first one is reached (null: no limit)."""

    max_steps: int | None = spec_field(None, doc="optimizer steps", ge=1)
    max_episodes: int | None = spec_field(None, doc="env episodes (rollouts, demos excluded, or eval)", ge=1)
    max_wall_s: float | None = spec_field(None, doc="seconds since the workload started", gt=0)


@dataclass(frozen=True)
class ScheduleSpec:
    """How the tenant shares the trainers (copied into the backend TenantConfig)."""

    priority: int = spec_field(0, doc="higher is leased first; ties go round-robin. Default 0: equal "
                                      "shares", ge=-1000, le=1000)
    max_inflight_jobs: int = spec_field(2, doc="unfinished training jobs per tenant-task. Default 2: keeps "
                                               "a producer from running far ahead of training", ge=1, le=64)
    staleness_bound: int = spec_field(128, doc="RL data more than this many policy versions old is dropped. "
                                               "Default 128: the reference system's bound", ge=1)
    sft_prefetch_items: int = spec_field(16, doc="queued SFT micro-batches per tenant. Default 16: offline "
                                                 "data cannot crowd out online RL", ge=1, le=4096)
    budget: BudgetSpec = spec_field(BudgetSpec, doc="limits; default none: sft ends after algorithm.steps, "
                                                    "eval after eval.episodes, rl runs until cancelled")


@dataclass(frozen=True)
class EvalSpec:
    """Read-only evaluation episodes on the env with a pinned policy version."""

    version: int | str = spec_field(
        "latest", doc="policy version: an integer, 'latest' (this tenant's newest export), or "
                      "'tenant:<name>@latest' / 'tenant:<name>@<n>' (another tenant's export). "
                      "Default 'latest'", ge=0, pattern=VERSION_PIN_PATTERN,
        pattern_text="'latest', 'tenant:<name>@latest' or 'tenant:<name>@<n>'")
    episodes: int = spec_field(50, doc="episodes to run. Default 50: the success rate's "
                                       "standard error is at most 7 points", ge=1, le=100_000)
    seed: int = spec_field(0, doc="first reset seed; episode i uses seed + i. Default 0: every version "
                                  "is scored on the same episodes", ge=0)
    sample: bool = spec_field(False, doc="sample actions (true) or take the mean (false). Default false: "
                                         "deterministic scores", )


@dataclass(frozen=True)
class OutputsSpec:
    """What the workload leaves behind."""

    export_every_steps: int = spec_field(
        0, doc="export a version at most every N optimizer steps (0: after every trained job, the "
               "trainer's behaviour). A final export always happens. Default 0", ge=0)
    report_path: str | None = spec_field(
        None, doc="where the master writes the final JSON report. Default null: "
                  "<data dir>/reports/<tenant>.json", min_length=1)


@dataclass(frozen=True, kw_only=True)  # kw_only: fields in reading order, defaults or not
class WorkloadSpec:
    """One tenant's workload: model, schema, data source, algorithm, schedule and outputs."""

    spec_version: Literal[1] = spec_field(SPEC_VERSION, doc="format version of this spec. Default 1: the "
                                                            "only version so far")
    tenant: str = spec_field(doc="tenant name, unique per deployment", pattern=TENANT_PATTERN,
                             pattern_text="letters, digits, _ and - (1-64 characters)")
    task: TaskType = spec_field(doc="sft: supervised fine-tuning; rl: asynchronous PPO; eval: "
                                    "read-only evaluation")
    base: str = spec_field(doc="frozen base model: a preset name or a local save_pretrained directory "
                               "written with a '/' (./my_base)",
                           choices=known_presets, pattern=BASE_PATH_PATTERN,
                           pattern_text="or a path containing '/' (./my_base)")
    action_module: ActionModuleSpec = spec_field(doc="the tenant's trainable head")
    observation: ObservationSpec = spec_field(doc="cameras, state and prompt template")
    action: ActionSpec = spec_field(doc="action size and horizon")
    seed: int = spec_field(0, doc="seeds head init and sampling. Default 0: reproducible runs", ge=0)
    env: EnvSource | None = spec_field(None, doc="simulator: required by rl and eval; sft uses it with "
                                                 "env.demos (exclusive with dataset)")
    dataset: DatasetSource | None = spec_field(None, doc="sft only: a local LeRobot v3.0 dataset "
                                                         "(exclusive with env)")
    algorithm: SFTAlgorithm | PPOAlgorithm | None = spec_field(
        None, doc="hyper-parameters typed by task (sft: SFTAlgorithm, rl: PPOAlgorithm; eval: none). "
                  "Default null: the task's defaults",
        select=_algorithm_for, select_options=(SFTAlgorithm, PPOAlgorithm))
    schedule: ScheduleSpec = spec_field(ScheduleSpec, doc="priority, caps and budget")
    eval: EvalSpec | None = spec_field(None, doc="evaluation settings: required by eval; on sft/rl, "
                                                 "evaluates the final version (needs env)")
    outputs: OutputsSpec = spec_field(OutputsSpec, doc="exports and report")

    def __post_init__(self) -> None:
        # An omitted algorithm means the task's defaults; stored specs then say what ran.
        if self.algorithm is None and self.task in ALGORITHMS:
            object.__setattr__(self, "algorithm", ALGORITHMS[self.task]())


# ---- task-type rules -------------------------------------------------------------------
@dataclass(frozen=True)
class TaskRule:
    """Which sections a task type needs or forbids, and which heads it can train."""

    required: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    exactly_one: tuple[str, ...] = ()  # exactly one of these sections is set
    heads: tuple[str, ...] = ("mlp", "flow", "gaussian")
    demos: Literal["required", "forbidden"] = "forbidden"  # env.demos, when env is set
    why: str = ""


TASK_RULES: dict[str, TaskRule] = {
    "sft": TaskRule(exactly_one=("dataset", "env"), demos="required",
                    why="sft learns from demonstrations: a LeRobot dataset, or an env whose scripted "
                        "expert records env.demos.episodes first"),
    "rl": TaskRule(required=("env",), forbidden=("dataset",), heads=("gaussian",),
                   why="rl rolls out in an env and PPO needs log-probs and values from a gaussian head"),
    "eval": TaskRule(required=("env", "eval"), forbidden=("dataset", "algorithm"),
                     why="eval runs episodes in an env with a pinned version and trains nothing"),
}


def _is_set(raw: dict[str, Any], key: str) -> bool:
    return raw.get(key) is not None


def _rule_errors(raw: dict[str, Any]) -> Errors:
    """Task-type rules on the raw document (sections present or not, whatever their content)."""
    task = raw.get("task")
    rule = TASK_RULES.get(task) if isinstance(task, str) else None
    if rule is None:
        return []  # the task field's own error says what is allowed
    errors: Errors = []
    for key in rule.required:
        if not _is_set(raw, key):
            errors.append((key, f"required for task {task!r}: {rule.why}"))
    for key in rule.forbidden:
        if _is_set(raw, key):
            errors.append((key, f"not allowed for task {task!r}; remove it"))
    if rule.exactly_one:
        present = [k for k in rule.exactly_one if _is_set(raw, k)]
        options = " or ".join(rule.exactly_one)
        if not present:
            errors.append((rule.exactly_one[0], f"task {task!r} needs one of {options}: {rule.why}"))
        for key in present[1:]:
            errors.append((key, f"task {task!r} takes one of {options}, not both; remove {key} or {present[0]}"))
    module = raw.get("action_module")
    kind = module.get("kind") if isinstance(module, dict) else None
    if isinstance(kind, str) and kind in HeadKind.__args__ and kind not in rule.heads:  # type: ignore[attr-defined]
        errors.append(("action_module.kind",
                       f"{kind!r} is not allowed for task {task!r}; allowed: {', '.join(rule.heads)} ({rule.why})"))
    env = raw.get("env")
    if isinstance(env, dict):
        has_demos = env.get("demos") is not None
        if rule.demos == "required" and not has_demos and not _is_set(raw, "dataset"):
            errors.append(("env.demos", f"required when task {task!r} trains from an env: record N "
                                        "scripted-expert episodes first, e.g. demos: {episodes: 50}"))
        if rule.demos == "forbidden" and has_demos:
            errors.append(("env.demos", f"only task 'sft' records demos; remove it for task {task!r}"))
    if _is_set(raw, "eval") and not _is_set(raw, "env") and "env" not in rule.required:
        errors.append(("eval", "evaluation runs episodes in an env: set env, or remove eval"))
    return errors


def _cross_errors(spec: WorkloadSpec) -> Errors:
    """Rules across sections that need parsed values (all sections valid)."""
    errors: Errors = []
    if spec.dataset is not None:
        names = [c.name for c in spec.observation.cameras]
        mapped = list(spec.dataset.camera_map.values())
        for key, target in spec.dataset.camera_map.items():
            if target not in names:
                errors.append((f"dataset.camera_map[{key}]",
                               f"{target!r} is not an observation camera; allowed: {', '.join(names)}"))
        for name in names:
            count = mapped.count(name)
            if count != 1:
                errors.append(("dataset.camera_map", f"observation camera {name!r} is mapped {count} times; "
                                                     "map exactly one dataset camera key to it"))
    if spec.task == "rl":
        clash = sorted(set(spec.action_module.params) & set(PPO_HEAD_FIELDS))
        if clash:
            errors.append(("action_module.params", f"{clash} are PPO settings: set them under algorithm "
                                                   "(one place), not in the head params"))
    return errors


# ---- public API ------------------------------------------------------------------------
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
    problem with its field path."""
    raw = data if isinstance(data, dict) else load_document(data)
    if not isinstance(raw, dict):
        raise SpecError([(ROOT, f"a workload spec must be a mapping of fields, got {type(raw).__name__}")])
    errors: Errors = []
    spec = parse_into(WorkloadSpec, raw, ROOT, errors)
    errors.extend(_rule_errors(raw))
    if spec is not None and not errors:
        errors.extend(_cross_errors(spec))
    if errors:
        raise SpecError(errors)
    return spec


def load_spec(path: str | Path) -> WorkloadSpec:
    """`parse_spec` of a file (YAML or JSON)."""
    return parse_spec(Path(path).read_bytes())


def spec_to_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """JSON-safe plain data (every field written, defaults included) for the workloads KV."""
    return to_plain(spec)


def spec_from_dict(data: dict[str, Any]) -> WorkloadSpec:
    """Inverse of `spec_to_dict`, as strict as `parse_spec`."""
    return parse_spec(dict(data))


def compile_tenant(spec: WorkloadSpec) -> TenantConfig:
    """The backend config of the spec's tenant. ``signature`` and ``created_at`` stay empty:
    the master derives them (never trusted from a client)."""
    schema = {
        "cameras": [to_plain(c) for c in spec.observation.cameras],
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
        if isinstance(alg, SFTAlgorithm):
            optim["total_steps"] = alg.steps  # cosine decay over the planned run
        if isinstance(alg, PPOAlgorithm) and spec.action_module.kind == "gaussian":
            # The gaussian head computes the PPO loss, so these live in its config.
            head_params.update({k: getattr(alg, k) for k in PPO_HEAD_FIELDS})
    sched = spec.schedule
    return TenantConfig(
        name=spec.tenant, base=spec.base, schema=schema, head=spec.action_module.kind,
        head_params=head_params, optim=optim, seed=spec.seed,
        max_inflight_jobs=sched.max_inflight_jobs, sft_prefetch_items=sched.sft_prefetch_items,
        staleness_bound=sched.staleness_bound, priority=sched.priority,
    )


# ---- JSON Schema -----------------------------------------------------------------------
def spec_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a workload spec, derived from the dataclasses and
    `TASK_RULES`. Cross-field checks that JSON Schema cannot say (unique camera names, the
    instruction template, camera_map coverage, warmup <= steps) are `parse_spec`'s alone."""
    defs: dict[str, Any] = {}
    ref = json_schema_for(WorkloadSpec, defs)
    top = defs.pop(WorkloadSpec.__name__)
    assert ref["$ref"].endswith(WorkloadSpec.__name__)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **top,
        "allOf": [_rule_schema(task, rule) for task, rule in TASK_RULES.items()] + [_eval_needs_env()],
        "$defs": defs,
    }
    return schema


def _object(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"type": "object"}}}


def _rule_schema(task: str, rule: TaskRule) -> dict[str, Any]:
    then: dict[str, Any] = {"properties": {}}
    conditions: list[dict[str, Any]] = []
    for key in rule.required:
        conditions.append(_object(key))
    for key in rule.forbidden:
        then["properties"][key] = {"type": "null"}
    if rule.exactly_one:
        then["oneOf"] = [_object(k) for k in rule.exactly_one]
    then["properties"]["action_module"] = {"properties": {"kind": {"enum": list(rule.heads)}}}
    env: dict[str, Any] = {"properties": {"demos": {"type": "object" if rule.demos == "required" else "null"}}}
    if rule.demos == "required":
        env["required"] = ["demos"]
    then["properties"]["env"] = env
    if task in ALGORITHMS:
        then["properties"]["algorithm"] = {"anyOf": [{"$ref": f"#/$defs/{ALGORITHMS[task].__name__}"},
                                                     {"type": "null"}]}
    if conditions:
        then["allOf"] = conditions
    return {"if": {"required": ["task"], "properties": {"task": {"const": task}}}, "then": then,
            "description": f"task {task}: {rule.why}"}


def _eval_needs_env() -> dict[str, Any]:
    return {"if": {"required": ["eval"], "properties": {"eval": {"type": "object"}}},
            "then": _object("env"), "description": "evaluation runs episodes in an env"}


# ---- generated docs --------------------------------------------------------------------
SCHEMA_DOC = "docs/workload_spec.schema.json"
FIELDS_DOC = "docs/workload_spec.md"
_BEGIN = "<!-- BEGIN GENERATED FIELD REFERENCE (python -m master.spec_schema) -->"
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


__all__ = [
    "ALGORITHMS", "TASK_RULES", "ActionModuleSpec", "ActionSpec", "BudgetSpec", "Camera", "DatasetSource",
    "DemosSpec", "EnvSource", "EvalSpec", "ObservationSpec", "OutputsSpec", "PPOAlgorithm", "SFTAlgorithm",
    "ScheduleSpec", "SpecError", "TaskRule", "WorkloadSpec", "compile_tenant", "known_presets", "load_document",
    "load_spec", "parse_spec", "spec_from_dict", "spec_json_schema", "spec_to_dict",
]
