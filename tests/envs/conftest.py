"""Shared fixtures for tests/envs: the lerobot-written fixture dataset and a recorded one.

`fixture_root` / `expected` are the dataset the lerobot library wrote and what it read back
(`tests.conftest.LEROBOT_FIXTURE`, not part of this repository): tests that compare against
them skip without it. A test that only needs a dataset of that shape takes `libero_like`
(tests/conftest.py), which the session writes itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import LEROBOT_FIXTURE as FIXTURE_ROOT

os.environ.setdefault("OMP_NUM_THREADS", "1")

EXPECTED_PATH = FIXTURE_ROOT.parent / "libero_like.expected.json"


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    if not (FIXTURE_ROOT / "meta" / "info.json").is_file():
        pytest.skip(f"compares against what the lerobot library wrote and read back; that fixture "
                    f"is not part of this repository and is not at {FIXTURE_ROOT}")
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
