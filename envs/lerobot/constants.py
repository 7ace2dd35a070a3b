"""Feature keys, on-disk path templates and defaults of the LeRobot v3.0 format.

Copied in meaning from lerobot's `datasets/utils.py` and `utils/constants.py` so datasets we
write are read by real lerobot, and theirs by us.
"""

from __future__ import annotations

CODEBASE_VERSION = "v3.0"
SUPPORTED_CODEBASE_VERSIONS = ("v3.0",)

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"

DEFAULT_CHUNK_SIZE = 1000  # max files per chunk directory
DEFAULT_DATA_FILE_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILE_SIZE_IN_MB = 200

# lerobot's LeRobotDataset(tolerance_s=1e-4): a decoded frame must lie this close to its query.
DEFAULT_TOLERANCE_S = 1e-4

# Feature keys.
ACTION = "action"
OBS_STATE = "observation.state"
OBS_IMAGES_PREFIX = "observation.images."
TIMESTAMP = "timestamp"
FRAME_INDEX = "frame_index"
EPISODE_INDEX = "episode_index"
INDEX = "index"
TASK_INDEX = "task_index"
TASK = "task"

DTYPE_VIDEO = "video"
DTYPE_IMAGE = "image"
VISUAL_DTYPES = (DTYPE_VIDEO, DTYPE_IMAGE)

# Features every v3.0 dataset has, in lerobot's order and dtypes.
DEFAULT_FEATURES: dict[str, dict] = {
    TIMESTAMP: {"dtype": "float32", "shape": [1], "names": None},
    FRAME_INDEX: {"dtype": "int64", "shape": [1], "names": None},
    EPISODE_INDEX: {"dtype": "int64", "shape": [1], "names": None},
    INDEX: {"dtype": "int64", "shape": [1], "names": None},
    TASK_INDEX: {"dtype": "int64", "shape": [1], "names": None},
}

# info.json keys a reader cannot do without.
REQUIRED_INFO_KEYS = ("codebase_version", "fps", "features", "data_path", "total_episodes", "total_frames")

# meta/episodes columns.
EP_TASKS = "tasks"
EP_LENGTH = "length"
EP_DATA_CHUNK = "data/chunk_index"
EP_DATA_FILE = "data/file_index"
EP_FROM_INDEX = "dataset_from_index"
EP_TO_INDEX = "dataset_to_index"
EP_META_CHUNK = "meta/episodes/chunk_index"
EP_META_FILE = "meta/episodes/file_index"
EP_STATS_PREFIX = "stats/"


def ep_video_column(video_key: str, field: str) -> str:
    """field: chunk_index | file_index | from_timestamp | to_timestamp."""
    return f"videos/{video_key}/{field}"


# Column of tasks.parquet holding the task string: lerobot writes it as the pandas index.
TASKS_PANDAS_INDEX_COLUMN = "__index_level_0__"

# Names lerobot gives image/video feature axes.
IMAGE_AXIS_NAMES = ["height", "width", "channels"]

# PyAV encoder name -> codec name as ffprobe reports it (what lerobot stores in video.codec).
CODEC_NAMES = {"libsvtav1": "av1", "libaom-av1": "av1", "libx264": "h264", "h264": "h264",
               "libx265": "hevc", "hevc": "hevc", "mpeg4": "mpeg4"}
