"""Hypothesis strategies of the fuzzing harness (tests/support/fuzzing.py): per target, cases in
three modes (raw bytes, broken envelopes, typed requests built from the request type's hints and
valid templates mutated), the intake's spec documents, and the deterministic draw of a plan.

Generation is deterministic (a fixed hypothesis seed, no example database): a CI failure replays
locally."""

from __future__ import annotations

import math
import types
import typing
import zlib
from typing import Any, Literal, Union

import msgpack
import msgspec
import numpy as np
import yaml
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.codec import EXT_NDARRAY, EXT_TENSOR, packb
from protocol.errors import ProtocolError
from protocol.wire import Array, registered_kinds
from tests.support.fuzz_types import MAX_RAW_BYTES, REPLY_TIMEOUT_S, Case, Context, Target


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


def plan(targets: list[Target], ctx: Context, per_target: int, seed: int = 0) -> list[Case]:
    cases: list[Case] = []
    for t in targets:
        # Per-target seeds from the label: adding a target does not reshuffle the others' cases.
        cases += draw_cases(t, ctx, per_target, seed=seed * 2**32 + zlib.crc32(t.label.encode()))
    return cases
