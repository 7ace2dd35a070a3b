"""The tenant mix of `bench.multitenant`: the tenant kinds (each one workload spec: RL / SFT on
reach, SFT on PickCube from demos, ...), their sizes, and parsing `--mix` / `--scaling` / `--base`
into `TenantPlan`s. Pure: no deployment, no NATS."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.chaos_config import load_example

MAX_TENANTS = 64  # a deployment's tenants in one run (the scaling curve goes to 16)
MAX_BUDGET = 100_000


# -- tenants -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Per-tenant work knobs that are not the budget (same in the shared and the alone runs)."""

    sft_demos: int = 40
    sft_batch: int = 32
    sft_items_per_job: int = 8
    sft_eval_episodes: int = 10
    rl_steps_per_update: int = 128
    rl_parallel_envs: int = 4
    rl_micro_batch: int = 32
    rl_epochs: int = 1
    pick_eval_episodes: int = 30  # sft-pick's closing eval on held-out PickCube seeds (30: as docs/results.md)
    pick_batch: int = 64  # rows per step: what took PickCube SFT to 100 % held-out (docs/results.md)
    pick_items_per_job: int = 16


def _rl(kind: str, env_id: str, options: dict[str, Any], cameras: list[dict[str, Any]] | None = None,
        state_dim: int | None = None, action_dim: int | None = None) -> Callable[..., dict[str, Any]]:
    def build(tenant: str, budget: int, base: str, seed: int, sz: Sizes) -> dict[str, Any]:
        rl = load_example("rl_reach.yaml")
        rl.update(tenant=tenant, base=base, seed=seed)
        rl["env"] = {"id": env_id, "options": dict(options)}
        if cameras is not None:
            rl["observation"]["cameras"] = cameras
        if state_dim is not None:
            rl["observation"]["state_dim"] = state_dim
        if action_dim is not None:
            rl["action"]["dim"] = action_dim
        rl["algorithm"].update(steps_per_update=sz.rl_steps_per_update, parallel_envs=sz.rl_parallel_envs,
                               micro_batch=sz.rl_micro_batch, epochs=sz.rl_epochs)
        # A fixed amount of env work: episodes (checked by the workflow between updates, so
        # the same in both runs whatever the trainer's pace), never wall time.
        rl["schedule"]["budget"] = {"max_episodes": budget}
        rl.pop("eval", None)  # the result is the success rate of its own last training episodes
        rl.pop("outputs", None)
        return rl
    build.kind = kind  # type: ignore[attr-defined]
    build.task = "rl"  # type: ignore[attr-defined]
    build.env_id = env_id  # type: ignore[attr-defined]
    return build


def _sft(tenant: str, budget: int, base: str, seed: int, sz: Sizes) -> dict[str, Any]:
    sft = load_example("sft_reach.yaml")
    sft.update(tenant=tenant, base=base, seed=seed)
    sft["env"]["demos"]["episodes"] = sz.sft_demos
    sft["algorithm"].update(steps=budget, items_per_job=min(sz.sft_items_per_job, budget),
                            batch_size=sz.sft_batch, warmup_steps=min(50, budget // 6))
    sft["schedule"]["budget"] = {}
    sft["eval"] = {"version": "latest", "episodes": sz.sft_eval_episodes, "seed": 10000}
    sft.pop("outputs", None)
    return sft


_sft.kind, _sft.task, _sft.env_id = "sft-reach", "sft", "builtin/reach-v0"  # type: ignore[attr-defined]

# sft-pick: SFT on ManiSkill3 PickCube-v1 from the scripted expert's demos (a LeRobot dataset,
# recorded once per invocation or given with --pick-dataset, published into every deployment that
# holds the tenant), then a read-only eval workload of its final export on held-out seeds: a
# dataset SFT cannot carry a closing eval (a spec has a dataset or an env, not both), so the
# runner submits the eval once the SFT completed; the tenant's result is that eval's success.
PICK_SFT, PICK_EVAL = "sft_maniskill_pickcube.yaml", "eval_maniskill_pickcube.yaml"
PICK_DATASET_NAME = "pickcube-demos"  # its name under <data dir>/datasets/published/
PICK_DEMO_SEED, PICK_DEMO_NOISE = 0, 0.1  # as docs/results.md's PickCube runs (DART noise 0.1)
PICK_EVAL_SEED = 100_000  # held-out: demo attempt i resets with PICK_DEMO_SEED + i, far below this
PICK_DEMOS = 150


def pick_published(data_dir: Path) -> Path:
    return data_dir / "datasets" / "published" / PICK_DATASET_NAME


def sft_pick(tenant: str, budget: int, base: str, seed: int, sz: Sizes, data_dir: Path | None = None) -> dict[str, Any]:
    sft = load_example(PICK_SFT)
    sft.update(tenant=tenant, base=base, seed=seed)
    if data_dir is not None:  # None: a spec to check (the example's placeholder root)
        sft["dataset"]["root"] = str(pick_published(data_dir))
    sft["algorithm"].update(steps=budget, batch_size=sz.pick_batch, items_per_job=min(sz.pick_items_per_job, budget),
                            warmup_steps=min(sft["algorithm"]["warmup_steps"], budget // 10))
    sft["schedule"]["budget"] = {}  # the steps are the budget (never wall time)
    sft["outputs"] = {"export_every_steps": min(sft["outputs"]["export_every_steps"], budget)}  # the last job exports
    return sft


def _pick_eval(tenant: str, sz: Sizes) -> dict[str, Any]:
    ev = load_example(PICK_EVAL)
    ev["tenant"] = tenant
    ev["eval"].update(version="latest", episodes=sz.pick_eval_episodes, seed=PICK_EVAL_SEED)
    return ev


def pick_env() -> tuple[str, dict[str, Any]]:
    """The env id and options the eval (and so the demos) use."""
    ev = load_example(PICK_EVAL)
    return ev["env"]["id"], dict(ev["env"]["options"])


sft_pick.kind, sft_pick.task, sft_pick.env_id = "sft-pick", "sft", "maniskill/PickCube-v1"  # type: ignore[attr-defined]
sft_pick.dataset = PICK_DATASET_NAME  # type: ignore[attr-defined]
sft_pick.followup = _pick_eval  # type: ignore[attr-defined]
_CAM64 = {"height": 64, "width": 64}
TENANT_KINDS: dict[str, Callable[..., dict[str, Any]]] = {
    "rl-reach": _rl("rl-reach", "builtin/reach-v0", {"cameras": ["top", "wrist"], "image_size": 64, "reward": "dense"}),
    # Task variants of the built-in reach: larger steps and a wider success radius; the top
    # camera alone (another observation schema in the same trainer group).
    "rl-reach-easy": _rl("rl-reach-easy", "builtin/reach-v0",
                         {"cameras": ["top", "wrist"], "image_size": 64, "reward": "dense",
                          "max_step": 0.15, "success_radius": 0.2}),
    "rl-reach-top": _rl("rl-reach-top", "builtin/reach-v0", {"cameras": ["top"], "image_size": 64, "reward": "dense"},
                        cameras=[{"name": "top", **_CAM64}]),
    # ManiSkill3 PushCube through the adapter (SAPIEN on CPU, rendered by lavapipe or the GPU):
    # one 64x64 camera, 25-d state, 8-d joint-delta action (no IK: ~2x faster on CPU).
    "rl-push": _rl("rl-push", "maniskill/PushCube-v1",
                   {"obs_mode": "rgb", "image_size": 64, "control_mode": "pd_joint_delta_pos"},
                   cameras=[{"name": "base_camera", **_CAM64}], state_dim=25, action_dim=8),
    "sft-reach": _sft,
    "sft-pick": sft_pick,
}
DEFAULT_MIX = "rl-reach:8,rl-reach-easy:8,rl-push:4,sft-reach:32"
DEFAULT_BUDGET = {"rl": 16, "sft": 48}  # sft-pick learns at ~3,000 (docs/results.md)
MANISKILL_STANDIN = "rl-reach-top"
DEFAULT_SCALING_KINDS = "rl-reach:8,sft-reach:24"


@dataclass(frozen=True)
class TenantPlan:
    name: str
    kind: str
    budget: int

    @property
    def task(self) -> str:
        return TENANT_KINDS[self.kind].task  # type: ignore[attr-defined]

    @property
    def dataset(self) -> str | None:
        """The published dataset this tenant trains from (None: none)."""
        return getattr(TENANT_KINDS[self.kind], "dataset", None)

    def spec(self, base: str, seed: int, sizes: Sizes, data_dir: Path | None = None) -> dict[str, Any]:
        build = TENANT_KINDS[self.kind]
        extra = {"data_dir": data_dir} if self.dataset else {}
        return build(self.name, self.budget, base, seed, sizes, **extra)

    def followup(self, sizes: Sizes) -> dict[str, Any] | None:
        """The workload submitted once this tenant's first completed (its closing eval), if any."""
        build = getattr(TENANT_KINDS[self.kind], "followup", None)
        return None if build is None else build(self.name, sizes)


class BadArgument(ValueError):
    """A bad command-line value; the message names the argument."""


def maniskill_problem() -> str | None:
    """Why ManiSkill cannot run here (None: it can): the package, then a Vulkan device."""
    import importlib.util

    if importlib.util.find_spec("mani_skill") is None:
        return "the mani-skill package is not installed"
    from envs.maniskill import vulkan_icd_candidates

    if not vulkan_icd_candidates():
        return "no Vulkan driver found (deploy/setup/vulkan.sh installs lavapipe)"
    return None


def parse_mix(text: str, maniskill: str = "auto", problem: Callable[[], str | None] | None = None
              ) -> tuple[list[TenantPlan], list[str]]:
    """``KIND[:BUDGET],...`` -> tenant plans (names unique: ``mt-<i>-<kind>``) and notes.
    ``problem``: why ManiSkill cannot run (default `maniskill_problem`, looked up at call time)."""
    problem = problem or maniskill_problem
    if maniskill not in ("auto", "on", "off"):
        raise BadArgument(f"--maniskill: {maniskill!r}; allowed: auto, on, off")
    entries = [e.strip() for e in (text or "").split(",")]
    if not text or not text.strip() or any(not e for e in entries):
        raise BadArgument(f"--mix: {text!r}: need comma-separated KIND[:BUDGET] entries, none empty; "
                          f"kinds: {', '.join(TENANT_KINDS)}")
    if len(entries) > MAX_TENANTS:
        raise BadArgument(f"--mix: {len(entries)} tenants; at most {MAX_TENANTS}")
    plans, notes = [], []
    why_not = None
    for i, entry in enumerate(entries):
        kind, sep, budget_text = entry.partition(":")
        kind = kind.strip()
        if kind not in TENANT_KINDS:
            raise BadArgument(f"--mix entry {i + 1} {entry!r}: unknown kind {kind!r}; kinds: {', '.join(TENANT_KINDS)}")
        task = TENANT_KINDS[kind].task  # type: ignore[attr-defined]
        if sep:
            try:
                budget = int(budget_text)
            except ValueError:
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: budget {budget_text!r} is not an integer "
                                  f"({'episodes' if task == 'rl' else 'optimizer steps'})") from None
        else:
            budget = DEFAULT_BUDGET[task]
        if not 1 <= budget <= MAX_BUDGET:
            raise BadArgument(f"--mix entry {i + 1} {entry!r}: budget {budget} is outside 1..{MAX_BUDGET} "
                              f"({'episodes' if task == 'rl' else 'optimizer steps'})")
        if kind == "sft-pick":
            # No stand-in: the SFT trains on PickCube demos and is scored in PickCube.
            if maniskill == "off":
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: sft-pick needs ManiSkill (--maniskill off)")
            why_not = why_not if why_not is not None else (problem() or "")
            if why_not:
                raise BadArgument(f"--mix entry {i + 1} {entry!r}: sft-pick needs ManiSkill, which cannot run "
                                  f"here: {why_not}")
        if kind == "rl-push":
            if maniskill == "off":
                kind = MANISKILL_STANDIN
                notes.append(f"tenant {i + 1}: rl-push replaced by {kind} (--maniskill off)")
            else:
                why_not = why_not if why_not is not None else (problem() or "")
                if why_not:
                    if maniskill == "on":
                        raise BadArgument(f"--mix entry {i + 1} {entry!r}: ManiSkill cannot run here: {why_not} "
                                          "(--maniskill auto replaces it with " + MANISKILL_STANDIN + ")")
                    kind = MANISKILL_STANDIN
                    notes.append(f"tenant {i + 1}: rl-push replaced by {kind}: ManiSkill cannot run here ({why_not})")
        plans.append(TenantPlan(name=f"mt-{i + 1}-{kind}", kind=kind, budget=budget))
    return plans, notes


def parse_scaling(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise BadArgument(f"--scaling: {text!r}: need comma-separated tenant counts, e.g. 1,2,4,8,16") from None
    if not counts or any(not 1 <= n <= MAX_TENANTS for n in counts):
        raise BadArgument(f"--scaling: {text!r}: every count must be in 1..{MAX_TENANTS}")
    if counts != sorted(set(counts)):
        raise BadArgument(f"--scaling: {text!r}: counts must be increasing, without repeats")
    return counts


def scaled_mix(kinds: list[TenantPlan], n: int) -> list[TenantPlan]:
    """``n`` tenants cycling through ``kinds`` (their budgets), named uniquely."""
    return [TenantPlan(name=f"mt-{i + 1}-{kinds[i % len(kinds)].kind}", kind=kinds[i % len(kinds)].kind,
                       budget=kinds[i % len(kinds)].budget) for i in range(n)]


def check_base(base: str) -> None:
    from models.presets import PRESETS

    if base not in PRESETS and not Path(base).is_dir():
        raise BadArgument(f"--base: {base!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory")
