"""The role image holds every package a role imports: each one is copied by the Dockerfile and
let through by .dockerignore (which ignores everything else). A new top-level package that
misses either breaks the image at build time, after minutes; this says so in a second."""

from __future__ import annotations

import re

from tests.conftest import ROOT
from tests.test_architecture import FLOOR

# Packages the role image does not need: benchmarks and deployment helpers run on the host.
HOST_ONLY = {"bench", "deploy"}


def test_every_runtime_package_is_in_the_image_context():
    packages = sorted(set(FLOOR) - HOST_ONLY)
    allowed = {line[1:].strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "deploy/compose/Dockerfile").read_text(), re.M))
    assert not [p for p in packages if p not in allowed], f".dockerignore lets through {sorted(allowed)}"
    assert not [p for p in packages if p not in copied], f"the Dockerfile copies {sorted(copied)}"
