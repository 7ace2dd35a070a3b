"""The `nexus` CLI without a cluster: --json of `spec validate` and `dataset info`, exit codes of
bad input, error lines, the plain (non-TTY) progress lines, and no torch on the fast paths.

The commands that need a cluster (status, tenants, workloads, submit, cancel, download) are
exercised with --json in tests/system/test_doc_examples.py, on the cluster the docs run against.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import yaml

from protocol.messages import WorkloadRecord
from sdk.progress import PlainProgress, Rate, budget_of, fmt_duration, progress_line
from tests.conftest import ROOT, nexus_cmd, python_env


def nexus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), cwd=ROOT, env=python_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_spec_validate_json_valid_and_invalid(tmp_path):
    out = nexus("spec", "validate", "examples/sft_reach.yaml", "--json")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert {k: reply[k] for k in ("file", "valid", "task", "tenant")} == {
        "file": "examples/sft_reach.yaml", "valid": True, "task": "sft", "tenant": "sft-reach"}
    # Offline: the row is measured against nats-server's default payload, and says so.
    assert 0 < reply["row_bytes"] < reply["row_limit_bytes"] < reply["max_payload"] == 1 << 20
    assert "offline" in reply["max_payload_source"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "examples/sft_reach.yaml").read_text()),
                                   "colour": "red", "task": "dance"}))
    out = nexus("spec", "validate", str(bad), "--json")
    assert out.returncode == 2
    reply = json.loads(out.stdout)
    assert reply["valid"] is False and {"colour", "task"} <= {e["field"] for e in reply["errors"]}
    # Without --json: a red header line, then one line per field error, all on stderr.
    out = nexus("spec", "validate", str(bad))
    assert out.returncode == 2 and not out.stdout
    assert out.stderr.startswith(f"error: {bad}: invalid workload spec")
    assert "colour: unknown field" in out.stderr and "task: 'dance' is not allowed" in out.stderr


def test_submit_leaves_a_kind_it_does_not_know_to_the_master(tmp_path):
    """A recipe's kind registered where the master runs (NEXUS_WORKFLOW_MODULES there) is not
    refused by the CLI's offline check: the spec goes to the master, which checks it (here no
    master answers: exit 1 on the connection, not 2 on the spec)."""
    spec = tmp_path / "repeat.yaml"
    spec.write_text(yaml.safe_dump({"tenant": "rep", "task": "repeat-eval", "env": {"id": "builtin/reach-v0"},
                                    "eval": {"version": "latest", "episodes": 2}, "algorithm": {"rounds": 3}}))
    out = nexus("submit", str(spec), "--nats-url", "nats://127.0.0.1:1", "--timeout-s", "1")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "task 'repeat-eval' is no kind this CLI knows" in out.stderr and "invalid workload spec" not in out.stderr


def test_dataset_info_json_through_nexus(libero_like):
    out = nexus("dataset", "info", str(libero_like), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["fps"] == 10 and info["total_frames"] == 90 and len(info["episodes"]) == 3
    out = nexus("dataset", "show", str(libero_like), "--index", "90")
    assert out.returncode == 2 and "out of range" in out.stderr


def test_bad_input_exits_2_with_one_error_line(tmp_path):
    for args, words in [
        (("spec", "validate"), "Missing argument 'FILE'"),
        (("up", "--nats-cluster", "2"), "2 is not one of 1, 3, 5"),
        (("no-such-command",), "No such command"),
        (("submit", str(tmp_path / "missing.yaml")), "cannot read"),
        (("dataset", "record", "--out", str(tmp_path / "x"), "--episodes", "1", "--env-option", "novalue"),
         "expected KEY=VALUE"),
    ]:
        out = nexus(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (args, out.stderr)


def test_no_cluster_is_a_failure_naming_the_fix(tmp_path):
    out = nexus("status", "--json", "--data-dir", str(tmp_path))
    assert out.returncode == 1 and not out.stdout
    assert out.stderr.startswith("error: no cluster found") and "nexus up" in out.stderr


def test_help_lists_every_command():
    out = nexus("--help")
    assert out.returncode == 0
    for command in ("up", "down", "status", "submit", "workloads", "tenants", "tenant", "cancel", "download",
                    "logs", "spec", "layout", "dataset"):
        assert command in out.stdout


def test_spec_validate_and_submit_import_no_torch(tmp_path):
    """`nexus spec validate` and `nexus submit` must start fast: neither imports torch nor transformers."""
    for args in (("spec", "validate", "examples/sft_reach.yaml"),
                 ("submit", "examples/sft_reach.yaml", "--nats-url", "nats://127.0.0.1:1", "--timeout-s", "1")):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "sdk.cli", *args], cwd=ROOT,
                             env=python_env(), capture_output=True, text=True, timeout=60)
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        assert "yaml" in imported, out.stderr[-2000:]  # the spec was read
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))
        assert not heavy, f"nexus {args[0]} imported {heavy[:5]}"


# -- plain progress lines ---------------------------------------------------------------------------
def record(state="running", step=0, episodes=0, metrics=None, task="sft", spec=None, message="", created_at=1000.0):
    spec = spec if spec is not None else {"algorithm": {"steps": 40}}
    return WorkloadRecord(workload="w-1", tenant="acme", task=task, state=state, spec=spec, created_at=created_at,
                          updated_at=created_at, step=step, episodes=episodes, metrics=metrics or {}, message=message)


def test_budget_of_each_task():
    assert budget_of(record(step=10)) == budget_of(record(step=10))
    assert (budget_of(record(step=10)).total, budget_of(record(step=10)).unit) == (40.0, "steps")
    rl = {"schedule": {"budget": {"max_steps": 8, "max_wall_s": 60}}}
    assert budget_of(record(task="rl", spec=rl, step=2)).total == 8
    wall = {"schedule": {"budget": {"max_wall_s": 60}}}
    b = budget_of(record(task="rl", spec=wall), now=1030.0)
    assert (b.done, b.total, b.unit) == (30.0, 60.0, "s")
    ev = budget_of(record(task="eval", spec={"eval": {"episodes": 5}}, episodes=2))
    assert (ev.done, ev.total, ev.unit) == (2, 5, "episodes")


def test_rate_and_eta_from_successive_records():
    rate = Rate()
    rate.update(record(step=0), now=0.0)
    rate.update(record(step=10), now=5.0)
    assert rate.per_s == pytest.approx(2.0) and rate.eta_s == pytest.approx(15.0)  # 30 steps left at 2/s
    rate.update(record(state="completed", step=40), now=20.0)
    assert rate.eta_s == 0.0
    assert fmt_duration(15.0) == "15s" and fmt_duration(130) == "2m10s" and fmt_duration(7300) == "2h01m"


def test_plain_progress_prints_one_line_per_change():
    buf = io.StringIO()
    view = PlainProgress(buf)
    rate = Rate()
    seq = [record(state="pending"), record(step=0), record(step=0), record(step=20, metrics={"loss": 0.5}),
           record(step=20, metrics={"loss": 0.5}), record(state="completed", step=40, metrics={"loss": 0.25})]
    for t, rec in enumerate(seq):
        view.show(rec, rate.update(rec, float(t)), float(t))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4  # the repeated records print nothing
    assert lines[0].split()[:4] == ["w-1", "acme", "sft", "pending"] and "0/40 steps" in lines[0]
    assert "[##########..........]" in lines[2] and "20/40 steps" in lines[2] and "loss=0.5000" in lines[2]
    assert "steps/s" in lines[2] and "eta " in lines[2]
    assert lines[3].split()[3] == "completed" and "[####################]" in lines[3] and "eta" not in lines[3]


def test_progress_line_for_rl_eval_and_failure():
    wall = {"schedule": {"budget": {"max_wall_s": 600}}}
    line = progress_line(record(task="rl", spec=wall, step=3, episodes=12, metrics={"success_rate": 0.25}),
                         now=1060.0)
    assert "step 3  ep 12  1m00s/10m00s" in line and "success=25%" in line and "[##......" in line
    line = progress_line(record(task="eval", spec={"eval": {"episodes": 4}}, episodes=1))
    assert "1/4 episodes" in line
    line = progress_line(record(state="failed", step=5, message="trainer lost"))
    assert line.endswith("(trainer lost)")
