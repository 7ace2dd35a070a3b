"""What every settings group is made of (protocol/settings.py): `EnvSettings`, the base of each
group, read from the environment by `from_env`; `var`, one field's alias and doc bits; `SettingsError`,
one line per bad variable; and how a field's bounds read to a person (`allowed_text`)."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from protocol.errors import ErrorCode, NexusError


class SettingsError(NexusError, ValueError):
    """One or more environment variables hold a value their setting does not allow.

    ``lines`` has one line per problem (``NEXUS_X='abc': must be ...``)."""

    code = ErrorCode.INVALID_FIELD

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines), details={"problems": lines})
        self.lines = lines

    def __str__(self) -> str:
        return self.message


def var(name: str, description: str, *, flag: str = "", cli: bool = False, allowed: str = "",
        default_text: str = "") -> dict[str, Any]:
    """Field keywords for one variable: its alias and the doc bits `env_table_markdown` prints.

    ``flag``: the `python -m actors.run` (and `nexus`) flag that wins over the variable; ``cli``:
    the `nexus` command reads it too; ``allowed`` / ``default_text``: how the bounds / the
    default read to a person where the type alone does not say it."""
    extra = {"flag": flag, "cli": cli, "allowed": allowed, "default_text": default_text}
    return {"alias": name, "description": description, "json_schema_extra": extra}


class EnvSettings(BaseModel):
    """A group of variables read by the same readers."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)
    # Who reads the group: role names (as `python -m actors.run` spells them) and a sentence.
    roles: ClassVar[tuple[str, ...]] = ()
    readers: ClassVar[str] = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> typing.Self:
        """The group from ``environ`` (default ``os.environ``); raises `SettingsError`."""
        env = os.environ if environ is None else environ
        raw = {}
        for info in cls.model_fields.values():
            value = env.get(info.alias)
            if value is not None and value.strip():
                raw[info.alias] = value.strip()
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise SettingsError(cls._problems(exc, raw)) from None

    @classmethod
    def _problems(cls, exc: ValidationError, raw: dict[str, str]) -> list[str]:
        by_alias = {info.alias: info for info in cls.model_fields.values()}
        by_name = {name: info for name, info in cls.model_fields.items()}
        lines = []
        for e in exc.errors():
            key = e["loc"][0] if e["loc"] else None
            info = by_alias.get(key) or by_name.get(key)
            if info is None:  # a rule over several variables: its message names them
                lines.append(str(e["msg"]).removeprefix("Value error, "))
                continue
            reason = f"must be {allowed_text(info)}"
            if e["type"] == "value_error":  # a validator's own words say more than the bound
                reason = f"{str(e['msg']).removeprefix('Value error, ')}; {reason}"
            lines.append(f"{info.alias}={raw.get(info.alias)!r}: {reason} -- {info.description}")
        return lines


def rule_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("settings_rule", "{message}", {"message": message})


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean (1/0, true/false, yes/no, on/off)",
               str: "text", Path: "a path"}


def _bounds(meta: list[Any]) -> str:
    lo = next((("[", m.ge) for m in meta if isinstance(m, annotated_types.Ge)), None)
    lo = lo or next((("(", m.gt) for m in meta if isinstance(m, annotated_types.Gt)), None)
    hi = next(((m.le, "]") for m in meta if isinstance(m, annotated_types.Le)), None)
    hi = hi or next(((m.lt, ")") for m in meta if isinstance(m, annotated_types.Lt)), None)
    if lo and hi:
        return f" in {lo[0]}{lo[1]:g}, {hi[0]:g}{hi[1]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    if hi:
        return f" {'<=' if hi[1] == ']' else '<'} {hi[0]:g}"
    return ""


def allowed_text(info: Any) -> str:
    """What a field allows, as a person reads it ("an integer >= 1", "one of 'a', 'b'")."""
    extra = info.json_schema_extra or {}
    if extra.get("allowed"):
        return extra["allowed"]
    tp = info.annotation
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: None is "unset"
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp))) + _bounds(info.metadata)
