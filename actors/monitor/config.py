"""`MonitorConfig`: what the monitor is built from, NEXUS_HEALTH_TIMEOUT_S and the
NEXUS_MONITOR_* / NEXUS_METRICS_* / NEXUS_TENSORBOARD variables (`protocol.settings`: defaults and
reasons there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.settings import HealthSettings, MonitorSettings


@dataclass(frozen=True)
class MonitorConfig:
    # When a silent instance counts as down: the same timeout the health manager uses.
    health: HealthSettings = field(default_factory=HealthSettings)
    # The retained series' bounds and the Prometheus endpoint.
    monitor: MonitorSettings = field(default_factory=MonitorSettings)

    @classmethod
    def from_env(cls) -> MonitorConfig:
        return cls(health=HealthSettings.from_env(), monitor=MonitorSettings.from_env())
