"""bench/elastic.py without deployments: its argument checks, and its report (summary, table,
PNG, --replot) on a made-up pair of arms. The runs themselves are recorded in docs/scaling.md."""

from __future__ import annotations

import json

import pytest

from bench import elastic


@pytest.mark.parametrize("argv,named", [
    (["--join", "40"], "--join"),
    (["--base-tenants", "0"], "--base-tenants"),
    (["--join-at-s", "-1"], "--join-at-s"),
    (["--episodes", "0"], "--episodes"),
    (["--arms", "fixed,elastic"], "--arms"),
    (["--arms", "fixed,fixed"], "--arms"),
    (["--bounds", "trainer=3:1"], "--bounds"),
    (["--fixed", "trainer=9"], "--fixed"),  # past the default bounds' trainer=1:2
    (["--fixed", "robot=1"], "--fixed"),
    (["--out", "x.txt"], "--out"),
    (["--rl-parallel-envs", "0"], "--rl-parallel-envs"),
    (["--base", "no-such-base"], "--base"),
])
def test_bad_arguments_are_refused_naming_the_argument(argv, named, capsys):
    assert elastic.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err


def test_the_arms_roles_and_settings():
    cfg = elastic.build_config(elastic.parser().parse_args(["--bounds", "env=1:3,trainer=1:2", "--join", "8"]))
    assert cfg.roles("fixed") == "env=2,inferencer=1,trainer=2"
    assert cfg.roles("scaler") == "env=1,inferencer=1,trainer=1"  # starts at the mins
    assert cfg.settings("scaler")["NEXUS_SCALER"] == "on" and cfg.settings("fixed")["NEXUS_SCALER"] == "off"
    assert cfg.settings("fixed")["NEXUS_SCALE_BOUNDS"] == "env=1:3,trainer=1:2"
    assert len(cfg.plans()) == 10 and cfg.settings("fixed")["NEXUS_MAX_ACTIVE_ROLLOUTS"] == "10"


def _arm(name: str, waits: list[float], env_pids: list[tuple[float, float]], decisions: list[dict]) -> dict:
    tenants = {f"el-{i + 1}": {"submitted_s": 0.0 if i < 2 else 60.0, "state": "completed", "message": "",
                               "episodes": 8, "jobs": 4, "first_rollout_s": w, "done_s": 200.0 + i,
                               "env_steps": 256, "env_steps_per_s": 256 / 200.0} for i, w in enumerate(waits)}
    pids = {str(100 + i): {"role": "env", "instance": f"env.{i}", "start": s, "last": e} for i, (s, e) in enumerate(env_pids)}
    pids["90"] = {"role": "trainer", "instance": "trainer", "start": 0.0, "last": 300.0}
    pids["91"] = {"role": "inferencer", "instance": "inferencer", "start": 0.0, "last": 300.0}
    counts = {"env": [[0.0, 1.0], [100.0, float(len(env_pids))], [250.0, 1.0]], "trainer": [[0.0, 1.0]],
              "inferencer": [[0.0, 1.0]]}
    arm = {"arm": name, "ok": True, "error": "", "counts": counts, "pids": pids, "decisions": decisions,
           "tenants": tenants, "audit": {"jobs": 16, "lost": 0, "trained_twice": 0}}
    arm["summary"] = elastic.summarise(arm)
    return arm


def test_the_report_on_made_up_arms(tmp_path, capsys):
    up = {"t": 95.0, "role": "env", "from": 1, "to": 2, "outcome": "", "reason": "active_rollouts per env 3.00 ..."}
    report = {"kind": "elastic", "config": {}, "arms": {
        "fixed": _arm("fixed", [5.0, 6.0, 30.0, 31.0], [(0.0, 300.0), (0.0, 300.0)], []),
        "scaler": _arm("scaler", [5.0, 6.0, 40.0, 41.0], [(0.0, 300.0), (100.0, 250.0)],
                       [up, {**up, "outcome": "applied: env 2"}])}}
    s = report["arms"]["scaler"]["summary"]
    assert s["device_s"] == 600.0 and s["env_worker_s"] == 450.0 and (s["decisions"], s["applied"]) == (1, 1)
    assert s["first_rollout_mean_s"] == pytest.approx(23.0) and s["first_rollout_max_s"] == 41.0
    assert report["arms"]["fixed"]["summary"]["env_worker_s"] == 600.0
    text = elastic.table(report)
    assert "el-4" in text and "1 (1)" in text and "16/0/0" in text
    path = tmp_path / "elastic.json"
    path.write_text(json.dumps(report))
    assert elastic.main(["--replot", str(path)]) == 0
    assert (tmp_path / "elastic.png").stat().st_size > 10_000
    assert "device-s held" in capsys.readouterr().out
