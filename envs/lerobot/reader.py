"""Random-access reader of a local LeRobot v3.0 dataset (pyarrow + PyAV, no lerobot package).

    from envs.lerobot import LeRobotReader
    with LeRobotReader("/data/my_dataset") as ds:
        len(ds), ds.meta.fps, ds.meta.tasks
        frame = ds[45]            # Frame: episode/frame index, timestamp, task, state, action, images
        frame.images["observation.images.image"]      # uint8 (H, W, 3)
        batch = ds.sample(32, rng=np.random.default_rng(0))   # Batch of stacked numpy arrays

Item `i` is row `i` of the data parquet files read in path order, as in lerobot. Numeric
columns are loaded once (small); camera frames are decoded per episode and kept in an LRU
bounded by `cache_bytes`, so training that samples across episodes decodes each episode
roughly once while it stays hot. Not thread-safe: one reader per thread or process.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from envs.errors import ConfigError, DatasetFormatError, DatasetIndexError, DatasetNotFoundError
from envs.lerobot import constants as C
from envs.lerobot.meta import DatasetMeta, load_meta
from envs.lerobot.video import VideoDecoder

_INDEX_COLUMNS = (C.INDEX, C.EPISODE_INDEX, C.FRAME_INDEX, C.TIMESTAMP, C.TASK_INDEX)


@dataclass(frozen=True)
class ReaderConfig:
    root: Path
    tolerance_s: float = C.DEFAULT_TOLERANCE_S  # lerobot's default
    cache_bytes: int = 256 * 2**20  # decoded-episode cache; ~1,400 episodes of 2x64x64x50 frames
    max_open_videos: int = 8  # open mp4 containers kept (file handles + demuxer state)
    max_cached_image_files: int = 2  # data parquet files whose PNG columns stay in memory
    # Feature keys of a batch's state and action (a spec's dataset.state_key / action_key).
    state_key: str = C.OBS_STATE
    action_key: str = C.ACTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if not self.tolerance_s > 0:
            raise ConfigError(f"ReaderConfig.tolerance_s: must be > 0, got {self.tolerance_s}")
        for name in ("cache_bytes", "max_open_videos", "max_cached_image_files"):
            if getattr(self, name) < 0 or (name != "cache_bytes" and getattr(self, name) < 1):
                raise ConfigError(f"ReaderConfig.{name}: out of range: {getattr(self, name)}")


@dataclass
class Frame:
    index: int
    episode_index: int
    frame_index: int
    timestamp: float  # the stored float32 value, widened
    task_index: int
    task: str
    state: np.ndarray | None  # observation.state, if the dataset has it
    action: np.ndarray | None
    images: dict[str, np.ndarray]  # camera key -> uint8 (H, W, 3)
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # other non-visual features


@dataclass
class Batch:
    index_B: np.ndarray
    episode_index_B: np.ndarray
    frame_index_B: np.ndarray
    timestamp_B: np.ndarray
    task_index_B: np.ndarray
    task_B: list[str]
    state_B_S: np.ndarray | None
    action_B_A: np.ndarray | None
    images: dict[str, np.ndarray]  # camera key -> uint8 (B, H, W, 3)
    extras: dict[str, np.ndarray] = field(default_factory=dict)


def _column_to_numpy(col: pa.ChunkedArray, shape: tuple[int, ...]) -> np.ndarray:
    arr = col.combine_chunks()
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        flat = arr.flatten()
        while pa.types.is_fixed_size_list(flat.type) or pa.types.is_list(flat.type):
            flat = flat.flatten()
        return flat.to_numpy(zero_copy_only=False).reshape((n, *shape))
    out = arr.to_numpy(zero_copy_only=False)
    return out.reshape((n, *shape)) if shape not in ((), (1,)) else out


class LeRobotReader:
    def __init__(self, root: str | Path | ReaderConfig) -> None:
        self.config = root if isinstance(root, ReaderConfig) else ReaderConfig(Path(root))
        self.meta: DatasetMeta = load_meta(self.config.root)
        self._decoder = VideoDecoder(self.config.max_open_videos, self.config.tolerance_s)
        self._episode_cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self._episode_cache_bytes = 0
        self._image_tables: OrderedDict[Path, pa.Table] = OrderedDict()
        # One read at a time: PyAV containers and the LRU caches are not thread-safe, and an env
        # worker serves concurrent `sample` requests from worker threads (they segfaulted it).
        self._lock = threading.RLock()
        self._load_columns()

    # -- loading -------------------------------------------------------------------------
    def _load_columns(self) -> None:
        meta = self.meta
        files = sorted({(e.data_chunk_index, e.data_file_index) for e in meta.episodes})
        paths = [meta.data_file(c, f) for c, f in files]
        numeric = [k for k, f in meta.features.items() if not f.is_visual]
        per_col: dict[str, list[np.ndarray]] = {k: [] for k in numeric}
        file_of_row, row_in_file = [], []
        for file_id, path in enumerate(paths):
            if not path.is_file():
                raise DatasetNotFoundError(f"data file missing: {path}", details={"path": str(path)})
            table = pq.read_table(path, columns=None)
            for k in numeric:
                if k not in table.column_names:
                    raise DatasetFormatError(f"{path}: missing column {k!r} (declared in {C.INFO_PATH} features)")
                per_col[k].append(_column_to_numpy(table.column(k), meta.features[k].shape))
            file_of_row.append(np.full(table.num_rows, file_id, np.int32))
            row_in_file.append(np.arange(table.num_rows, dtype=np.int64))
        self._paths = paths
        self._cols = {k: np.concatenate(v) if v else np.zeros(0) for k, v in per_col.items()}
        self._file_of_row = np.concatenate(file_of_row) if file_of_row else np.zeros(0, np.int32)
        self._row_in_file = np.concatenate(row_in_file) if row_in_file else np.zeros(0, np.int64)
        for k in _INDEX_COLUMNS:
            if k not in self._cols:
                raise DatasetFormatError(f"{meta.root / C.INFO_PATH}: features lack the default column {k!r}")
        n = len(self._file_of_row)
        if n != sum(e.length for e in meta.episodes):
            raise DatasetFormatError(
                f"{meta.root}: data files hold {n} rows but {C.EPISODES_DIR} lengths sum to "
                f"{sum(e.length for e in meta.episodes)}"
            )
        self._n = n

    # -- public API ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __enter__(self) -> LeRobotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._decoder.close()
            self._episode_cache.clear()
            self._episode_cache_bytes = 0
            self._image_tables.clear()

    def check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise DatasetIndexError(f"frame index must be an int, got {type(index).__name__}")
        i = int(index)
        if i < -self._n or i >= self._n:
            valid = f"0..{self._n - 1}" if self._n else "none (empty dataset)"
            raise DatasetIndexError(
                f"frame index {i} is out of range for {self.meta.root} ({self._n} frames; valid range {valid})",
                details={"index": i, "num_frames": self._n},
            )
        return i % self._n

    def __getitem__(self, index: int) -> Frame:
        b = self.get_batch([index])
        return Frame(
            index=int(b.index_B[0]),
            episode_index=int(b.episode_index_B[0]),
            frame_index=int(b.frame_index_B[0]),
            timestamp=float(b.timestamp_B[0]),
            task_index=int(b.task_index_B[0]),
            task=b.task_B[0],
            state=None if b.state_B_S is None else b.state_B_S[0],
            action=None if b.action_B_A is None else b.action_B_A[0],
            images={k: v[0] for k, v in b.images.items()},
            extras={k: v[0] for k, v in b.extras.items()},
        )

    def sample(self, n: int, rng: np.random.Generator | int | None = None) -> Batch:
        """n frames drawn uniformly with replacement from a seeded generator."""
        if n <= 0:
            raise ConfigError(f"sample: n must be > 0, got {n}")
        if isinstance(rng, int) and rng < 0:  # numpy's ValueError would read as a server bug
            raise ConfigError(f"sample: seed must be >= 0, got {rng}")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        return self.get_batch(gen.integers(0, self._n, size=n))

    def get_batch(self, indices: Any) -> Batch:
        with self._lock:
            return self._get_batch(indices)

    def _get_batch(self, indices: Any) -> Batch:
        idx_B = np.fromiter((self.check_index(i) for i in np.asarray(indices).reshape(-1).tolist()), np.int64)
        cols = self._cols
        ep_B = cols[C.EPISODE_INDEX][idx_B].astype(np.int64)
        task_index_B = cols[C.TASK_INDEX][idx_B].astype(np.int64)
        state_key, action_key = self.config.state_key, self.config.action_key
        extras_keys = [k for k in cols if k not in (*_INDEX_COLUMNS, state_key, action_key)]
        return Batch(
            index_B=cols[C.INDEX][idx_B],
            episode_index_B=ep_B,
            frame_index_B=cols[C.FRAME_INDEX][idx_B],
            timestamp_B=cols[C.TIMESTAMP][idx_B],
            task_index_B=task_index_B,
            task_B=[self._task(int(t)) for t in task_index_B],
            state_B_S=cols[state_key][idx_B] if state_key in cols else None,
            action_B_A=cols[action_key][idx_B] if action_key in cols else None,
            images={k: self._images(k, idx_B, ep_B) for k in self.meta.camera_keys},
            extras={k: cols[k][idx_B] for k in extras_keys},
        )

    # -- internals -------------------------------------------------------------------------
    def _task(self, task_index: int) -> str:
        try:
            return self.meta.tasks[task_index]
        except KeyError:
            raise DatasetFormatError(f"{self.meta.root / C.TASKS_PATH}: no task with task_index {task_index}") from None

    def _images(self, key: str, idx_B: np.ndarray, ep_B: np.ndarray) -> np.ndarray:
        if self.meta.features[key].dtype == C.DTYPE_IMAGE:
            return np.stack([self._png(key, int(i)) for i in idx_B])
        out = None
        for ep in np.unique(ep_B):
            frames = self._episode_video(int(ep), key)
            sel = ep_B == ep
            local = idx_B[sel] - self.meta.episodes[int(ep)].dataset_from_index
            chunk = frames[local]
            if out is None:
                out = np.empty((len(idx_B), *chunk.shape[1:]), np.uint8)
            out[sel] = chunk
        return out

    def _episode_video(self, ep: int, key: str) -> np.ndarray:
        """All frames of one episode of one camera, aligned with the episode's rows."""
        cache_key = (ep, key)
        if cache_key in self._episode_cache:
            self._episode_cache.move_to_end(cache_key)
            return self._episode_cache[cache_key]
        e = self.meta.episodes[ep]
        rows = np.arange(e.dataset_from_index, e.dataset_to_index)
        query_ts = e.videos[key].from_timestamp + self._cols[C.TIMESTAMP][rows].astype(np.float64)
        frames = self._decoder.decode_at(self.meta.video_file(ep, key), query_ts)
        if frames.nbytes <= self.config.cache_bytes:
            self._episode_cache[cache_key] = frames
            self._episode_cache_bytes += frames.nbytes
            while self._episode_cache_bytes > self.config.cache_bytes:
                _, old = self._episode_cache.popitem(last=False)
                self._episode_cache_bytes -= old.nbytes
        return frames

    def _png(self, key: str, index: int) -> np.ndarray:
        path = self._paths[int(self._file_of_row[index])]
        table = self._image_tables.get(path)
        if table is None:
            table = pq.read_table(path, columns=self.meta.image_keys)
            self._image_tables[path] = table
            while len(self._image_tables) > self.config.max_cached_image_files:
                self._image_tables.popitem(last=False)
        else:
            self._image_tables.move_to_end(path)
        cell = table.column(key)[int(self._row_in_file[index])].as_py()
        data = cell.get("bytes") if isinstance(cell, dict) else None
        if not data:
            raise DatasetFormatError(f"{path}: row {int(self._row_in_file[index])} of {key!r} has no image bytes")
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
