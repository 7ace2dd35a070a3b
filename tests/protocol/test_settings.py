"""The typed NEXUS_* settings (protocol/settings.py): every variable parsed and read by its role,
bad values named, the README's table generated, and no NEXUS_* read anywhere else.

Fast: the roles are built in this process (nothing connects), and two `python -m actors.run`
processes exit at their settings check before they would connect.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import settings as S
from protocol.settings import GROUPS, SettingsError, role_settings

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("transport", "actors", "master", "sdk", "protocol", "models", "envs", "examples", "bench", "workflows")

# A valid value other than the default for every variable: (raw, what the setting holds).
GOOD: dict[str, tuple[str, object]] = {
    "NEXUS_NATS_URL": ("nats://127.0.0.1:1,nats://127.0.0.1:2", "nats://127.0.0.1:1,nats://127.0.0.1:2"),
    "NEXUS_PREFIX": ("tsettings", "tsettings"),
    "NEXUS_DATA_DIR": ("<tmp>", "<tmp>"),
    "NEXUS_HEARTBEAT_INTERVAL_S": ("0.7", 0.7),
    "NEXUS_MAX_CONCURRENCY": ("9", 9),
    "NEXUS_MAX_PENDING": ("11", 11),
    "NEXUS_HEALTH_TIMEOUT_S": ("4.5", 4.5),
    "NEXUS_LEASE_RENEW_EVERY_S": ("0.3", 0.3),
    "NEXUS_TRAINER_DRAIN_FINISH_S": ("7", 7.0),
    "NEXUS_ORPHAN_TTL_S": ("12.5", 12.5),
    "NEXUS_COMPACT_EVERY_S": ("0.5", 0.5),
    "NEXUS_JOB_RETENTION_S": ("99", 99.0),
    "NEXUS_VERSIONS_KEPT": ("3", 3),
    "NEXUS_RETENTION_S": ("120", 120.0),
    "NEXUS_RETENTION_MAX_WORKLOADS": ("50", 50),
    "NEXUS_USAGE_LABELS_MAX": ("9", 9),
    "NEXUS_SIM_TIMEOUT_S": ("7.5", 7.5),
    "NEXUS_SIM_PROCS_MAX": ("3", 3),
    "NEXUS_MAX_ACTIVE_ROLLOUTS": ("5", 5),
    "NEXUS_MAX_TENANTS": ("2000", 2000),
    "NEXUS_MAX_ACTIVE_WORKLOADS": ("64", 64),
    "NEXUS_HOSTED_WAIT_S": ("30", 30.0),
    "NEXUS_HOSTED_LEASE_S": ("5", 5.0),
    "NEXUS_TRAINER_GROUP_MAX": ("6", 6),
    "NEXUS_SCALE_BOUNDS": ("trainer=0:4", "trainer=0:4"),
    "NEXUS_SCALER": ("on", True),
    "NEXUS_TRAINER_LEASE_S": ("45", 45.0),
    "NEXUS_TRAINER_COHORT_WAIT_S": ("30", 30.0),
    "NEXUS_TRAINER_DEVICE": ("cpu", "cpu"),
    "NEXUS_TRAINER_FAULT": ("after_commit", "after_commit"),
    "NEXUS_INFER_BASE": ("tiny-qwen3-vl-32", "tiny-qwen3-vl-32"),
    "NEXUS_INFER_DEVICE": ("cuda:1", "cuda:1"),
    "NEXUS_INFER_FAST": ("yes", True),
    "NEXUS_INFER_COMPILE": ("on", True),
    "NEXUS_INFER_WARMUP": ("false", False),
    "NEXUS_INFER_EULER": ("compile+tf32", "compile+tf32"),
    "NEXUS_TRAINER_FAST": ("on", True),
    "NEXUS_TRAINER_COMPILE": ("yes", True),
    "NEXUS_BASE_IMAGE_SIZE": ("192", 192),
    "NEXUS_TRAINER_SLOT_BUDGET_MB": ("512.5", 512.5),
    "NEXUS_TRAINER_RANKS": ("2", 2),
    "NEXUS_TRAINER_RANK_TIMEOUT_S": ("45", 45.0),
    "NEXUS_INFER_HEAD_BUDGET_MB": ("64", 64.0),
    "NEXUS_INFER_MAX_BATCH_SIZE": ("17", 17),
    "NEXUS_INFER_BATCH_WAIT_TIMEOUT_S": ("0.25", 0.25),
    "NEXUS_INFER_PIPELINE_DEPTH": ("3", 3),
    "NEXUS_INFER_MAX_QUEUE_PER_KEY": ("40", 40),
    "NEXUS_INFER_MAX_QUEUED": ("400", 400),
    "NEXUS_INFER_BUSY_RETRY_AFTER_S": ("0.1", 0.1),
    "NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S": ("3", 3.0),
    "NEXUS_INFER_REPLY_CACHE_SIZE": ("100", 100),
    "NEXUS_INFER_REPLY_CACHE_TTL_S": ("30", 30.0),
    "NEXUS_INFER_MAX_JOINED_PER_REQUEST": ("2", 2),
    "NEXUS_INFER_MAX_QUEUED_PER_TENANT": ("30", 30),
    "NEXUS_ENV_MAX_SESSIONS": ("5", 5),
    "NEXUS_ENV_MAX_SESSIONS_PER_TENANT": ("3", 3),
    "NEXUS_ENV_PLUGINS": ("tests.support.crashy_env, json", ("tests.support.crashy_env", "json")),
    "NEXUS_WORKFLOW_MODULES": ("workflows, tests.support.crashy_env", ("workflows", "tests.support.crashy_env")),
    "NEXUS_VULKAN_DIR": ("/opt/vk", Path("/opt/vk")),
    "NEXUS_USAGE_FLUSH_EVERY_S": ("0.5", 0.5),
    "NEXUS_METER_TRAIN_OVERHEAD_ROWS": ("0.5", 0.5),
    "NEXUS_METER_INFER_OVERHEAD_ROWS": ("2", 2.0),
    "NEXUS_QUOTA_MAX_INFLIGHT_JOBS": ("3", 3),
    "NEXUS_QUOTA_MAX_ACTIVE_ROLLOUTS": ("2", 2),
    "NEXUS_QUOTA_PREDICT_RATE_PER_S": ("50", 50.0),
    "NEXUS_QUOTA_PREDICT_BURST": ("7", 7),
    "NEXUS_QUOTA_MAX_PRIORITY": ("4", 4),
    "NEXUS_TRACE_SAMPLE_RATIO": ("0.5", 0.5),
    "NEXUS_TRACE_SLOW_MS": ("250", 250.0),
    "NEXUS_TRACE_FILE_MAX_MB": ("8", 8.0),
    "NEXUS_TRACE_FILE_BACKUPS": ("1", 1),
    "NEXUS_MONITOR_POINTS": ("120", 120),
    "NEXUS_MONITOR_RETAIN_S": ("60", 60.0),
    "NEXUS_MONITOR_SERIES_MAX": ("100", 100),
    "NEXUS_MONITOR_TENANT_CAP": ("3", 3),
    "NEXUS_METRICS_PORT": ("0", 0),
    "NEXUS_METRICS_HOST": ("0.0.0.0", "0.0.0.0"),
    "NEXUS_TENSORBOARD": ("no", False),
    "NEXUS_CREDS": ("/tmp/x.creds", Path("/tmp/x.creds")),
    "NEXUS_DATA_ROOTS": ("/data/a:/data/b", "/data/a:/data/b"),
    "NEXUS_ROLE_USER": ("nexus-{role}", "nexus-{role}"),
    "NEXUS_NATS_PORT": ("4333", 4333),
    "NEXUS_TENANT_STORAGE_MB": ("8", 8.0),
    "NEXUS_TENANT_MAX_CONNS": ("4", 4),
    "NEXUS_TENANT_MAX_SUBS": ("32", 32),
    "NEXUS_TENANT_MAX_PAYLOAD_KB": ("64", 64),
}
# A value each variable refuses, and words its line must carry (the allowed values).
BAD: dict[str, tuple[str, str]] = {
    "NEXUS_NATS_URL": ("http://x:4222", "is not a nats:// URL"),
    "NEXUS_PREFIX": ("a.b", "1-64 characters"),
    "NEXUS_HEARTBEAT_INTERVAL_S": ("0", "a number in (0, 60]"),
    "NEXUS_MAX_CONCURRENCY": ("abc", "an integer in [1, 65536]"),
    "NEXUS_MAX_PENDING": ("-1", "an integer >= 0"),
    "NEXUS_HEALTH_TIMEOUT_S": ("soon", "a number > 0"),
    "NEXUS_LEASE_RENEW_EVERY_S": ("abc", "a number >= 0.01"),
    "NEXUS_TRAINER_DRAIN_FINISH_S": ("-3", "a number >= 0"),
    "NEXUS_ORPHAN_TTL_S": ("nan", "a number >= 0.1"),
    "NEXUS_COMPACT_EVERY_S": ("inf", "a number >= 0.1"),
    "NEXUS_JOB_RETENTION_S": ("1h", "a number >= 0"),
    "NEXUS_VERSIONS_KEPT": ("2.5", "an integer >= 1"),
    "NEXUS_RETENTION_S": ("7d", "a number >= 0"),
    "NEXUS_RETENTION_MAX_WORKLOADS": ("0", "an integer >= 1"),
    "NEXUS_USAGE_LABELS_MAX": ("0", "an integer in [1, 100000]"),
    "NEXUS_SIM_TIMEOUT_S": ("0", "a number in (0, 86400]"),
    "NEXUS_SIM_PROCS_MAX": ("1025", "an integer in [1, 1024]"),
    "NEXUS_MAX_ACTIVE_ROLLOUTS": ("0", "an integer >= 1"),
    "NEXUS_MAX_TENANTS": ("0", "an integer >= 1"),
    "NEXUS_MAX_ACTIVE_WORKLOADS": ("-1", "an integer >= 1"),
    "NEXUS_HOSTED_WAIT_S": ("0", "a number in (0, 86400]"),
    "NEXUS_HOSTED_LEASE_S": ("1", "a number in [2, 600]"),
    "NEXUS_TRAINER_GROUP_MAX": ("0", "an integer in [1, 256]"),
    "NEXUS_TRAINER_LEASE_S": ("-60", "a number > 0"),
    "NEXUS_TRAINER_COHORT_WAIT_S": ("601", "a number in [0, 600]"),
    "NEXUS_TRAINER_DEVICE": ("gpu", "cpu, cuda, cuda:N"),
    "NEXUS_TRAINER_FAULT": ("after_lunch", "one of 'after_lease'"),
    "NEXUS_INFER_DEVICE": ("cuda0", "cpu, cuda, cuda:N"),
    "NEXUS_INFER_FAST": ("maybe", "true, false or auto"),
    "NEXUS_INFER_COMPILE": ("perhaps", "true, false or auto"),
    "NEXUS_INFER_WARMUP": ("sometimes", "true, false or auto"),
    "NEXUS_INFER_EULER": ("bf16", "auto, fp32, tf32, compile or compile+tf32"),
    "NEXUS_TRAINER_FAST": ("sometimes", "a boolean"),
    "NEXUS_BASE_IMAGE_SIZE": ("200", "a multiple of 32 in 32..1024"),
    "NEXUS_TRAINER_COMPILE": ("maybe", "a boolean"),
    "NEXUS_TRAINER_SLOT_BUDGET_MB": ("-1", "a number >= 0 (0 = no budget)"),
    "NEXUS_TRAINER_RANKS": ("65", "an integer in 1..64"),
    "NEXUS_TRAINER_RANK_TIMEOUT_S": ("0", "a number in (0, 3600]"),
    "NEXUS_INFER_HEAD_BUDGET_MB": ("1GB", "a number >= 0 (0 = no budget)"),
    "NEXUS_INFER_MAX_BATCH_SIZE": ("2048", "an integer in [1, 1024]"),
    "NEXUS_INFER_BATCH_WAIT_TIMEOUT_S": ("11", "a number in [0, 10]"),
    "NEXUS_INFER_PIPELINE_DEPTH": ("0", "an integer in [1, 8]"),
    "NEXUS_INFER_MAX_QUEUE_PER_KEY": ("0", "an integer >= 1"),
    "NEXUS_INFER_MAX_QUEUED": ("many", "an integer >= NEXUS_INFER_MAX_QUEUE_PER_KEY"),
    "NEXUS_INFER_BUSY_RETRY_AFTER_S": ("0", "a number in (0, 60]"),
    "NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S": ("61", "60]"),
    "NEXUS_INFER_REPLY_CACHE_SIZE": ("0", "an integer >= 1"),
    "NEXUS_INFER_REPLY_CACHE_TTL_S": ("0", "a number > 0"),
    "NEXUS_INFER_MAX_JOINED_PER_REQUEST": ("1.0e1", "an integer >= 1"),
    "NEXUS_INFER_MAX_QUEUED_PER_TENANT": ("0", "an integer >= 1"),
    "NEXUS_ENV_MAX_SESSIONS": ("-5", "an integer >= 1"),
    "NEXUS_ENV_MAX_SESSIONS_PER_TENANT": ("0", "an integer >= 1"),
    "NEXUS_ENV_PLUGINS": ("tests/support/crashy_env.py", "is not a module name"),
    "NEXUS_WORKFLOW_MODULES": ("workflows/rl.py", "is not a module name"),
    "NEXUS_USAGE_FLUSH_EVERY_S": ("0", "a number in [0.01, 3600]"),
    "NEXUS_METER_TRAIN_OVERHEAD_ROWS": ("-1", "a number in [0, 1024]"),
    "NEXUS_METER_INFER_OVERHEAD_ROWS": ("lots", "a number in [0, 1024]"),
    "NEXUS_QUOTA_MAX_INFLIGHT_JOBS": ("0", "an integer in [1, 100000]"),
    "NEXUS_QUOTA_MAX_ACTIVE_ROLLOUTS": ("x", "an integer in [1, 100000]"),
    "NEXUS_QUOTA_PREDICT_RATE_PER_S": ("0", "a number > 0"),
    "NEXUS_QUOTA_PREDICT_BURST": ("0", "an integer >= 1"),
    "NEXUS_QUOTA_MAX_PRIORITY": ("11", "an integer in [-10, 10]"),
    "NEXUS_TRACE_SAMPLE_RATIO": ("1.5", "a number in [0, 1]"),
    "NEXUS_SCALE_BOUNDS": ("trainer=4:2", "min 4 is above max 2"),
    "NEXUS_SCALER": ("maybe", "a boolean"),
    "NEXUS_TRACE_SLOW_MS": ("-1", "a number >= 0"),
    "NEXUS_TRACE_FILE_MAX_MB": ("0", "a number > 0"),
    "NEXUS_TRACE_FILE_BACKUPS": ("101", "an integer in [0, 100]"),
    "NEXUS_MONITOR_POINTS": ("1", "an integer in [2, 100000]"),
    "NEXUS_MONITOR_RETAIN_S": ("0", "a number > 0"),
    "NEXUS_MONITOR_SERIES_MAX": ("5", "an integer >= 10"),
    "NEXUS_MONITOR_TENANT_CAP": ("0", "an integer >= 1"),
    "NEXUS_METRICS_PORT": ("70000", "a port, or 0 for a free one"),
    "NEXUS_METRICS_HOST": ("monitor.local", "not an IP address literal"),
    "NEXUS_TENSORBOARD": ("sometimes", "a boolean"),
    "NEXUS_NATS_PORT": ("70000", "an integer in [1, 65535]"),
    "NEXUS_TENANT_STORAGE_MB": ("0", "a number > 0"),
    "NEXUS_TENANT_MAX_CONNS": ("0", "an integer in [1, 100000]"),
    "NEXUS_TENANT_MAX_SUBS": ("many", "an integer in [1, 1e+06]"),
    "NEXUS_TENANT_MAX_PAYLOAD_KB": ("70000", "an integer in [1, 65536]"),
    "NEXUS_ROLE_USER": ("a b", "a user name (may contain `{role}`), or `-`"),
}
# Free text or a path: nothing to refuse (an empty value is unset).
UNREFUSED = {"NEXUS_DATA_DIR", "NEXUS_INFER_BASE", "NEXUS_VULKAN_DIR", "NEXUS_CREDS", "NEXUS_DATA_ROOTS"}


def _fields():
    return [(group, name, info) for group in GROUPS for name, info in group.model_fields.items()]


def _group_of(alias: str):
    return next((g, n) for g, n, info in _fields() if info.alias == alias)


def test_every_variable_has_a_sample_and_one_home():
    aliases = [info.alias for _, _, info in _fields()]
    assert len(aliases) == len(set(aliases)), "a variable in two groups"
    assert set(GOOD) == set(aliases)
    assert set(BAD) | UNREFUSED == set(aliases) and not set(BAD) & UNREFUSED
    for _, _, info in _fields():
        assert info.alias.startswith("NEXUS_") and info.description, info.alias


@pytest.mark.parametrize("alias", sorted(GOOD))
def test_every_variable_parsed(alias, tmp_path):
    raw, want = GOOD[alias]
    raw, want = (str(tmp_path), tmp_path) if raw == "<tmp>" else (raw, want)
    group, name = _group_of(alias)
    assert getattr(group.from_env({alias: raw}), name) == want
    assert getattr(group.from_env({alias: f"  {raw} "}), name) == want  # surrounding blanks dropped
    default = group.model_fields[name].default
    assert getattr(group.from_env({}), name) == default
    assert getattr(group.from_env({alias: ""}), name) == default  # empty = unset
    assert want != default


@pytest.mark.parametrize("alias", sorted(BAD))
def test_bad_value_names_the_variable(alias):
    raw, allowed = BAD[alias]
    group, _ = _group_of(alias)
    with pytest.raises(SettingsError) as err:
        group.from_env({alias: raw})
    (line,) = err.value.lines
    assert line.startswith(f"{alias}={raw!r}: "), line
    assert allowed in line, line
    assert isinstance(err.value, ValueError) and str(err.value) == line


def test_rules_across_variables_name_both():
    with pytest.raises(SettingsError, match=r"^NEXUS_INFER_MAX_QUEUED=8: must be >= NEXUS_INFER_MAX_QUEUE_PER_KEY \(256\)$"):
        S.InferencerSettings.from_env({"NEXUS_INFER_MAX_QUEUED": "8"})
    with pytest.raises(SettingsError, match=r"^NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S=0.1: must be >= NEXUS_INFER_BUSY_RETRY_AFTER_S \(0.5\)$"):
        S.InferencerSettings.from_env({"NEXUS_INFER_BUSY_RETRY_AFTER_S": "0.5", "NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S": "0.1"})
    for role in ("health", "monitor"):
        with pytest.raises(SettingsError, match=r"^NEXUS_HEALTH_TIMEOUT_S=0.5: must be > NEXUS_HEARTBEAT_INTERVAL_S \(1\)"):
            role_settings(role, {"NEXUS_HEALTH_TIMEOUT_S": "0.5", "NEXUS_HEARTBEAT_INTERVAL_S": "1"})


def test_every_problem_at_once_and_only_the_roles_own():
    env = {"NEXUS_MAX_CONCURRENCY": "x", "NEXUS_INFER_PIPELINE_DEPTH": "9", "NEXUS_TRAINER_GROUP_MAX": "0"}
    with pytest.raises(SettingsError) as err:
        role_settings("inferencer", env)
    assert [line.split("=")[0] for line in err.value.lines] == ["NEXUS_MAX_CONCURRENCY", "NEXUS_INFER_PIPELINE_DEPTH"]
    # The trainer's variable is the trainer's problem: an inferencer starts with it.
    assert S.InferencerSettings in role_settings("inferencer", {"NEXUS_TRAINER_GROUP_MAX": "0"})
    with pytest.raises(ValueError, match="role='nobody'"):
        role_settings("nobody", {})


def test_every_group_belongs_to_a_reader():
    from protocol.subjects import ROLES

    for group in GROUPS:
        assert group.readers, group.__name__
        assert set(group.roles) <= set(ROLES), group.__name__
        assert group.roles or group is S.CliSettings, f"{group.__name__}: no role reads it"
    for role in ROLES:
        assert S.RoleSettings in role_settings(role, {})


def test_roles_read_every_variable(tmp_path, monkeypatch):
    """Each role built from an environment holding every variable's sample: each value is where
    the role uses it (nothing here connects; setup() is not run)."""
    from actors.env_worker.env_worker import EnvWorker
    from actors.health.health import HealthManager
    from actors.inferencer.inferencer import Inferencer
    from actors.monitor.monitor import Monitor
    from actors.runtime import RoleConfig
    from actors.trainer.trainer import Trainer
    from envs.maniskill import ICD_FILE, vulkan_icd_candidates
    from master.service import Master

    for alias, (raw, _) in GOOD.items():
        monkeypatch.setenv(alias, str(tmp_path) if raw == "<tmp>" else raw)
    cfg = RoleConfig.from_env(instance="s1")
    reads = {
        "NEXUS_NATS_URL": (cfg.nats_url, GOOD["NEXUS_NATS_URL"][1]),
        "NEXUS_PREFIX": (cfg.prefix, "tsettings"),
        "NEXUS_DATA_DIR": (cfg.data_dir, tmp_path),
        "NEXUS_HEARTBEAT_INTERVAL_S": (cfg.heartbeat_interval_s, 0.7),
        "NEXUS_MAX_CONCURRENCY": (cfg.max_concurrency, 9),
        "NEXUS_MAX_PENDING": (cfg.max_pending, 11),
    }
    for role_cls in (HealthManager, Monitor):
        reads[f"NEXUS_HEALTH_TIMEOUT_S ({role_cls.name})"] = (role_cls(cfg).table.timeout_s, 4.5)
    health = HealthManager(cfg)
    reads["NEXUS_SCALER"] = (health.scaler is not None, True)
    reads["NEXUS_SCALE_BOUNDS (health)"] = (health.scaler.bounds["trainer"].text() if health.scaler else None, "0:4")
    master, trainer = Master(cfg), Trainer(cfg)
    for who, role in (("master", master.st), ("trainer", trainer)):
        reads[f"NEXUS_LEASE_RENEW_EVERY_S ({who})"] = (role.leases.renew_every_s, 0.3)
        reads[f"NEXUS_TRAINER_DRAIN_FINISH_S ({who})"] = (role.leases.drain_finish_s, 7.0)
        reads[f"NEXUS_ORPHAN_TTL_S ({who})"] = (role.leases.orphan_ttl_s, 12.5)
    reads |= {
        "NEXUS_COMPACT_EVERY_S": (master.st.retention.every_s, 0.5),
        "NEXUS_JOB_RETENTION_S": (master.st.retention.job_records_s, 99.0),
        "NEXUS_VERSIONS_KEPT": (master.st.retention.versions_kept, 3),
        "NEXUS_RETENTION_S": (master.st.retention.records_s, 120.0),
        "NEXUS_RETENTION_MAX_WORKLOADS": (master.st.retention.workload_records_max, 50),
        "NEXUS_USAGE_LABELS_MAX": (master.st.retention.usage_labels_max, 9),
        "NEXUS_MAX_ACTIVE_ROLLOUTS": (master.st.max_active_rollouts, 5),
        "NEXUS_MAX_TENANTS": (master.st.max_tenants, 2000),
        "NEXUS_MAX_ACTIVE_WORKLOADS": (master.st.max_active_workloads, 64),
        "NEXUS_HOSTED_WAIT_S": (master.st.hosted_wait_s, 30.0),
        "NEXUS_HOSTED_LEASE_S": (master.st.hosted_lease_s, 5.0),
        "NEXUS_TRAINER_GROUP_MAX": (trainer.tcfg.group_max, 6),
        "NEXUS_TRAINER_LEASE_S": (trainer.tcfg.lease_s, 45.0),
        "NEXUS_TRAINER_COHORT_WAIT_S": (trainer.tcfg.cohort_wait_s, 30.0),
        "NEXUS_TRAINER_DEVICE": (trainer.tcfg.device, "cpu"),
        "NEXUS_TRAINER_FAST": (trainer.tcfg.fast, True),
        "NEXUS_TRAINER_COMPILE": (trainer.tcfg.compile, True),
        "NEXUS_TRAINER_SLOT_BUDGET_MB": (trainer.tcfg.slot_budget_mb, 512.5),
        "NEXUS_TRAINER_RANKS": (trainer.tcfg.ranks, 2),
        "NEXUS_TRAINER_RANK_TIMEOUT_S": (trainer.tcfg.rank_timeout_s, 45.0),
        "NEXUS_TRAINER_FAULT": (trainer.fault, "after_commit"),
        "NEXUS_BASE_IMAGE_SIZE (trainer)": (trainer.tcfg.image_size, 192),
    }
    inf = Inferencer(cfg)
    try:
        reads |= {
            "NEXUS_INFER_BASE": (inf.base_source, "tiny-qwen3-vl-32"),
            "NEXUS_INFER_DEVICE": (inf.device, "cuda:1"),
            "NEXUS_INFER_FAST": (inf.fast, True),
            "NEXUS_INFER_COMPILE": (inf.compile, True),
            "NEXUS_INFER_WARMUP": (inf.warmup, False),
            "NEXUS_INFER_EULER": (inf.euler, "compile+tf32"),
            "NEXUS_BASE_IMAGE_SIZE (inferencer)": (inf.image_size, 192),
            "NEXUS_INFER_MAX_BATCH_SIZE": (inf.icfg.max_batch_size, 17),
            "NEXUS_INFER_BATCH_WAIT_TIMEOUT_S": (inf.icfg.batch_wait_timeout_s, 0.25),
            "NEXUS_INFER_PIPELINE_DEPTH": (inf.pipeline_depth, 3),
            "NEXUS_INFER_HEAD_BUDGET_MB": (inf.head_budget_mb, 64.0),
            "NEXUS_INFER_MAX_QUEUE_PER_KEY": (inf.icfg.max_queue_per_key, 40),
            "NEXUS_INFER_MAX_QUEUED": (inf.icfg.max_queued, 400),
            "NEXUS_INFER_BUSY_RETRY_AFTER_S": (inf.icfg.busy_retry_after_s, 0.1),
            "NEXUS_INFER_BUSY_MAX_RETRY_AFTER_S": (inf.icfg.busy_max_retry_after_s, 3.0),
            "NEXUS_INFER_REPLY_CACHE_SIZE": (inf.icfg.reply_cache_size, 100),
            "NEXUS_INFER_REPLY_CACHE_TTL_S": (inf.icfg.reply_cache_ttl_s, 30.0),
            "NEXUS_INFER_MAX_JOINED_PER_REQUEST": (inf.icfg.max_joined_per_request, 2),
            "NEXUS_INFER_MAX_QUEUED_PER_TENANT": (inf.icfg.max_queued_per_tenant, 30),
        }
        for who, role in (("trainer", trainer), ("inferencer", inf)):
            reads[f"NEXUS_USAGE_FLUSH_EVERY_S ({who})"] = (role.usage_flush.every_s, 0.5)
            reads[f"NEXUS_METER_TRAIN_OVERHEAD_ROWS ({who})"] = (role.usage_flush.train_overhead_rows, 0.5)
            reads[f"NEXUS_METER_INFER_OVERHEAD_ROWS ({who})"] = (role.usage_flush.infer_overhead_rows, 2.0)
        for who, role in (("master", master.st), ("inferencer", inf)):
            q = role.default_quotas
            reads[f"NEXUS_QUOTA_MAX_INFLIGHT_JOBS ({who})"] = (q.max_inflight_jobs, 3)
            reads[f"NEXUS_QUOTA_MAX_ACTIVE_ROLLOUTS ({who})"] = (q.max_active_rollouts, 2)
            reads[f"NEXUS_QUOTA_PREDICT_RATE_PER_S ({who})"] = (q.predict_rate_per_s, 50.0)
            reads[f"NEXUS_QUOTA_PREDICT_BURST ({who})"] = (q.predict_burst, 7)
            reads[f"NEXUS_QUOTA_MAX_PRIORITY ({who})"] = (q.max_priority, 4)
    finally:
        inf._forward_pool.shutdown(wait=False)
    env = EnvWorker(cfg)
    reads |= {
        "NEXUS_ENV_MAX_SESSIONS": (env.max_sessions, 5),
        "NEXUS_SIM_TIMEOUT_S": (env.sim.timeout_s, 7.5),
        "NEXUS_SIM_PROCS_MAX": (env.sim.procs_max, 3),
        "NEXUS_ENV_MAX_SESSIONS_PER_TENANT": (env.max_sessions_per_tenant, 3),
        "NEXUS_ENV_PLUGINS": (env.env_settings.plugins, ("tests.support.crashy_env", "json")),
        "NEXUS_WORKFLOW_MODULES": (env.workflow_settings.modules, ("workflows", "tests.support.crashy_env")),
        "NEXUS_VULKAN_DIR": (vulkan_icd_candidates()[0], Path("/opt/vk") / ICD_FILE),
    }
    from actors.tracing import telemetry_settings

    tel = telemetry_settings()
    mon = Monitor(cfg).mcfg
    reads |= {
        "NEXUS_TRACE_SAMPLE_RATIO": (tel.sample_ratio, 0.5),
        "NEXUS_TRACE_SLOW_MS": (tel.slow_ms, 250.0),
        "NEXUS_TRACE_FILE_MAX_MB": (tel.file_max_mb, 8.0),
        "NEXUS_TRACE_FILE_BACKUPS": (tel.file_backups, 1),
        "NEXUS_MONITOR_POINTS": (mon.points, 120),
        "NEXUS_MONITOR_RETAIN_S": (mon.retain_s, 60.0),
        "NEXUS_MONITOR_SERIES_MAX": (mon.series_max, 100),
        "NEXUS_MONITOR_TENANT_CAP": (mon.tenant_cap, 3),
        "NEXUS_METRICS_PORT": (mon.metrics_port, 0),
        "NEXUS_METRICS_HOST": (mon.metrics_host, "0.0.0.0"),
        "NEXUS_TENSORBOARD": (mon.tensorboard, False),
    }
    from transport.datasets import data_roots

    reads["NEXUS_CREDS"] = (cfg.creds, Path("/tmp/x.creds"))
    from actors.supervisor.children import role_user_name

    reads["NEXUS_ROLE_USER"] = (role_user_name("trainer"), "nexus-trainer")
    from transport.cluster import scale_bounds

    reads["NEXUS_SCALE_BOUNDS"] = (scale_bounds()["trainer"].text(), "0:4")
    reads["NEXUS_DATA_ROOTS"] = (data_roots(tmp_path)[-2:], [Path("/data/a"), Path("/data/b")])
    wrong = {k: got for k, (got, want) in reads.items() if got != want}
    assert not wrong
    cli = {"NEXUS_NATS_PORT", "NEXUS_TENANT_STORAGE_MB", "NEXUS_TENANT_MAX_CONNS", "NEXUS_TENANT_MAX_SUBS",
           "NEXUS_TENANT_MAX_PAYLOAD_KB"}
    read = {k.split(" ")[0] for k in reads} | cli  # the CLI's: test_cli_envvars_agree
    assert read == set(GOOD)


def test_cli_envvars_agree():
    """`nexus` reads its variables through typer (``envvar=``): the same names and flags."""
    text = "".join(p.read_text() for p in sorted((ROOT / "sdk").glob("cli*.py")))
    declared = dict((v, f) for f, v in re.findall(r'"(--[a-z-]+)", envvar="(NEXUS_[A-Z_]+)"', text))
    want = {info.alias: (info.json_schema_extra or {})["flag"] for _, _, info in _fields()
            if (info.json_schema_extra or {}).get("cli")}
    assert declared == want


def _code_files():
    for d in CODE_DIRS:
        yield from sorted((ROOT / d).rglob("*.py")) if (ROOT / d).is_dir() else ()


def test_no_nexus_variable_read_elsewhere():
    # os.environ / getenv / any mapping's .get, a subscript that is not an assignment (a child's
    # environment is written, not read), a membership test, typer's envvar=.
    read = re.compile(r"""(environ\s*\[|getenv\s*\(|\.get\s*\(|envvar\s*=)\s*f?["']NEXUS_"""
                      r"""|\[\s*["']NEXUS_[A-Z0-9_]+["']\s*\](?!\s*=[^=])|["']NEXUS_[A-Z0-9_]+["']\s+(not\s+)?in\b""")
    offenders = []
    for path in _code_files():
        if path == ROOT / "protocol/settings.py":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for m in read.finditer(text)
                      if not path.match("sdk/cli*.py") or "envvar" not in m.group(0)]
    assert not offenders


def test_every_nexus_name_in_the_code_is_known():
    """A NEXUS_* name spelled in code, compose or scripts is a setting or listed as read elsewhere."""
    known = {info.alias for _, _, info in _fields()}
    known |= {n for name, _, _ in S.STANDARD_VARIABLES for n in name.split(" / ")}
    files = list(_code_files()) + sorted((ROOT / "deploy").rglob("*.sh")) + sorted((ROOT / "deploy").rglob("*.yml"))
    files += [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_settings.py"]  # its typos are on purpose
    unknown = {}
    for path in files:
        for name in re.findall(r"\bNEXUS_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            if name not in known:
                unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert not unknown


def test_makefile_exports_are_documented():
    exported = set(re.findall(r"^export ([A-Z_]+)", (ROOT / "Makefile").read_text(), flags=re.M))
    documented = {n for name, _, _ in S.STANDARD_VARIABLES for n in name.split(" / ")}
    assert exported and exported <= documented


def test_readme_table_is_generated():
    # Regenerate with `python -m protocol.settings` when this fails.
    text = (ROOT / S.ENV_DOC).read_text()
    assert S.render_env_doc(text) == text
    for _, _, info in _fields():
        assert f"| `{info.alias}` |" in text


def _env_of_child(**env: str) -> dict[str, str]:
    from tests.conftest import python_env

    # Only the variables the test names: stderr is then exactly the lines asserted.
    return {k: v for k, v in python_env().items() if not k.startswith("NEXUS_")} | env


def _run_role(role: str, **env: str) -> subprocess.CompletedProcess:
    # Port 1: nothing listens there; a role that got past its settings would fail to connect.
    return subprocess.run([sys.executable, "-m", "actors.run", role, "--nats-url", "nats://127.0.0.1:1"],
                          env=_env_of_child(**env), cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_role_process_with_a_bad_value_exits_with_one_line():
    proc = _run_role("trainer", NEXUS_LEASE_RENEW_EVERY_S="abc")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: NEXUS_LEASE_RENEW_EVERY_S='abc': must be a number >= 0.01 -- "
        "a trainer renews its jobs' leases at most this often (s)"]
    assert proc.stdout == ""


def test_unknown_variables_are_named_with_the_nearest():
    env = {"NEXUS_INFER_MAX_BATCH": "4", "NEXUS_PREFIX": "x", "NEXUS_REQUIRE_MANISKILL": "1", "NEXUS_QQQQQQQQQQQQ": "",
           "HOME": "/root"}
    assert S.unknown_variables(env) == [
        "NEXUS_INFER_MAX_BATCH is set but nothing reads it (did you mean NEXUS_INFER_MAX_BATCH_SIZE?)",
        "NEXUS_QQQQQQQQQQQQ is set but nothing reads it"]
    assert S.unknown_variables({alias: "1" for alias in GOOD}) == []


def test_role_process_lists_every_bad_value():
    proc = _run_role("inferencer", NEXUS_INFER_MAX_BATCH_SIZE="-1", NEXUS_MAX_CONCURRENCY="lots",
                     NEXUS_INFER_FAST="fast")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "error: NEXUS_MAX_CONCURRENCY", "error: NEXUS_INFER_FAST", "error: NEXUS_INFER_MAX_BATCH_SIZE"]
    assert "'lots': must be an integer in [1, 65536]" in lines[0]


def test_supervisor_checks_every_role_once():
    env = {"NEXUS_MAX_CONCURRENCY": "0", "NEXUS_INFER_FAST": "maybe", "NEXUS_PREFIX": "a.b"}
    with pytest.raises(SettingsError) as err:
        S.check_supervised_roles(("health", "trainer", "inferencer"), env)
    # Read by all three, reported once; the prefix is the supervisor's flag, never the roles'.
    assert [line.split("=")[0] for line in err.value.lines] == ["NEXUS_MAX_CONCURRENCY", "NEXUS_INFER_FAST"]
    S.check_supervised_roles(("health", "trainer"), {"NEXUS_INFER_FAST": "maybe"})


def test_nexus_up_with_a_bad_value_starts_nothing(tmp_path):
    from transport.broker import free_port
    from tests.conftest import nexus_cmd

    proc = subprocess.run(nexus_cmd("up", "--data-dir", str(tmp_path), "--nats-port", str(free_port())),
                          env=_env_of_child(NEXUS_ORPHAN_TTL_S="-1", NEXUS_ORPHAN_TTL="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "warning: NEXUS_ORPHAN_TTL is set but nothing reads it (did you mean NEXUS_ORPHAN_TTL_S?)",
        "error: NEXUS_ORPHAN_TTL_S='-1': must be a number >= 0.1 -- "
        "a job idle this long while reserved or filling is failed and purged (s)"]
    assert not (tmp_path / "cluster.json").exists() and not (tmp_path / "logs").exists()


def test_regenerating_rewrites_only_the_table(tmp_path):
    text = (ROOT / S.ENV_DOC).read_text()
    stale = text.replace("| `NEXUS_PREFIX` |", "| `NEXUS_PREFIX_OLD` |")
    (tmp_path / S.ENV_DOC).write_text(stale)
    assert S.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / S.ENV_DOC).read_text() == text
    with pytest.raises(ValueError, match="markers"):
        S.render_env_doc("no table here")
