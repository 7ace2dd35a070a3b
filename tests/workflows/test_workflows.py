"""The three workflows through the services (not in-process shortcuts), on the built-in task:
RL rollouts via the inference service into the training queue, SFT from recorded expert demos,
read-only evaluation of a pinned version."""

from __future__ import annotations

import asyncio

import numpy as np

from protocol import ops
from protocol.messages import WorkflowSpec, TenantConfig, WorkloadEvent
from protocol.wire import decode
from sdk.client import AsyncClient

REACH_SCHEMA = {
    "cameras": [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}],
    "state_dim": 4, "action_dim": 2, "action_horizon": 1, "instruction_template": "{instruction}",
}


def reach_tenant(name: str, head: str) -> TenantConfig:
    return TenantConfig(name=name, base="tiny-qwen3-vl-64", schema=REACH_SCHEMA, head=head, optim={"lr": 1e-3})


async def run_workflow(c: AsyncClient, spec: WorkflowSpec, timeout_s: float = 240) -> list[WorkloadEvent]:
    events: asyncio.Queue = asyncio.Queue()

    async def on_event(msg):
        await events.put(decode(msg.data, WorkloadEvent))

    await c.bus.nc.subscribe(c.names.workload_events(spec.workload), cb=on_event)
    await c.bus.call(ops.ENV_START_WORKFLOW, spec, timeout_s=30)
    seen = []
    while True:
        ev = await asyncio.wait_for(events.get(), timeout=timeout_s)
        seen.append(ev)
        if ev.kind == "done":
            return seen


def test_rl_sft_and_eval_workflows(roles):
    for role in ("master", "trainer", "env"):
        roles.start(role)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(reach_tenant("rl-t", "gaussian"))
            await c.create_tenant(reach_tenant("sft-t", "mlp"))
            rl, sft = await asyncio.gather(
                # With a KL term to the policy it starts from (version 0): the trainer takes the
                # anchor at the first step and reports kl_ref in every step's metrics.
                run_workflow(c, WorkflowSpec(workload="w-rl", tenant="rl-t", kind="rl", env_id="builtin/reach-v0",
                                             algo={"episodes_per_update": 2, "parallel_envs": 2, "kl_coef": 0.1},
                                             max_episodes=4, start_version=0)),
                run_workflow(c, WorkflowSpec(workload="w-sft", tenant="sft-t", kind="sft", env_id="builtin/reach-v0",
                                             demo_episodes=4, algo={"batch_size": 8, "items_per_job": 2},
                                             max_steps=3, record_path="datasets/tenants/sft-t/w-sft")),
            )
            sft_version = (await c.latest_weights("sft-t")).version
            ev = await run_workflow(c, WorkflowSpec(workload="w-eval", tenant="sft-t", kind="eval",
                                                    env_id="builtin/reach-v0", eval_version=sft_version,
                                                    eval_episodes=5))
            rl_jobs, sft_jobs = await c.jobs("rl-t"), await c.jobs("sft-t")
            after_eval = (await c.latest_weights("sft-t")).version
            return rl, sft, ev, rl_jobs, sft_jobs, sft_version, after_eval
        finally:
            await c.close()

    rl, sft, ev, rl_jobs, sft_jobs, sft_version, after_eval = asyncio.run(go())
    for events in (rl, sft, ev):
        assert events[-1].kind == "done" and events[-1].state != "failed", events[-1].message
    assert rl[-1].episodes == 4 and "success_rate" in rl[-1].metrics
    assert len(rl_jobs) == 2 and all(j.state == "cleared" and j.behaviour_version >= 0 for j in rl_jobs)
    assert all("kl_ref" in j.metrics and "policy_loss" in j.metrics for j in rl_jobs), [j.metrics for j in rl_jobs]
    # One PPO step per micro-batch put: a micro-batch over the max payload is stored as parts
    # (items) and trained as one step (JobRecord.steps; tests/actors/test_split_step.py).
    assert rl[-1].step == sum(j.steps for j in rl_jobs) and sum(j.items for j in rl_jobs) >= rl[-1].step
    assert sft_version == 3 and "loss" in sft[-1].metrics
    # items_per_job 2 with 3 steps: a job of 2 micro-batches, then one of the 1 left.
    assert sorted(j.items for j in sft_jobs) == [1, 2]
    assert ev[-1].metrics["episodes"] == 5 and ev[-1].metrics["version"] == sft_version
    assert after_eval == sft_version  # evaluation changed nothing


def test_workflows_stand_on_the_sdk_alone():
    """workflows/ is user-level code: it imports the SDK, the message and error types, the
    env library and the pure spec helpers, never a role's module, and reaches the cluster only
    through the client's public methods (no ``client.bus`` / ``client.names``)."""
    import ast
    from pathlib import Path

    # protocol.recipe_configs, pydantic and master.spec_schema: a recipe's typed config and its
    # errors in the spec's words (Workflow.read_config).
    allowed = ("sdk.client", "sdk.tracing", "protocol.errors", "protocol.messages", "protocol.policy", "protocol.recipes",
               "protocol.recipe_configs", "pydantic", "envs", "master.spec", "master.spec_schema", "workflows",
               "numpy", "__future__", "asyncio", "logging", "time", "uuid", "dataclasses", "pathlib",
               "typing")
    root = Path(__file__).resolve().parents[2] / "workflows"
    bad = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                bad += [f"{path.name}: import {m}" for m in mods
                        if not any(m == a or m.startswith(a + ".") for a in allowed)]
            if isinstance(node, ast.Attribute) and node.attr in ("bus", "names", "_bus", "_call"):
                bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert len(list(root.glob("*.py"))) >= 5
    assert not bad, bad


def test_rl_group_success_shares_reset_seeds_and_queues_outcome_advantages(roles):
    """`algorithm.advantage: group_success` through the services: the 4 episodes of an update
    are 2 groups of 2 reset seeds (read back from the queued job: 2 start states, each
    twice), and every queued advantage is an outcome's against its group (-1, 0 or 1 for
    pairs), not a normalised GAE value. No trainer until the job is read (it would clear it)."""
    for role in ("master", "env"):
        roles.start(role)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(reach_tenant("grp-t", "gaussian"))
            run = asyncio.ensure_future(run_workflow(c, WorkflowSpec(
                workload="w-grp", tenant="grp-t", kind="rl", env_id="builtin/reach-v0",
                algo={"advantage": "group_success", "group_size": 2, "episodes_per_update": 4, "parallel_envs": 2,
                      "micro_batch": 64}, max_episodes=4)))
            deadline = asyncio.get_running_loop().time() + 180
            while not (jobs := await c.jobs("grp-t", states=["ready"])):
                assert not run.done() and asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.2)
            items = []
            while len(items) < jobs[0].items:  # a reply holds what fits one message
                items += (await c.queue_get("grp-t", jobs[0].job, start=len(items), max_items=64)).items
            await asyncio.get_running_loop().run_in_executor(None, roles.start, "trainer")  # may clear it now
            return await run, items
        finally:
            await c.close()

    events, items = asyncio.run(go())
    assert events[-1].state != "failed", events[-1].message
    state = np.concatenate([it.state for it in items])
    adv = np.concatenate([it.advantages for it in items])
    # Episodes of one seed start alike and part at their first sampled action: the repeated
    # states are the 2 groups' start states, each twice (4 seeds would repeat none).
    _, counts = np.unique(state, axis=0, return_counts=True)
    assert sorted(counts[counts > 1].tolist()) == [2, 2], counts
    assert np.allclose(np.abs(adv[np.abs(adv) > 1e-6]), 1.0, atol=1e-4), np.unique(adv)
