"""The ManiSkill benches' specs (bench/maniskill_sft.py, bench/maniskill_rl.py) are what a submit
accepts, for both tasks, and describe one tenant across SFT, PPO and eval (fast: no simulator,
no deployment; the runs themselves are recorded in docs/results.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import maniskill_rl, maniskill_sft
from master.spec import compile_tenant, load_document, parse_spec


@pytest.mark.parametrize("task", sorted(maniskill_sft.TASKS))
def test_sft_ppo_and_eval_specs_are_valid_and_name_one_tenant(task):
    sft_path, eval_path, _ = maniskill_sft.TASKS[task]
    sft_example, ev_example = load_document(sft_path.read_text()), load_document(eval_path.read_text())
    sft = maniskill_rl.sft_spec(sft_example, "t-s1", 1, Path("/data/published/demos"), 300)
    rl = maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0)
    ev = maniskill_rl.eval_spec(ev_example, "t-s1", 30, 100_000)
    specs = [parse_spec(s) for s in (sft, rl, ev)]
    assert [s.task for s in specs] == ["sft", "rl", "eval"]
    assert {s.tenant for s in specs} == {"t-s1"}
    # SFT and PPO train the same slot: the tenant each compiles to is the same one.
    assert compile_tenant(specs[0]).signature == compile_tenant(specs[1]).signature
    assert specs[1].schedule.budget.max_episodes == 100 and specs[1].env.id == ev_example["env"]["id"]
    assert specs[0].algorithm.steps == 300 and specs[2].eval.sample is False
    assert specs[1].algorithm.value_warmup_episodes == 0
    warm = parse_spec(maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0, value_warmup_episodes=32))
    assert warm.algorithm.value_warmup_episodes == 32
    slow = parse_spec(maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0,
                                           ppo={**maniskill_rl.PPO, "lr": 5e-5, "epochs": 1}))
    assert slow.algorithm.lr == 5e-5 and slow.algorithm.epochs == 1  # --lr / --epochs reach the spec
    # --kl-coef: the first round anchors to its own start (the SFT version), later ones name it.
    assert specs[1].algorithm.kl_coef == 0.0 and specs[1].algorithm.kl_anchor_version is None
    first = parse_spec(maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0, kl_coef=0.05))
    later = parse_spec(maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0, kl_coef=0.05, kl_anchor_version=300))
    assert (first.algorithm.kl_coef, first.algorithm.kl_anchor_version) == (0.05, None)
    assert (later.algorithm.kl_coef, later.algorithm.kl_anchor_version) == (0.05, 300)
    # --value-detach: the head option, on the SFT slot and so on PPO's (one slot, one signature).
    detached = maniskill_rl.sft_spec(sft_example, "t-s1", 1, Path("/data/published/demos"), 300,
                                     maniskill_rl.action_module(value_detach=True))
    d_sft, d_rl = parse_spec(detached), parse_spec(maniskill_rl.rl_spec(detached, ev_example["env"], 100, 600.0))
    assert d_sft.action_module.params["value_detach"] is True
    assert compile_tenant(d_sft).signature == compile_tenant(d_rl).signature
    assert "value_detach" not in specs[0].action_module.params
    # --init-log-std: the head's starting exploration noise, on the SFT slot (so PPO's).
    quiet = parse_spec(maniskill_rl.sft_spec(sft_example, "t-s1", 1, Path("/d"), 300,
                                             maniskill_rl.action_module(init_log_std=-2.5)))
    assert quiet.action_module.params["init_log_std"] == -2.5
    assert specs[0].action_module.params["init_log_std"] == maniskill_rl.GAUSSIAN["params"]["init_log_std"]
    # --max-inflight-jobs and --micro-batch reach PPO's spec.
    sync = parse_spec(maniskill_rl.rl_spec(sft, ev_example["env"], 100, 600.0, max_inflight_jobs=1,
                                           ppo={**maniskill_rl.PPO, "micro_batch": 256}))
    assert sync.schedule.max_inflight_jobs == 1 and sync.algorithm.micro_batch == 256
    assert specs[1].schedule.max_inflight_jobs == 2
    # --ignore-terminations: PPO's env only; the eval's env is left as it was.
    it = parse_spec(maniskill_rl.rl_spec(sft, maniskill_rl.ppo_env(ev_example["env"], True), 100, 600.0))
    assert it.env.options["ignore_terminations"] is True and "ignore_terminations" not in ev_example["env"]["options"]
    assert maniskill_rl.ppo_env(ev_example["env"], False) == ev_example["env"]
    # The example is not changed by building a spec from it.
    assert load_document(sft_path.read_text()) == sft_example


def test_rl_bench_refuses_a_zero_round_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as e:
        maniskill_rl.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds 0: must be >= 1" in capsys.readouterr().err


def test_group_flags_reach_ppos_spec():
    """--group-size / --episodes-per-update / --parallel-envs: outcome advantages over groups of
    one reset seed (algorithm.advantage group_success), whole groups an update."""
    import argparse

    sft_path, eval_path, _ = maniskill_sft.TASKS["push"]
    sft = maniskill_rl.sft_spec(load_document(sft_path.read_text()), "t-s1", 1, Path("/d"), 200)
    env = load_document(eval_path.read_text())["env"]
    args = argparse.Namespace(lr=5e-5, epochs=2, micro_batch=128, parallel_envs=4, group_size=4, episodes_per_update=8)
    alg = parse_spec(maniskill_rl.rl_spec(sft, env, 48, 600.0, ppo=maniskill_rl.ppo_settings(args))).algorithm
    assert (alg.advantage, alg.group_size, alg.episodes_per_update) == ("group_success", 4, 8)
    assert alg.steps_per_update is None
    assert alg.parallel_envs == 4 and alg.lr == 5e-5
    plain = parse_spec(maniskill_rl.rl_spec(sft, env, 48, 600.0, ppo=maniskill_rl.ppo_settings(
        argparse.Namespace(**{**vars(args), "group_size": 1})))).algorithm
    assert plain.advantage == "gae" and plain.steps_per_update == maniskill_rl.PPO["steps_per_update"]


def _report(seed: int, **settings) -> dict:
    rounds = [{"round": 1, "episodes_total": 48, "train_success": 0.3, "eval": 0.6}]
    return {"task": "push", "sft_steps": 200, "seeds": [seed], "ppo": {"lr": 5e-5}, **settings,
            "rows": [{"seed": seed, "sft_eval": 0.45, "rounds": rounds, "gain_points": 15.0}]}


def test_merge_joins_seeds_of_one_setting_and_refuses_another(tmp_path, capsys):
    import json

    paths = []
    for seed, lr in ((1, 5e-5), (2, 5e-5), (3, 1e-4)):
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(_report(seed, ppo={"lr": lr})))
    out = tmp_path / "merged.json"
    assert maniskill_rl.main(["--merge", str(paths[0]), str(paths[1]), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [r["seed"] for r in merged["rows"]] == [1, 2] and merged["seeds"] == [1, 2]
    assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(SystemExit) as e:
        maniskill_rl.main(["--merge", str(paths[0]), str(paths[2]), "--out", str(tmp_path / "bad.json")])
    assert e.value.code == 2 and "ppo is" in capsys.readouterr().err and not (tmp_path / "bad.json").exists()
