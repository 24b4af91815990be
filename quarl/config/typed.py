"""Typed configuration: nested dataclasses <- YAML file <- dotted CLI overrides.

Every package owns one dataclass (``RolloutConfig``, ``QuantConfig`` ...); the run
configuration composes them and each component receives only its own part. Values
are checked against the annotations: an unknown key or a wrong type fails with a
message naming the key and, for a typo, the closest valid one.

    cfg = load_config("run.yaml", ["--rollout.temperature=0.8", "--quant.scheme", "w4a16"])
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message says which key and why."""


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def closest(value: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to a mistyped ``value``, else ``""``."""
    close = difflib.get_close_matches(value, valid, n=1, cutoff=0.4)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(sorted(valid))})"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert ``value`` to annotation ``tp``; strings from the CLI are parsed."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            valid = [m.value for m in tp]
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(v) for v in valid)}"
                              f"{closest(str(value), [str(v) for v in valid])}") from None
    if isinstance(tp, type) and hasattr(tp, "from_config"):  # a value type named by a string (QuantScheme)
        try:
            return tp.from_config(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    if origin is Literal:
        if isinstance(value, str) and value not in args:
            # allow CLI numbers for numeric literals
            for a in args:
                if str(a) == value:
                    return a
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):  # "a,b" or YAML's flow form "[a, 'b']"
            text = value.strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            value = [v for v in (s.strip().strip("'\"") for s in text.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, where)
    if tp in (bool, int, float, str):
        return _coerce_scalar(value, tp, where)
    raise ConfigError(f"{where}: unsupported annotation {tp!r}")


def _coerce_scalar(value: Any, tp: type, where: str) -> Any:
    """bool / int / float / str, from YAML values or CLI strings."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")


def _build(cls, data: dict[str, Any], where: str = ""):
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            moved = getattr(cls, "_moved", {}).get(key)
            if moved:
                raise ConfigError(f"config key {name!r} has moved: use {moved}")
            raise ConfigError(f"unknown config key {name!r}{_suggest(key, list(fields))}")
        factory = fields[key].default_factory
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[key]) and factory is not dataclasses.MISSING:
            # keys not given keep the field's own default (rollout.engine's 0.35 memory share),
            # not the nested class's defaults
            value = merge(to_dict(factory()), value)
        kwargs[key] = _coerce(value, hints[key], name)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def from_dict(cls, data: dict[str, Any] | None):
    """Build dataclass ``cls`` from a nested mapping, checking keys and types."""
    return _build(cls, data or {})


def to_dict(obj) -> dict[str, Any]:
    """Plain YAML/JSON data: enums by value, value types by their config name."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if hasattr(v, "to_config"):
        return v.to_config()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--a.b=1", "--c.d", "x"]`` -> ``{"a": {"b": "1"}, "c": {"d": "x"}}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override {arg!r} has no value: write --{body}=VALUE")
            key, value = body, args[i + 1]
            i += 1
        node = out
        parts = key.replace("-", "_").split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r} conflicts with an earlier one")
        node[parts[-1]] = value
        i += 1
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """Defaults <- YAML file <- CLI overrides, validated into ``cls``."""
    data = read_yaml(path) if path else {}
    data = merge(data, parse_overrides(overrides or []))
    return from_dict(cls, data)


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
