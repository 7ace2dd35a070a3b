"""LeRobotReader against the fixture written by lerobot 0.4.4 itself, and its error messages.

Pixel tolerance: the fixture README says decoding with pyarrow + PyAV gives pixels identical
to lerobot's, so means must agree to float rounding and the 4x4 patches exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from envs.errors import (
    DatasetFormatError,
    DatasetIndexError,
    DatasetNotFoundError,
    UnsupportedDatasetVersionError,
)
from envs.lerobot import LeRobotReader, ReaderConfig, load_meta

MEAN_TOL = 1e-6


def _float_chw(img_HWC: np.ndarray) -> np.ndarray:
    return img_HWC.transpose(2, 0, 1).astype(np.float32) / 255.0


def test_metadata_matches_lerobot(fixture_root, expected):
    meta = load_meta(fixture_root)
    em = expected["meta"]
    assert meta.info == expected["info_json"]
    assert meta.fps == em["fps"] and meta.robot_type == em["robot_type"]
    assert meta.total_episodes == em["total_episodes"] and meta.total_frames == em["total_frames"]
    assert len(meta.tasks) == em["total_tasks"]
    assert {str(k): v for k, v in meta.tasks.items()} == em["tasks"]
    assert meta.camera_keys == em["camera_keys"]
    assert meta.video_keys == em["video_keys"] and meta.image_keys == em["image_keys"]
    for key, ft in em["features"].items():
        spec = meta.features[key]
        assert (spec.dtype, list(spec.shape), spec.names) == (ft["dtype"], ft["shape"], ft["names"])
    assert [e.raw for e in meta.episodes] == em["episodes"]
    with LeRobotReader(fixture_root) as ds:
        assert len(ds) == em["num_frames (len(ds))"]


def test_sampled_frames_match_lerobot(fixture_root, expected):
    with LeRobotReader(fixture_root) as ds:
        for ef in expected["frames"]:
            f = ds[ef["global_index"]]
            assert (f.index, f.episode_index, f.frame_index, f.task_index) == (
                ef["index"], ef["episode_index"], ef["frame_index"], ef["task_index"])
            assert f.timestamp == ef["timestamp"]
            assert f.task == ef["task"]
            assert np.array_equal(f.state, np.array(ef["observation.state"], np.float32))
            assert np.array_equal(f.action, np.array(ef["action"], np.float32))
            for key, cam in ef["cameras"].items():
                img = f.images[key]
                assert img.dtype == np.uint8 and list(img.transpose(2, 0, 1).shape) == cam["returned_shape"]
                chw = _float_chw(img)
                np.testing.assert_allclose(chw.astype(np.float64).mean(axis=(1, 2)), cam["mean_per_channel"], atol=MEAN_TOL)
                assert img.transpose(2, 0, 1)[:, :4, :4].tolist() == cam["patch_top_left_4x4_uint8_CHW"]


def test_every_frame_aligned_with_lerobot(fixture_root, expected):
    """Per-channel means of all 90 frames of both cameras: an off-by-one frame lookup fails here."""
    with LeRobotReader(fixture_root) as ds:
        batch = ds.get_batch(np.arange(len(ds)))
    for key, rt in expected["roundtrip_all_frames"].items():
        means = _float_chw_batch(batch.images[key])
        np.testing.assert_allclose(means, rt["mean_per_channel_all_frames"], atol=MEAN_TOL)


def _float_chw_batch(imgs_BHWC: np.ndarray) -> np.ndarray:
    return (imgs_BHWC.astype(np.float32) / 255.0).astype(np.float64).mean(axis=(1, 2))


def test_sample_is_seeded_and_batched(libero_like):
    with LeRobotReader(libero_like) as ds:
        a = ds.sample(16, rng=3)
        b = ds.sample(16, rng=np.random.default_rng(3))
        assert np.array_equal(a.index_B, b.index_B)
        assert a.state_B_S.shape == (16, 8) and a.action_B_A.shape == (16, 7)
        assert a.images["observation.images.image"].shape == (16, 64, 64, 3)
        assert len(a.task_B) == 16
        for i, idx in enumerate(a.index_B[:4]):
            f = ds[int(idx)]
            assert np.array_equal(f.images["observation.images.wrist_image"], a.images["observation.images.wrist_image"][i])


def test_decoded_episode_cache_is_bounded(libero_like):
    one_episode = 35 * 64 * 64 * 3  # the longest episode of one camera
    with LeRobotReader(ReaderConfig(libero_like, cache_bytes=one_episode)) as ds:
        ds.get_batch(np.arange(len(ds)))
        assert ds._episode_cache_bytes <= one_episode
        assert len(ds._episode_cache) == 1
    with LeRobotReader(ReaderConfig(libero_like, cache_bytes=0)) as ds:  # no caching still works
        assert ds[89].episode_index == 2 and not ds._episode_cache


def test_negative_index_counts_from_the_end(libero_like):
    with LeRobotReader(libero_like) as ds:
        assert ds[-1].index == 89


# -- errors ------------------------------------------------------------------------------
@pytest.fixture
def copy_root(libero_like, tmp_path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(libero_like, dst)
    return dst


def test_missing_root(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        LeRobotReader(tmp_path / "nope")


def test_missing_info_json(copy_root):
    (copy_root / "meta" / "info.json").unlink()
    with pytest.raises(DatasetNotFoundError, match="info.json"):
        LeRobotReader(copy_root)


def test_bad_json(copy_root):
    (copy_root / "meta" / "info.json").write_text("{not json")
    with pytest.raises(DatasetFormatError, match="not valid JSON"):
        LeRobotReader(copy_root)


@pytest.mark.parametrize("key", ["fps", "features", "codebase_version", "data_path"])
def test_missing_info_key_is_named(copy_root, key):
    path = copy_root / "meta" / "info.json"
    info = json.loads(path.read_text())
    del info[key]
    path.write_text(json.dumps(info))
    with pytest.raises(DatasetFormatError, match=f"missing key '{key}'"):
        LeRobotReader(copy_root)


def test_unsupported_version(copy_root):
    path = copy_root / "meta" / "info.json"
    info = json.loads(path.read_text())
    info["codebase_version"] = "v2.1"
    path.write_text(json.dumps(info))
    with pytest.raises(UnsupportedDatasetVersionError, match="'v2.1' is not supported"):
        LeRobotReader(copy_root)


def test_missing_video_file_names_the_path(copy_root):
    video = copy_root / "videos" / "observation.images.wrist_image" / "chunk-000" / "file-000.mp4"
    video.unlink()
    with LeRobotReader(copy_root) as ds:
        with pytest.raises(DatasetNotFoundError) as e:
            ds[3]
    assert str(video) in e.value.message


def test_index_past_the_end_gives_the_valid_range(libero_like):
    with LeRobotReader(libero_like) as ds:
        with pytest.raises(DatasetIndexError, match=r"valid range 0\.\.89") as e:
            ds[90]
        assert isinstance(e.value, IndexError)
