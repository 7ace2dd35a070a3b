"""Typed dataclasses as the single source of truth for a strict parser and a JSON Schema.

A spec dataclass declares each field with `spec_field(default, doc, **constraints)`. From those
declarations this module derives, with no second hand-written definition:

- `parse_into(cls, raw, path, errors)`: plain data (from YAML or JSON) -> the dataclass,
  appending *every* problem to ``errors`` as ``(field path, message)`` instead of stopping at
  the first (``observation.cameras[1].height: expected an integer, got str``);
- `json_schema_for(cls, defs)`: a JSON Schema (draft 2020-12) with ``additionalProperties:
  false``, descriptions and defaults;
- `to_plain(obj)`: the JSON-safe dict that `parse_into` reads back to an equal object.

Supported annotations: str, int, float, bool, Literal[...], X | None, unions of scalars,
tuple[X, ...], dict[str, X], Any and nested dataclasses. Constraints (in field metadata):
``ge``/``gt``/``le`` (numbers), ``pattern`` (strings, full match), ``choices`` (a callable
listing allowed strings; a value matching ``pattern`` is accepted too), ``min_items``
(tuples and dicts), ``select`` (a callable ``parent_raw -> dataclass | None`` choosing the
type of a field from its siblings, e.g. the algorithm section by task). A dataclass may define
``_checks(self) -> Iterable[(relative path, message)]`` for rules across its own fields.

Run ``python -m master.spec_schema`` to rewrite docs/workload_spec.schema.json and the field
reference of docs/workload_spec.md from the code (a test fails when they are stale).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Iterable
from typing import Any, Union

Errors = list[tuple[str, str]]
ROOT = "<root>"  # path of the whole document in error reports

_MISSING = dataclasses.MISSING
_HINTS: dict[type, dict[str, Any]] = {}


def spec_field(default: Any = _MISSING, doc: str = "", **meta: Any) -> Any:
    """A dataclass field with a doc line and constraints; a dataclass default is copied per
    instance (pass the class, e.g. ``spec_field(ScheduleSpec, ...)``)."""
    meta["doc"] = doc
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, dict):
        frozen = dict(default)
        return dataclasses.field(default_factory=lambda: dict(frozen), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def join(path: str, name: str) -> str:
    return name if path in ("", ROOT) else f"{path}.{name}"


def hints(cls: type) -> dict[str, Any]:
    out = _HINTS.get(cls)
    if out is None:
        out = _HINTS[cls] = typing.get_type_hints(cls)
    return out


def has_default(f: dataclasses.Field) -> bool:
    return f.default is not _MISSING or f.default_factory is not _MISSING  # type: ignore[misc]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not _MISSING else f.default  # type: ignore[misc]


def _kind(value: Any) -> str:
    # Name the YAML/JSON type a user wrote, not the Python class.
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


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


# ---- parsing ---------------------------------------------------------------------------
class _Bad(Exception):
    """One scalar problem at the current path (internal to the parser)."""


def parse_into(cls: type, raw: Any, path: str, errors: Errors) -> Any:
    """Build ``cls`` from plain data; on any problem append to ``errors`` and return None."""
    if not isinstance(raw, dict):
        errors.append((path, f"expected a mapping with fields {_field_names(cls)}, got {_kind(raw)}"))
        return None
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    before = len(errors)
    for key in raw:
        if key not in fields:
            errors.append((join(path, str(key)), f"unknown field; allowed in {_where(cls, path)}: {_field_names(cls)}"))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        fpath = join(path, name)
        if name not in raw:
            if not has_default(f):
                doc = f.metadata.get("doc", "")
                errors.append((fpath, f"required field is missing; expected {describe(hints(cls)[name], f.metadata)}"
                                      + (f" ({doc})" if doc else "")))
            continue
        tp = hints(cls)[name]
        select = f.metadata.get("select")
        if select is not None:
            chosen = select(raw)
            if chosen is None:  # the sibling that decides is itself wrong; reported there
                continue
            tp = chosen | None
        value = _parse_value(tp, raw[name], fpath, f.metadata, errors)
        kwargs[name] = value
    if len(errors) > before:
        return None
    obj = cls(**kwargs)
    checks = getattr(obj, "_checks", None)
    if checks is not None:
        for rel, message in checks():
            errors.append((join(path, rel) if rel else path, message))
    return obj


def _parse_value(tp: Any, value: Any, path: str, meta: dict[str, Any], errors: Errors) -> Any:
    try:
        return _value(tp, value, path, meta, errors)
    except _Bad as exc:
        errors.append((path, str(exc)))
        return None


def _value(tp: Any, value: Any, path: str, meta: dict[str, Any], errors: Errors) -> Any:
    if tp is Any:
        return value
    args = _union_args(tp)
    if args is not None:
        if value is None:
            if type(None) in args:
                return None
            raise _Bad(f"must not be null; expected {describe(tp, meta)}")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], value, path, meta, errors)
        # Scalar unions (int | str): the branch of the value's own type decides.
        for option in options:
            if _is_instance(value, option):
                return _value(option, value, path, meta, errors)
        raise _Bad(f"expected {describe(tp, meta)}, got {_kind(value)}")
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) or value not in allowed:
            raise _Bad(f"{value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Bad(f"expected a list of {describe(typing.get_args(tp)[0], {})}, got {_kind(value)}")
        if len(value) < meta.get("min_items", 0):
            raise _Bad(f"needs at least {meta['min_items']} item(s), got {len(value)}")
        item_tp = typing.get_args(tp)[0]
        before = len(errors)
        items = [_parse_value(item_tp, v, f"{path}[{i}]", {}, errors) for i, v in enumerate(value)]
        return None if len(errors) > before else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"expected a mapping, got {_kind(value)}")
        if len(value) < meta.get("min_items", 0):
            raise _Bad(f"needs at least {meta['min_items']} entr(y/ies), got {len(value)}")
        _, val_tp = typing.get_args(tp)
        before = len(errors)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append((f"{path}[{k!r}]", f"keys must be strings, got {_kind(k)}"))
                continue
            out[k] = _parse_value(val_tp, v, f"{path}[{k}]", {}, errors)
        return None if len(errors) > before else out
    if dataclasses.is_dataclass(tp):
        return parse_into(tp, value, path, errors)
    if tp is bool:
        if not isinstance(value, bool):
            raise _Bad(f"expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        # JSON Schema counts 1.0 as an integer; agree with it, but never accept true as 1.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"expected an integer, got {_kind(value)}")
        _check_range(value, meta)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Bad(f"expected a number, got {_kind(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            raise _Bad("must be a finite number")
        _check_range(value, meta)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Bad(f"expected a string, got {_kind(value)}")
        _check_string(value, meta)
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a spec dataclass")


def _is_instance(value: Any, tp: Any) -> bool:
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp in (str, bool):
        return isinstance(value, tp)
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if typing.get_origin(tp) is tuple:
        return isinstance(value, list | tuple)
    return False


def _check_range(value: float, meta: dict[str, Any]) -> None:
    if "ge" in meta and not value >= meta["ge"]:
        raise _Bad(f"{value!r} is too small; must be >= {meta['ge']}{_le_text(meta)}")
    if "gt" in meta and not value > meta["gt"]:
        raise _Bad(f"{value!r} is too small; must be > {meta['gt']}{_le_text(meta)}")
    if "le" in meta and not value <= meta["le"]:
        raise _Bad(f"{value!r} is too large; must be <= {meta['le']}")


def _le_text(meta: dict[str, Any]) -> str:
    return f" and <= {meta['le']}" if "le" in meta else ""


def _check_string(value: str, meta: dict[str, Any]) -> None:
    if meta.get("min_length", 0) > len(value):
        raise _Bad(f"must be at least {meta['min_length']} character(s)")
    choices = meta.get("choices")
    allowed = tuple(choices()) if choices is not None else ()
    if value in allowed:
        return
    pattern = meta.get("pattern")
    if pattern is not None and re.fullmatch(pattern, value):
        return
    if choices is not None:
        raise _Bad(f"{value!r} is not allowed; allowed: one of {', '.join(allowed)}, {meta.get('pattern_text', '')}")
    if pattern is not None:
        raise _Bad(f"{value!r} is not allowed; must be {meta.get('pattern_text', 'a match of ' + pattern)}")


def describe(tp: Any, meta: dict[str, Any]) -> str:
    args = _union_args(tp)
    if args is not None:
        return " or ".join(describe(a, meta) for a in args)
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.init)


def _where(cls: type, path: str) -> str:
    return "the spec" if path in ("", ROOT) else path


# ---- plain data ------------------------------------------------------------------------
def to_plain(obj: Any) -> Any:
    """Dataclass -> JSON-safe plain data (tuples become lists; every field is written)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj


# ---- JSON Schema -----------------------------------------------------------------------
def json_schema_for(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    """``{"$ref": ...}`` for ``cls``, filling ``defs`` with it and every nested dataclass."""
    name = cls.__name__
    if name not in defs:
        defs[name] = {}  # placeholder: breaks cycles
        properties: dict[str, Any] = {}
        required: list[str] = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            tp = hints(cls)[f.name]
            select = f.metadata.get("select")
            if select is not None:
                tp = Union[tuple(f.metadata["select_options"])] | None  # noqa: UP007 - built at run time
            prop = type_schema(tp, f.metadata, defs)
            if f.metadata.get("doc"):
                prop["description"] = f.metadata["doc"]
            if has_default(f):
                prop["default"] = to_plain(default_of(f))
            else:
                required.append(f.name)
            properties[f.name] = prop
        body: dict[str, Any] = {
            "type": "object",
            "title": name,
            "description": _doc(cls),
            "properties": properties,
            "additionalProperties": False,
        }
        if required:
            body["required"] = required
        defs[name] = body
    return {"$ref": f"#/$defs/{name}"}


def type_schema(tp: Any, meta: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any:
        return {}
    args = _union_args(tp)
    if args is not None:
        return {"anyOf": [type_schema(a, meta, defs) for a in args]}
    if tp is type(None):
        return {"type": "null"}
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is tuple:
        out = {"type": "array", "items": type_schema(typing.get_args(tp)[0], {}, defs)}
        if meta.get("min_items"):
            out["minItems"] = meta["min_items"]
        return out
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        out = {"type": "object", "additionalProperties": type_schema(val_tp, {}, defs) if val_tp is not Any else True}
        if meta.get("min_items"):
            out["minProperties"] = meta["min_items"]
        return out
    if dataclasses.is_dataclass(tp):
        return json_schema_for(tp, defs)
    if tp is bool:
        return {"type": "boolean"}
    if tp in (int, float):
        out = {"type": "integer" if tp is int else "number"}
        for key, word in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum")):
            if key in meta:
                out[word] = meta[key]
        return out
    if tp is str:
        out = {"type": "string"}
        if meta.get("min_length"):
            out["minLength"] = meta["min_length"]
        choices = meta.get("choices")
        if choices is not None:
            branches: list[dict[str, Any]] = [{"enum": list(choices())}]
            if "pattern" in meta:
                branches.append({"pattern": _anchored(meta["pattern"])})
            out["anyOf"] = branches
        elif "pattern" in meta:
            out["pattern"] = _anchored(meta["pattern"])
        return out
    raise TypeError(f"unsupported annotation {tp!r} in a spec dataclass")


def _anchored(pattern: str) -> str:
    # JSON Schema patterns search; the parser uses fullmatch. Anchor so both agree.
    return pattern if pattern.startswith("^") and pattern.endswith("$") else f"^(?:{pattern})$"


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def field_rows(cls: type, prefix: str = "", seen: set[type] | None = None) -> Iterable[tuple[str, str, str, str]]:
    """(path, type, default, doc) for every field, depth first: the docs' field reference."""
    seen = set() if seen is None else seen
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        default = "required" if not has_default(f) else _default_text(default_of(f))
        options: list[Any] = list(f.metadata.get("select_options", ())) or _dataclasses_in(tp)
        yield path, _type_text(tp, f.metadata), default, f.metadata.get("doc", "")
        for sub in options:
            if sub in seen:
                continue
            seen.add(sub)
            # Several candidate types (the algorithm section): say which one a row belongs to.
            label = f" ({sub.__name__})" if len(options) > 1 else ""
            sub_prefix = f"{path}[]." if typing.get_origin(tp) is tuple else f"{path}."
            for sub_path, sub_type, sub_default, sub_doc in field_rows(sub, sub_prefix, seen):
                yield sub_path + label, sub_type, sub_default, sub_doc


def _dataclasses_in(tp: Any) -> list[type]:
    args = _union_args(tp) or (tp,)
    out = []
    for a in args:
        if typing.get_origin(a) is tuple:
            a = typing.get_args(a)[0]
        if dataclasses.is_dataclass(a):
            out.append(a)
    return out


def _type_text(tp: Any, meta: dict[str, Any]) -> str:
    if meta.get("select_options"):
        return "mapping (by task) or null"
    args = _union_args(tp)
    if args is not None:
        return " or ".join(_type_text(a, {}) for a in args)
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_text(typing.get_args(tp)[0], {})}"
    if origin is dict:
        return f"mapping of {_type_text(typing.get_args(tp)[1], {})}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {int: "int", float: "number", str: "string", bool: "bool"}.get(tp, "any")


def _default_text(value: Any) -> str:
    plain = to_plain(value)
    if dataclasses.is_dataclass(value):
        return "(see fields)"
    if plain is None:
        return "null"
    if plain == {}:
        return "{}"
    return f"`{json.dumps(plain)}`"


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated docs (schema JSON, field reference in the markdown)."""
    import argparse

    from master.spec import write_docs

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--root", default=".", help="repository root (default: .)")
    args = parser.parse_args(argv)
    for path in write_docs(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
