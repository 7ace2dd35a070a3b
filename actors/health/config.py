"""`HealthConfig`: what the health manager is built from: NEXUS_HEALTH_TIMEOUT_S, NEXUS_SCALER
and NEXUS_SCALE_BOUNDS (`protocol.settings`: defaults and reasons there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.settings import HealthSettings, ScaleSettings


@dataclass(frozen=True)
class HealthConfig:
    # When a silent instance counts as down (`timeout_s` of the heartbeat interval).
    health: HealthSettings = field(default_factory=HealthSettings)
    # Whether the scaler runs, and the bounds and policy it scales within.
    scale: ScaleSettings = field(default_factory=ScaleSettings)

    @classmethod
    def from_env(cls) -> HealthConfig:
        return cls(health=HealthSettings.from_env(), scale=ScaleSettings.from_env())
