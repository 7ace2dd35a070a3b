"""The eval workload: read-only, its whole run is `workflows.evaluation.evaluate` (N episodes of
a version pinned once; no training queue, no optimizer, no version change)."""

from __future__ import annotations

from workflows.common import Workflow
from workflows.evaluation import evaluate


class EvalWorkflow(Workflow):
    kind = family = "eval"

    async def train(self) -> None:  # an eval workload is its evaluation, nothing else
        await evaluate(self)
