"""What a chaos run (bench/chaos.py) is given and what it records: the budgets, the four workload
specs sized by one (from examples/*.yaml), `ChaosConfig`, and the `Kill` / `NatsKill` records."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_deploy import ROOT

EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "bench" / "results"


# -- workloads --------------------------------------------------------------------------------
# Per budget: what to change in the example specs. Small: the short test (about a minute of
# chaos on 2 cores); full: the benchmark (8-10 minutes, at least 20 kills).
BUDGETS: dict[str, dict[str, Any]] = {
    # Tiny: the default suite's run (tests/system/test_chaos.py; a few kills and one NATS node of
    # three, a few minutes at most on 2 cores). The workloads still outlast the chaos: the SFT
    # tenant records its demos and trains 6 jobs, then the eval starts.
    "tiny": {
        "sft": {"demos": 10, "steps": 24, "items_per_job": 4, "batch_size": 8},
        "rl": {"steps_per_update": 32, "parallel_envs": 2, "micro_batch": 16, "epochs": 1, "max_steps": 64},
        "eval_episodes": 4,
        "kills": 3,
        "timeout_s": 300.0,
    },
    "small": {
        "sft": {"demos": 20, "steps": 48, "items_per_job": 4, "batch_size": 16},
        "rl": {"steps_per_update": 64, "parallel_envs": 4, "micro_batch": 32, "epochs": 1, "max_steps": 64},
        "eval_episodes": 10,
        "kills": 7,
        "timeout_s": 420.0,
    },
    "full": {
        # Sized on this 2-core machine under other load: 22 kills 15-30 s apart take ~8.5 min.
        # RL 840 / SFT 320 took 17 min with 22 kills; RL 480 / SFT 240 ended after 7 min and
        # only 17 drains: so in between.
        "sft": {"demos": 100, "steps": 280, "items_per_job": 8, "batch_size": 32},
        "rl": {"steps_per_update": 128, "parallel_envs": 8, "micro_batch": 32, "epochs": 2, "max_steps": 640},
        "eval_episodes": 30,
        "kills": 22,
        "timeout_s": 2400.0,
    },
}


def load_example(name: str) -> dict[str, Any]:
    from master.spec import load_document  # the master's loader: YAML 1.2 floats (1e-3 is a number)

    return load_document((EXAMPLES / name).read_text())


def workload_specs(budget: str, tag: str) -> list[dict[str, Any]]:
    """SFT, two RL, and an eval of the SFT tenant, from examples/*.yaml, sized by ``budget``.
    ``tag`` keeps tenant names unique per run (a tenant name is unique per deployment)."""
    b = BUDGETS[budget]
    sft = load_example("sft_reach.yaml")
    sft["tenant"] = f"chaos-sft-{tag}"
    sft["env"]["demos"]["episodes"] = b["sft"]["demos"]
    sft["algorithm"].update(steps=b["sft"]["steps"], items_per_job=b["sft"]["items_per_job"],
                            batch_size=b["sft"]["batch_size"], warmup_steps=min(50, b["sft"]["steps"] // 6))
    sft.pop("eval", None)  # the eval tenant scores it; no closing eval inside the workload
    sft.pop("outputs", None)
    rls = []
    for i, letter in enumerate("ab"):
        rl = load_example("rl_reach.yaml")
        rl["tenant"], rl["seed"] = f"chaos-rl{letter}-{tag}", 1 + i
        rl["algorithm"].update({k: v for k, v in b["rl"].items() if k != "max_steps"})
        rl["schedule"]["budget"] = {"max_steps": b["rl"]["max_steps"]}
        rl.pop("eval", None)
        rls.append(rl)
    ev = load_example("eval_reach.yaml")
    ev["tenant"] = f"chaos-eval-{tag}"
    ev["eval"].update(version=f"tenant:{sft['tenant']}@latest", episodes=b["eval_episodes"])
    ev.pop("outputs", None)  # its report_path is relative to the master's cwd
    return [sft, *rls, ev]


# -- records ----------------------------------------------------------------------------------
@dataclass
class Kill:
    n: int
    role: str
    instance: str
    pid: int
    mode: str  # kill | drain-request | drain-sigterm
    at: float  # unix s
    replaced_by: str = ""
    registered_s: float | None = None  # kill -> replacement's ServiceRecord says ready
    monitor_alive_s: float | None = None  # kill -> the monitor lists the replacement alive
    replaced: bool = False
    note: str = ""
    progress: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> {version, episodes} gained


@dataclass
class NatsKill:
    done: bool = False
    skipped: str = ""
    pid: int = 0
    at: float = 0.0
    restarted_pid: int = 0
    back_s: float | None = None  # kill -> restarted node answers on its client port
    note: str = ""


@dataclass
class ChaosConfig:
    mode: str = "kill"
    budget: str = "small"
    interval_s: tuple[float, float] = (15.0, 30.0)
    kills: int = -1  # -1: the budget's default; 0: no chaos (a baseline run)
    nats_cluster: int = 1
    seed: int = 0
    data_dir: Path | None = None
    keep_data: bool = False
    out: Path | None = None
    timeout_s: float = 0.0  # 0: the budget's default
    allowed_failure: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("kill", "drain"):
            raise ValueError(f"mode: {self.mode!r}; allowed: kill, drain")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget: {self.budget!r}; allowed: {sorted(BUDGETS)}")
        lo, hi = self.interval_s
        if not 0 < lo <= hi:
            raise ValueError(f"interval_s: need 0 < lo <= hi, got {lo},{hi}")
        if self.nats_cluster not in (1, 3):
            raise ValueError(f"nats_cluster: {self.nats_cluster}; allowed: 1 (single server), 3")
        self.kills = BUDGETS[self.budget]["kills"] if self.kills < 0 else self.kills
        self.timeout_s = self.timeout_s or BUDGETS[self.budget]["timeout_s"]
        self.out = self.out or RESULTS / f"chaos-{self.mode}.json"
