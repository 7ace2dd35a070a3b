"""Shared fixtures for tests/models: the tiny base most model tests run on."""

from __future__ import annotations

import pytest

from models import BaseConfig, BaseModel


@pytest.fixture(scope="module")
def base() -> BaseModel:
    """tiny-qwen3-vl at 64 px on CPU, one copy per module: tests hook its core and attach LoRA
    routers to it, so modules never share one. A module that runs on other bases overrides it."""
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
