"""sdk/dataset_cli.py handlers through argparse, and once as `python -m sdk.dataset_cli`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdk.dataset_cli import EXIT_OK, EXIT_USAGE, add_dataset_commands
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nexus")
    add_dataset_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dataset", *argv])
    return args.func(args)


def test_info_json(fixture_root, expected, capsys):
    assert run_cli(["info", str(fixture_root), "--json"]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["fps"] == 10 and out["total_episodes"] == 3 and out["total_frames"] == 90
    assert out["tasks"] == expected["meta"]["tasks"]
    names = expected["meta"]["features"]["observation.state"]["names"]
    assert out["features"]["observation.state"] == {"dtype": "float32", "shape": [8], "names": names}
    assert [e["length"] for e in out["episodes"]] == [30, 25, 35]


def test_info_table(libero_like, capsys):
    assert run_cli(["info", str(libero_like)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "fps 10" in out and "observation.images.image" in out and "open the top drawer" in out


def test_show_json_matches_lerobot(fixture_root, expected, capsys):
    ef = next(f for f in expected["frames"] if f["global_index"] == 45)
    assert run_cli(["show", str(fixture_root), "--index", "45", "--json"]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert (out["episode_index"], out["frame_index"], out["timestamp"], out["task"]) == (
        ef["episode_index"], ef["frame_index"], ef["timestamp"], ef["task"])
    assert out["state"] == pytest.approx(ef["observation.state"], abs=0)
    assert out["action"] == pytest.approx(ef["action"], abs=0)
    for key, cam in ef["cameras"].items():
        np.testing.assert_allclose(out["cameras"][key]["mean_per_channel"], cam["mean_per_channel"], atol=1e-6)


def test_show_index_past_end(libero_like, capsys):
    assert run_cli(["show", str(libero_like), "--index", "90"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "out of range" in err and "0..89" in err


def test_info_missing_root(tmp_path, capsys):
    assert run_cli(["info", str(tmp_path / "nope")]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err


def test_record_then_info(tmp_path, capsys):
    out = tmp_path / "demos"
    assert run_cli(["record", "--out", str(out), "--episodes", "3", "--seed", "5", "--images"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "record: episode 3/3" in captured.err and "wrote 3 episodes" in captured.out
    assert run_cli(["info", str(out), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["features"]["observation.images.top"]["dtype"] == "image" and info["total_episodes"] == 3


def test_record_with_env_options_and_noise(tmp_path, capsys):
    out = tmp_path / "demos"
    argv = ["record", "--out", str(out), "--episodes", "2", "--images", "--noise", "0.3",
            "--env-option", "image_size=32", "--env-option", "cameras=[top]"]
    assert run_cli(argv) == EXIT_OK
    capsys.readouterr()
    assert run_cli(["info", str(out), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["features"]["observation.images.top"]["shape"][:2] == [32, 32]
    assert "observation.images.wrist" not in info["features"]
    # An option the env does not know: a usage error naming it, nothing written.
    bad = ["record", "--out", str(tmp_path / "bad"), "--episodes", "1", "--env-option", "colour=red"]
    assert run_cli(bad) == EXIT_USAGE
    assert "colour" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        run_cli(["record", "--out", str(tmp_path / "x"), "--episodes", "1", "--env-option", "novalue"])


def test_record_unknown_env(tmp_path, capsys):
    assert run_cli(["record", "--out", str(tmp_path / "x"), "--episodes", "1", "--env", "nope/v0"]) == EXIT_USAGE
    assert "known env ids" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_module_entry_point(libero_like):
    proc = subprocess.run(
        [sys.executable, "-m", "sdk.dataset_cli", "show", str(libero_like), "--index", "0", "--json"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["task"] == "put the black bowl on the plate"
