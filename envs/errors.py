"""Errors raised by simulators and dataset readers.

Every class roots in `protocol.errors.NexusError` (so the env worker can turn it into an
error reply with a stable code) and also inherits the stdlib type a Python caller would
expect (`KeyError`-like lookups raise `LookupError` subclasses, bad values `ValueError`).

    from envs.errors import EnvError, DatasetError
    try:
        env = envs.make("builtin/nope-v0")
    except EnvError as e:
        print(e.message)  # names the id and lists the known ones
"""

from __future__ import annotations

from protocol.errors import ErrorCode, NexusError


class EnvError(NexusError):
    """Root of simulator errors."""

    code = ErrorCode.INVALID_FIELD


class UnknownEnvError(EnvError, LookupError):
    code = ErrorCode.NOT_FOUND


class UnknownTaskError(EnvError, LookupError):
    code = ErrorCode.NOT_FOUND


class ActionError(EnvError, ValueError):
    """Action of the wrong shape or with non-finite values."""

    code = ErrorCode.INVALID_FIELD


class EnvStateError(EnvError, RuntimeError):
    """step before reset, or any call after close."""

    code = ErrorCode.CONFLICT


class ConfigError(EnvError, ValueError):
    """A config dataclass field is invalid; the message names the field."""

    code = ErrorCode.INVALID_FIELD


class DatasetError(NexusError):
    """Root of dataset read/write errors."""

    code = ErrorCode.INVALID_FIELD


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    code = ErrorCode.NOT_FOUND


class DatasetFormatError(DatasetError, ValueError):
    """info.json or a parquet/video file is missing a key or is inconsistent."""

    code = ErrorCode.INVALID_FIELD


class UnsupportedDatasetVersionError(DatasetError, ValueError):
    code = ErrorCode.UNSUPPORTED_VERSION


class DatasetIndexError(DatasetError, IndexError):
    code = ErrorCode.NOT_FOUND


class FrameTimestampError(DatasetError, ValueError):
    """No decoded video frame lies within tolerance of the requested timestamp."""

    code = ErrorCode.INVALID_FIELD
