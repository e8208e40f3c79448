"""`RLConfig` <-> plain dicts and YAML, and `key=value` overrides, typed by the dataclasses' own annotations.

Everything goes through one function, `from_dict`, which builds the dataclasses (so their `__post_init__`
validation runs) and coerces each value to its field's annotation: YAML files, the run directory's
`config.yaml` and command-line overrides therefore accept and reject exactly the same things.

    cfg = load_yaml("configs/tiny_grpo_spec.yaml")
    cfg = apply_overrides(cfg, ["grpo.group_size=4", "spec.method=ngram", "spec=null"])
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from .config import RLConfig

_NULLS = ("null", "none", "~")
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def to_dict(cfg: Any) -> Any:
    """A dataclass tree as nested dicts of YAML-safe values (tuples become lists; `from_dict` turns them back)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def from_dict(data: dict | None, cls: type = RLConfig, *, where: str = "") -> Any:
    """Build `cls` from a (possibly partial) dict: missing keys take the dataclass defaults, unknown keys and values
    of the wrong type raise a ValueError naming the dotted key, and `__post_init__` validates the result."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'} must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(_unknown_key(where, str(key), names))
        kwargs[key] = _coerce(value, hints[key], _join(where, key))
    try:
        return cls(**kwargs)
    except TypeError as err:
        # The one TypeError a dict can cause: a required field (e.g. spec.method) that was never given.
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if not missing:
            raise
        raise ValueError(f"{where or 'config'} needs {', '.join(_join(where, m) for m in missing)} "
                         f"(no default), e.g. {_join(where, missing[0])}=...") from err


def apply_overrides(cfg: RLConfig, overrides: Iterable[str]) -> RLConfig:
    """A new config with `section.field=value` overrides applied in order (`cfg` is left untouched).

    `section=null` drops an optional section (`spec=null`: plain decoding); setting a field of a section that is
    None starts it from its defaults (`spec.method=ngram`). All overrides are applied before validation, so
    `spec.num_speculative_tokens=5 spec.method=ngram` works whatever the order.
    """
    data = to_dict(cfg)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value (e.g. grpo.group_size=8)")
        _set(data, type(cfg), key.split("."), text.strip())
    return from_dict(data, type(cfg))


def override_args(sets: dict[str, object]) -> list[str]:
    """Dotted overrides held as values (`Layout.overrides`) as the `key=value` text `apply_overrides` reads; None is
    `null`."""
    return [f"{key}={'null' if value is None else value}" for key, value in sets.items()]


def load_yaml(path: str | Path, base: RLConfig | None = None) -> RLConfig:
    """Read a YAML config. Keys it leaves out keep their value in `base` (default: the RLConfig defaults)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    data = yaml.safe_load(path.read_text())
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    merged = _merge(to_dict(base if base is not None else RLConfig()), data or {})
    try:
        return from_dict(merged, RLConfig)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def dump_yaml(cfg: RLConfig, path: str | Path | None = None) -> str:
    """The config as YAML, fields in declaration order; written to `path` when one is given."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


# --- helpers -------------------------------------------------------------------------------------------------


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


MOVED = {"backend.is_clip": "grpo.rollout_correction.truncate"}
"""Keys that now live elsewhere: old key -> new key (named in the error an old config meets)."""


def _unknown_key(where: str, key: str, valid: list[str]) -> str:
    if _join(where, key) in MOVED:
        return f"{_join(where, key)} is now {MOVED[_join(where, key)]}: rename the key"
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {_join(where, close[0])}?)" if close else ""
    return f"unknown key {_join(where, key)!r}{hint}; valid keys of {where or 'the config'}: {', '.join(valid)}"


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`, (`hint`, False) otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` (from YAML, or an override's text) as an instance of the annotation `hint`."""
    inner, optional = _split_optional(hint)
    # `null` on the command line means None, except for a str field that cannot be None (a directory may be "none").
    null_text = isinstance(value, str) and value.strip().lower() in _NULLS
    if value is None or (null_text and (optional or inner is not str)):
        if optional:
            return None
        raise ValueError(f"{key} cannot be null")
    if dataclasses.is_dataclass(inner):
        if isinstance(value, str):  # an override giving a whole section as a YAML mapping: spec={method: ngram}
            value = yaml.safe_load(value)
        return from_dict(value, inner, where=key)
    if typing.get_origin(inner) is tuple:
        return _coerce_tuple(value, inner, key)
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, str):
            return _unquote(value)
    else:
        raise TypeError(f"{key}: fields annotated {inner!r} are not supported by the config loader")
    raise ValueError(f"{key} expects {_type_name(hint)}, got {value!r}")


def _coerce_tuple(value: Any, hint: Any, key: str) -> tuple:
    if isinstance(value, str):  # "1,2,3" or "[1, 2, 3]" on the command line
        text = value.strip()
        if text.startswith(("[", "(")) and text.endswith(("]", ")")):
            text = text[1:-1]
        value = [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} expects {_type_name(hint)}, got {value!r}")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
        raise ValueError(f"{key} expects {len(args)} values, got {len(value)}")
    return tuple(_coerce(v, a, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _type_name(hint: Any) -> str:
    inner, optional = _split_optional(hint)
    name = getattr(inner, "__name__", None) if typing.get_origin(inner) is None else None
    name = name or str(inner).replace("typing.", "")
    return f"{name} or null" if optional else name


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _set(data: dict, cls: type, path: list[str], text: str) -> None:
    """Put an override's raw text at `path` in `data`, checking every key against the dataclass it names."""
    where = ""
    for i, key in enumerate(path):
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if key not in names:
            raise ValueError(_unknown_key(where, key, names))
        if i == len(path) - 1:
            data[key] = text  # coerced (and validated) by from_dict, with the dotted key in its errors
            return
        inner, _ = _split_optional(typing.get_type_hints(cls)[key])
        where = _join(where, key)
        if not dataclasses.is_dataclass(inner):
            raise ValueError(f"{where} is a {_type_name(inner)} field, not a section: {'.'.join(path)} does not exist")
        if isinstance(data.get(key), str):  # set earlier by a whole-section override: spec={method: ngram}
            data[key] = yaml.safe_load(data[key])
        if data.get(key) is None:
            data[key] = {}  # a None section starts from its defaults
        if not isinstance(data[key], dict):
            raise ValueError(f"{where} must be a mapping, got {data[key]!r}")
        data, cls = data[key], inner


def _merge(base: dict, update: dict) -> dict:
    """`update` laid over `base`, section by section (a section set to null replaces the whole section)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
