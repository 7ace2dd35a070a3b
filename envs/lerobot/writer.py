"""Write a LeRobot v3.0 dataset (the layout lerobot 0.4.x writes and reads), episode by episode.

    features = {
        "observation.images.top": {"dtype": "video", "shape": [64, 64, 3]},   # or "image" (PNG)
        "observation.state": {"dtype": "float32", "shape": [4], "names": ["x", "y", "vx", "vy"]},
        "action": {"dtype": "float32", "shape": [2], "names": ["vx", "vy"]},
    }
    with LeRobotWriter(WriterConfig(root="/data/out", fps=10, features=features)) as w:
        w.add_episode("reach the red target", {"observation.images.top": frames_THWC, ...})
    # leaving the block without an exception finalizes: meta/info.json, tasks, episodes, stats

Layout: data/chunk-CCC/file-FFF.parquet (many episodes per file, rotated at
`data_files_size_in_mb`), videos/<key>/chunk-CCC/file-FFF.mp4 (episodes back to back, each
starting on a keyframe; rotated at `video_files_size_in_mb`), meta/episodes/chunk-000/
file-000.parquet with lerobot's columns (per-episode stats included), meta/tasks.parquet with
the task string as the pandas index, meta/stats.json. Timestamps are frame_index / fps.
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from envs.errors import ConfigError, DatasetError
from envs.lerobot import constants as C
from envs.lerobot import stats as S
from envs.lerobot.video import DEFAULT_CRF, DEFAULT_GOP, DEFAULT_PIX_FMT, DEFAULT_VCODEC, VideoEncoder

_NUMERIC_DTYPES = {"float32": pa.float32(), "float64": pa.float64(), "int64": pa.int64(),
                   "int32": pa.int32(), "bool": pa.bool_()}
_IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# PNG compression 1: lerobot's image writer uses it too; level 6 is ~3x slower for ~10% less.
_PNG_COMPRESS_LEVEL = 1


@dataclass(frozen=True)
class WriterConfig:
    root: Path
    fps: int
    features: dict[str, dict[str, Any]]  # user features (cameras, state, action, ...); defaults are added
    robot_type: str | None = None
    vcodec: str = DEFAULT_VCODEC  # lerobot's default (AV1); "libx264" and "mpeg4" also work
    pix_fmt: str = DEFAULT_PIX_FMT
    gop: int | None = DEFAULT_GOP
    crf: int | None = DEFAULT_CRF
    chunks_size: int = C.DEFAULT_CHUNK_SIZE
    data_files_size_in_mb: float = C.DEFAULT_DATA_FILE_SIZE_IN_MB  # rotate data files past this
    video_files_size_in_mb: float = C.DEFAULT_VIDEO_FILE_SIZE_IN_MB
    overwrite: bool = False  # replace an existing dataset at root (only if it holds meta/info.json)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if not isinstance(self.fps, int) or self.fps <= 0:
            raise ConfigError(f"WriterConfig.fps: must be a positive int, got {self.fps!r}")
        if not self.features:
            raise ConfigError("WriterConfig.features: at least one feature is required")
        for key, ft in self.features.items():
            where = f"WriterConfig.features[{key!r}]"
            if key in C.DEFAULT_FEATURES:
                raise ConfigError(f"{where}: is a default feature, added by the writer")
            if "dtype" not in ft or "shape" not in ft:
                raise ConfigError(f"{where}: needs 'dtype' and 'shape'")
            shape = tuple(ft["shape"])
            if ft["dtype"] in C.VISUAL_DTYPES:
                if len(shape) != 3 or shape[2] != 3:
                    raise ConfigError(f"{where}: cameras need shape [H, W, 3], got {list(shape)}")
            elif ft["dtype"] not in _NUMERIC_DTYPES:
                raise ConfigError(f"{where}: dtype must be one of {[*C.VISUAL_DTYPES, *_NUMERIC_DTYPES]}")
            elif len(shape) != 1:
                raise ConfigError(f"{where}: numeric features must be 1-D, got shape {list(shape)}")
        if self.vcodec not in C.CODEC_NAMES:
            raise ConfigError(f"WriterConfig.vcodec: must be one of {sorted(C.CODEC_NAMES)}, got {self.vcodec!r}")
        for name in ("chunks_size", "data_files_size_in_mb", "video_files_size_in_mb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"WriterConfig.{name}: must be > 0")


@dataclass
class _FilePos:
    chunk_index: int = 0
    file_index: int = 0

    def advance(self, chunks_size: int) -> None:
        self.file_index += 1
        if self.file_index >= chunks_size:
            self.chunk_index, self.file_index = self.chunk_index + 1, 0


@dataclass
class _VideoFile:
    pos: _FilePos = field(default_factory=_FilePos)
    encoder: VideoEncoder | None = None


def _png(frame_HWC: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame_HWC).save(buf, format="PNG", compress_level=_PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def _hf_feature(ft: dict[str, Any]) -> dict[str, Any]:
    """The `huggingface` parquet metadata entry for one feature (as `datasets` writes it)."""
    if ft["dtype"] == C.DTYPE_IMAGE:
        return {"_type": "Image"}
    value = {"dtype": ft["dtype"], "_type": "Value"}
    if list(ft["shape"]) == [1]:
        return value
    return {"feature": value, "length": int(ft["shape"][0]), "_type": "List"}


class LeRobotWriter:
    def __init__(self, config: WriterConfig) -> None:
        self.config = config
        root = config.root
        if root.exists() and any(root.iterdir()):
            if not config.overwrite:
                raise DatasetError(f"{root}: exists and is not empty (pass overwrite=True to replace a dataset)")
            if not (root / C.INFO_PATH).is_file():
                raise DatasetError(f"{root}: not empty and holds no {C.INFO_PATH}; refusing to delete it")
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        self.features: dict[str, dict[str, Any]] = {}
        for key, ft in config.features.items():
            entry = {"dtype": ft["dtype"], "shape": list(ft["shape"]), "names": ft.get("names")}
            if ft["dtype"] in C.VISUAL_DTYPES and entry["names"] is None:
                entry["names"] = list(C.IMAGE_AXIS_NAMES)
            self.features[key] = entry
        self.features.update({k: dict(v) for k, v in C.DEFAULT_FEATURES.items()})
        self._video_keys = [k for k, f in self.features.items() if f["dtype"] == C.DTYPE_VIDEO]
        self._tasks: dict[str, int] = {}
        self._episodes: list[dict[str, Any]] = []
        self._episode_stats: list[dict[str, dict[str, np.ndarray]]] = []
        self._total_frames = 0
        self._data_pos = _FilePos()
        self._data_buffer: list[pa.Table] = []
        self._data_buffer_bytes = 0
        self._videos = {k: _VideoFile() for k in self._video_keys}
        self._schema = self._data_schema()
        self._finalized = False

    # -- public API ------------------------------------------------------------------------
    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def abort(self) -> None:
        """Stop without finalizing: close open video files; the root keeps a partial dataset."""
        self._close_videos()

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    def add_episode(self, task: str, data: dict[str, Any]) -> int:
        """Append one episode; `data[key]` has a leading time axis T. Returns its episode index."""
        if self._finalized:
            raise DatasetError(f"{self.config.root}: writer already finalized")
        arrays = self._validate_episode(data)
        T = len(next(iter(arrays.values())))
        ep = len(self._episodes)
        from_index = self._total_frames
        task_index = self._tasks.setdefault(task, len(self._tasks))
        frame_index = np.arange(T, dtype=np.int64)
        arrays[C.TIMESTAMP] = (frame_index / self.config.fps).astype(np.float32)
        arrays[C.FRAME_INDEX] = frame_index
        arrays[C.EPISODE_INDEX] = np.full(T, ep, np.int64)
        arrays[C.INDEX] = from_index + frame_index
        arrays[C.TASK_INDEX] = np.full(T, task_index, np.int64)

        row: dict[str, Any] = {
            C.EPISODE_INDEX: ep,
            C.EP_TASKS: [task],
            C.EP_LENGTH: T,
            C.EP_DATA_CHUNK: self._data_pos.chunk_index,
            C.EP_DATA_FILE: self._data_pos.file_index,
            C.EP_FROM_INDEX: from_index,
            C.EP_TO_INDEX: from_index + T,
        }
        for key in self._video_keys:
            row.update(self._write_video(key, arrays[key]))
        self._buffer_data(arrays, T)

        ep_stats = {k: S.feature_stats(arrays[k], self.features[k]["dtype"] in C.VISUAL_DTYPES)
                    for k in self.features}
        self._episode_stats.append(ep_stats)
        for k, st in ep_stats.items():
            for name, value in st.items():
                row[f"{C.EP_STATS_PREFIX}{k}/{name}"] = value.tolist()
        row[C.EP_META_CHUNK] = 0
        row[C.EP_META_FILE] = 0
        self._episodes.append(row)
        self._total_frames += T
        return ep

    def finalize(self) -> Path:
        if self._finalized:
            return self.config.root
        if not self._episodes:
            self._close_videos()
            raise DatasetError(f"{self.config.root}: no episodes were added")
        self._flush_data()
        self._close_videos()
        root = self.config.root
        episodes_path = root / C.EPISODES_PATH.format(chunk_index=0, file_index=0)
        episodes_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self._episodes), episodes_path)
        self._write_tasks(root / C.TASKS_PATH)
        stats = {k: {n: v.tolist() for n, v in S.aggregate([s[k] for s in self._episode_stats]).items()}
                 for k in self.features}
        (root / C.STATS_PATH).write_text(json.dumps(stats, indent=4))
        (root / C.INFO_PATH).write_text(json.dumps(self._info(), indent=4))
        self._finalized = True
        return root

    # -- internals -------------------------------------------------------------------------
    def _validate_episode(self, data: dict[str, Any]) -> dict[str, np.ndarray]:
        user_keys = [k for k in self.features if k not in C.DEFAULT_FEATURES]
        missing = sorted(set(user_keys) - set(data))
        extra = sorted(set(data) - set(user_keys))
        if missing or extra:
            raise DatasetError(f"add_episode: keys must be {user_keys}; missing {missing}, unexpected {extra}")
        arrays: dict[str, np.ndarray] = {}
        lengths = set()
        for k in user_keys:
            ft = self.features[k]
            dtype = np.uint8 if ft["dtype"] in C.VISUAL_DTYPES else np.dtype(ft["dtype"])
            a = np.asarray(data[k])
            if a.shape[1:] != tuple(ft["shape"]):
                want = ", ".join(map(str, ft["shape"]))
                raise DatasetError(f"add_episode: {k!r} must have shape (T, {want}), got {a.shape}")
            arrays[k] = a.astype(dtype, copy=False)
            lengths.add(len(a))
        if len(lengths) != 1 or 0 in lengths:
            raise DatasetError(f"add_episode: every feature needs the same T >= 1, got lengths {sorted(lengths)}")
        return arrays

    def _data_schema(self) -> pa.Schema:
        fields, hf = [], {}
        for k, ft in self.features.items():
            if ft["dtype"] == C.DTYPE_VIDEO:
                continue
            if ft["dtype"] == C.DTYPE_IMAGE:
                typ = _IMAGE_STRUCT
            elif ft["shape"] == [1]:
                typ = _NUMERIC_DTYPES[ft["dtype"]]
            else:
                typ = pa.list_(_NUMERIC_DTYPES[ft["dtype"]], int(ft["shape"][0]))
            fields.append(pa.field(k, typ))
            hf[k] = _hf_feature(ft)
        return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": hf}})})

    def _buffer_data(self, arrays: dict[str, np.ndarray], T: int) -> None:
        cols = []
        for f in self._schema:
            a = arrays[f.name]
            if f.type == _IMAGE_STRUCT:
                cols.append(pa.array([{"bytes": _png(img), "path": f"frame-{i:06d}.png"} for i, img in enumerate(a)],
                                     type=_IMAGE_STRUCT))
            elif pa.types.is_fixed_size_list(f.type):
                cols.append(pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), type=f.type.value_type),
                                                              f.type.list_size))
            else:
                cols.append(pa.array(a.reshape(T), type=f.type))
        table = pa.Table.from_arrays(cols, schema=self._schema)
        self._data_buffer.append(table)
        self._data_buffer_bytes += table.nbytes
        if self._data_buffer_bytes >= self.config.data_files_size_in_mb * 2**20:
            self._flush_data()
            self._data_pos.advance(self.config.chunks_size)

    def _flush_data(self) -> None:
        if not self._data_buffer:
            return
        path = self.config.root / C.DATA_PATH.format(
            chunk_index=self._data_pos.chunk_index, file_index=self._data_pos.file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(self._data_buffer), path)
        self._data_buffer, self._data_buffer_bytes = [], 0

    def _write_video(self, key: str, frames_THWC: np.ndarray) -> dict[str, Any]:
        vf = self._videos[key]
        cfg = self.config
        if vf.encoder is None:
            h, w, _ = self.features[key]["shape"]
            path = cfg.root / C.VIDEO_PATH.format(video_key=key, chunk_index=vf.pos.chunk_index,
                                                  file_index=vf.pos.file_index)
            vf.encoder = VideoEncoder(path, cfg.fps, h, w, cfg.vcodec, cfg.pix_fmt, cfg.gop, cfg.crf)
        enc = vf.encoder
        from_ts = enc.frames_written / cfg.fps
        for i, frame in enumerate(frames_THWC):
            enc.write(frame, keyframe=i == 0)
        cols = {
            C.ep_video_column(key, "chunk_index"): vf.pos.chunk_index,
            C.ep_video_column(key, "file_index"): vf.pos.file_index,
            C.ep_video_column(key, "from_timestamp"): float(from_ts),
            C.ep_video_column(key, "to_timestamp"): float(enc.frames_written / cfg.fps),
        }
        # Rotate between episodes (never inside one), like lerobot, once the file is big enough.
        if enc.bytes_written >= cfg.video_files_size_in_mb * 2**20:
            enc.close()
            vf.encoder = None
            vf.pos.advance(cfg.chunks_size)
        return cols

    def _close_videos(self) -> None:
        for vf in self._videos.values():
            if vf.encoder is not None:
                vf.encoder.close()
                vf.encoder = None

    def _write_tasks(self, path: Path) -> None:
        # lerobot writes tasks with pandas: the task string is the (unnamed) index.
        tasks = sorted(self._tasks.items(), key=lambda kv: kv[1])
        pandas_meta = {
            "index_columns": [C.TASKS_PANDAS_INDEX_COLUMN],
            "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                                "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
            "columns": [
                {"name": C.TASK_INDEX, "field_name": C.TASK_INDEX, "pandas_type": "int64",
                 "numpy_type": "int64", "metadata": None},
                {"name": None, "field_name": C.TASKS_PANDAS_INDEX_COLUMN, "pandas_type": "unicode",
                 "numpy_type": "object", "metadata": None},
            ],
            "attributes": {},
            "creator": {"library": "pyarrow", "version": pa.__version__},
            "pandas_version": "2.2.3",
        }
        table = pa.table(
            {C.TASK_INDEX: pa.array([i for _, i in tasks], pa.int64()),
             C.TASKS_PANDAS_INDEX_COLUMN: pa.array([t for t, _ in tasks], pa.large_string())},
        ).replace_schema_metadata({"pandas": json.dumps(pandas_meta)})
        pq.write_table(table, path)

    def _info(self) -> dict[str, Any]:
        cfg = self.config
        features = {}
        for k, ft in self.features.items():
            entry = dict(ft)
            if ft["dtype"] == C.DTYPE_VIDEO:
                h, w, c = ft["shape"]
                entry["info"] = {
                    "video.height": h, "video.width": w, "video.codec": C.CODEC_NAMES[cfg.vcodec],
                    "video.pix_fmt": cfg.pix_fmt, "video.is_depth_map": False, "video.fps": cfg.fps,
                    "video.channels": c, "has_audio": False,
                }
            features[k] = entry
        return {
            "codebase_version": C.CODEBASE_VERSION,
            "robot_type": cfg.robot_type,
            "total_episodes": len(self._episodes),
            "total_frames": self._total_frames,
            "total_tasks": len(self._tasks),
            "chunks_size": cfg.chunks_size,
            "data_files_size_in_mb": cfg.data_files_size_in_mb,
            "video_files_size_in_mb": cfg.video_files_size_in_mb,
            "fps": cfg.fps,
            "splits": {"train": f"0:{len(self._episodes)}"},
            "data_path": C.DATA_PATH,
            "video_path": C.VIDEO_PATH if self._video_keys else None,
            "features": features,
        }
