"""A run's configuration in a file: ``fastmoe-train --config run.toml`` (TOML, YAML or JSON).

The file holds the same nested fields as the ``--section.field`` options, plus ``preset`` and
``seed`` at the top::

    preset = "small-moe"     # the preset the file starts from (--preset on the command line wins)
    seed = 1

    [optim]
    lr = 1e-3

    [schedule]
    steps = 2000
    global_batch = 64

    [parallel]
    ep = 2

The order is preset, then the file, then the options given on the command line, each overriding
the one before. ``--print-config toml`` (or ``yaml``, ``json``) writes the combined config in a form
this module reads back. ``run.json`` of a run directory reads too (its ``config`` object).

Values are checked as the options' are: a field that does not exist, a value of the wrong type or a
file that does not parse is one ``error:`` line naming the file and the field. A string where a
number is due is parsed as the option would parse it (YAML reads ``3e-4`` as a string); ``"none"``
(or YAML's ``null``) sets an optional field to None, as ``--checkpoint.dir none`` does.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from typing import Any

from .errors import ConfigError


def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """{field: (scalar type, whether None is allowed)} of a config dataclass."""
    out = {}
    for name, annotation in typing.get_type_hints(cls).items():
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            out[name] = (args[0], True)
        else:
            out[name] = (annotation, False)
    return out


def parse_value(raw: str, typ: type, optional: bool, name: str) -> Any:
    """``raw`` as the option ``--name`` reads it: ``typ(raw)``, or None where allowed ("none", "null", "")."""
    if optional and raw.lower() in ("none", "null", ""):
        return None
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"--{name} expects {typ.__name__}, got {raw!r}") from None

#: File formats by extension.
FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
#: Top-level keys that are not sections.
TOP_FIELDS = ("preset", "seed")


def _sections() -> dict[str, type]:
    from . import section_classes

    return section_classes()


def _format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"--config {path}: unknown format {ext or '(no extension)'!r}; use .toml, .yaml, .yml "
                          "or .json")
    return FORMATS[ext]


def _parse(path: str, text: str, fmt: str) -> Any:
    if fmt == "json":
        return json.loads(text)
    if fmt == "toml":
        try:
            import tomllib  # Python 3.11+
        except ImportError:
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise ConfigError(f"--config {path}: reading TOML needs Python 3.11 or the tomli package "
                                  "(pip install tomli); or give the config as .yaml or .json") from None
        return tomllib.loads(text)
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or give the config "
                          "as .toml or .json") from None
    return yaml.safe_load(text)


def read_config_file(path: str) -> dict[str, Any]:
    """The file's fields as ``{"preset": ..., "seed": ..., "section.field": value, ...}``, every key
    checked against the config's fields (values are checked by :func:`apply_config_values`).
    Raises :class:`ConfigError` with one line."""
    fmt = _format(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    try:
        data = _parse(path, text, fmt)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - each parser has its own error class; all say where
        raise ConfigError(f"--config {path} is not valid {fmt.upper()}: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a table of fields at the top, got {type(data).__name__}")
    if isinstance(data.get("config"), dict) and "layout" in data:  # a run directory's run.json
        data = data["config"]
    return flatten(data, path)


def flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``{"model": {"lr": ...}}`` (or dotted keys ``{"model.lr": ...}``) as checked dotted keys."""
    sections = _sections()
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if key in out:
            raise ConfigError(f"--config {source}: {key} is given twice")
        out[key] = value

    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"--config {source}: key {key!r} is not a name")
        if key in TOP_FIELDS:
            put(key, value)
            continue
        section, dot, name = key.partition(".")
        if section not in sections:
            hint = difflib.get_close_matches(key, [*TOP_FIELDS, *sections], n=1, cutoff=0.6)
            raise ConfigError(f"--config {source}: unknown key {key!r}"
                              + (f" (did you mean {hint[0]}?)" if hint else "")
                              + f"; the sections are {', '.join(sections)}")
        fields = [f.name for f in dataclasses.fields(sections[section])]
        items = [(name, value)] if dot else None
        if items is None:
            if not isinstance(value, dict):
                raise ConfigError(f"--config {source}: {section} must be a table of fields, got {value!r}")
            items = list(value.items())
        for name, v in items:
            if name not in fields:
                hint = difflib.get_close_matches(str(name), fields, n=1, cutoff=0.6)
                raise ConfigError(f"--config {source}: unknown field {name!r} in [{section}]"
                                  + (f" (did you mean {hint[0]}?)" if hint else ""))
            put(f"{section}.{name}", v)
    return out


def _coerce(value: Any, typ: type, optional: bool, key: str, source: str) -> Any:

    if value is None:
        if optional:
            return None
        raise ConfigError(f"--config {source}: {key} needs a {typ.__name__}, got null")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"--config {source}: {key} must be true or false, got {value!r}")
    if isinstance(value, str):
        if typ is str:
            return None if optional and value.lower() in ("none", "null", "") else value
        try:
            return parse_value(value, typ, optional, key)  # as the option would read it
        except ConfigError:
            raise ConfigError(f"--config {source}: {key} expects {typ.__name__}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"--config {source}: {key} expects {typ.__name__}, got {value!r}")
    if typ is float:
        return float(value)
    if typ is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"--config {source}: {key} expects int, got {value!r}")
        return int(value)
    return str(value)  # a number where a string is due (e.g. --parallel.ac 1): as on the command line


def apply_config_values(cfg: Any, values: dict[str, Any], source: str) -> None:
    """Set ``values`` (from :func:`read_config_file`; ``preset`` is left to the caller) on ``cfg``."""

    for key, value in values.items():
        if key == "preset":
            continue
        if key == "seed":
            cfg.seed = _coerce(value, int, False, key, source)
            continue
        section, _, name = key.partition(".")
        sub = getattr(cfg, section)
        typ, optional = field_types(type(sub))[name]
        setattr(sub, name, _coerce(value, typ, optional, key, source))


# ----------------------------------------------------------------------------- writing
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(text, text)
    return json.dumps(str(value))  # a TOML basic string has JSON's escapes


def dump_config(cfg: Any, fmt: str = "toml", preset_cfg: Any = None) -> str:
    """``cfg`` as a file :func:`read_config_file` reads back to the same config. ``preset_cfg`` (the
    preset's own values) lets an unset optional field that the preset leaves unset too be written as
    a comment instead of ``"none"``."""
    d = cfg.to_dict()
    if fmt == "json":
        return json.dumps(d, indent=2)
    if fmt == "yaml":
        try:
            import yaml
        except ImportError:
            raise ConfigError("--print-config yaml needs PyYAML (pip install pyyaml); or use toml or json") from None
        return "# fastmoe-train --config FILE reads this back; options given beside it override it\n" + \
            yaml.safe_dump(d, sort_keys=False, default_flow_style=False)
    if fmt != "toml":
        raise ConfigError(f"--print-config must be toml, yaml or json, got {fmt!r}")
    base = preset_cfg.to_dict() if preset_cfg is not None else {}
    lines = ["# fastmoe-train --config FILE reads this back; options given beside it override it"]
    for key in TOP_FIELDS:
        lines.append(f"{key} = {_toml_value(d[key])}")
    for section in _sections():
        lines.append("")
        lines.append(f"[{section}]")
        for name, value in d[section].items():
            if value is None:
                if base.get(section, {}).get(name, None) is None:
                    lines.append(f"# {name} = \"none\"  (unset)")
                else:
                    lines.append(f"{name} = \"none\"")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
