"""`EnvWorkerConfig`: what the env worker is built from, the NEXUS_ENV_* and NEXUS_WORKFLOW_*
groups of `protocol.settings` (names, defaults and reasons there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.settings import EnvWorkerSettings, WorkflowSettings


@dataclass(frozen=True)
class EnvWorkerConfig:
    # Session bounds and the simulator plugin modules.
    env: EnvWorkerSettings = field(default_factory=EnvWorkerSettings)
    # The modules whose workflows (recipes) this worker runs.
    workflow: WorkflowSettings = field(default_factory=WorkflowSettings)

    @classmethod
    def from_env(cls) -> EnvWorkerConfig:
        return cls(env=EnvWorkerSettings.from_env(), workflow=WorkflowSettings.from_env())
