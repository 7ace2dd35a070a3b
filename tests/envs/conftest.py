"""Shared fixtures for tests/envs: the lerobot-written fixture dataset and a recorded one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_ROOT = PROJECT_ROOT / ".." / "shared" / "fixtures" / "lerobot" / "libero_like"
EXPECTED_PATH = FIXTURE_ROOT.parent / "libero_like.expected.json"


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    if not (FIXTURE_ROOT / "meta" / "info.json").is_file():
        pytest.skip(f"lerobot fixture not found at {FIXTURE_ROOT}")
    return FIXTURE_ROOT


@pytest.fixture(scope="session")
def expected(fixture_root: Path) -> dict:
    return json.loads(EXPECTED_PATH.read_text())


@pytest.fixture(scope="session")
def recorded_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from envs.lerobot import RecordConfig, record

    out = tmp_path_factory.mktemp("rec") / "reach_video"
    record(RecordConfig(out=out, episodes=6, seed=100, use_videos=True))
    return out
