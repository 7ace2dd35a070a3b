"""Exceptions of the model core: one root, each subclass also a stdlib type.

Callers (trainer, inferencer) catch `ModelCoreError` to turn any model-core failure into an
error envelope; tests and plain Python callers can still catch `ValueError` / `KeyError`.
"""

from __future__ import annotations


class ModelCoreError(Exception):
    """Root of every error raised by `models`."""


class SchemaError(ModelCoreError, ValueError):
    """A tenant schema or config field is invalid; the message names the field and what is allowed."""


class InputError(ModelCoreError, ValueError):
    """An observation, batch or model input does not match what the schema or base expects."""


class IncompatibleBatchError(ModelCoreError, ValueError):
    """Batches with different compatibility keys were asked to share one base forward."""


class CheckpointError(ModelCoreError, ValueError):
    """Exported params or a checkpoint do not match the slot they are loaded into."""


class UnknownNameError(ModelCoreError, KeyError):
    """A preset, head kind or model family name is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""
