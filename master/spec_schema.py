"""Pydantic v2 helpers for the workload spec: field-path errors in plain words, the JSON
Schema and the docs' field reference, all derived from the same models (`master.spec`).

- `spec_errors(model, exc, raw)`: a pydantic `ValidationError` -> ``[{"field": "a.b[0].c",
  "message": ..., "value": ...}]``, every problem at once, each message saying what is
  allowed (the range, the enum, the pattern, the fields of the section);
- `reraise_details(exc)`: a `ValidationError`'s line errors in a form `raise_rules`
  (protocol/recipe_configs.py: cross-field rules as ordinary line errors) can raise again;
- `model_schema(model)`: pydantic's JSON Schema (draft 2020-12) without the noise titles;
- `field_rows(model)`: (path, type, default, doc) for every leaf and section, depth first.

Markers a model may put in ``Annotated[...]`` metadata (pydantic keeps unknown metadata and
ignores it): `Allowed("...")` (how a pattern reads to a person) and `BySibling(field,
options)` (the section's type is chosen by a sibling's value, e.g. ``algorithm`` by ``task``).

``python -m master.spec`` rewrites docs/workload_spec.schema.json and the field reference of
docs/workload_spec.md from the code (a test fails when they are stale).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

ROOT = "<root>"  # path of the whole document in error reports


@dataclass(frozen=True)
class Allowed:
    """How a field's pattern reads to a person ("letters, digits, _ and -")."""

    text: str


@dataclass(frozen=True)
class BySibling:
    """The field's type is ``options[parent[field]]`` (None when the sibling is invalid).
    ``resolve``, when given, finds it instead (a registered recipe's config too, so errors
    name its fields); the docs and the JSON Schema list ``options`` only."""

    field: str
    options: dict[str, type]
    resolve: Callable[[Any], type | None] | None = None

    def type_for(self, value: Any) -> type | None:
        if self.resolve is not None:
            return self.resolve(value)
        return self.options.get(value) if isinstance(value, str) else None


# ---- rules as line errors ----------------------------------------------------------------
# `rule` / `raise_rules` live in protocol/recipe_configs.py (the recipes' configs raise them too).
def reraise_details(exc: ValidationError) -> list[InitErrorDetails]:
    """Line errors of ``exc`` in a form that `raise_rules` can raise again with more."""
    out = []
    for e in exc.errors():
        ctx = {k: v for k, v in (e.get("ctx") or {}).items() if isinstance(v, (str, int, float, bool))}
        out.append(InitErrorDetails(type=PydanticCustomError(e["type"], "{message}", {**ctx, "message": e["msg"]}),
                                    loc=e["loc"], input=e["input"]))
    return out


# ---- annotations -------------------------------------------------------------------------
def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """(type without Annotated and None, metadata found on the way)."""
    meta: list[Any] = []
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            meta.extend(tp.__metadata__)
            tp = tp.__origin__
            continue
        args = _union_args(tp)
        if args is not None:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp, meta


def is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


@dataclass
class _Spot:
    """What a location in the document is: its printable path and its declaration."""

    path: str
    tp: Any = Any  # the (stripped) type at the location
    meta: tuple[Any, ...] = ()  # constraints and markers of the field
    doc: str = ""
    parent: Any = None  # the model holding the last field, if any
    parent_path: str = ""


def _walk(model: type[BaseModel], loc: tuple[Any, ...], raw: Any) -> _Spot:
    tp: Any = model
    path, parent, parent_path, meta, doc = "", None, "", [], ""
    node = raw
    for part in loc:
        if part == "[key]":
            continue
        if is_model(tp) and isinstance(part, str) and part in tp.model_fields:
            info = tp.model_fields[part]
            parent, parent_path = tp, path
            path = part if not path else f"{path}.{part}"
            ftp, fmeta = _strip(info.annotation)
            meta, doc = [*info.metadata, *fmeta], info.description or ""
            for m in meta:
                if isinstance(m, BySibling):
                    ftp = m.type_for(node.get(m.field)) if isinstance(node, dict) else None
                    ftp = Any if ftp is None else ftp
            tp = ftp
            node = node.get(part) if isinstance(node, dict) else None
            continue
        origin = typing.get_origin(tp)
        if isinstance(part, int) and origin in (tuple, list):
            path = f"{path}[{part}]"
            tp, _ = _strip(typing.get_args(tp)[0])
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
        elif origin is dict:
            path = f"{path}[{part}]"
            tp, _ = _strip(typing.get_args(tp)[1])
            node = node.get(part) if isinstance(node, dict) else None
        else:  # an unknown field (or a pydantic union tag): name it as written
            parent, parent_path = (tp if is_model(tp) else None), path
            path = str(part) if not path else f"{path}.{part}"
            tp, meta, doc, node = Any, [], "", None
    return _Spot(path or ROOT, tp, tuple(meta), doc, parent, parent_path)


def fields_of(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


# ---- messages ----------------------------------------------------------------------------
def kind(value: Any) -> str:
    """The YAML/JSON type a user wrote, not the Python class."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return f"a string ({value!r})" if len(value) <= 40 else "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def describe(tp: Any) -> str:
    tp, _ = _strip(tp)
    args = _union_args(tp)
    if args is not None:
        return " or ".join(describe(a) for a in args if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if is_model(tp):
        return f"a mapping with fields {fields_of(tp)}"
    if typing.get_origin(tp) in (tuple, list):
        return "a list"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, "a value")


def _bound(meta: tuple[Any, ...], cls: type, attr: str) -> Any:
    for m in meta:
        if isinstance(m, cls):
            return getattr(m, attr)
    return None


def _range_text(meta: tuple[Any, ...]) -> str:
    parts = []
    for cls, attr, word in ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"),
                            (annotated_types.Le, "le", "<="), (annotated_types.Lt, "lt", "<")):
        b = _bound(meta, cls, attr)
        if b is not None:
            parts.append(f"{word} {b}")
    return " and ".join(parts)


def _message(e: dict[str, Any], spot: _Spot) -> str:
    t, value, ctx = e["type"], e.get("input"), e.get("ctx") or {}
    if t == "spec_rule":
        return ctx.get("message", e["msg"])
    if t == "missing":
        doc = f" ({spot.doc})" if spot.doc else ""
        return f"required field is missing; expected {describe(spot.tp)}{doc}"
    if t == "extra_forbidden":
        where = "the spec" if not spot.parent_path else spot.parent_path
        allowed = fields_of(spot.parent) if spot.parent is not None else "?"
        return f"unknown field; allowed in {where}: {allowed}"
    if t == "literal_error":
        lit, _ = _strip(spot.tp)
        options = typing.get_args(lit) if typing.get_origin(lit) is typing.Literal else ()
        return f"{value!r} is not allowed; allowed: {', '.join(map(str, options)) or ctx.get('expected', '?')}"
    if t in ("int_type", "int_parsing", "int_from_float"):
        return f"expected an integer, got {kind(value)}"
    if t in ("float_type", "float_parsing"):
        return f"expected a number, got {kind(value)}"
    if t == "finite_number":
        return "must be a finite number"
    if t in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {kind(value)}"
    if t == "string_type":
        return f"expected a string, got {kind(value)}"
    if t in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        word = "small" if t.startswith("greater") else "large"
        return f"{value!r} is too {word}; allowed: {_range_text(spot.meta) or e['msg']}"
    if t == "string_too_short":
        return f"must be at least {ctx.get('min_length')} character(s)"
    if t == "string_too_long":
        return f"must be at most {ctx.get('max_length')} character(s)"
    if t == "string_pattern_mismatch":
        allowed = next((m.text for m in spot.meta if isinstance(m, Allowed)), f"a match of {ctx.get('pattern')}")
        return f"{value!r} is not allowed; must be {allowed}"
    if t == "too_short":
        return f"needs at least {ctx.get('min_length')} item(s), got {ctx.get('actual_length')}"
    if t == "too_long":
        return f"takes at most {ctx.get('max_length')} item(s), got {ctx.get('actual_length')}"
    if t in ("model_type", "dict_type", "model_attributes_type"):
        return f"expected {describe(spot.tp) if spot.tp is not Any else 'a mapping'}, got {kind(value)}"
    if t in ("tuple_type", "list_type"):
        return f"expected a list, got {kind(value)}"
    return e["msg"]


def _plain_value(value: Any) -> Any:
    """The offending value as JSON-safe data (a large section is summarised)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)[:200]
    return value if len(text) <= 200 else f"<{kind(value)} of {len(value)} entries>"


def spec_errors(model: type[BaseModel], exc: ValidationError, raw: Any) -> list[dict[str, Any]]:
    out, seen = [], set()
    errors = exc.errors()
    locs = [tuple(e["loc"]) for e in errors]
    for e in errors:
        loc = tuple(e["loc"])
        # pydantic counts only the items that validated: a list whose items failed is not "short".
        if e["type"] == "too_short" and any(len(other) > len(loc) and other[:len(loc)] == loc for other in locs):
            continue
        spot = _walk(model, loc, raw)
        message = _message(e, spot)
        if (spot.path, message) in seen:
            continue
        seen.add((spot.path, message))
        value = None if e["type"] == "missing" else _plain_value(e.get("input"))
        out.append({"field": spot.path, "message": message, "value": value})
    return out


# ---- JSON Schema -------------------------------------------------------------------------
def _drop_titles(node: Any, in_properties: bool = False) -> Any:
    if isinstance(node, dict):
        return {k: _drop_titles(v, k == "properties") for k, v in node.items()
                if not (k == "title" and not in_properties and isinstance(v, str) and not _is_def(node))}
    if isinstance(node, list):
        return [_drop_titles(v) for v in node]
    return node


def _is_def(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and "properties" in node


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """pydantic's schema of ``model``, property titles dropped (the names say it)."""
    return _drop_titles(model.model_json_schema(mode="validation"))


# ---- field reference ---------------------------------------------------------------------
def _models_in(tp: Any, meta: tuple[Any, ...]) -> list[type[BaseModel]]:
    for m in meta:
        if isinstance(m, BySibling):
            return list(dict.fromkeys(m.options.values()))
    tp, _ = _strip(tp)
    if typing.get_origin(tp) in (tuple, list):
        tp, _ = _strip(typing.get_args(tp)[0])
    args = _union_args(tp) or (tp,)
    return [a for a in args if is_model(a)]


def type_text(tp: Any, meta: tuple[Any, ...] = ()) -> str:
    if any(isinstance(m, BySibling) for m in meta):
        return "mapping (by task) or null"
    args = _union_args(tp)
    if args is not None:
        return " or ".join(type_text(a) for a in args)
    if typing.get_origin(tp) is typing.Annotated:
        return type_text(tp.__origin__)
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {type_text(typing.get_args(tp)[1])}"
    if is_model(tp):
        return "mapping"
    return {int: "int", float: "number", str: "string", bool: "bool"}.get(tp, "any")


def default_of(info: Any) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return info.default


def default_text(info: Any) -> str:
    if info.is_required():
        return "required"
    value = default_of(info)
    if isinstance(value, BaseModel):
        return "(see fields)"
    if value is None:
        return "null"
    plain = json.loads(json.dumps(value, default=list))
    return "{}" if plain == {} else f"`{json.dumps(plain)}`"


def field_rows(model: type[BaseModel], prefix: str = "", seen: set[type] | None = None):
    """(path, type, default, doc) for every field, depth first."""
    seen = set() if seen is None else seen
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        meta = tuple(info.metadata)
        yield path, type_text(info.annotation, meta), default_text(info), info.description or ""
        subs = _models_in(info.annotation, meta)
        stripped, _ = _strip(info.annotation)
        for sub in subs:
            if sub in seen:
                continue
            seen.add(sub)
            label = f" ({sub.__name__})" if len(subs) > 1 else ""
            sub_prefix = f"{path}[]." if typing.get_origin(stripped) in (tuple, list) else f"{path}."
            for row in field_rows(sub, sub_prefix, seen):
                yield (row[0] + label, *row[1:])


def leaf_paths(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel], str]]:
    """Every leaf field as (dotted path, model that declares it, field name); sections chosen by a
    sibling contribute each option's leaves (``algorithm.lr`` once per algorithm model)."""
    out = []
    for name, info in model.model_fields.items():
        subs = _models_in(info.annotation, tuple(info.metadata))
        stripped, _ = _strip(info.annotation)
        if not subs:
            out.append((f"{prefix}{name}", model, name))
            continue
        sep = "[]." if typing.get_origin(stripped) in (tuple, list) else "."
        for sub in subs:
            out.extend(leaf_paths(sub, f"{prefix}{name}{sep}"))
    return out
