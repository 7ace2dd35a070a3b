"""Each recipe's algorithm config: one pydantic model per workload kind, every knob with one
default and its reason. The workload spec composes them (its ``algorithm`` section is the
task's model, `master.spec`), the master sends the validated section as `WorkflowSpec.algo`,
and the workflow validates that once into the same model (`workflows.common.Workflow.config`)
and reads typed fields: no second default anywhere.

    from protocol.recipe_configs import RLConfig
    cfg = RLConfig.model_validate({"gamma": 0.9})   # strict: "0.9" is no number, unknown keys refused
    cfg.episodes_per_update                          # 16: neither episodes nor steps set

They sit here, below master/ and workflows/, because both read them (the spec at submit, the
workflow at start) and the floors only point down (docs/architecture.md). Also here: the strict
scalar types and the `rule` / `raise_rules` helpers the spec's own sections use.

A recipe of your own (docs/workload_spec.md "Adding a recipe") defines its model beside its
workflow, subclassing `RecipeConfig`, and passes it to `protocol.recipes.register`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator
from pydantic import Strict as _Strict
from pydantic_core import InitErrorDetails, PydanticCustomError

from protocol.messages import MAX_KL_COEF, MAX_STEP_ROWS

# Strict scalars: "64" is not an integer, true is not 1; floats are finite.
Int = StrictInt
Float = Annotated[float, _Strict(), Field(allow_inf_nan=False)]
Str = StrictStr
Bool = StrictBool


def doc(text: str, default: Any = ..., **kw: Any) -> Any:
    """A field with its description (the generated docs print it) and default."""
    return Field(default, description=text, **kw)


class RecipeConfig(BaseModel):
    """Base of a spec section and of a recipe's config: unknown keys refused, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)


def rule(loc: tuple[str | int, ...], message: str, value: Any = None) -> InitErrorDetails:
    """A cross-field rule as an ordinary line error at ``loc`` (pydantic prefixes its path)."""
    # "{message}" template: the text is substituted, never parsed (it may contain braces).
    return InitErrorDetails(type=PydanticCustomError("spec_rule", "{message}", {"message": message}),
                            loc=loc, input=value)


def raise_rules(title: str, rules: list[InitErrorDetails]) -> None:
    if rules:
        raise ValidationError.from_exception_data(title, rules)


# ---- the built-in recipes' configs ------------------------------------------------------
class SFTConfig(RecipeConfig):
    """Supervised fine-tuning of the action module (task sft)."""

    lr: Float = doc("peak AdamW learning rate. Default 1e-4: the model core's default, stable for "
                    "small heads on a frozen base", 1e-4, gt=0, le=1)
    batch_size: Int = doc("samples per micro-batch (one optimizer step each). Default 32: fits one "
                          "queue message for 2 cameras at 64x64", 32, ge=1, le=MAX_STEP_ROWS)
    DEFAULT_STEPS: ClassVar[int] = 1000  # a few minutes for the tiny bases on CPU

    steps: Int | None = doc("optimizer steps this workload trains, counted from the tenant's version "
                            "when it is accepted (a tenant at version 384 given steps 128 ends at 512); "
                            "also the length of the cosine LR decay. Set either steps or until_version. "
                            "Default null: 1000 steps (a few minutes for the tiny bases on CPU) unless "
                            "until_version is set", None, ge=1)
    until_version: Int | None = doc("train until the tenant's policy version reaches this (a total, not "
                                    "a count: the workload trains until_version minus the version it is "
                                    "accepted at); one already reached is refused at submit. Default null: "
                                    "train `steps` more", None, ge=1)
    items_per_job: Int = doc("micro-batches per training-queue job; at most "
                             "schedule.sft_prefetch_items. The trainer commits once per job (and "
                             "exports per outputs.export_every_steps), so more items per job mean "
                             "less overhead per step. Default 1: a commit after every step",
                             1, ge=1, le=256)
    weight_decay: Float = doc("AdamW weight decay. Default 0.01: the model core's default", 0.01, ge=0)
    grad_clip: Float | None = doc("global gradient-norm clip (null: none). Default 1.0: guards the "
                                  "first steps of a fresh head", 1.0, gt=0)
    warmup_steps: Int = doc("linear LR warmup steps (at most steps). Default 0: heads start small "
                            "and AdamW's bias correction already damps early steps", 0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_steps(cls, data: Any) -> Any:
        # Neither set: the default step count. Normalised here so a stored spec says what ran.
        if isinstance(data, dict) and data.get("steps") is None and data.get("until_version") is None:
            data = {**data, "steps": cls.DEFAULT_STEPS}
        return data

    @model_validator(mode="after")
    def _checks(self) -> SFTConfig:
        if self.steps is not None and self.until_version is not None:
            raise_rules("SFTConfig", [rule(("until_version",), "set either steps (how many more) or "
                                           "until_version (the version to reach), not both", self.until_version)])
        if self.steps is not None and self.warmup_steps > self.steps:
            raise_rules("SFTConfig", [rule(("warmup_steps",), f"{self.warmup_steps} exceeds "
                                           f"steps={self.steps}; allowed: <= steps", self.warmup_steps)])
        return self


class RLConfig(RecipeConfig):
    """Asynchronous PPO (task rl): workflows roll out, compute GAE, and queue micro-batches."""

    DEFAULT_EPISODES_PER_UPDATE: ClassVar[int] = 16  # enough episodes for advantages, small jobs

    lr: Float = doc("AdamW learning rate (constant after warmup). Default 3e-4: the usual PPO Adam "
                    "rate", 3e-4, gt=0, le=1)
    gamma: Float = doc("discount (0: only the immediate reward counts). Default 0.99: episodes of "
                       "tens of steps", 0.99, ge=0, le=1)
    gae_lambda: Float = doc("GAE lambda (0: one-step TD advantages). Default 0.95: the PPO paper's "
                            "value", 0.95, ge=0, le=1)
    clip_ratio: Float = doc("PPO surrogate clip. Default 0.2: the PPO paper's value", 0.2, gt=0, le=1)
    value_coef: Float = doc("value-loss weight. Default 0.5: the gaussian head's default", 0.5, ge=0)
    entropy_coef: Float = doc("entropy bonus. Default 0: the learnt log-std explores enough on "
                              "continuous control", 0.0, ge=0)
    advantage: Literal["gae", "group_success"] = doc(
        "how an update's steps are scored for the policy term. gae: generalised advantage estimation "
        "from the value head (PPO's usual). group_success: outcome advantages as GRPO-style VLA RL "
        "(SimpleVLA-RL) computes them: group_size episodes share each reset seed, and every step of an "
        "episode gets (its success - the group's mean success) / (the group's std + 1e-6); a group that "
        "all succeeded or all failed teaches nothing and scores 0. No critic in the policy's signal: for "
        "a tenant starting from an SFT version, whose untrained value head's GAE is noise (docs/results.md). "
        "The value head still learns the GAE returns. Default gae", "gae")
    group_size: Int = doc("episodes per reset seed under advantage group_success (at least 2; "
                          "episodes_per_update a multiple of it). Default 1: no groups (gae)", 1, ge=1, le=64)
    normalize_advantages: Bool = doc("standardise advantages over each rollout (zero mean, unit std) "
                                     "before queueing (advantage gae; group_success's are standardised per "
                                     "group already). Default true: the usual PPO practice; rewards "
                                     "of any scale then give steps of one size", True)
    epochs: Int = doc("passes over each rollout. Default 1: async RL trains each queued job once; more "
                      "passes reuse data beyond what staleness allows", 1, ge=1, le=64)
    episodes_per_update: Int | None = doc("episodes rolled out per update (one job). Default null: 16 "
                                          "episodes, unless steps_per_update is set (set at most one)",
                                          None, ge=1)
    steps_per_update: Int | None = doc("env steps rolled out per update instead of whole episodes. "
                                       "Default null: count episodes", None, ge=1)
    parallel_envs: Int = doc("episodes rolled out at once, each in its own env session; their "
                             "predict requests share the inferencer's group forwards. Default 1: one "
                             "episode at a time", 1, ge=1, le=256)
    micro_batch: Int = doc("samples per queued micro-batch (one optimizer step each). Default 64: a "
                           "few steps per update", 64, ge=1, le=MAX_STEP_ROWS)
    weight_decay: Float = doc("AdamW weight decay. Default 0: the usual choice for RL, where data "
                              "shifts under the policy", 0.0, ge=0)
    grad_clip: Float | None = doc("global gradient-norm clip (null: none). Default 0.5: the usual PPO "
                                  "max_grad_norm", 0.5, gt=0)
    warmup_steps: Int = doc("linear LR warmup steps. Default 0: the clip ratio already bounds early "
                            "updates", 0, ge=0)
    value_warmup_episodes: Int = doc("the workload's first episodes (the updates that end within them) "
                                     "train the value head only: their advantages are queued as zeros, so "
                                     "the policy takes no PPO step until the value head has seen its "
                                     "returns. For a tenant starting from an SFT version. Default 0: none",
                                     0, ge=0, le=1_000_000)
    # The KL knobs travel on the queued micro-batches (workflows/rl.py), not as gaussian-head
    # options as clip_ratio does: their one default is here, each workload's items carry its own
    # values (a later workload of the tenant changes them without touching the slot's config),
    # and the anchor version is the workload's to say (its start version), not the slot's.
    kl_coef: Float = doc("weight of the KL divergence of the policy from an anchor, added to the PPO "
                         "loss, the anchor being a frozen copy of the policy (mean and log-std, not the "
                         "value net) taken at kl_anchor_version: keeps PPO near a start (an SFT "
                         "version) whose skill its first updates would otherwise lose (docs/results.md). "
                         "Default 0: off, no anchor is taken (plain PPO, as in the paper)", 0.0, ge=0,
                         le=MAX_KL_COEF)
    kl_anchor_version: Int | None = doc("the tenant version the KL term anchors to: the trainer copies the "
                                        "policy when the slot is at this version and keeps the copy "
                                        "(checkpointed) while later workloads name the same version, so "
                                        "rounds of PPO can all stay near one SFT start. Needs kl_coef > 0. "
                                        "Default null: the version this workload starts from", None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_collection(cls, data: Any) -> Any:
        # Neither set: collect by episodes. Normalised here so a stored spec says what ran.
        if isinstance(data, dict) and data.get("episodes_per_update") is None and data.get("steps_per_update") is None:
            data = {**data, "episodes_per_update": cls.DEFAULT_EPISODES_PER_UPDATE}
        return data

    @model_validator(mode="after")
    def _checks(self) -> RLConfig:
        if self.episodes_per_update is not None and self.steps_per_update is not None:
            raise_rules("RLConfig", [rule(("steps_per_update",), "set either episodes_per_update or "
                                          "steps_per_update, not both", self.steps_per_update)])
        if self.advantage == "group_success":
            if self.group_size < 2:
                raise_rules("RLConfig", [rule(("group_size",), "advantage group_success compares the episodes of "
                                              "one reset seed: set group_size >= 2", self.group_size)])
            if self.steps_per_update is not None:
                raise_rules("RLConfig", [rule(("steps_per_update",), "advantage group_success collects whole "
                                              "groups of episodes: set episodes_per_update (a multiple of "
                                              "group_size) instead", self.steps_per_update)])
            if (self.episodes_per_update or 0) % self.group_size:
                raise_rules("RLConfig", [rule(("episodes_per_update",), f"{self.episodes_per_update} is not a "
                                              f"multiple of group_size={self.group_size}: an update takes whole "
                                              "groups", self.episodes_per_update)])
        elif self.group_size != 1:
            raise_rules("RLConfig", [rule(("group_size",), "groups are read only by advantage group_success; "
                                          "with gae leave group_size at 1", self.group_size)])
        if self.kl_anchor_version is not None and self.kl_coef == 0:
            raise_rules("RLConfig", [rule(("kl_anchor_version",), "names the KL term's anchor, but kl_coef is 0 "
                                          "(no KL term): set kl_coef > 0, or leave kl_anchor_version out",
                                          self.kl_anchor_version)])
        return self


# kind -> its config: the spec's ``algorithm`` section by task. eval has none (it trains nothing).
CONFIGS: dict[str, type[RecipeConfig]] = {"sft": SFTConfig, "rl": RLConfig}

__all__ = ["CONFIGS", "Bool", "Float", "Int", "RLConfig", "RecipeConfig", "SFTConfig", "Str", "doc", "raise_rules",
           "rule"]
