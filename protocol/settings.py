"""Every NEXUS_* environment variable, typed, bounded and documented in one place.

Each group below is a pydantic v2 model whose fields carry their variable as an alias; a role
reads its groups at start (``python -m actors.run ROLE`` checks them all before the role is
built), so a bad value is one clear line naming the variable, its value and what is allowed,
never an error deep inside a loop::

    from protocol.settings import InferencerSettings
    s = InferencerSettings.from_env()          # os.environ; or from_env({"NEXUS_...": "..."})
    s.max_batch_size

An empty value counts as unset (``NEXUS_INFER_DEVICE= cmd`` means the default); a NEXUS_*
variable that nothing reads is a warning at start (`unknown_variables`). Nothing else
reads ``os.environ`` for a NEXUS_* variable: a test checks the code for it, and that the
README's table is `env_table_markdown()`. Run ``python -m protocol.settings`` to rewrite that
table after changing a field here.

Standard variables (OMP_NUM_THREADS, OTEL_EXPORTER_OTLP_ENDPOINT, MUJOCO_GL, ...) stay where
the library that owns them wants them; `STANDARD_VARIABLES` says who reads or sets each.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from protocol.errors import NexusError
from protocol.policy import COHORT_JOIN_WAIT_S, INFERENCE_OUTAGE, Leases, Retention, UsageFlush
from protocol.subjects import DEFAULT_PREFIX, ROLES, Names
from protocol.settings_base import EnvSettings, SettingsError, rule_error, allowed_text, var
from protocol.settings_platform import (AuthSettings, CliSettings, HealthSettings, LeaseSettings, MonitorSettings,
                                        QuotaSettings, RetentionSettings, ScaleSettings, TelemetrySettings,
                                        UsageSettings)

# The trainer's fault points for the exactly-once tests, in lifecycle order.
FAULT_POINTS = ("after_lease", "after_train", "after_commit", "after_trained", "after_export", "after_synced")
DEFAULT_INFER_BASE = "tiny-qwen3-vl-64"  # the embedded preset the built-in task runs on
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_DEVICE = r"^(cpu|cuda|mps|xpu)(:[0-9]+)?$"


# ---- the groups -------------------------------------------------------------------------
class RoleSettings(EnvSettings):
    roles = ROLES
    readers = "every role"

    nats_url: str = Field("nats://127.0.0.1:4222", min_length=1, **var(
        "NEXUS_NATS_URL", "NATS server(s); comma-separated for a cluster", flag="--nats-url", cli=True,
        allowed="nats:// URLs, comma-separated", default_text="embedded on `127.0.0.1:4222`"))
    prefix: str = Field(DEFAULT_PREFIX, **var(
        "NEXUS_PREFIX", "subject prefix (two deployments on one server)", flag="--prefix", cli=True,
        allowed="1-64 characters from A-Z a-z 0-9 _ -"))
    data_dir: Path = Field(Path(".nexus"), **var(
        "NEXUS_DATA_DIR", "data dir (JetStream store, logs, traces, cluster.json)", flag="--data-dir", cli=True,
        default_text="`./.nexus/`"))
    # 1 s beats with a 3 s timeout in the health manager: a kill is seen in about 3-4 s.
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60, **var(
        "NEXUS_HEARTBEAT_INTERVAL_S", "seconds between a role's heartbeats"))
    # Requests handled at once; more wait in NATS (bounded by the subscription's pending limit).
    max_concurrency: int = Field(64, ge=1, le=65536, **var(
        "NEXUS_MAX_CONCURRENCY", "requests a role handles at once"))
    max_pending: int = Field(0, ge=0, **var(
        "NEXUS_MAX_PENDING", "requests a role holds (running + waiting) before answering `busy`",
        allowed="an integer >= 0 (0 = 4 x max concurrency)", default_text="4 x max concurrency"))

    @field_validator("nats_url")
    @classmethod
    def _urls(cls, value: str) -> str:
        for url in value.split(","):
            if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+", url.strip()):
                raise ValueError(f"{url.strip()!r} is not a nats:// URL")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        try:
            Names(value)
        except NexusError:
            raise ValueError("not a valid name") from None
        return value


class MasterSettings(EnvSettings):
    roles = ("master",)
    readers = "master"

    # Reference default: 1 active rollout per tenant, 3 across the deployment.
    max_active_rollouts: int = Field(3, ge=1, **var(
        "NEXUS_MAX_ACTIVE_ROLLOUTS", "active rollouts across the deployment (1 per tenant)"))
    # Capacity: past it a new tenant / workload is refused (`CapacityExceeded`), so what is
    # admitted keeps its share. 1,000 / 256 is the scale this node is sized for (docs/scale.md).
    max_tenants: int = Field(1000, ge=1, **var(
        "NEXUS_MAX_TENANTS", "tenants registered at once; past it `tenant_create` and a new tenant's submit are refused"))
    max_active_workloads: int = Field(256, ge=1, **var(
        "NEXUS_MAX_ACTIVE_WORKLOADS", "workloads pending or running at once; past it a submit is refused"))
    # Hosted envs (docs/hosted_envs.md): a workload whose env the tenant hosts waits this long
    # for one of its `nexus env serve` processes, then fails saying so; a process that stops
    # claiming for the lease loses its workloads (back to pending, queued data kept).
    hosted_wait_s: float = Field(600.0, gt=0, le=86400, **var(
        "NEXUS_HOSTED_WAIT_S", "a pending workload with env.hosted waits this long (s) for a hosted env process "
        "of its tenant to take it, then fails naming why"))
    hosted_lease_s: float = Field(15.0, ge=2, le=600, **var(
        "NEXUS_HOSTED_LEASE_S", "a hosted env process that has not claimed for this long (s) is gone: its "
        "workloads go back to pending (episodes in flight lost, queued data kept)"))


class TrainerSettings(EnvSettings):
    roles = ("trainer",)
    readers = "trainer"

    group_max: int = Field(4, ge=1, le=256, **var(
        "NEXUS_TRAINER_GROUP_MAX", "jobs (tenants) in the trainer's running group: the grouped base forward's width"))
    # Leases are renewed while a job trains, so this bounds how long a hung trainer holds
    # work, not how long a job may take.
    lease_s: float = Field(60.0, gt=0, **var(
        "NEXUS_TRAINER_LEASE_S", "a training job's lease (s), renewed from lease to clear"))
    # A starting group's wait for the rest of its lease: longer keeps a lease's jobs in every
    # step on a slow host (fair per-step charges, fewer steps), shorter starts training sooner.
    cohort_wait_s: float = Field(COHORT_JOIN_WAIT_S, ge=0, le=600, **var(
        "NEXUS_TRAINER_COHORT_WAIT_S", "a group that has not stepped yet waits this long (s) for the other jobs "
        "of its lease still being prepared, so jobs leased together share every step"))
    device: str | None = Field(None, pattern=_DEVICE, **var(
        "NEXUS_TRAINER_DEVICE", "the trainer's torch device", allowed="cpu, cuda, cuda:N, mps or xpu",
        default_text="cuda if available, else cpu"))
    # Off by default, like the inferencer's: each new group size captures a CUDA graph.
    fast: bool = Field(False, **var(
        "NEXUS_TRAINER_FAST", "on CUDA, the base forward of training steps through the fast engine (models.fast; "
        "Qwen3-VL bases): CUDA graphs for frozen-base tenants, the engine's layers uncaptured for LoRA tenants "
        "(their gradients reach their adapters; adapters with dropout keep the plain forward)"))
    # Off by default: compiling the blocks costs a minute or more at the first step of each shape.
    compile: bool = Field(False, **var(
        "NEXUS_TRAINER_COMPILE", "with NEXUS_TRAINER_FAST on CUDA: torch.compile the fast engine's vision "
        "blocks and decoder layers"))
    # 0: every slot that trained stays in memory (docs/scale.md: ~8.6 MB each on the tiny base).
    slot_budget_mb: float = Field(0.0, ge=0, **var(
        "NEXUS_TRAINER_SLOT_BUDGET_MB", "memory for tenant slots (MiB; head, adapter, grads, AdamW moments): past it "
        "the least recently used idle slots are dropped and restored from their checkpoint on their next job; "
        "a slot larger than the whole budget fails its job", allowed="a number >= 0 (0 = no budget)",
        default_text="`0` (no budget)"))
    # 1: today's trainer, one process. N: the role process is rank 0 of N (its ranks 1..N-1
    # are child processes) and every grouped step spreads each tenant's rows over the ranks
    # (actors/trainer/ranks.py, docs/data_parallel.md).
    ranks: int = Field(1, ge=1, le=64, **var(
        "NEXUS_TRAINER_RANKS", "data-parallel ranks of one trainer: each step's rows spread over this many "
        "processes (gloo on CPU; NCCL for the gradients on CUDA, rank r on cuda:r of the trainer's visible "
        "devices), the tenants' gradients all-reduced, one commit per job", allowed="an integer in 1..64"))
    # A collective waits this long for the other ranks: a dead rank is seen at once (its socket
    # closes), a hung one after this; the first step of a base includes the ranks' base load.
    rank_timeout_s: float = Field(300.0, gt=0, le=3600, **var(
        "NEXUS_TRAINER_RANK_TIMEOUT_S", "with NEXUS_TRAINER_RANKS > 1: how long (s) a rank waits for the others "
        "in a collective before the trainer exits non-zero (its jobs then fail over as after a lost trainer)"))
    fault: Literal[FAULT_POINTS] | None = Field(None, **var(  # type: ignore[valid-type]
        "NEXUS_TRAINER_FAULT", "tests only: SIGKILL the trainer at this point of its first job",
        default_text="unset"))


class BaseImageSettings(EnvSettings):
    """The shared base's canonical camera resolution: every role that runs the base must agree
    (a tenant's features, and so its trained head, depend on it). Fewer pixels are fewer vision
    tokens: on an H200 the 8 x 4 grouped forward of `qwen3-vl-4b` takes 82.5 ms at 224 px and
    62.0 at 192 (docs/benchmarks.md); tenants whose cameras are at most that size lose nothing."""

    roles = ("trainer", "inferencer")
    readers = "trainer, inferencer"

    image_size: int | None = Field(None, ge=32, le=1024, multiple_of=32, **var(
        "NEXUS_BASE_IMAGE_SIZE", "the base's canonical camera resolution (px, square) in the trainer and the "
        "inferencer alike: frames are resized to it, so fewer pixels mean fewer vision tokens and a faster "
        "forward; set the same on every trainer and inferencer", allowed="a multiple of 32 in 32..1024",
        default_text="the base's own (a preset's default, 224 for qwen3-vl-4b; a checkpoint's vision tower)"))


class InferencerSettings(EnvSettings):
    roles = ("inferencer",)
    readers = "inferencer"

    base: str = Field(DEFAULT_INFER_BASE, min_length=1, **var(
        "NEXUS_INFER_BASE", "the base an inferencer serves (its pool): a preset name or a local path",
        allowed="a preset name or a path"))
    device: str | None = Field(None, pattern=_DEVICE, **var(
        "NEXUS_INFER_DEVICE", "the inferencer's torch device", allowed="cpu, cuda, cuda:N, mps or xpu",
        default_text="cuda if available, else cpu"))
    # The optimized Qwen3-VL encode with CUDA graphs (models.fast). Unset: on where it pays (a
    # CUDA device and a Qwen3-VL base), as the service's engine should be (issue 27 item 4).
    fast: bool | None = Field(None, **var(
        "NEXUS_INFER_FAST", "optimized encode with CUDA graphs (Qwen3-VL)", allowed="true, false or auto",
        default_text="auto: on with a CUDA device and a Qwen3-VL base"))
    # Unset: on wherever fast is on a CUDA device; each capture size compiles (tens of seconds),
    # which the warm-up below pays before requests do.
    compile: bool | None = Field(None, **var(
        "NEXUS_INFER_COMPILE", "with NEXUS_INFER_FAST on CUDA: torch.compile the fast engine's vision blocks and "
        "decoder layers", allowed="true, false or auto", default_text="auto: on wherever the fast engine runs on CUDA"))
    # Unset: on with the fast engine. Every capture size up to the largest group, per layout,
    # captured (and compiled) before any request of that layout waits on it.
    warmup: bool | None = Field(None, **var(
        "NEXUS_INFER_WARMUP", "with the fast engine: run every capture size up to NEXUS_INFER_MAX_BATCH_SIZE once per "
        "observation layout (the synced tenants' before the inferencer says ready, a new one's before its first "
        "group), so no request pays a capture or a compile", allowed="true, false or auto",
        default_text="auto: on with the fast engine"))

    # How action experts' grouped Euler loop runs (models.heads.expert.EulerOptions). Unset: on
    # CUDA compiled with TF32 matmuls where the engine compiles, TF32 alone where it does not;
    # fp32 elsewhere. Measured on an H200 (docs/benchmarks.md): fp32 matmuls were 18.5 of a
    # step's 22.7 ms; TF32 11.1, compiled with TF32 7.6 ms; actions within 1e-3 of fp32.
    euler: str | None = Field(None, pattern=r"^(auto|fp32|tf32|compile|compile\+tf32)$", **var(
        "NEXUS_INFER_EULER", "how action experts' grouped Euler loop runs", allowed="auto, fp32, tf32, compile or "
        "compile+tf32", default_text="auto: compile+tf32 where the engine compiles on CUDA, tf32 on other CUDA, "
        "fp32 elsewhere"))

    @field_validator("fast", "compile", "warmup", "euler", mode="before")
    @classmethod
    def _auto(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() == "auto" else v
    # 32 rows fill a GPU forward well for 2-camera inputs; 5 ms bounds what a lone request
    # pays waiting for company.
    max_batch_size: int = Field(32, ge=1, le=1024, **var(
        "NEXUS_INFER_MAX_BATCH_SIZE", "rows in one grouped forward at most"))
    batch_wait_timeout_s: float = Field(0.005, ge=0, le=10, **var(
        "NEXUS_INFER_BATCH_WAIT_TIMEOUT_S", "seconds a request waits for company before its group runs"))
    # One group in the forward, one prepared behind it (on an H200, 3 was slower: 146 -> 131 req/s).
    pipeline_depth: int = Field(2, ge=1, le=8, **var(
        "NEXUS_INFER_PIPELINE_DEPTH", "groups between forming and replied (canonicalised ahead of the forward)"))
    # 8 full default groups per key: a request admitted waits at most ~8 forwards.
    max_queue_per_key: int = Field(256, ge=1, **var(
        "NEXUS_INFER_MAX_QUEUE_PER_KEY", "requests queued per compatibility key before `busy`"))
    # A 2-camera 64x64 request is ~25 KB decoded: 4096 is ~100 MB at most.
    max_queued: int = Field(4096, ge=1, **var(
        "NEXUS_INFER_MAX_QUEUED", "requests held in all before `busy`",
        allowed="an integer >= NEXUS_INFER_MAX_QUEUE_PER_KEY"))
    busy_retry_after_s: float = Field(0.05, gt=0, le=60, **var(
        "NEXUS_INFER_BUSY_RETRY_AFTER_S", "the smallest `busy` retry hint (s); it grows with the queue"))
    # The SDK's longest back-off.
    busy_max_retry_after_s: float = Field(INFERENCE_OUTAGE.max_backoff_s, gt=0, le=60, **var(
        "NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S", "the largest `busy` retry hint (s)",
        allowed="a number in [NEXUS_INFER_BUSY_RETRY_AFTER_S, 60]"))
    # 0: every tenant's current head stays loaded once it was served or announced.
    head_budget_mb: float = Field(0.0, ge=0, **var(
        "NEXUS_INFER_HEAD_BUDGET_MB", "memory for loaded serving heads (MiB): past it the least recently used "
        "heads no request holds are dropped and reloaded from the weights store on their next request; "
        "a head larger than the whole budget is refused", allowed="a number >= 0 (0 = no budget)",
        default_text="`0` (no budget)"))
    reply_cache_size: int = Field(4096, ge=1, **var(
        "NEXUS_INFER_REPLY_CACHE_SIZE", "replies kept so a retried request id is answered once"))
    # The SDK's whole retry horizon: a retry it can still send always finds its first reply.
    reply_cache_ttl_s: float = Field(INFERENCE_OUTAGE.deadline_s, gt=0, **var(
        "NEXUS_INFER_REPLY_CACHE_TTL_S", "seconds a reply stays in that cache"))
    # The SDK has one attempt out at a time: a few copies cover retries racing a slow reply.
    max_joined_per_request: int = Field(16, ge=1, **var(
        "NEXUS_INFER_MAX_JOINED_PER_REQUEST", "copies of one request id that may wait on it at once"))
    # A quarter of the default max_queued: one tenant's flood cannot hold the whole instance.
    max_queued_per_tenant: int = Field(1024, ge=1, **var(
        "NEXUS_INFER_MAX_QUEUED_PER_TENANT", "requests of one tenant held at once (queued and in a forward) "
        "before `quota_exceeded` (a busy: the caller retries); NEXUS_INFER_MAX_QUEUED still bounds all"))

    @model_validator(mode="after")
    def _order(self) -> InferencerSettings:
        if self.max_queued < self.max_queue_per_key:
            raise rule_error(f"NEXUS_INFER_MAX_QUEUED={self.max_queued}: must be >= NEXUS_INFER_MAX_QUEUE_PER_KEY "
                             f"({self.max_queue_per_key})")
        if self.busy_max_retry_after_s < self.busy_retry_after_s:
            raise rule_error(f"NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S={self.busy_max_retry_after_s:g}: must be >= "
                             f"NEXUS_INFER_BUSY_RETRY_AFTER_S ({self.busy_retry_after_s:g})")
        return self


class EnvWorkerSettings(EnvSettings):
    roles = ("env",)
    readers = "env worker"

    max_sessions: int = Field(64, ge=1, **var("NEXUS_ENV_MAX_SESSIONS", "simulator sessions per env worker"))
    # A quarter of the worker's: one tenant cannot take every session of a shared worker.
    max_sessions_per_tenant: int = Field(16, ge=1, **var(
        "NEXUS_ENV_MAX_SESSIONS_PER_TENANT", "simulator sessions one tenant's account holds on one env worker "
        "(past it `create` is refused `quota_exceeded`; NEXUS_ENV_MAX_SESSIONS still bounds all of them)"))
    plugins: tuple[str, ...] = Field((), **var(
        "NEXUS_ENV_PLUGINS", "modules an env worker imports at start (they call `envs.register`)",
        allowed="comma-separated module names", default_text="none"))

    @field_validator("plugins", mode="before")
    @classmethod
    def _modules(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(m.strip() for m in value.split(",") if m.strip())
        for module in value:
            if not _MODULE_NAME.match(module):
                raise ValueError(f"{module!r} is not a module name")
        return value


class WorkflowSettings(EnvSettings):
    """The modules that register workflow recipes (`protocol.recipes`), imported at start: by the
    master (a spec's task is one of the kinds they declare) and by the hosts that run them."""

    roles = ("master", "env")
    readers = "master, env worker, `nexus env serve`"

    modules: tuple[str, ...] = Field(("workflows",), **var(
        "NEXUS_WORKFLOW_MODULES", "modules imported at start that register the workflows run for workloads, by "
        "kind (`protocol.recipes.register`); the master accepts a spec's task of those kinds, the env workers run "
        "them (set it alike on both); a module that does not import stops the start naming it",
        allowed="comma-separated module names", default_text="`workflows` (sft, rl, eval)"))

    @field_validator("modules", mode="before")
    @classmethod
    def _modules(cls, value: Any) -> Any:
        return EnvWorkerSettings._modules(value)


class SimulatorSettings(EnvSettings):
    roles = ("env",)
    readers = "env worker (ManiSkill envs)"

    vulkan_dir: Path | None = Field(None, **var(
        "NEXUS_VULKAN_DIR", "where `deploy/setup/vulkan.sh` put lavapipe (its `lvp_icd.json`), searched first",
        default_text="`<sys.prefix>/vulkan`, then `.venv/vulkan`"))


class SimCallSettings(EnvSettings):
    """Simulator child processes (`envs.simproc`): a hung simulator is killed, its episode fails."""

    roles = ("env",)
    readers = "env worker (sessions and workflows)"

    timeout_s: float = Field(120.0, gt=0, le=86400, **var(
        "NEXUS_SIM_TIMEOUT_S", "a simulator call (make, reset, step, close) taking longer kills its process and "
        "fails its session or episode (s)"))
    # One simulator per child process (~50 MB for the built-in task, hundreds for ManiSkill):
    # the bound of the worker's sessions and its workflows' envs together.
    procs_max: int = Field(64, ge=1, le=1024, **var(
        "NEXUS_SIM_PROCS_MAX", "simulator child processes per env worker (sessions and workflow envs); past it "
        "`create` is refused `busy` and a workflow's make waits up to NEXUS_SIM_TIMEOUT_S for one to end"))


GROUPS: tuple[type[EnvSettings], ...] = (
    RoleSettings, HealthSettings, LeaseSettings, RetentionSettings, MasterSettings, TrainerSettings,
    BaseImageSettings, InferencerSettings, EnvWorkerSettings, WorkflowSettings, SimulatorSettings, SimCallSettings, UsageSettings, QuotaSettings,
    TelemetrySettings, MonitorSettings, AuthSettings, ScaleSettings, CliSettings,
)


def role_settings(role: str, environ: Mapping[str, str] | None = None) -> dict[type[EnvSettings], EnvSettings]:
    """Every group ``role`` reads, checked at once: one `SettingsError` lists every problem."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: allowed {', '.join(ROLES)}")
    out: dict[type[EnvSettings], EnvSettings] = {}
    lines: list[str] = []
    for group in GROUPS:
        if role in group.roles:
            try:
                out[group] = group.from_env(environ)
            except SettingsError as exc:
                lines.extend(exc.lines)
    # A rule across groups (a trainer's renewal interval needs none: it renews at least
    # four times per lease whatever NEXUS_LEASE_RENEW_EVERY_S says).
    if not lines and role in HealthSettings.roles:
        base, health = out[RoleSettings], out[HealthSettings]
        timeout = health.health_timeout_s  # type: ignore[attr-defined]
        if timeout is not None and timeout <= base.heartbeat_interval_s:  # type: ignore[attr-defined]
            lines.append(f"NEXUS_HEALTH_TIMEOUT_S={timeout:g}: must be > NEXUS_HEARTBEAT_INTERVAL_S "
                         f"({base.heartbeat_interval_s:g}), or every role is declared dead between beats")  # type: ignore[attr-defined]
    if lines:
        raise SettingsError(lines)
    return out


# What a supervisor sets for each role it starts, from its own flags: a value of these in its
# own environment never reaches a role.
SUPERVISOR_SETS = ("NEXUS_NATS_URL", "NEXUS_PREFIX", "NEXUS_DATA_DIR")


def check_supervised_roles(roles: typing.Iterable[str], environ: Mapping[str, str] | None = None) -> None:
    """`role_settings` of each role a supervisor would start with ``environ``, before it starts
    any: one `SettingsError` with each problem once (a variable several roles read is one line)."""
    env = dict(os.environ if environ is None else environ)
    for name in SUPERVISOR_SETS:
        env.pop(name, None)
    lines: list[str] = []
    for role in roles:
        try:
            role_settings(role, env)
        except SettingsError as exc:
            lines.extend(line for line in exc.lines if line not in lines)
    if lines:
        raise SettingsError(lines)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning line for each NEXUS_* variable set that nothing reads (a typo is otherwise
    silently the default), with the nearest known name."""
    import difflib

    env = os.environ if environ is None else environ
    known = [info.alias for group in GROUPS for info in group.model_fields.values()]
    known += [n for name, _, _ in STANDARD_VARIABLES for n in name.split(" / ") if n.startswith("NEXUS_")]
    lines = []
    for name in sorted(env):
        if name.startswith("NEXUS_") and name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            lines.append(f"{name} is set but nothing reads it{hint}")
    return lines


def leases_from_env() -> Leases:
    """`LEASES` with NEXUS_LEASE_RENEW_EVERY_S / NEXUS_TRAINER_DRAIN_FINISH_S / NEXUS_ORPHAN_TTL_S."""
    return LeaseSettings.from_env().leases()


def retention_from_env() -> Retention:
    """`RETENTION` with NEXUS_COMPACT_EVERY_S / NEXUS_JOB_RETENTION_S / NEXUS_VERSIONS_KEPT."""
    return RetentionSettings.from_env().retention()


def default_quotas():
    """The quotas of a tenant that has none of its own: `protocol.messages.TenantQuotas`'s
    defaults, each overridable by NEXUS_QUOTA_<FIELD> (typed in `QuotaSettings`)."""
    return QuotaSettings.from_env().quotas()


def usage_flush_from_env() -> UsageFlush:
    """`USAGE_FLUSH` (protocol.policy) with NEXUS_USAGE_FLUSH_EVERY_S and
    NEXUS_METER_{TRAIN,INFER}_OVERHEAD_ROWS (typed in `UsageSettings`)."""
    return UsageSettings.from_env().usage_flush()


# ---- variables this module does not parse -----------------------------------------------
# (name, who reads or sets it, why). Standard variables are left to the library that owns
# them; the set-up script and the test switch are not read by any role.
STANDARD_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "every role (actors/tracing.py), `nexus up`",
     "trace export over OTLP/HTTP; unset: JSONL files in `DATA_DIR/traces/`"),
    ("OMP_NUM_THREADS", "set to 1 for every role process (supervisor, `run_role`) unless set; the Makefile",
     "one BLAS / torch thread per process: more threads fight over the cores"),
    ("HF_HUB_OFFLINE", "the Makefile sets 1; transformers honours it", "nothing is downloaded from the Hub"),
    ("TOKENIZERS_PARALLELISM", "the Makefile sets false", "no tokenizer thread pool (and its fork warning)"),
    ("PYTHONUNBUFFERED", "set to 1 for role processes the supervisor and `nexus up` start",
     "log lines reach the log file as they are written"),
    ("MUJOCO_GL", "envs/libero.py (defaults it to `egl`); the Makefile", "MuJoCo renders headless"),
    ("SVT_LOG", "envs/lerobot/video.py (defaults it to 1)", "quiets the AV1 encoder's banner"),
    ("VK_ICD_FILENAMES / VK_DRIVER_FILES", "envs/maniskill.py (set to lavapipe unless already set)",
     "the Vulkan driver ManiSkill renders with"),
    ("NEXUS_VULKAN_SUITE / NEXUS_VULKAN_MIRROR", "deploy/setup/vulkan.sh (shell; also NEXUS_VULKAN_DIR)",
     "the Debian suite and mirror lavapipe is downloaded from"),
    ("NEXUS_REQUIRE_MANISKILL", "tests/envs/test_maniskill.py", "1: a missing ManiSkill or Vulkan fails instead of skipping (CI)"),
)


# ---- generated docs ---------------------------------------------------------------------
ENV_DOC = "README.md"
_BEGIN = "<!-- BEGIN GENERATED ENV TABLE (python -m protocol.settings) -->"
_END = "<!-- END GENERATED ENV TABLE -->"


def default_text(info: Any) -> str:
    extra = info.json_schema_extra or {}
    if extra.get("default_text"):
        return extra["default_text"]
    value = info.default
    if isinstance(value, bool):
        return "off" if not value else "on"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def env_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(variable, read by, flag, allowed, default, meaning) for every variable, group by group."""
    rows = []
    for group in GROUPS:
        for info in group.model_fields.values():
            extra = info.json_schema_extra or {}
            readers = group.readers + (", `nexus`" if extra.get("cli") and group is not CliSettings else "")
            flag = f"`{extra['flag']}`" if extra.get("flag") else ""
            rows.append((info.alias, readers, flag, allowed_text(info), default_text(info), info.description))
    return rows


def env_table_markdown() -> str:
    def cell(text: str) -> str:
        return text.replace("|", "/")

    lines = ["| variable | read by | flag | allowed | default | meaning |", "|---|---|---|---|---|---|"]
    for name, readers, flag, allowed, default, doc in env_rows():
        lines.append(f"| `{name}` | {readers} | {flag} | {cell(allowed)} | {default} | {cell(doc)} |")
    lines += ["", "Not parsed here (standard variables, the set-up script's, a test switch):", "",
              "| variable | read or set by | why |", "|---|---|---|"]
    for name, where, why in STANDARD_VARIABLES:
        names = " / ".join(f"`{n}`" for n in name.split(" / "))
        lines.append(f"| {names} | {cell(where)} | {cell(why)} |")
    return "\n".join(lines) + "\n"


def render_env_doc(text: str) -> str:
    """``text`` with the generated table between its markers replaced."""
    if _BEGIN not in text or _END not in text:
        raise ValueError(f"{ENV_DOC}: the markers {_BEGIN!r} ... {_END!r} are missing")
    head, _, rest = text.partition(_BEGIN)
    _, _, tail = rest.partition(_END)
    return f"{head}{_BEGIN}\n{env_table_markdown()}{_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite the README's environment-variable table from the models."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=".", help="repository root (default: .)")
    args = parser.parse_args(argv)
    path = Path(args.root) / ENV_DOC
    path.write_text(render_env_doc(path.read_text()))
    print(f"wrote {path}")
    return 0


__all__ = [
    "FAULT_POINTS", "GROUPS", "STANDARD_VARIABLES", "CliSettings", "EnvSettings", "EnvWorkerSettings",
    "HealthSettings", "InferencerSettings", "LeaseSettings", "MasterSettings", "MonitorSettings", "RetentionSettings",
    "RoleSettings", "SUPERVISOR_SETS", "ScaleSettings", "SettingsError", "SimCallSettings", "SimulatorSettings", "TelemetrySettings", "TrainerSettings",
    "check_supervised_roles", "env_table_markdown", "unknown_variables",
    "leases_from_env", "render_env_doc", "retention_from_env", "role_settings",
]

if __name__ == "__main__":
    raise SystemExit(main())
