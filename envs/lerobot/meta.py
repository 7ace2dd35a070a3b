"""Load and validate a LeRobot v3.0 dataset's metadata (meta/info.json, tasks, episodes).

    meta = load_meta("/data/my_dataset")
    meta.fps, meta.total_frames, meta.tasks[0], meta.episodes[2].length
    meta.video_keys, meta.image_keys, meta.features["action"].shape

Every problem raises a `DatasetError` subclass whose message names the file and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from envs.errors import DatasetFormatError, DatasetNotFoundError, UnsupportedDatasetVersionError
from envs.lerobot import constants as C


@dataclass(frozen=True)
class FeatureSpec:
    key: str
    dtype: str
    shape: tuple[int, ...]
    names: Any = None

    @property
    def is_visual(self) -> bool:
        return self.dtype in C.VISUAL_DTYPES


@dataclass(frozen=True)
class VideoSegment:
    """Where one episode of one camera lives inside a (shared) mp4 file."""

    chunk_index: int
    file_index: int
    from_timestamp: float
    to_timestamp: float


@dataclass(frozen=True)
class EpisodeMeta:
    episode_index: int
    length: int
    tasks: tuple[str, ...]
    dataset_from_index: int
    dataset_to_index: int
    data_chunk_index: int
    data_file_index: int
    videos: dict[str, VideoSegment] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # every non-stats column, as stored


@dataclass(frozen=True)
class DatasetMeta:
    root: Path
    info: dict[str, Any]  # the raw info.json
    features: dict[str, FeatureSpec]
    tasks: dict[int, str]  # task_index -> task
    episodes: tuple[EpisodeMeta, ...]

    @property
    def codebase_version(self) -> str:
        return self.info["codebase_version"]

    @property
    def fps(self) -> int:
        return self.info["fps"]

    @property
    def robot_type(self) -> str | None:
        return self.info.get("robot_type")

    @property
    def total_frames(self) -> int:
        return self.info["total_frames"]

    @property
    def total_episodes(self) -> int:
        return self.info["total_episodes"]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f.dtype == C.DTYPE_VIDEO]

    @property
    def image_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f.dtype == C.DTYPE_IMAGE]

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f.is_visual]

    def data_file(self, chunk_index: int, file_index: int) -> Path:
        return self.root / self.info["data_path"].format(chunk_index=chunk_index, file_index=file_index)

    def video_file(self, episode_index: int, video_key: str) -> Path:
        seg = self.episodes[episode_index].videos[video_key]
        return self.root / self.info["video_path"].format(
            video_key=video_key, chunk_index=seg.chunk_index, file_index=seg.file_index
        )


def _read_info(root: Path) -> dict[str, Any]:
    path = root / C.INFO_PATH
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: missing; a LeRobot dataset root needs {C.INFO_PATH}")
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise DatasetFormatError(f"{path}: top level must be an object, got {type(info).__name__}")
    for key in C.REQUIRED_INFO_KEYS:
        if key not in info:
            raise DatasetFormatError(f"{path}: missing key {key!r}", details={"key": key})
    version = info["codebase_version"]
    if version not in C.SUPPORTED_CODEBASE_VERSIONS:
        raise UnsupportedDatasetVersionError(
            f"{path}: codebase_version {version!r} is not supported; this reader reads "
            f"{', '.join(C.SUPPORTED_CODEBASE_VERSIONS)} (convert older datasets with lerobot's "
            "convert_dataset_v21_to_v30 script)",
            details={"codebase_version": version},
        )
    if not isinstance(info["fps"], (int, float)) or info["fps"] <= 0:
        raise DatasetFormatError(f"{path}: key 'fps' must be a positive number, got {info['fps']!r}")
    if not isinstance(info["features"], dict) or not info["features"]:
        raise DatasetFormatError(f"{path}: key 'features' must be a non-empty object")
    return info


def _parse_features(info: dict[str, Any], path: Path) -> dict[str, FeatureSpec]:
    features: dict[str, FeatureSpec] = {}
    for key, ft in info["features"].items():
        for sub in ("dtype", "shape"):
            if not isinstance(ft, dict) or sub not in ft:
                raise DatasetFormatError(f"{path}: key 'features.{key}.{sub}' is missing")
        features[key] = FeatureSpec(key, ft["dtype"], tuple(int(d) for d in ft["shape"]), ft.get("names"))
    if any(f.dtype == C.DTYPE_VIDEO for f in features.values()) and not info.get("video_path"):
        raise DatasetFormatError(f"{path}: missing key 'video_path' (the dataset has video features)")
    return features


def _read_tasks(root: Path) -> dict[int, str]:
    path = root / C.TASKS_PATH
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: missing")
    table = pq.read_table(path)
    names = table.column_names
    task_col = C.TASK if C.TASK in names else C.TASKS_PANDAS_INDEX_COLUMN
    if C.TASK_INDEX not in names or task_col not in names:
        raise DatasetFormatError(f"{path}: needs columns {C.TASK_INDEX!r} and {C.TASK!r} (or the pandas index)")
    return dict(zip(table.column(C.TASK_INDEX).to_pylist(), table.column(task_col).to_pylist(), strict=True))


def _read_episodes(root: Path, info: dict[str, Any], video_keys: list[str]) -> tuple[EpisodeMeta, ...]:
    files = sorted((root / C.EPISODES_DIR).glob("chunk-*/file-*.parquet"))
    if not files:
        raise DatasetNotFoundError(f"{root / C.EPISODES_DIR}: no chunk-*/file-*.parquet files")
    rows: list[dict[str, Any]] = []
    for path in files:
        # Per-episode stats columns are large and unused here; never read them.
        schema = pq.read_schema(path)
        cols = [n for n in schema.names if not n.startswith(C.EP_STATS_PREFIX)]
        rows.extend(pq.read_table(path, columns=cols).to_pylist())
    rows.sort(key=lambda r: r[C.EPISODE_INDEX])
    required = [C.EPISODE_INDEX, C.EP_LENGTH, C.EP_FROM_INDEX, C.EP_TO_INDEX, C.EP_DATA_CHUNK, C.EP_DATA_FILE]
    required += [C.ep_video_column(k, f) for k in video_keys
                 for f in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    episodes = []
    for i, row in enumerate(rows):
        for col in required:
            if col not in row:
                raise DatasetFormatError(f"{root / C.EPISODES_DIR}: missing column {col!r}")
        if row[C.EPISODE_INDEX] != i:
            raise DatasetFormatError(
                f"{root / C.EPISODES_DIR}: episode indices must be 0..N-1; found {row[C.EPISODE_INDEX]} at position {i}"
            )
        videos = {
            k: VideoSegment(
                int(row[C.ep_video_column(k, "chunk_index")]),
                int(row[C.ep_video_column(k, "file_index")]),
                float(row[C.ep_video_column(k, "from_timestamp")]),
                float(row[C.ep_video_column(k, "to_timestamp")]),
            )
            for k in video_keys
        }
        episodes.append(EpisodeMeta(
            episode_index=i,
            length=int(row[C.EP_LENGTH]),
            tasks=tuple(row.get(C.EP_TASKS) or ()),
            dataset_from_index=int(row[C.EP_FROM_INDEX]),
            dataset_to_index=int(row[C.EP_TO_INDEX]),
            data_chunk_index=int(row[C.EP_DATA_CHUNK]),
            data_file_index=int(row[C.EP_DATA_FILE]),
            videos=videos,
            raw=row,
        ))
    if len(episodes) != info["total_episodes"]:
        raise DatasetFormatError(
            f"{root / C.INFO_PATH}: key 'total_episodes' is {info['total_episodes']} but "
            f"{C.EPISODES_DIR} lists {len(episodes)} episodes"
        )
    return tuple(episodes)


def load_meta(root: str | Path) -> DatasetMeta:
    root = Path(root)
    if not root.exists():
        raise DatasetNotFoundError(f"dataset root {root} does not exist")
    if not root.is_dir():
        raise DatasetNotFoundError(f"dataset root {root} is not a directory")
    info = _read_info(root)
    features = _parse_features(info, root / C.INFO_PATH)
    video_keys = [k for k, f in features.items() if f.dtype == C.DTYPE_VIDEO]
    return DatasetMeta(
        root=root,
        info=info,
        features=features,
        tasks=_read_tasks(root),
        episodes=_read_episodes(root, info, video_keys),
    )
