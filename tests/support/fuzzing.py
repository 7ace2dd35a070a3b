"""Fuzzing harness for every role op and the durable spec intake (hypothesis strategies).

Shared by the default-suite test (`tests/system/test_fuzz.py`, ~1,200 cases) and the benchmark
(`bench/fuzz.py`, 10,000+). It:
  1. discovers the targets: every op each live role lists in its ``info`` reply (on
     ``<prefix>.<role>.<op>``), each instance's own ``info``, the inferencer's predict
     subject and the durable intake ``<prefix>.workloads.submit``;
  2. generates cases per target with hypothesis, in three modes:
       raw       random bytes, truncated / nested / garbage msgpack;
       envelope  ``{"kind", "v", "body"}`` maps with wrong kinds, versions, unknown keys,
                 wrong types, and forged array ext payloads;
       typed     the op's own request type, built from its dataclass type hints (invalid
                 tokens, negative / huge ints, nan / inf, arrays of odd dtypes and shapes,
                 nested Structs), and valid templates with one or two fields mutated;
  3. sends them (bounded concurrency, a timeout per request) and checks each answer: the
     op's documented reply type or an `ErrorReply` with a stable `ErrorCode`; ``internal``
     (a handler bug), no reply and an undecodable reply are collected with their input.

Generation is deterministic (a fixed hypothesis seed, no example database), so a CI failure
replays locally. Reference names known at run time (the fuzz tenant, a reserved job, an env
session, the dataset fixture) are mixed into the strings, so typed cases reach past the
"unknown tenant" checks into the handlers' real code.
"""

from __future__ import annotations

import asyncio
import math
import time
import types
import typing
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import msgpack
import msgspec
import numpy as np
import yaml
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import ops
from protocol.codec import EXT_NDARRAY, EXT_TENSOR, packb
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, PredictReply, PredictRequest, WorkloadEvent
from protocol.subjects import Names
from protocol.wire import Array, decode, registered_kinds

# -- policy ------------------------------------------------------------------------------
# Generous: an op that touches KV or a simulator answers in milliseconds; a loaded 2-core
# CI box can stretch that by 100x. A reply later than this counts as "no reply".
REPLY_TIMEOUT_S = 20.0
# Requests in flight at once: enough to keep the roles busy, few enough that one slow op
# (the trainer's export under its compute lock) does not push the others past the timeout.
CONCURRENCY = 8
# How long the intake may take to answer all its specs after the last publish.
INTAKE_TIMEOUT_S = 30.0
MAX_RAW_BYTES = 2048

# Ops never sent. Each name says why, so the list stays short and honest.
EXCLUDED_OPS: dict[str, str] = {
    # `drain` on an instance (or its role subject) legitimately stops the role: it finishes
    # in flight work and exits 0. That is its contract, not a crash; fuzzing it would end the run.
    "drain": "stops the role by design",
}

MODES = ("raw", "envelope", "typed")
PROBLEMS = ("internal", "no_reply", "bad_reply")
ERROR_CODES = frozenset(c.value for c in ErrorCode)

INTAKE = "intake"
PREDICT = "predict"


@dataclass(frozen=True)
class Target:
    """One subject that takes requests, with what it accepts and may answer."""

    role: str
    op: str
    subject: str
    request: type | None  # None: the intake takes spec text (YAML / JSON), not an envelope
    replies: tuple[type, ...]
    kind: Literal["op", "instance", "predict", "intake"] = "op"

    @property
    def label(self) -> str:
        return f"{self.role}.{self.op}" + ("@instance" if self.kind == "instance" else "")


@dataclass
class Context:
    """Names that exist in the running deployment, mixed into generated strings."""

    tenant: str  # a live tenant (tiny base, LIBERO-like schema)
    schema: dict[str, Any]
    base: str
    jobs: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    env_ids: list[str] = field(default_factory=lambda: ["builtin/reach-v0"])
    roots: list[str] = field(default_factory=list)  # readable LeRobot datasets
    workloads: list[str] = field(default_factory=list)
    # Never created: ops whose valid request starts real work get this tenant (see typed_bodies).
    ghost_tenant: str = "fz-ghost"


@dataclass
class Case:
    target: Target
    mode: str
    payload: bytes
    shown: str  # the generated object, as Python, for a repro
    index: int = 0  # its place among its target's cases (the first ones are the warm-up)


@dataclass
class Outcome:
    case: Case
    answer: str  # a reply kind, an error code, or a problem name
    latency_s: float
    problem: str = ""  # "", "internal", "no_reply", "bad_reply"
    message: str = ""


# -- strategies: leaves -------------------------------------------------------------------
BAD_TOKENS = ["", ".", "a.b", "*", ">", "a b", "x" * 65, "é", "\x00", "../..", "nexus.master.list", "-"]
EDGE_INTS = [-1, 0, 1, -(2**31), 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e300, math.nan, math.inf, -math.inf]

ints = st.one_of(st.integers(-3, 300), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS))
texts = st.text(max_size=48)
# msgpack's own Timestamp ext (-1) decodes to an object no message field expects.
timestamps = st.integers(0, 2**32 - 1).map(lambda s: msgpack.Timestamp(s))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=16), timestamps)
# JSON-ish values with msgpack's extras (bytes); maps keyed by strings (strict_map_key).
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=12)

# Keys that real option / config maps take (env options, algo, head params): values of the
# wrong type under a known key reach the configs' own checks.
OPTION_KEYS = ["seed", "image_height", "image_width", "cameras", "max_episode_steps", "max_step", "reward",
               "lr", "batch_size", "width", "depth", "parallel_envs", "episodes_per_update", "name", "height"]

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64"]
TORCH_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
TORCH_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
                  "bfloat16": 2, "float32": 4, "float64": 8}
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def np_arrays(draw) -> np.ndarray:
    return draw(hnp.arrays(dtype=st.sampled_from(NUMPY_DTYPES).map(np.dtype), shape=shapes))


@st.composite
def tensor_exts(draw) -> msgpack.ExtType:
    """A well-formed torch tensor ext payload (the harness needs no torch)."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    nbytes = math.prod(shape) * TORCH_ITEMSIZE[dtype]
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([dtype, list(shape), raw], use_bin_type=True))


@st.composite
def forged_exts(draw) -> msgpack.ExtType:
    """Array ext payloads that lie: unknown codes, bad dtypes, shapes and byte counts."""
    code = draw(st.sampled_from([EXT_NDARRAY, EXT_TENSOR, 0, 3, 99, 127]))
    if draw(st.booleans()):
        return msgpack.ExtType(code, draw(st.binary(max_size=64)))
    dtype = draw(st.one_of(st.sampled_from(NUMPY_DTYPES + ["bfloat16", "object", "complex64", "<f4", "V8", "U3"]),
                           scalars))
    shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=4),
                           st.sampled_from([[2**40], [-1], [2**62, 2**62], [0, 2**62], [1] * 17, [1.5], "x", None,
                                            [True, 2], [2**63 - 1]])))
    raw = draw(st.one_of(st.binary(max_size=64), st.none(), texts))
    header = draw(st.one_of(st.just([dtype, shape, raw]), st.lists(scalars, max_size=4)))
    return msgpack.ExtType(code, msgpack.packb(header, use_bin_type=True))


arrays = st.one_of(np_arrays(), tensor_exts(), forged_exts())


def tensor_ext(dtype: str, shape: tuple[int, ...], raw: bytes | None = None) -> msgpack.ExtType:
    nbytes = math.prod(shape) * TORCH_ITEMSIZE[dtype]
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb([dtype, list(shape), raw if raw is not None else b"\1" * nbytes],
                                                     use_bin_type=True))


@st.composite
def arrays_like(draw, like: np.ndarray) -> Any:
    """Near misses of a valid array: same shape with another dtype (numpy or torch), nan / inf
    values, one dimension off, an extra or a missing dimension."""
    shape = like.shape
    how = draw(st.sampled_from(["dtype", "torch", "nonfinite", "dim", "rank"]))
    if how == "dtype":
        return np.zeros(shape, draw(st.sampled_from(NUMPY_DTYPES)))
    if how == "torch":  # bfloat16 half the time: the one dtype numpy cannot take over
        return tensor_ext(draw(st.one_of(st.just("bfloat16"), st.sampled_from(TORCH_DTYPES))), shape)
    if how == "nonfinite":
        return np.full(shape, draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e38])), like.dtype
                       if like.dtype.kind == "f" else np.float32)
    if how == "dim" and shape:
        i = draw(st.integers(0, len(shape) - 1))
        new = list(shape)
        new[i] = draw(st.sampled_from([0, 1, shape[i] + 1, max(0, shape[i] - 1), 1024]))
        if math.prod(new) > 1 << 20:
            new[i] = shape[i] + 1
        return np.zeros(tuple(new), like.dtype)
    return np.zeros(shape + (1,), like.dtype) if draw(st.booleans()) or not shape else np.zeros(shape[1:], like.dtype)


def names_of(pool: list[str]) -> st.SearchStrategy[str]:
    """A known name, a bad token or free text."""
    known = st.sampled_from(pool) if pool else st.nothing()
    return st.one_of(known, known, st.sampled_from(BAD_TOKENS), texts)


def strings_for(name: str, ctx: Context) -> st.SearchStrategy[str]:
    """Field-aware strings: tenant fields get tenant names, sessions get session ids..."""
    pools = {
        "tenant": [ctx.tenant, ctx.ghost_tenant], "policy_tenant": [ctx.tenant, ctx.ghost_tenant],
        "job": ctx.jobs, "session": ctx.sessions, "workload": ctx.workloads or ["w-none"],
        "env_id": ctx.env_ids + ["nope/x-v0", "builtin/", "/"],
        "root": ctx.roots + ["/", "/nonexistent", "", ".", "/dev/null"],
        "dataset_root": ctx.roots + ["/nonexistent"],
        "base": [ctx.base, "nope", "/nonexistent", ""],
        "trainer": ["fz-trainer"], "object_name": ["", "fz/none", "x" * 300],
        "task": ["sft", "rl", "eval", "green", "red"],
        "head": ["mlp", "gaussian", "flow", "nope"],
    }
    if name == "name":
        # tenant_create's config.name: no free text, so a valid generated config can create at
        # most one new tenant ("fz-new"), never the ghost, never an unbounded number.
        return st.one_of(st.sampled_from([ctx.tenant, "fz-new"]), st.sampled_from(BAD_TOKENS))
    if name in pools:
        return names_of(pools[name])
    return st.one_of(texts, st.sampled_from(BAD_TOKENS))


# -- strategies: typed bodies from dataclass hints ---------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def value_for(tp: Any, name: str, ctx: Context, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values that fit annotation ``tp`` (mostly) plus wrong-typed ones (sometimes)."""
    right = _right_for(tp, name, ctx, depth)
    # Mostly the right type (so the body decodes and the handler runs), sometimes not.
    return st.one_of(right, right, right, right, scalars) if depth == 0 else st.one_of(right, right, right, scalars)


def _right_for(tp: Any, name: str, ctx: Context, depth: int) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return values
    if origin in (Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else _right_for(a, name, ctx, depth)
                           for a in typing.get_args(tp)])
    if origin is Literal:
        return st.one_of(st.sampled_from(typing.get_args(tp)), texts)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return st.lists(value_for(item, name.rstrip("s"), ctx, depth + 1), max_size=4)
    if origin is dict and name == "spec":
        return spec_docs(ctx).filter(lambda d: isinstance(d, dict))
    if origin is dict and name == "schema":
        return st.one_of(schema_mutations(ctx), values.filter(lambda d: isinstance(d, dict)))
    if tp is str and name == "spec_text":
        return st.one_of(spec_docs(ctx).map(lambda d: yaml.safe_dump(d) if _yaml_safe(d) else repr(d)), texts)
    if origin is dict:
        _, val = typing.get_args(tp) or (Any, Any)
        cameras = [c["name"] for c in ctx.schema["cameras"]]
        keys = st.one_of(texts, st.sampled_from(cameras), st.sampled_from(OPTION_KEYS))
        return st.dictionaries(keys, value_for(val, name, ctx, depth + 1), max_size=4)
    if tp is Array:
        return arrays
    if _is_struct(tp):
        return st.one_of(typed_body(tp, ctx, depth + 1), template_mutations(tp, ctx))
    if tp is float:
        return floats
    if tp is int:
        return ints
    if tp is bool:
        return st.booleans()
    if tp is str:
        return strings_for(name, ctx)
    if tp is bytes:
        return st.binary(max_size=32)
    raise TypeError(f"{name}: no strategy for annotation {tp!r}")


def typed_body(cls: type, ctx: Context, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Every field generated from its type hint; optional fields sometimes left out."""
    hints = _hints(cls)
    required, optional = {}, {}
    for f in msgspec.structs.fields(cls):
        strat = value_for(hints[f.name], f.name, ctx, depth)
        (required if f.required else optional)[f.name] = strat
    return st.fixed_dictionaries(required, optional=optional)


def template(cls: type, ctx: Context) -> dict[str, Any]:
    """A body that decodes as ``cls`` and names things that exist (the deep path)."""
    s = ctx.schema
    cams = {c["name"]: (c["height"], c["width"]) for c in s["cameras"]}
    job = ctx.jobs[0] if ctx.jobs else "j-none"
    session = ctx.sessions[0] if ctx.sessions else "s-none"
    name = cls.__name__
    if name == "EnvCloseRequest":  # its own session, so the others' steps keep a live one
        return {"session": ctx.sessions[-1] if ctx.sessions else "s-none"}
    if name == "QueuePutRequest":
        b = 2
        return {"tenant": ctx.tenant, "job": job, "seq": 1,
                "images": {k: np.zeros((b, h, w, 3), np.uint8) for k, (h, w) in cams.items()},
                "state": np.zeros((b, s["state_dim"]), np.float32), "instructions": ["pick"] * b,
                "actions": np.zeros((b, s["action_horizon"], s["action_dim"]), np.float32)}
    if name == "PredictRequest":
        return {"tenant": ctx.tenant, "images": {k: np.zeros((h, w, 3), np.uint8) for k, (h, w) in cams.items()},
                "state": np.zeros(s["state_dim"], np.float32), "instruction": "pick", "timeout_s": REPLY_TIMEOUT_S}
    if name == "EnvStepRequest":
        return {"session": session, "action": np.zeros(2, np.float32)}
    if name == "SampleRequest":
        return {"root": ctx.roots[0] if ctx.roots else "/nonexistent", "n": 2}
    if name == "TenantConfig":
        return {"name": ctx.tenant, "base": ctx.base, "schema": dict(s), "optim": {"lr": 1e-3}}
    if name == "WorkflowSpec":
        return {"workload": "w-fuzz", "tenant": ctx.ghost_tenant, "kind": "eval", "env_id": ctx.env_ids[0],
                "eval_episodes": 1}
    body: dict[str, Any] = {}
    hints = _hints(cls)
    for f in msgspec.structs.fields(cls):
        if not f.required:
            continue
        tp = hints[f.name]
        fixed = {"tenant": ctx.tenant, "job": job, "session": session, "env_id": ctx.env_ids[0],
                 "trainer": "fz-trainer", "workload": (ctx.workloads or ["w-none"])[0]}
        if f.name in fixed:
            body[f.name] = fixed[f.name]
        elif _is_struct(tp):
            body[f.name] = template(tp, ctx)
        elif tp is Array:
            body[f.name] = np.zeros(2, np.float32)
        else:
            body[f.name] = {str: "x", int: 0, float: 1.0, bool: False}.get(tp, None)
            if body[f.name] is None:
                origin = typing.get_origin(tp)
                body[f.name] = {list: [], dict: {}}.get(origin, typing.get_args(tp)[0] if origin is Literal else None)
    return body


@st.composite
def template_mutations(draw, cls: type, ctx: Context) -> dict[str, Any]:
    """A valid template with one or two fields replaced, dropped, or an unknown one added."""
    body = dict(template(cls, ctx))
    hints = _hints(cls)
    names = [f.name for f in msgspec.structs.fields(cls)]
    for _ in range(draw(st.integers(0, 2))):
        if not names:
            break
        what = draw(st.sampled_from(["replace", "replace", "replace", "drop", "unknown"]))
        fname = draw(st.sampled_from(names))
        if what == "replace":
            current = body.get(fname)
            if isinstance(current, np.ndarray) and draw(st.booleans()):
                body[fname] = draw(arrays_like(current))
            elif isinstance(current, dict) and current and all(isinstance(v, np.ndarray) for v in current.values()) \
                    and draw(st.booleans()):
                cam = draw(st.sampled_from(sorted(current)))
                body[fname] = {**current, cam: draw(arrays_like(current[cam]))}
            else:
                body[fname] = draw(value_for(hints[fname], fname, ctx, 1))
        elif what == "drop":
            body.pop(fname, None)
        else:
            body[draw(texts)] = draw(values)
    return body


def sanitize(target: Target, body: Any, ctx: Context) -> Any:
    """Keep a generated request from legitimately starting unbounded work (see `Context`), or
    from closing the one session every other env case steps.

    ``start_workflow`` runs a real workflow for any spec it decodes (the master validates
    specs; the env worker trusts it): its tenant is forced to one that does not exist and its
    episode / env counts to small values, so a case costs milliseconds, not a training run.
    """
    if target.op == "start_workflow" and isinstance(body, dict):
        body = dict(body)
        body["tenant"] = "fz-ghost"
        body["workload"] = f"w-fuzz-{len(str(body.get('workload', ''))) % 4}"  # a bounded set of ids
        for key in ("demo_episodes", "eval_episodes", "max_episodes"):
            if key in body:
                body[key] = 1
        body["algo"] = {}
    if target.op == "close" and target.role == "env" and isinstance(body, dict) and ctx.sessions \
            and body.get("session") == ctx.sessions[0]:
        body = {**body, "session": ctx.sessions[-1]}
    return body


# -- strategies: the three modes -----------------------------------------------------------
def raw_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=MAX_RAW_BYTES),
        st.binary(max_size=64).map(lambda b: b"\x83" + b),  # a map header, then garbage
        st.integers(1, 5000).map(lambda n: b"\x91" * n + b"\xc0"),  # deep nesting
        st.integers(1, 4).map(lambda n: b"\xdf\xff\xff\xff\xff"[: n + 1]),  # a 4G-entry map header
        st.just(b""),
    )


def envelopes(target: Target, ctx: Context) -> st.SearchStrategy[Any]:
    """Envelope maps that are wrong in their frame: kind, v, body, keys."""
    assert target.request is not None
    own_kind, own_v = target.request.KIND, target.request.VERSION  # type: ignore[attr-defined]
    kinds = st.one_of(st.just(own_kind), st.sampled_from(sorted(registered_kinds())), texts, scalars)
    versions = st.one_of(st.just(own_v), st.sampled_from([0, 2, -1, 2**63 - 1, "1", 1.0, True, None]), scalars)
    bodies = st.one_of(typed_body(target.request, ctx), st.dictionaries(texts, values, max_size=4), values,
                       st.dictionaries(texts, arrays, max_size=2))

    @st.composite
    def build(draw) -> Any:
        env: dict[Any, Any] = {"kind": draw(kinds), "v": draw(versions), "body": sanitize(target, draw(bodies), ctx)}
        for key in draw(st.lists(st.sampled_from(["kind", "v", "body"]), max_size=2, unique=True)):
            env.pop(key)
        env.update(draw(st.dictionaries(texts, values, max_size=2)))
        return env if draw(st.integers(0, 9)) else draw(st.one_of(values, st.lists(values, max_size=3)))

    return build()


def typed(target: Target, ctx: Context) -> st.SearchStrategy[Any]:
    """Envelopes of the op's own kind and version, body built from the request's fields."""
    assert target.request is not None
    cls = target.request
    # Templates name live things (tenant, job, session): their mutations reach the handlers.
    body = st.one_of(typed_body(cls, ctx), template_mutations(cls, ctx), template_mutations(cls, ctx))
    kind, version = cls.KIND, cls.VERSION  # type: ignore[attr-defined]
    return body.map(lambda b: {"kind": kind, "v": version, "body": sanitize(target, b, ctx)})


def spec_docs(ctx: Context) -> st.SearchStrategy[Any]:
    """Workload-spec-like documents that can never be accepted (the intake must reject them):
    every valid-looking one names a tenant that already exists (a conflict) or a bad token."""
    cams = [{"name": c["name"], "height": c["height"], "width": c["width"]} for c in ctx.schema["cameras"]]
    base = {"tenant": ctx.tenant, "task": "sft", "base": ctx.base,
            "observation": {"cameras": cams, "state_dim": ctx.schema["state_dim"]},
            "action": {"dim": ctx.schema["action_dim"], "horizon": ctx.schema["action_horizon"]},
            "action_module": {"kind": "mlp"}, "env": {"id": ctx.env_ids[0], "demos": {"episodes": 2}},
            "algorithm": {"lr": 1e-3, "batch_size": 8, "steps": 2}}
    sections = sorted(base)

    @st.composite
    def mutated(draw) -> dict[str, Any]:
        doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
        doc["task"] = draw(st.sampled_from(["sft", "rl", "eval", "nope"]))
        for _ in range(draw(st.integers(0, 3))):
            key = draw(st.sampled_from(sections))
            if isinstance(doc.get(key), dict) and draw(st.booleans()):
                sub = doc[key]
                sub[draw(st.one_of(st.sampled_from(sorted(sub)), texts))] = draw(values)
            else:
                doc[key] = draw(values)
        # Never acceptable: an existing tenant is a conflict; the rest fail validation.
        doc["tenant"] = draw(st.sampled_from([ctx.tenant, *BAD_TOKENS[:8]]))
        return doc

    return st.one_of(mutated(), st.dictionaries(texts, values, max_size=5), values)


@st.composite
def schema_mutations(draw, ctx: Context) -> dict[str, Any]:
    """The live tenant's schema with one entry (or one camera's entry) replaced."""
    schema = {k: ([dict(c) for c in v] if k == "cameras" else v) for k, v in ctx.schema.items()}
    key = draw(st.sampled_from(sorted(schema)))
    if key == "cameras" and draw(st.booleans()):
        cam = draw(st.sampled_from(schema["cameras"]))
        cam[draw(st.sampled_from(["name", "height", "width", "extra"]))] = draw(st.one_of(ints, values))
    else:
        schema[key] = draw(st.one_of(ints, values))
    return schema


def intake_payloads(ctx: Context) -> st.SearchStrategy[tuple[str, bytes, str]]:
    """(mode, bytes, shown) for the intake: it reads YAML or JSON bytes, not envelopes."""
    import json

    def as_text(doc: Any, fmt: str) -> bytes:
        if fmt == "json":
            try:
                return json.dumps(doc, default=repr, allow_nan=True).encode()
            except (TypeError, ValueError):
                return repr(doc).encode()
        return yaml.safe_dump(doc, allow_unicode=True).encode() if _yaml_safe(doc) else repr(doc).encode()

    raw = raw_bytes().map(lambda b: ("raw", b, repr(b[:200])))
    text = st.tuples(spec_docs(ctx), st.sampled_from(["yaml", "json"])).map(
        lambda t: ("typed" if isinstance(t[0], dict) and "observation" in t[0] else "envelope", as_text(*t),
                   f"{t[1]}: {t[0]!r}"[:400]))
    return st.one_of(raw, text, text)


def _yaml_safe(doc: Any) -> bool:
    try:
        yaml.safe_dump(doc)
        return True
    except yaml.YAMLError:
        return False


def case_strategy(target: Target, ctx: Context) -> st.SearchStrategy[tuple[str, bytes, str]]:
    if target.kind == "intake":
        return intake_payloads(ctx)

    def pack(mode: str) -> Any:
        def go(obj: Any) -> tuple[str, bytes, str]:
            if isinstance(obj, bytes):
                return mode, obj, repr(obj[:200])
            try:
                data = packb(obj)
            except ProtocolError:  # e.g. an int past 64 bits: msgpack cannot carry it at all
                data = msgpack.packb(repr(obj), use_bin_type=True)
            return mode, data, _show(obj)
        return go

    # Weights: a fifth raw, a fifth broken envelopes, three fifths typed requests.
    return st.one_of(
        raw_bytes().map(pack("raw")),
        envelopes(target, ctx).map(pack("envelope")),
        *[typed(target, ctx).map(pack("typed"))] * 3,
    )


def _show(obj: Any, limit: int = 600) -> str:
    def short(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return f"np.zeros({v.shape}, np.{v.dtype})"
        if isinstance(v, dict):
            return {k: short(x) for k, x in v.items()}
        if isinstance(v, list):
            return [short(x) for x in v]
        return v
    text = repr(short(obj))
    return text if len(text) <= limit else text[:limit] + "..."


def draw_cases(target: Target, ctx: Context, n: int, seed: int = 0) -> list[Case]:
    """``n`` cases for ``target`` (fewer if its input space is smaller), deterministic per seed."""
    out: list[Case] = []
    strategy = case_strategy(target, ctx)

    @hyp_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @given(strategy)
    def collect(item: tuple[str, bytes, str]) -> None:
        mode, data, shown = item
        out.append(Case(target, mode, data, shown, index=len(out)))

    collect()
    return out[:n]


# -- targets -------------------------------------------------------------------------------
async def discover(bus: Any, names: Names, roles: list[tuple[str, str]]) -> list[Target]:
    """Every op the live roles list in ``info``, plus instance info, predict and the intake."""
    from protocol.messages import InfoRequest, RoleInfo

    targets: list[Target] = []
    for role, instance in roles:
        info_op = ops.INFO.of(role)
        info = await bus.request(info_op.instance_subject(names, instance), InfoRequest(), RoleInfo, timeout_s=10)
        known = {o.name: o for o in ops.ops_of(role)}
        for op_name in info.ops:
            if op_name in EXCLUDED_OPS:
                continue
            if op_name not in known:
                raise AssertionError(f"{role} lists op {op_name!r} in info but protocol/ops.py has no such op")
            o = known[op_name]
            targets.append(Target(role, op_name, o.subject(names), o.request, o.replies))
        targets.append(Target(role, "info", info_op.instance_subject(names, instance), info_op.request,
                              info_op.replies, kind="instance"))
        if role == "inferencer":
            targets.append(Target(role, PREDICT, names.infer(info.extra["pool"]), PredictRequest, (PredictReply,),
                                  kind="predict"))
    targets.append(Target("master", INTAKE, names.workloads_submit, None, (WorkloadEvent,), kind="intake"))
    return targets


# -- sending and judging -------------------------------------------------------------------
def judge(case: Case, data: bytes | None, latency_s: float) -> Outcome:
    if data is None:
        if case.target.kind == "predict" and _caller_gave_up(case.payload):
            # Documented: a predict whose own timeout_s has passed is dropped unworked (its
            # caller stopped waiting). Counted apart, not a problem.
            return Outcome(case, "dropped_by_timeout_s", latency_s)
        return Outcome(case, "no_reply", latency_s, "no_reply", f"no reply within {REPLY_TIMEOUT_S:g} s")
    try:
        reply = decode(data)
    except ProtocolError as exc:
        return Outcome(case, "bad_reply", latency_s, "bad_reply", str(exc))
    if isinstance(reply, ErrorReply):
        if reply.code not in ERROR_CODES:
            return Outcome(case, "bad_reply", latency_s, "bad_reply", f"unknown error code {reply.code!r}")
        if reply.code == ErrorCode.INTERNAL:
            return Outcome(case, reply.code, latency_s, "internal", reply.message)
        return Outcome(case, reply.code, latency_s)
    if not isinstance(reply, case.target.replies):
        return Outcome(case, "bad_reply", latency_s, "bad_reply",
                       f"{type(reply).__name__}, not {[t.__name__ for t in case.target.replies]}")
    return Outcome(case, type(reply).KIND, latency_s)  # type: ignore[attr-defined]


def _caller_gave_up(payload: bytes) -> bool:
    try:
        req = decode(payload, PredictRequest)
    except ProtocolError:
        return False
    t = req.timeout_s
    return not (t > REPLY_TIMEOUT_S)  # nan, negative, or shorter than our own wait


async def send_cases(nc: Any, cases: list[Case], concurrency: int = CONCURRENCY) -> list[Outcome]:
    """Request-reply cases, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> Outcome:
        async with sem:
            started = time.monotonic()
            try:
                msg = await nc.request(case.target.subject, case.payload, timeout=REPLY_TIMEOUT_S)
                data = msg.data
            except Exception as exc:  # nats timeout / no responders: judged as no reply
                if type(exc).__name__ not in ("TimeoutError", "NoRespondersError"):
                    raise
                data = None
            return judge(case, data, time.monotonic() - started)

    return list(await asyncio.gather(*(one(c) for c in cases)))


def intake_workload_id(stream_seq: int) -> str:
    # Mirrors master/workloads.py `_intake_loop`: the id is derived from the stream sequence.
    return f"i{stream_seq:010d}"


async def send_intake(nc: Any, js: Any, names: Names, cases: list[Case]) -> list[Outcome]:
    """Publish specs with JetStream; each must be answered by a `rejected` WorkloadEvent."""
    events: dict[str, tuple[WorkloadEvent, float]] = {}

    async def on_event(msg: Any) -> None:
        try:
            ev = decode(msg.data, WorkloadEvent)
        except ProtocolError:
            return
        events.setdefault(ev.workload, (ev, time.monotonic()))

    sub = await nc.subscribe(names.workload_events_all, cb=on_event)
    try:
        sent: list[tuple[Case, str, float]] = []
        for case in cases:
            started = time.monotonic()
            ack = await js.publish(names.workloads_submit, case.payload, timeout=10)
            sent.append((case, intake_workload_id(ack.seq), started))
        deadline = time.monotonic() + INTAKE_TIMEOUT_S
        while time.monotonic() < deadline and any(w not in events for _, w, _ in sent):
            await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
    out = []
    for case, workload, started in sent:
        if workload not in events:
            out.append(Outcome(case, "no_reply", INTAKE_TIMEOUT_S, "no_reply",
                               f"no event for {workload} within {INTAKE_TIMEOUT_S:g} s"))
            continue
        ev, at = events[workload]
        if ev.kind != "rejected":
            out.append(Outcome(case, ev.kind, at - started, "bad_reply", f"spec was {ev.kind}: {ev.message}"))
        else:
            out.append(Outcome(case, "rejected", at - started))
    return out


async def run_plan(bus: Any, names: Names, cases: list[Case]) -> list[Outcome]:
    intake = [c for c in cases if c.target.kind == "intake"]
    ops = [c for c in cases if c.target.kind != "intake"]
    results = await send_cases(bus.nc, ops)
    if intake:
        results += await send_intake(bus.nc, bus.js, names, intake)
    return results


# -- reports -------------------------------------------------------------------------------
@dataclass
class TargetStats:
    label: str
    cases: int = 0
    answers: Counter = field(default_factory=Counter)
    internal: int = 0
    no_reply: int = 0
    bad_reply: int = 0
    max_latency_s: float = 0.0


def summarize(outcomes: list[Outcome]) -> dict[str, TargetStats]:
    stats: dict[str, TargetStats] = {}
    for o in outcomes:
        s = stats.setdefault(o.case.target.label, TargetStats(o.case.target.label))
        s.cases += 1
        s.answers[o.answer] += 1
        if o.problem:
            setattr(s, o.problem, getattr(s, o.problem) + 1)
        s.max_latency_s = max(s.max_latency_s, o.latency_s)
    return dict(sorted(stats.items()))


def table(stats: dict[str, TargetStats]) -> str:
    rows = [f"{'TARGET':32} {'CASES':>6} {'INTERNAL':>8} {'NO REPLY':>8} {'MAX LAT s':>9}  ANSWERS"]
    for s in stats.values():
        answers = ", ".join(f"{k}:{v}" for k, v in s.answers.most_common())
        rows.append(f"{s.label:32} {s.cases:6d} {s.internal:8d} {s.no_reply + s.bad_reply:8d} "
                    f"{s.max_latency_s:9.3f}  {answers}")
    return "\n".join(rows)


def problems(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.problem]


def describe(o: Outcome) -> str:
    return (f"{o.case.target.label} [{o.problem}] mode={o.case.mode}: {o.message[:300]}\n"
            f"    input: {o.case.shown}\n    bytes: {o.case.payload[:120]!r}")


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS, KiB); -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return -1  # exited (a zombie has no VmRSS line either)


async def warm_up(nc: Any, targets: list[Target]) -> None:
    """One tensor-bearing request per role: decoding a tensor ext imports torch (about 180 MiB
    once) in a role that had not needed it, which would read as growth after the warm-up."""
    tensor = msgpack.ExtType(EXT_TENSOR, msgpack.packb(["float32", [1], b"\0" * 4], use_bin_type=True))
    data = packb({"kind": "info.request", "v": 1, "body": {"warm": tensor}})
    for t in targets:
        if t.kind == "instance":
            try:
                await nc.request(t.subject, data, timeout=REPLY_TIMEOUT_S)
            except Exception as exc:  # a dead role: its cases report it, one per request
                if type(exc).__name__ not in ("TimeoutError", "NoRespondersError"):
                    raise


# -- regression cases: inputs that once found a handler bug ---------------------------------
def regression_cases(ctx: Context, names: Names) -> list[tuple[str, str, bytes, str]]:
    """(label, subject, payload, expected error code) for each bug this harness found."""
    from protocol.messages import EnvCreateRequest, EnvResetRequest, EnvStepRequest, JobRef, LeaseRequest, \
        WorkflowSpec, QueuePutRequest, SampleRequest

    def env(cls: type, **over: Any) -> bytes:
        body = {**template(cls, ctx), **over}
        return packb({"kind": cls.KIND, "v": cls.VERSION, "body": body})  # type: ignore[attr-defined]

    bf16 = tensor_ext("bfloat16", (2, ctx.schema["state_dim"]))
    return [
        # IndexError in the trainer: an empty job made the lease pick any ready job.
        ("trainer.train_batch job ''", ops.TRAINER_TRAIN_BATCH.subject(names), env(JobRef, job=""), "invalid_field"),
        # InvalidKeyError from the KV: a tenant that is not a token.
        ("inferencer.predict tenant '*'", names.infer(pool_of(ctx)), env(PredictRequest, tenant="*"), "invalid_field"),
        # TypeError: a bfloat16 tensor has no numpy view.
        ("master.queue_put bf16 state", ops.MASTER_QUEUE_PUT.subject(names), env(QueuePutRequest, state=bf16), "invalid_field"),
        ("env.step bf16 action", ops.ENV_STEP.subject(names), env(EnvStepRequest, action=tensor_ext("bfloat16", (2,))),
         "invalid_field"),
        # OverflowError converting to int64; ValueError from numpy on a negative seed.
        ("env.sample index 2**64-1", ops.ENV_SAMPLE.subject(names), env(SampleRequest, indices=[2**64 - 1]), "invalid_field"),
        ("env.sample seed -1", ops.ENV_SAMPLE.subject(names), env(SampleRequest, seed=-1), "invalid_field"),
        # A negative seed made reset raise, and the session was closed as crashed.
        ("env.reset seed -1", ops.ENV_RESET.subject(names), env(EnvResetRequest, seed=-1), "invalid_field"),
        # TypeError / ValueError in the built-in env's config; an unbounded image size.
        ("env.create options.seed 'x'", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"seed": "x"}),
         "invalid_field"),
        ("env.create options.max_step 'x'", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"max_step": "x"}),
         "invalid_field"),
        ("env.create image 10**6", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"image_height": 10**6}),
         "invalid_field"),
        ("env.create options.image_size 5.0", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"image_size": 5.0}),
         "invalid_field"),
        # Not a token: the workflow ran, but none of its events could be published.
        ("env.start_workflow workload 'w.x'", ops.ENV_START_WORKFLOW.subject(names),
         env(WorkflowSpec, workload="w.x"), "invalid_field"),
        # An option the env's config did not type-check itself (TypeError in ReachConfig).
        ("env.create options.cameras 5", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"cameras": 5}),
         "invalid_field"),
        # nan never expires: the job would stay leased forever.
        ("master.lease lease_s nan", ops.MASTER_LEASE.subject(names), env(LeaseRequest, lease_s=math.nan), "invalid_field"),
        # <= 0: dropped unworked, no reply ever.
        ("inferencer.predict timeout_s -1", names.infer(pool_of(ctx)), env(PredictRequest, timeout_s=-1.0),
         "invalid_field"),
    ]


def pool_of(ctx: Context) -> str:
    from protocol.subjects import pool_name

    return pool_name(ctx.base)


async def check_regressions(nc: Any, ctx: Context, names: Names) -> list[tuple[str, str]]:
    """Send every regression case; return (label, what came back) per case whose answer is
    not the expected code."""
    bad = []
    for label, subject, payload, want in regression_cases(ctx, names):
        try:
            msg = await nc.request(subject, payload, timeout=REPLY_TIMEOUT_S)
            reply = decode(msg.data)
            got = reply.code if isinstance(reply, ErrorReply) else type(reply).__name__
            text = reply.message if isinstance(reply, ErrorReply) else ""
        except Exception as exc:  # no reply: that is the failure we report
            got, text = type(exc).__name__, str(exc)
        if got != want:
            bad.append((label, f"{label}: expected {want}, got {got} {text[:200]}"))
    return bad


async def concurrent_samples(nc: Any, ctx: Context, names: Names, n: int = 16) -> list[str]:
    """``n`` sample requests on one dataset at once: the env worker's reader threads shared
    PyAV containers and segfaulted the worker (every later request went unanswered)."""
    from protocol.messages import SampleRequest

    payload = packb({"kind": SampleRequest.KIND, "v": SampleRequest.VERSION, "body": template(SampleRequest, ctx)})
    replies = await asyncio.gather(*(nc.request(ops.ENV_SAMPLE.subject(names), payload, timeout=REPLY_TIMEOUT_S)
                                     for _ in range(n)), return_exceptions=True)
    out = []
    for r in replies:
        if isinstance(r, BaseException):
            out.append(f"{type(r).__name__}: {r}")
        elif type(decode(r.data)).__name__ != "DatasetBatch":
            out.append(repr(decode(r.data))[:200])
    return out


# -- the deployment under test ---------------------------------------------------------------
ROLE_ORDER = ("health", "monitor", "master", "trainer", "inferencer", "env")
FUZZ_TENANT = "fz"


def start_roles(roles: Any) -> None:
    """Start one real process of every role (a `tests.conftest.RoleProcs`), tiny base models.

    All six at once: none needs another to become ready, and their imports overlap. Each
    instance id carries its role's name, so the shared counter cannot make two collide."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.tq_helpers import BASE

    with ThreadPoolExecutor(max_workers=len(ROLE_ORDER)) as pool:
        futures = [pool.submit(roles.start, role, **({"NEXUS_INFER_BASE": BASE} if role == "inferencer" else {}))
                   for role in ROLE_ORDER]
        for f in futures:
            f.result()  # a role that failed to start raises here, with its log


async def make_context(nats_url: str, prefix: str, dataset: Path) -> Context:
    """A live tenant with a filling job and an open env session; lazy paths warmed. ``dataset``:
    a readable LeRobot root (the session's `libero_like`)."""
    from sdk.client import AsyncClient
    from tests.support.tq_helpers import BASE, micro_batch, tenant

    cfg = tenant(FUZZ_TENANT)
    async with AsyncClient(nats_url, prefix, timeout_s=60) as c:
        await c.create_tenant(cfg)
        job = await c.reserve(cfg.name, "sft")
        await c.queue_put(micro_batch(cfg, job.job, 0))
        session = await c.env_create("builtin/reach-v0", lease_s=3600)
        await c.env_reset(session, seed=0)  # so generated steps reach the simulator
        closable = await c.env_create("builtin/reach-v0", lease_s=3600)
        # What a first real request loads (the trainer's slot, the inferencer's head), loaded
        # now, so the RSS baseline after the warm-up already holds it.
        await c.export_params(cfg.name)
        images = {cam["name"]: np.zeros((cam["height"], cam["width"], 3), np.uint8) for cam in cfg.schema["cameras"]}
        await c.predict(cfg.name, images, np.zeros(cfg.schema["state_dim"], np.float32), "pick")
    return Context(tenant=cfg.name, schema=cfg.schema, base=BASE, jobs=[job.job],
                   sessions=[session.session, closable.session],
                   roots=[str(dataset)])


@dataclass
class Run:
    targets: list[Target]
    outcomes: list[Outcome]
    rss_warm_kib: dict[str, int]
    rss_end_kib: dict[str, int]
    infos: dict[str, Any]  # role -> RoleInfo at the end (None if it did not answer)
    wall_s: float
    regressions: list[tuple[str, str]]  # (label, message) of failed regression cases
    concurrency: list[str]  # failed concurrent sample requests


async def fuzz(nats_url: str, prefix: str, procs: list[tuple[str, str, Any]], ctx: Context, cases: int,
               warmup_fraction: float, seed: int = 0) -> Run:
    """Discover, send the regression cases, generate ``cases`` (spread evenly over the targets),
    send the first ``warmup_fraction`` of each target's, read RSS, send the rest, read RSS, ask
    every role for info."""
    from transport.bus import Bus
    from protocol.errors import NexusError
    from protocol.messages import InfoRequest

    names = Names(prefix)
    # In role order, whatever order they became ready in: the plan must not depend on it.
    instances = sorted(((role, inst) for role, inst, _ in procs), key=lambda ri: ROLE_ORDER.index(ri[0]))
    pids = {role: proc.pid for role, _, proc in procs}
    bus = await Bus.connect(nats_url, name="fuzz", reconnect_forever=False, prefix=prefix)
    try:
        targets = await discover(bus, names, instances)
        per_target = math.ceil(cases / len(targets))
        warmup_per_target = max(1, int(per_target * warmup_fraction))
        planned = plan(targets, ctx, per_target, seed=seed)
        # Regressions first: they name the live job and session, which the fuzzing may close.
        regressions = await check_regressions(bus.nc, ctx, names)
        concurrency = await concurrent_samples(bus.nc, ctx, names)
        started = time.monotonic()
        await warm_up(bus.nc, targets)
        out = await run_plan(bus, names, [c for c in planned if c.index < warmup_per_target])
        rss_warm = {r: rss_kib(p) for r, p in pids.items()}
        out += await run_plan(bus, names, [c for c in planned if c.index >= warmup_per_target])
        rss_end = {r: rss_kib(p) for r, p in pids.items()}
        wall_s = time.monotonic() - started
        infos: dict[str, Any] = {}
        for role, inst in instances:
            try:
                infos[role] = await bus.call(ops.INFO.of(role), InfoRequest(), instance=inst, timeout_s=10)
            except NexusError:
                infos[role] = None
        return Run(targets, out, rss_warm, rss_end, infos, wall_s, regressions, concurrency)
    finally:
        await bus.close()


def plan(targets: list[Target], ctx: Context, per_target: int, seed: int = 0) -> list[Case]:
    cases: list[Case] = []
    for t in targets:
        # Per-target seeds from the label: adding a target does not reshuffle the others' cases.
        cases += draw_cases(t, ctx, per_target, seed=seed * 2**32 + zlib.crc32(t.label.encode()))
    return cases
