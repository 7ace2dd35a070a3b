"""LeRobot v3.0 datasets without the lerobot package: reader, writer, expert recording.

    from envs.lerobot import LeRobotReader, LeRobotWriter, WriterConfig, record, RecordConfig
"""

from envs.lerobot.meta import DatasetMeta, EpisodeMeta, FeatureSpec, load_meta
from envs.lerobot.reader import Batch, Frame, LeRobotReader, ReaderConfig
from envs.lerobot.record import RecordConfig, RecordProgress, RecordResult, record
from envs.lerobot.writer import LeRobotWriter, WriterConfig

__all__ = [
    "Batch",
    "DatasetMeta",
    "EpisodeMeta",
    "FeatureSpec",
    "Frame",
    "LeRobotReader",
    "LeRobotWriter",
    "ReaderConfig",
    "RecordConfig",
    "RecordProgress",
    "RecordResult",
    "WriterConfig",
    "load_meta",
    "record",
]
