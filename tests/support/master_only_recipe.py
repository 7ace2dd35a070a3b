"""A recipe kind for tests/system/test_recipe_kind.py, loaded by the master only: its workloads
are accepted (the master declares the kind) and must then fail clearly on env workers that
never loaded it, not wait for one forever.

    NEXUS_WORKFLOW_MODULES=workflows,examples.recipe_repeat_eval,tests.support.master_only_recipe
"""

from __future__ import annotations

from protocol.recipes import register
from workflows.common import as_recipe
from workflows.eval import EvalWorkflow


class MasterOnlyEval(EvalWorkflow):
    kind = "master-only-eval"


register(MasterOnlyEval.kind, as_recipe(MasterOnlyEval))
