"""A workflow recipe in one file (docs/workload_spec.md "Adding a recipe"): its config model,
its workflow class and its registration. The master and the hosts load it by module name:

    NEXUS_WORKFLOW_MODULES=workflows,examples.recipe_repeat_eval nexus up ...

and a spec then names it like a built-in task (``task: repeat-eval``, ``algorithm: {rounds: 3}``).

It evaluates the pinned version ``rounds`` times over (the same seeds each round: a check that
scores are deterministic with ``eval.sample: false``); its events and report are an eval's.
"""

from __future__ import annotations

from protocol.recipe_configs import Int, RecipeConfig, doc
from protocol.recipes import register
from workflows.common import Workflow, as_recipe
from workflows.evaluation import evaluate


class RepeatEvalConfig(RecipeConfig):
    """The recipe's knobs, each with its one default (the workflow reads `self.config`)."""

    rounds: Int = doc("evaluations of the pinned version. Default 2: the fewest that can disagree", 2, ge=1, le=16)


class RepeatEvalWorkflow(Workflow):
    kind = "repeat-eval"
    family = "eval"  # the master checks its spec by eval's rules: env and eval required, a pinned version read
    config_model = RepeatEvalConfig
    config: RepeatEvalConfig

    async def train(self) -> None:
        runs = []
        for _ in range(self.config.rounds):
            self.progress.episodes = self.progress.successes = 0
            self.progress.returns = []
            await evaluate(self)
            runs.append(self.final["success_rate"])
        self.final["rounds_disagree"] = float(len(set(runs)) > 1)


register(RepeatEvalWorkflow.kind, as_recipe(RepeatEvalWorkflow))
