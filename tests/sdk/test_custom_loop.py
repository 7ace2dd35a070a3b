"""examples/custom_loop.py runs against real services: a loop built only from primitives."""

from __future__ import annotations

import asyncio
import importlib.util

from tests.conftest import ROOT, run_client
from tests.support.tq_helpers import role_info


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_loop", ROOT / "examples" / "custom_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_custom_loop_from_primitives(roles, tmp_path):
    from envs.lerobot import record
    from envs.lerobot.record import RecordConfig

    for role in ("master", "trainer", "inferencer", "env"):
        roles.start(role)
    dataset = tmp_path / "demos"
    record(RecordConfig(out=dataset, episodes=4))
    out = asyncio.run(_load_example().run(roles.nats_url, roles.prefix, dataset, "loop", steps=4, episodes=2))
    assert len(out["losses"]) == 4 and all(l > 0 for l in out["losses"])
    assert out["version"] == 4  # one optimizer step per train_batch, each applied once
    # The evaluation went through the inferencer: a pinned prediction at every step of both
    # episodes (success_rate itself is a count over two episodes, any value of it is valid).
    inferencer = next(i for r, i, _ in roles.procs if r == "inferencer")
    served = run_client(roles, lambda c: role_info(c, "inferencer", inferencer)).extra["served"]
    assert served >= 2, served
