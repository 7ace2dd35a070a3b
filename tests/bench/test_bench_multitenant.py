"""bench.multitenant: argument checks and the report logic (no deployment: the experiment itself
is a benchmark, run by hand; docs/results.md has its runs)."""

from __future__ import annotations

import copy
import json

import pytest

from bench import mt_mix
from bench import multitenant as mt
from bench.mt_report import compare, failures, scaling, summarize, summary_table, table, utilisation_series


def no_problem() -> None:
    return None


def vulkan_missing() -> str:
    return "no Vulkan driver found"


# -- arguments ---------------------------------------------------------------------------------
def test_mix_parses_kinds_budgets_and_unique_names():
    plans, notes = mt.parse_mix("rl-reach:12,rl-reach,sft-reach:30,rl-push:5", problem=no_problem)
    assert [(p.kind, p.budget, p.task) for p in plans] == [
        ("rl-reach", 12, "rl"), ("rl-reach", mt_mix.DEFAULT_BUDGET["rl"], "rl"), ("sft-reach", 30, "sft"), ("rl-push", 5, "rl")]
    assert len({p.name for p in plans}) == 4 and notes == []


@pytest.mark.parametrize("mix, needle", [
    ("", "--mix"),
    ("rl-reach,,sft-reach", "none empty"),
    ("rl-fly:3", "unknown kind 'rl-fly'"),
    ("rl-reach:ten", "budget 'ten' is not an integer (episodes)"),
    ("sft-reach:0", "budget 0 is outside 1..100000 (optimizer steps)"),
    ("sft-reach:-5", "outside"),
    (",".join(["rl-reach:1"] * (mt_mix.MAX_TENANTS + 1)), f"at most {mt_mix.MAX_TENANTS}"),
])
def test_bad_mix_names_the_entry(mix, needle):
    with pytest.raises(mt.BadArgument, match="--mix") as exc:
        mt.parse_mix(mix, problem=no_problem)
    assert needle in str(exc.value)


def test_maniskill_stand_in_error_and_off():
    plans, notes = mt.parse_mix("rl-push:4,sft-reach:8", "auto", problem=vulkan_missing)
    assert plans[0].kind == mt_mix.MANISKILL_STANDIN and plans[0].budget == 4
    assert "no Vulkan driver found" in notes[0]
    with pytest.raises(mt.BadArgument, match="ManiSkill cannot run here: no Vulkan driver found"):
        mt.parse_mix("rl-push:4", "on", problem=vulkan_missing)
    plans, notes = mt.parse_mix("rl-push:4", "off", problem=no_problem)
    assert plans[0].kind == mt_mix.MANISKILL_STANDIN and "--maniskill off" in notes[0]
    with pytest.raises(mt.BadArgument, match="--maniskill: 'maybe'"):
        mt.parse_mix("rl-reach", "maybe", problem=no_problem)


def test_sft_pick_kind_parses_and_has_no_stand_in():
    plans, notes = mt.parse_mix("rl-reach:4,rl-reach-easy:4,rl-reach-top:4,sft-pick:20", problem=no_problem)
    assert [(p.kind, p.task, p.budget) for p in plans][-1] == ("sft-pick", "sft", 20) and notes == []
    assert plans[-1].dataset == mt.PICK_DATASET_NAME and plans[0].dataset is None
    assert plans[-1].followup(mt.Sizes())["task"] == "eval" and plans[0].followup(mt.Sizes()) is None
    # It trains on PickCube demos and is scored in PickCube: no reach stand-in, a clear error.
    with pytest.raises(mt.BadArgument, match="sft-pick needs ManiSkill, which cannot run here: no Vulkan driver"):
        mt.parse_mix("sft-pick:20", "auto", problem=vulkan_missing)
    with pytest.raises(mt.BadArgument, match=r"sft-pick needs ManiSkill \(--maniskill off\)"):
        mt.parse_mix("sft-pick:20", "off", problem=no_problem)


def test_sft_pick_specs_train_from_the_published_dataset_then_eval_held_out(tmp_path):
    from master.spec import parse_spec

    plans, _ = mt.parse_mix("sft-pick:40", problem=no_problem)
    sizes = mt.Sizes(pick_eval_episodes=7)
    spec = plans[0].spec("tiny-qwen3-vl-64", seed=3, sizes=sizes, data_dir=tmp_path)
    assert spec["dataset"]["root"] == str(tmp_path / "datasets" / "published" / mt.PICK_DATASET_NAME)
    assert spec["algorithm"]["steps"] == 40 and spec["algorithm"]["batch_size"] == sizes.pick_batch
    assert spec["algorithm"]["items_per_job"] == 16 and spec["algorithm"]["warmup_steps"] == 4
    assert spec["schedule"]["budget"] == {} and spec["outputs"]["export_every_steps"] == 40
    assert spec["seed"] == 3 and spec["tenant"] == plans[0].name
    ev = plans[0].followup(sizes)
    assert ev["tenant"] == plans[0].name and ev["env"]["id"] == "maniskill/PickCube-v1"
    assert ev["eval"]["episodes"] == 7 and ev["eval"]["seed"] == mt.PICK_EVAL_SEED and ev["eval"]["version"] == "latest"
    parse_spec(spec)
    parse_spec(ev)


def _dataset(root, state_shape=24, camera="observation.images.base_camera"):
    (root / "meta").mkdir(parents=True)
    features = {"observation.state": {"dtype": "float32", "shape": [state_shape]},
                "action": {"dtype": "float32", "shape": [7]}, camera: {"dtype": "image", "shape": [64, 64, 3]}}
    (root / "meta" / "info.json").write_text(json.dumps({"features": features}))
    return root


def test_pick_dataset_checked_before_anything_starts(tmp_path, capsys):
    assert mt.pick_dataset_problem(_dataset(tmp_path / "ok")) is None
    mix = ["--mix", "rl-reach:2,sft-pick:4"]
    cases = [(tmp_path / "missing", "holds no LeRobot dataset (no meta/info.json)"),
             (_dataset(tmp_path / "wide", state_shape=42), "has shape [42], but observation.state_dim is 24"),
             (_dataset(tmp_path / "cam", camera="observation.images.top"),
              "no camera 'observation.images.base_camera'")]
    for root, needle in cases:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mt_mix, "maniskill_problem", no_problem)
            assert mt.main([*mix, "--pick-dataset", str(root)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --pick-dataset: ") and needle in err, err
    assert mt.main(["--mix", "rl-reach:2", "--pick-dataset", str(tmp_path / "ok")]) == 2
    assert "no sft-pick tenant in the mix" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--seeds", "1,x"], "--seeds: '1,x'"), (["--seeds", "1,1"], "distinct"),
    (["--seeds", "1,2", "--scaling", "1,2"], "--seeds: the scaling curve"),
    (["--rl-epochs", "0"], "--rl-epochs: 0"), (["--pick-eval-episodes", "0"], "--pick-eval-episodes: 0"),
])
def test_seed_and_pick_options_refused(argv, needle, capsys):
    assert mt.main(["--mix", "rl-reach:2", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_seeds_and_sizes_reach_the_config():
    cfg = mt.build_config(mt.parser().parse_args(["--mix", "rl-reach:2", "--seeds", "1,2", "--rl-epochs", "2",
                                                  "--rl-steps-per-update", "512", "--pick-eval-episodes", "9"]))
    assert cfg.run_seeds == [1, 2] and cfg.sizes.rl_epochs == 2 and cfg.sizes.pick_eval_episodes == 9
    assert mt.build_config(mt.parser().parse_args(["--mix", "rl-reach:2", "--seed", "5"])).run_seeds == [5]
    spec = cfg.plans[0].spec("tiny-qwen3-vl-64", seed=1, sizes=cfg.sizes)
    assert spec["algorithm"]["epochs"] == 2 and spec["algorithm"]["steps_per_update"] == 512


@pytest.mark.parametrize("text, needle", [("1,2,x", "comma-separated"), ("0,2", "1..64"),
                                          ("4,2", "increasing"), ("2,2", "increasing"), ("65", "1..64")])
def test_bad_scaling(text, needle):
    with pytest.raises(mt.BadArgument, match="--scaling") as exc:
        mt.parse_scaling(text)
    assert needle in str(exc.value)


def test_scaled_mix_cycles_kinds_with_unique_names():
    kinds, _ = mt.parse_mix("rl-reach:3,sft-reach:9", problem=no_problem)
    plans = mt.scaled_mix(kinds, 5)
    assert [p.kind for p in plans] == ["rl-reach", "sft-reach"] * 2 + ["rl-reach"]
    assert [p.budget for p in plans] == [3, 9, 3, 9, 3] and len({p.name for p in plans}) == 5


@pytest.mark.parametrize("argv, needle", [
    (["--base", "no-such-base"], "--base: 'no-such-base'"),
    (["--run-timeout-s", "0"], "--run-timeout-s"),
    (["--mix", "rl-reach", "--sft-demos", "0"], "--sft-demos: 0"),
    (["--mix", "rl-reach", "--rl-parallel-envs", "100"], "--rl-parallel-envs: 100"),
    (["--mix", "rl-reach", "--out", "/tmp/x.txt"], "must end in .json"),
    (["--scaling", "8,4"], "--scaling"),
    (["--mix", "rl-reach", "--poll-s", "0"], "--poll-s: 0.0"),
    (["--mix", "rl-reach", "--trainer-group-max", "300"], "--trainer-group-max: 300"),
    (["--mix", "bogus"], "unknown kind"),
])
def test_main_refuses_bad_arguments_before_starting_anything(argv, needle, capsys):
    assert mt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_specs_carry_budget_and_pass_the_masters_spec_check():
    from master.spec import parse_spec

    plans, _ = mt.parse_mix("rl-reach:7,rl-reach-easy:7,rl-reach-top:7,rl-push:3,sft-reach:20", problem=no_problem)
    for i, p in enumerate(plans):
        spec = p.spec("tiny-qwen3-vl-64", seed=i, sizes=mt.Sizes())
        assert spec["tenant"] == p.name
        if p.task == "rl":
            assert spec["schedule"]["budget"] == {"max_episodes": p.budget} and "eval" not in spec
        else:
            assert spec["algorithm"]["steps"] == 20 and spec["eval"]["episodes"] == mt.Sizes().sft_eval_episodes
        parse_spec(spec)  # raises with the field errors if the bench built an invalid spec


def test_settings_same_for_every_run_but_group_width():
    cfg = mt.Config(plans=[], base="qwen3-vl-4b", fast=True)
    s4, s16 = cfg.settings(4), cfg.settings(16)
    assert s4["NEXUS_INFER_BASE"] == "qwen3-vl-4b" and s4["NEXUS_INFER_FAST"] == "1"
    assert s16["NEXUS_TRAINER_GROUP_MAX"] == "16" and s16["NEXUS_MAX_ACTIVE_ROLLOUTS"] == "16"
    assert cfg.settings(1)["NEXUS_TRAINER_GROUP_MAX"] == "4"


# -- report ------------------------------------------------------------------------------------
def _run(name, tenants, held, busy, ready_held=None, ok=True, sync=(0.1, 0.3)):
    return {"name": name, "ok": ok, "error": "", "wall_s": held, "up_s": 5.0,
            "services": {svc: {"held_s": held, "held_ready_s": ready_held or held - 5.0, "busy_s": busy[svc]}
                         for svc in ("trainer", "inferencer")},
            "timeline": {svc: [[0.0, 0.0], [held / 2, busy[svc] / 2], [held, busy[svc]]] for svc in ("trainer", "inferencer")},
            "tenants": copy.deepcopy(tenants), "weight_sync_s": list(sync)}


def _tenant(kind, task, success, version=10, state="completed"):
    return {"kind": kind, "task": task, "state": state, "message": "budget reached", "version": version,
            "episodes": 8, "success": success, "loss": 0.2 if task == "sft" else None,
            "train_rows": 320, "infer_rows": 400, "curve": [[1.0, 1.0, 0.5]]}


@pytest.fixture()
def runs():
    ta, tb = _tenant("rl-reach", "rl", 0.50), _tenant("sft-reach", "sft", 0.80)
    shared = _run("shared", {"a": ta, "b": tb}, held=100.0, busy={"trainer": 60.0, "inferencer": 30.0})
    alone = [_run("alone:a", {"a": _tenant("rl-reach", "rl", 0.45)}, held=90.0, busy={"trainer": 20.0, "inferencer": 15.0}),
             _run("alone:b", {"b": _tenant("sft-reach", "sft", 0.90)}, held=110.0, busy={"trainer": 30.0, "inferencer": 10.0})]
    return shared, alone


def test_compare_figures(runs):
    shared, alone = runs
    c = compare(shared, alone)
    assert c["device_s"]["shared"] == 200.0 and c["device_s"]["alone_sum"] == 400.0
    assert c["device_s"]["efficiency"] == pytest.approx(2.0)
    assert c["device_s"]["efficiency_ready"] == pytest.approx((85 + 105) * 2 / (95 * 2))
    tr = c["services"]["trainer"]
    assert tr["shared"]["utilisation"] == pytest.approx(0.6) and tr["alone"]["utilisation"] == pytest.approx(50 / 200)
    assert tr["util_gain"] == pytest.approx(0.6 / 0.25)
    assert c["services"]["inferencer"]["util_gain"] == pytest.approx(0.3 / (25 / 200))
    assert c["tenants"]["a"]["delta_points"] == pytest.approx(5.0)
    assert c["tenants"]["b"]["delta_points"] == pytest.approx(-10.0)
    t = c["targets"]
    assert t["efficiency"]["met"] and not t["trainer_util_gain"]["met"] and t["inferencer_util_gain"]["met"]
    assert t["learning_points"]["value"] == pytest.approx(10.0) and t["learning_points"]["met"]
    assert c["weight_sync_s"]["alone"]["n"] == 4 and c["weight_sync_s"]["shared"]["p50"] == pytest.approx(0.3)
    bd = c["breakdown"]["shared"]["trainer"]
    assert bd == {"held_s": 100.0, "startup_s": 5.0, "busy_s": 60.0, "idle_s": 35.0}
    text = table(c)
    assert "| trainer_util_gain | 2.40 | >= 2.5 | NO |" in text and "efficiency 2.00x" in text
    json.dumps(c)  # the JSON the bench writes


def test_compare_refuses_a_failed_run_and_says_which_and_why(runs):
    shared, alone = runs
    alone[1]["tenants"]["b"].update(state="failed", message="RuntimeError: trainer lost")
    alone[1]["ok"] = False
    with pytest.raises(ValueError, match=r"no comparison: alone:b: tenant b failed: RuntimeError: trainer lost"):
        compare(shared, alone)
    shared2 = copy.deepcopy(shared)
    shared2.update(ok=False, error="nexus up failed: port in use")
    assert failures([shared2]) == ["shared: nexus up failed: port in use"]
    with pytest.raises(ValueError, match="tenants differ: no isolated run for \\['b'\\]"):
        compare(shared, alone[:1])


def test_compare_refuses_an_alone_run_of_two_tenants(runs):
    shared, alone = runs
    alone[0]["tenants"]["x"] = _tenant("rl-reach", "rl", 0.1)
    with pytest.raises(ValueError, match="must hold one tenant"):
        compare(shared, alone)


def test_utilisation_series_spreads_busy_over_bins():
    x, y = utilisation_series([[0.0, 0.0], [2.0, 1.0], [4.0, 1.0], [6.0, 4.0]], 2.0)
    assert x == [0.0, 2.0, 4.0] and y == pytest.approx([0.5, 0.0, 1.0])  # 3 s in a 2 s bin is capped at 1
    assert utilisation_series([[0.0, 0.0]], 2.0) == ([], [])


def test_scaling_rows_and_plots(runs, tmp_path):
    from bench.mt_report import plot, plot_scaling

    shared, alone = runs
    rows = scaling([shared])
    assert rows[0]["tenants"] == 2 and rows[0]["device_s_per_opt_step"] == pytest.approx(200 / 20)
    assert rows[0]["device_s_per_1k_env_steps"] == pytest.approx(200 * 1000 / 800)
    png = plot_scaling(rows, [shared], tmp_path / "s.png")
    report = {"runs": {"shared": shared, "alone": alone}}
    png2 = plot(report, tmp_path / "c.png")
    assert png.stat().st_size > 1000 and png2.stat().st_size > 1000


def test_replot_merges_scaling_files_and_a_clean_rerun_replaces_a_failed_count(runs, tmp_path, capsys):
    shared, _ = runs
    one = {**copy.deepcopy(shared), "name": "scale:2"}
    failed16 = {**copy.deepcopy(shared), "name": "scale:16", "ok": False, "error": "trainer info failed", "tenants": {}}
    clean16 = {**copy.deepcopy(shared), "name": "scale:16",
               "tenants": {f"t{i}": _tenant("rl-reach", "rl", 0.0) for i in range(16)}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"kind": "scaling", "config": {}, "runs": [one, failed16], "rows": [], "refused": ["x"]}))
    b.write_text(json.dumps({"kind": "scaling", "config": {}, "runs": [clean16], "rows": [], "refused": []}))
    out = tmp_path / "merged.json"
    assert mt.replot([a, b], out) == 0
    merged = json.loads(out.read_text())
    assert [r["tenants"] for r in merged["rows"]] == [2, 16] and all(r["ok"] for r in merged["rows"])
    assert merged["refused"] == [] and merged["replaced_failed_runs"] == ["scale:16: failed in one file, ran clean in another"]
    assert (tmp_path / "merged.png").stat().st_size > 1000
    # a failed run that nothing replaced keeps its count (from its name) and stays refused
    assert [r["tenants"] for r in scaling([failed16])] == [16] and scaling([failed16])[0]["ok"] is False
    assert mt.replot([a, b], None) == 2 and "--out" in capsys.readouterr().err


# -- across seeds ------------------------------------------------------------------------------
def _seed_entry(seed, shared_a, alone_a, shared_b, alone_b, held_shared=100.0):
    ta, tb = _tenant("rl-reach", "rl", shared_a), _tenant("sft-pick", "sft", shared_b)
    shared = _run("shared", {"a": ta, "b": tb}, held=held_shared, busy={"trainer": 60.0, "inferencer": 30.0})
    alone = [_run("alone:a", {"a": _tenant("rl-reach", "rl", alone_a)}, held=90.0, busy={"trainer": 20.0, "inferencer": 15.0}),
             _run("alone:b", {"b": _tenant("sft-pick", "sft", alone_b)}, held=110.0, busy={"trainer": 30.0, "inferencer": 10.0})]
    return {"seed": seed, "runs": {"shared": shared, "alone": alone}, "comparison": compare(shared, alone), "refused": []}


def test_summary_means_verdicts_and_efficiency_per_seed():
    e1 = _seed_entry(1, 0.90, 1.00, 1.00, 0.70)
    e2 = _seed_entry(2, 0.96, 0.90, 0.80, 0.90, held_shared=125.0)
    failed = {"seed": 3, "runs": {}, "comparison": None, "refused": ["shared: boom"]}
    s = summarize([e1, e2, failed])
    assert s["seeds"] == [1, 2, 3] and s["compared_seeds"] == [1, 2]
    a, b = s["tenants"]["a"], s["tenants"]["b"]
    assert a["shared"] == {"1": pytest.approx(90.0), "2": pytest.approx(96.0)} and a["alone_mean"] == pytest.approx(95.0)
    assert a["shared_mean"] == pytest.approx(93.0) and a["delta_points"] == pytest.approx(-2.0) and a["within_target"]
    # b: seed 1 is 30 points up, seed 2 10 down: the means (90 vs 80) are 10 apart: within (<= 10)
    assert b["delta_points"] == pytest.approx(10.0) and b["within_target"] is True
    assert b["loss_shared"] == {"1": 0.2, "2": 0.2}
    eff = s["efficiency"]
    assert eff["per_seed"]["1"]["total"] == pytest.approx(2.0) and eff["per_seed"]["2"]["total"] == pytest.approx(400 / 250)
    assert eff["mean"]["total"] == pytest.approx((2.0 + 1.6) / 2)
    assert eff["mean"]["ready"] == pytest.approx((380 / 190 + 380 / 240) / 2)  # alone ready 85+105, shared 95 / 120 (x2 services)
    assert s["targets"]["learning_points"] == {"value": pytest.approx(10.0), "target": 10.0, "met": True}
    assert s["targets"]["efficiency_ready"]["met"] is True
    text = summary_table(s)
    assert "| a | rl-reach | 90 / 100 | 96 / 90 | 93.0 / 95.0 | -2.0 | yes |" in text
    assert "seed 2 1.60x" in text and "mean 1.80x" in text
    s2 = summarize([_seed_entry(1, 0.5, 0.9, 1.0, 1.0)])
    assert s2["tenants"]["a"]["within_target"] is False and s2["targets"]["learning_points"]["met"] is False
    json.dumps(s)
    assert summarize([failed])["targets"]["learning_points"]["met"] is False


def test_fig12_curves_every_tenant_shared_solid_alone_dashed_one_colour(tmp_path):
    from bench.mt_report import learning_curves, plot, seed_runs
    from bench.mt_report import load_pyplot

    e1, e2 = _seed_entry(1, 0.9, 1.0, 1.0, 0.7), _seed_entry(2, 0.9, 1.0, 1.0, 0.7)
    for e in (e1, e2):
        for run in [e["runs"]["shared"], *e["runs"]["alone"]]:
            for name, t in run["tenants"].items():
                t["budget"] = 40
                # [t, step, episodes, value]: RL success over episodes, SFT loss over steps
                t["curve"] = ([[1.0, 2.0, 10.0, 0.2], [2.0, 4.0, 40.0, 0.9]] if t["task"] == "rl"
                              else [[1.0, 10.0, 0.0, 0.5], [2.0, 40.0, 0.0, 0.05]])
    report = {"kind": "compare", "config": {"seed": 1}, "runs": e1["runs"], "comparison": e1["comparison"],
              "seeds": [{"seed": 1, "runs": "top-level runs"}, e2]}
    assert [s for s, _ in seed_runs(report)] == [1, 2] and seed_runs(report)[1][1] is e2["runs"]
    assert [s for s, _ in seed_runs({"config": {"seed": 4}, "runs": e1["runs"]})] == [4]  # an older file
    plt = load_pyplot()
    fig, ax = plt.subplots()
    learning_curves(ax, report)
    lines = ax.get_lines() + fig.axes[1].get_lines()  # RL on the left axis, SFT loss on the right
    assert len(lines) == 8  # 2 tenants x shared/alone x 2 seeds
    by_label = {ln.get_label(): ln for ln in lines if not ln.get_label().startswith("_")}
    assert set(by_label) == {"a (shared)", "a (alone)", "b (shared, SFT loss)", "b (alone, SFT loss)"}
    assert by_label["a (shared)"].get_linestyle() == "-" and by_label["a (alone)"].get_linestyle() == "--"
    assert by_label["a (shared)"].get_color() == by_label["a (alone)"].get_color() != by_label["b (shared, SFT loss)"].get_color()
    assert list(by_label["a (shared)"].get_xdata()) == [0.25, 1.0]  # episodes / budget
    assert list(by_label["b (alone, SFT loss)"].get_xdata()) == [0.25, 1.0]  # steps / budget
    assert fig.axes[1].get_yscale() == "log"
    plt.close(fig)
    assert plot(report, tmp_path / "f.png").stat().st_size > 1000


def test_pick_recording_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    import bench.maniskill_sft as ms

    target = tmp_path / "rec"

    def mkdtemp(prefix=""):
        target.mkdir()
        return str(target)

    def record_fails(root, *args, **kwargs):
        (root / "meta").mkdir()  # half-written
        raise RuntimeError("`nexus dataset record` failed (1): no expert")

    monkeypatch.setattr(mt.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(ms, "record_demos", record_fails)
    plans, _ = mt.parse_mix("sft-pick:4", problem=no_problem)
    with pytest.raises(RuntimeError, match="no expert"):
        mt.prepare_datasets(mt.Config(plans=plans))
    assert not target.exists()
    cfg = mt.Config(plans=mt.parse_mix("rl-reach:2", problem=no_problem)[0])
    mt.prepare_datasets(cfg)  # no sft-pick: nothing recorded
    assert cfg.datasets == {}


def test_replot_merges_compare_files_of_one_mix_into_a_summary_across_seeds(tmp_path, capsys):
    plans = [{"name": "a", "kind": "rl-reach", "budget": 40}, {"name": "b", "kind": "sft-pick", "budget": 40}]

    def report(seed, *results):
        e = _seed_entry(seed, *results)
        return {"kind": "compare", "config": {"seed": seed, "plans": plans}, "runs": e["runs"],
                "comparison": e["comparison"], "refused": [],
                "seeds": [{"seed": seed, "comparison": e["comparison"], "refused": [], "runs": "top-level runs"}]}

    a, b, old = tmp_path / "s1.json", tmp_path / "s2.json", tmp_path / "old.json"
    a.write_text(json.dumps(report(1, 0.9, 1.0, 1.0, 0.7)))
    b.write_text(json.dumps(report(2, 0.96, 0.9, 0.8, 0.9)))
    out = tmp_path / "both.json"
    assert mt.replot([a, b], out) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"]["compared_seeds"] == [1, 2] and merged["merged_from"] == [str(a), str(b)]
    assert merged["summary"]["tenants"]["a"]["shared_mean"] == pytest.approx(93.0)
    assert merged["seeds"][0]["runs"] == "top-level runs" and merged["seeds"][1]["runs"]["shared"]["name"] == "shared"
    assert "across seeds 1, 2" in capsys.readouterr().out and (tmp_path / "both.png").stat().st_size > 1000
    assert mt.replot([a, a], out) == 2 and "a seed repeats" in capsys.readouterr().err
    # a file from before --seeds (no "seeds" key): one seed, its config's
    legacy = report(3, 0.5, 0.5, 0.5, 0.5)
    del legacy["seeds"]
    old.write_text(json.dumps(legacy))
    assert mt.replot([a, old], out) == 0 and json.loads(out.read_text())["summary"]["compared_seeds"] == [1, 3]
    other = report(4, 0.5, 0.5, 0.5, 0.5)
    other["config"]["plans"] = plans[:1]
    b.write_text(json.dumps(other))
    assert mt.replot([a, b], out) == 2 and "mixes differ" in capsys.readouterr().err


def test_run_compare_over_seeds_writes_every_run_as_it_finishes(tmp_path, monkeypatch):
    """The seeds loop without a deployment (one_run faked): the JSON after each run, the summary
    at the end; an invocation stopped half-way keeps what it finished."""
    results = {("shared", 1): {"a": 0.9, "b": 1.0}, ("alone", 1): {"a": 1.0, "b": 0.9},
               ("shared", 2): {"a": 0.8, "b": 1.0}, ("alone", 2): {"a": 0.9, "b": 1.0}}
    calls = []

    def fake_run(name, plans, cfg, n, seed=None):
        side = "shared" if name.startswith("shared") else "alone"
        calls.append((name, seed))
        if len(calls) == stop_at:
            on_disk.append(json.loads(cfg.out.read_text()))
            raise KeyboardInterrupt
        tenants = {p.name: _tenant(p.kind, p.task, results[(side, seed)][p.name]) for p in plans}
        return _run(name, tenants, held=100.0 if side == "shared" else 80.0, busy={"trainer": 40.0, "inferencer": 20.0})

    monkeypatch.setattr(mt, "one_run", fake_run)
    plans = [mt.TenantPlan("a", "rl-reach", 4), mt.TenantPlan("b", "sft-reach", 8)]
    cfg = mt.Config(plans=plans, seeds=[1, 2], out=tmp_path / "mt.json")
    stop_at, on_disk = 0, []
    code, report = mt.run_compare(cfg)
    assert code == 0 and [c[1] for c in calls] == [1, 1, 1, 2, 2, 2]
    assert [c[0] for c in calls[:3]] == ["shared s1", "alone:a s1", "alone:b s1"]
    saved = json.loads(cfg.out.read_text())
    assert saved["runs"]["shared"]["name"] == "shared s1" and saved["comparison"]["tenants"]["a"]["delta_points"] == pytest.approx(-10)
    assert [e["seed"] for e in saved["seeds"]] == [1, 2] and saved["seeds"][1]["runs"]["shared"]["name"] == "shared s2"
    assert saved["summary"]["tenants"]["a"]["shared_mean"] == pytest.approx(85.0) and saved["refused"] == []
    assert saved["summary"]["efficiency"]["per_seed"]["2"]["total"] == pytest.approx(160 / 100)
    # stopped during seed 2's second run: seed 1 complete on disk, seed 2's shared run kept, marked incomplete
    calls.clear()
    stop_at = 5
    with pytest.raises(KeyboardInterrupt):
        mt.run_compare(cfg)
    partial = on_disk[0]
    assert partial["comparison"] is not None and partial["seeds"][1]["runs"]["shared"]["name"] == "shared s2"
    assert partial["seeds"][1]["refused"] == ["incomplete: 1 of 3 runs done (the invocation was still running, "
                                              "or was stopped)"]
    assert partial["summary"]["compared_seeds"] == [1]


def test_resume_keeps_the_successful_runs_and_runs_the_rest(tmp_path, monkeypatch):
    """`--resume`: an invocation whose second alone run failed (a trainer crash) is resumed:
    its shared run and first alone run are kept, only the failed one runs again; a JSON made
    with other settings is refused naming them."""
    argv = ["--mix", "rl-reach:2,sft-reach:2", "--seed", "3", "--out", str(tmp_path / "r.json")]
    cfg = mt.build_config(mt.parser().parse_args(argv))
    a, b = (p.name for p in cfg.plans)
    ok = lambda name, tenants, held: _run(name, {t: _tenant("rl-reach", "rl", 0.5) for t in tenants}, held=held,  # noqa: E731
                                          busy={"trainer": 10.0, "inferencer": 5.0})
    crashed = ok(f"alone:{b}", [b], 50.0)
    crashed.update(ok=False, error="trainer did not answer info")
    earlier = {"seed": 3, "runs": {"shared": ok("shared", [a, b], 100.0), "alone": [ok(f"alone:{a}", [a], 60.0), crashed]},
               "comparison": None, "refused": ["alone:b crashed"]}
    first = tmp_path / "first.json"
    first.write_text(json.dumps(mt.assemble(cfg, [earlier])))
    ran: list[str] = []

    def one_run(name, plans, _cfg, _n, _seed):  # what a deployment would return: a fresh run record
        ran.append(name)
        return ok(name, [p.name for p in plans], 70.0)

    monkeypatch.setattr(mt, "one_run", one_run)
    monkeypatch.setattr(mt, "plot", lambda report, out: out)  # no figure needed here
    code, report = mt.run_compare(mt.build_config(mt.parser().parse_args([*argv, "--resume", str(first)])))
    assert code == 0 and ran == [f"alone:{b}"]
    assert report["seeds"][0]["resumed"] == ["shared", f"alone:{a}"]
    assert report["comparison"]["device_s"]["alone_sum"] == 2 * (60.0 + 70.0)
    other = mt.build_config(mt.parser().parse_args(["--mix", "rl-reach:4,sft-reach:2", "--seed", "3",
                                                    "--resume", str(first), "--out", str(tmp_path / "x.json")]))
    with pytest.raises(mt.BadArgument, match="made with other settings \\(.*plans.*\\); resume it with the same command"):
        mt.run_compare(other)


def test_a_failed_run_keeps_its_data_dir_and_names_it(tmp_path, monkeypatch, capsys):
    """A run that fails (here `nexus up` refuses a setting: a real CLI call, no deployment
    starts) keeps its temp data dir without --keep-data: the roles' logs there are the record
    of why (a crashed trainer's fault-handler dump is more than the error's one log line)."""
    monkeypatch.setenv("NEXUS_TRAINER_RANKS", "0")
    monkeypatch.setattr(mt.tempfile, "tempdir", str(tmp_path))
    cfg = mt.Config(plans=[mt.TenantPlan("a", "rl-reach", 4)], out=tmp_path / "mt.json")
    out = mt.one_run("shared", cfg.plans, cfg, 1)
    assert not out["ok"] and "nexus up failed" in out["error"] and "NEXUS_TRAINER_RANKS" in out["error"]
    kept = out["data_dir"]
    assert kept.startswith(str(tmp_path.resolve())) and mt.Path(kept).is_dir()
    assert f"logs kept in {kept}/logs" in capsys.readouterr().out
