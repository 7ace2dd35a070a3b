"""What a run would refuse in its first seconds, checked at submit and by `nexus spec validate`.

`master.spec.parse_spec` checks a spec on its own; this checks it against the things it runs
on, each known without a deployment, a simulator or torch:

  * the env (`envs.registry.describe`): env.options against the options the env id takes
    (an unknown key names the allowed ones; values go through the env's own config checks),
    and the observation against what the env renders with those options (camera names and
    sizes, state and action lengths), plus a scripted expert for env.demos;
  * the head (`head_options`, read from models/heads/*.py's source): action_module.params
    against the head kind's config fields (unknown keys, value types);
  * the broker: one training-queue row (one sample of a micro-batch: every camera's frame,
    state, action chunk and the RL fields) must fit one message, the broker's max payload
    less `protocol.policy.CHUNK_HEADROOM_BYTES` (a micro-batch is split row-wise, never a row).

The master runs it on every sft / rl submit with its server's max payload before anything
of the tenant is created (master/workloads.py); `nexus spec validate` offline with
nats-server's default (`DEFAULT_MAX_PAYLOAD`), and says which one it used. What could not be
checked without the env's simulator (an env id only an env worker's plugin registers, cameras
a ManiSkill task outside the table renders, LIBERO's camera names) is no error: `unchecked`
lists it, and `nexus spec validate` prints it as "not checked here" notes.

    errors = run_errors(spec, max_payload=DEFAULT_MAX_PAYLOAD)   # [(field, message, value)]
"""

from __future__ import annotations

import ast
import functools
import math
from pathlib import Path
from typing import Any

from master.spec import PPO_HEAD_FIELDS, WorkloadSpec
from protocol.policy import CHUNK_HEADROOM_BYTES

# nats-server's own default max_payload (1 MiB): the deployment (nexus up) does not change it.
DEFAULT_MAX_PAYLOAD = 1 << 20
# What a row's instruction is counted as: the real ones come from the env or the dataset
# (the built-in tasks' are ~25 bytes); a row must still fit with a long one.
INSTRUCTION_ALLOWANCE_BYTES = 256
# Per image array, what its msgpack header may grow by from a 1x1 frame to a large one.
_ARRAY_HEADER_SLACK = 16

_HEADS_DIR = Path(__file__).resolve().parents[1] / "models" / "heads"
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


@functools.cache
def head_options() -> dict[str, dict[str, str]]:
    """head kind -> {option: annotation} of its config dataclass, read from the source of
    models/heads/*.py (the `@register_head(kind, Config)` lines): importing the models pulls in
    torch, which `nexus spec validate` must not (tests/master/test_submit_checks.py checks both agree)."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(_HEADS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_head"
                    and len(node.args) == 2 and isinstance(node.args[1], ast.Name)):
                continue
            kind = node.args[0].value if isinstance(node.args[0], ast.Constant) else consts.get(
                getattr(node.args[0], "id", ""))
            cls = classes.get(node.args[1].id)
            if isinstance(kind, str) and cls is not None:
                out[kind] = {s.target.id: ast.unparse(s.annotation) for s in cls.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


def _type_ok(annotation: str, value: Any) -> bool:
    """A plain option value against its annotation (int, float, bool, str, X | None)."""
    parts = [p.strip() for p in annotation.split("|")]
    if value is None:
        return "None" in parts
    for part in parts:
        if part == "None":
            continue
        types = _TYPES.get(part)
        if types is None:
            return True  # an annotation this check does not know: the model core judges it
        if isinstance(value, types) and (part == "bool" or not isinstance(value, bool)):
            return True
    return False


def head_errors(spec: WorkloadSpec) -> list[tuple[str, str, Any]]:
    module = spec.action_module
    if module is None:
        return []
    options = head_options().get(module.kind)
    if options is None:
        return []
    if spec.family == "rl":  # PPO settings live under algorithm (master.spec's own rule says so)
        options = {k: v for k, v in options.items() if k not in PPO_HEAD_FIELDS}
    errors: list[tuple[str, str, Any]] = []
    allowed = ", ".join(sorted(options))
    for key, value in module.params.items():
        field = f"action_module.params.{key}"
        if key in PPO_HEAD_FIELDS and spec.family == "rl":
            continue
        if key not in options:
            errors.append((field, f"unknown option of head {module.kind!r}; allowed: {allowed}", key))
        elif not _type_ok(options[key], value):
            errors.append((field, f"{value!r} is not allowed; head {module.kind!r} takes {options[key]} here", value))
    return errors


def env_errors(spec: WorkloadSpec, whose: str = "") -> list[tuple[str, str, Any]]:
    """env.options and env.demos against the env id, and the observation / action against
    what it renders with those options. ``whose``: how to name the observation's owner in
    messages (an eval's comes from the policy it scores)."""
    import envs.registry as registry

    env = spec.env
    if env is None or env.hosted is not None:
        return []  # a hosted env is the tenant's own: its process checks observations at the first reset
    facts = registry.describe(env.id, dict(env.options))
    if facts is None:
        return []  # not described here (an env worker's plugin): its env worker checks at start
    errors: list[tuple[str, str, Any]] = []
    if env.demos is not None and not registry.has_expert(env.id):
        errors.append(("env.demos", f"env {env.id} has no scripted expert to record demos with; env ids with one: "
                       f"{', '.join(registry.experts())} (or train from a dataset)", env.demos.episodes))
    for key in facts.unknown:
        errors.append((f"env.options.{key}", f"unknown option of env {env.id}; allowed: {', '.join(facts.options)}",
                       env.options[key]))
    if facts.problem:
        field = f"env.options.{facts.problem_option}" if facts.problem_option else "env.options"
        errors.append((field, facts.problem, env.options.get(facts.problem_option) if facts.problem_option else None))
    if facts.unknown or facts.problem:
        return errors
    obs, act = spec.observation, spec.action
    what = f"{whose} " if whose else ""
    renders = ("nothing (no camera)" if facts.cameras == () else
               ", ".join(f"{c.name} {c.height}x{c.width}" for c in facts.cameras or ()))
    if obs is not None and facts.cameras is not None:
        env_cams = {c.name: c for c in facts.cameras}
        for i, cam in enumerate(obs.cameras):
            theirs = env_cams.get(cam.name)
            if theirs is None:
                errors.append((f"observation.cameras[{i}].name", f"{what}camera {cam.name!r} is not rendered by "
                               f"env {env.id} with these options; it renders: {renders} (set env.options.cameras, "
                               "or declare only those)", cam.name))
            elif (cam.height, cam.width) != (theirs.height, theirs.width):
                errors.append((f"observation.cameras[{i}]", f"{what}camera {cam.name!r} is {cam.height}x{cam.width} "
                               f"(height x width) but env {env.id} renders it at {theirs.height}x{theirs.width}; "
                               f"allowed: height {theirs.height}, width {theirs.width}, or set env.options.image_size: "
                               f"[{cam.height}, {cam.width}]", f"{cam.height}x{cam.width}"))
        declared = {c.name for c in obs.cameras}
        extra = [c.name for c in facts.cameras if c.name not in declared]
        if extra:
            errors.append(("observation.cameras", f"env {env.id} also renders {', '.join(map(repr, extra))}, which "
                           f"{what or 'the spec '}declares no camera for; declare every camera it renders ({renders}) "
                           "or leave them out of env.options.cameras", [c.name for c in obs.cameras]))
    if obs is not None and facts.state_dim is not None and obs.state_dim != facts.state_dim:
        errors.append(("observation.state_dim", f"{what}state_dim is {obs.state_dim} but env {env.id} gives a "
                       f"{facts.state_dim}-long state; allowed: {facts.state_dim}", obs.state_dim))
    if act is not None and facts.action_dim is not None and act.dim != facts.action_dim:
        errors.append(("action.dim", f"{what}action.dim is {act.dim} but env {env.id} takes a {facts.action_dim}-long "
                       f"action; allowed: {facts.action_dim}", act.dim))
    return errors


def unchecked(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """What `env_errors` could not check for this spec, as (field, why) notes: the run checks
    it when its env worker builds the env, not the submit. An env id not registered here (an
    env worker's ``NEXUS_ENV_PLUGINS`` module, or a typo) has nothing checked; a described one
    may leave cameras, state or action unknown until its simulator is built (a ManiSkill task
    not in its table); LIBERO's camera names are robosuite's, checked on a task's first reset."""
    import envs.registry as registry

    env = spec.env
    if env is None:
        return []
    if env.hosted is not None:
        return [("env.hosted", "the tenant's own env: its observations are checked against observation.* at the "
                 "first reset in its `nexus env serve` process")]
    facts = registry.describe(env.id, dict(env.options))
    if facts is None:
        return [("env.id", f"{env.id} is not registered here (an env worker's NEXUS_ENV_PLUGINS module, or a "
                 f"typo: registered here are {', '.join(registry.known_env_ids())}); its options, cameras, state "
                 "and action are checked when its env worker starts the workload")]
    if facts.unknown or facts.problem:
        return []  # refused anyway
    notes = []
    if facts.cameras is None:
        notes.append(("observation.cameras", f"env {env.id} renders cameras known only once its simulator is "
                      "built; checked when the workload starts"))
    elif env.id.startswith("libero/") and facts.cameras:
        notes.append(("observation.cameras", "camera names are LIBERO's scene cameras, which robosuite checks "
                      "on a task's first reset (sizes are checked here)"))
    if facts.state_dim is None:
        notes.append(("observation.state_dim", f"env {env.id}'s state length is known once its simulator is built"))
    if facts.action_dim is None:
        notes.append(("action.dim", f"env {env.id}'s action length is known once its simulator is built"))
    return notes


def _row(spec: WorkloadSpec, images: dict[str, Any]) -> Any:
    import numpy as np

    from protocol.messages import QueuePutRequest

    obs, act = spec.observation, spec.action
    rl = spec.family == "rl"
    one = np.zeros(1, np.float32) if rl else None
    return QueuePutRequest(
        tenant=spec.tenant, job="j" * 32, seq=0, images=images, state=np.zeros((1, obs.state_dim), np.float32),
        instructions=["x" * INSTRUCTION_ALLOWANCE_BYTES], actions=np.zeros((1, act.horizon, act.dim), np.float32),
        old_log_prob=one, advantages=one, returns=one, behaviour_version=0 if rl else -1)


def row_bytes(spec: WorkloadSpec) -> tuple[int, dict[str, int]]:
    """(bytes of one training-queue row as encoded, {camera: its frame's bytes}). Frames are
    counted, not allocated: a hostile spec's 4096x4096 cameras cost nothing here."""
    import numpy as np

    from protocol.wire import encode

    cams = {c.name: c.height * c.width * 3 for c in spec.observation.cameras}
    tiny = {name: np.zeros((1, 1, 1, 3), np.uint8) for name in cams}
    framing = len(encode(_row(spec, tiny)))
    return framing + sum(b - 3 + _ARRAY_HEADER_SLACK for b in cams.values()), cams


def payload_errors(spec: WorkloadSpec, max_payload: int, source: str) -> list[tuple[str, str, Any]]:
    """One row against the broker's max payload (``source`` says where that number is from)."""
    if spec.family == "eval" or spec.observation is None or spec.action is None:
        return []
    total, cams = row_bytes(spec)
    limit = max_payload - CHUNK_HEADROOM_BYTES
    if total <= limit:
        return []
    frames = sum(cams.values())
    rest = total - frames
    where = (f"the broker's max payload {max_payload:,} bytes ({source}) less {CHUNK_HEADROOM_BYTES:,} for "
             "headers")
    if rest >= limit:
        a = spec.action
        return [("action", f"one training row is {total:,} bytes and its action chunk and state alone take "
                 f"{rest:,}; a row must fit one message: {limit:,} bytes ({where}); shrink action.horizon "
                 f"({a.horizon}) x action.dim ({a.dim})", {"horizon": a.horizon, "dim": a.dim})]
    # The same scale on every frame that brings the row under the limit: a concrete size to ask for.
    scale = math.sqrt((limit - rest - len(cams) * _ARRAY_HEADER_SLACK) / frames)
    fits = ", ".join(f"{c.name} {max(1, int(c.height * scale))}x{max(1, int(c.width * scale))}"
                     for c in spec.observation.cameras)
    sizes = ", ".join(f"{c.name} {c.height}x{c.width} = {cams[c.name]:,}" for c in
                      sorted(spec.observation.cameras, key=lambda c: -cams[c.name]))
    return [("observation.cameras", f"one training row is {total:,} bytes (frames: {sizes}; state, action chunk "
             f"and framing {rest:,}), over the {limit:,} bytes a row may take: {where}. A micro-batch is split "
             f"into rows, never a row: shrink the cameras (largest first), e.g. {fits}, or drop one",
             {"row_bytes": total, "limit_bytes": limit})]


def run_errors(spec: WorkloadSpec, max_payload: int | None = DEFAULT_MAX_PAYLOAD,
               source: str = "nats-server's default") -> list[tuple[str, str, Any]]:
    """Every check above; ``max_payload`` None skips the row size (the master checks it with
    its own server's)."""
    errors = head_errors(spec) + env_errors(spec)
    if max_payload is not None:
        errors += payload_errors(spec, max_payload, source)
    return errors


__all__ = ["DEFAULT_MAX_PAYLOAD", "env_errors", "head_errors", "head_options", "payload_errors", "row_bytes",
           "run_errors", "unchecked"]
