"""A recipe of a new kind submitted through the master like a built-in (issue 28; docs/
workload_spec.md "Adding a recipe"), on real role processes.

The master and the env worker run with NEXUS_WORKFLOW_MODULES naming examples/recipe_repeat_eval.py
beside `workflows`. A tenant trains a small SFT policy on the built-in env and submits
``task: repeat-eval`` against it: the master checks the spec by eval's rules with the recipe's
config (``algorithm.rounds``), holds it until the training workload ends (as an eval), and the
env worker runs the recipe's workflow, whose report carries ``rounds_disagree``. A kind no module
registered is refused at submit naming the kinds the master knows; a kind only the master
loaded (tests/support/master_only_recipe.py) fails on the env worker that lacks it, naming
the kind and the setting, instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from protocol.errors import InvalidField
from sdk.client import AsyncClient
from tests.master.test_workloads import BASE_SPEC, sft_spec

RECIPES = "workflows,examples.recipe_repeat_eval"


def _eval(tenant: str, task: str, **extra) -> dict:
    return {"tenant": tenant, "task": task, "env": dict(BASE_SPEC["env"]),
            "eval": {"version": "latest", "episodes": 2, "sample": False}, **extra}


@pytest.mark.timeout(300)
def test_a_registered_kind_runs_through_the_master(roles, tmp_path):
    roles.start("health")
    roles.start("master", NEXUS_WORKFLOW_MODULES=f"{RECIPES},tests.support.master_only_recipe")
    roles.start("trainer")
    roles.start("env", NEXUS_WORKFLOW_MODULES=RECIPES)
    roles.start("inferencer", NEXUS_INFER_BASE=BASE_SPEC["base"])

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            with pytest.raises(InvalidField) as refused:
                await c.submit(_eval("rep", "dance-eval"))
            sft = await c.submit(sft_spec("rep", steps=2))
            # Submitted while rep trains: accepted, held until the training ends (an eval's rule).
            rep = await c.submit(_eval("rep", "repeat-eval", algorithm={"rounds": 2}))
            lost = await c.submit(_eval("rep", "master-only-eval"))
            recs = await asyncio.gather(*(h.wait(timeout_s=240) for h in (sft, rep, lost)))
            report = json.loads((await c.download_report(rep.id, out_dir=tmp_path)).read_text())
            return refused.value, recs, report
        finally:
            await c.close()

    refused, (sft, rep, lost), report = asyncio.run(go())
    assert "'dance-eval' is not allowed; allowed: sft, rl, eval, repeat-eval, master-only-eval" in refused.message
    assert "NEXUS_WORKFLOW_MODULES" in refused.message
    assert sft.state == "completed", (sft.state, sft.message)
    assert rep.state == "completed", (rep.state, rep.message)
    assert (rep.task, rep.family, rep.eval_version) == ("repeat-eval", "eval", sft.step)
    assert rep.metrics["rounds_disagree"] in (0.0, 1.0) and rep.episodes == 2
    assert report["task"] == "repeat-eval" and report["metrics"]["rounds_disagree"] == rep.metrics["rounds_disagree"]
    assert lost.state == "failed" and "'master-only-eval'" in lost.message, lost.message
    assert "NEXUS_WORKFLOW_MODULES" in lost.message
