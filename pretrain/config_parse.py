"""Parsing a config: YAML text (no key given twice), `section.key=value` overrides, and the typed build of a
dataclass tree from plain dicts (unknown keys, wrong types, `Literal` choices, whole numbers for integer fields,
64-bit bounds), each refused with one `ConfigError` naming the key. `pretrain.config` owns the tree itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any, Literal

import yaml

INT64_MAX = 2**63 - 1  # what torch and numpy hold: larger integers fail far from the config
# YAML aliases (`*name`) repeat a node without repeating its text: nested ones expand exponentially, in every later
# walk of the value (type checks, messages, the config saved in a run). A config holds far fewer values than this.
MAX_YAML_VALUES = 1_000_000

_SHOWN = reprlib.Repr()
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = 8
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlevel = 3


def shown(value: Any) -> str:
    """`repr(value)` cut to a message's width (a list or string given as a value may be any length)."""
    return _SHOWN.repr(value)


class ConfigError(ValueError):
    """A config file or override that cannot be turned into a `Config`."""


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin is list or annotation is list:
        items = typing.get_args(annotation)
        return isinstance(value, list) and (not items or all(_type_ok(v, items[0]) for v in value))
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config key '{dotted}'{hint}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                raise ConfigError(f"'{dotted}' must be a mapping, got {shown(value)}")
            kwargs[key] = build(annotation, value, dotted + ".")
            continue
        if annotation is float or (float in typing.get_args(annotation)):
            if isinstance(value, str):  # YAML reads "3e-4" as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
        if annotation is int or (int in typing.get_args(annotation) and float not in typing.get_args(annotation)):
            value = _whole_number(dotted, value)
        if not _type_ok(value, annotation):
            item_choices = _list_item_choices(annotation)
            if item_choices is not None:
                if not isinstance(value, list):
                    raise ConfigError(f"'{dotted}' must be a list of {item_choices[1]}, got {shown(value)}")
                bad = [v for v in value if v not in item_choices[0]]
                raise ConfigError(f"{dotted}: {shown(bad[0])} is not one of {item_choices[1]}")
            choices = _choices(annotation)
            if choices is not None:
                raise ConfigError(f"{dotted}={shown(value)} is not one of {choices}")
            raise ConfigError(
                f"'{dotted}' must be of type {_type_name(annotation)}, got {shown(value)} ({type(value).__name__})"
            )
        if isinstance(value, int) and not isinstance(value, bool) and annotation is float:
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


def _whole_number(dotted: str, value: Any) -> Any:
    """An integer field's value: a float or numeric string that is a whole number (`1e6`, `8.0`) becomes that
    integer, and one outside int64 is refused naming the key; anything else (fractions too) is left to the type
    check."""
    given = value
    if isinstance(value, str):  # YAML reads "1e6" as a string
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        value = number
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            return given  # a fraction: the type check names it
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise ConfigError(f"{dotted}={given} is out of range (integers must fit in 64 bits, at most {INT64_MAX:,})")
    return value


def _choices(annotation: Any) -> str | None:
    """'a, b, c' (and ' (or null)') for a Literal field, None for other types."""
    if typing.get_origin(annotation) is Literal:
        return ", ".join(typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    literals = [a for a in args if typing.get_origin(a) is Literal]
    if len(literals) != 1 or len(args) != 1:
        return None
    optional = type(None) in typing.get_args(annotation)
    return ", ".join(typing.get_args(literals[0])) + (" (or null)" if optional else "")


def _list_item_choices(annotation: Any) -> tuple[tuple, str] | None:
    """(choices, 'a, b, c') for a list-of-Literal field (optionally null), None for other types."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            items = typing.get_args(arg)
            if items and typing.get_origin(items[0]) is Literal:
                choices = typing.get_args(items[0])
                return choices, ", ".join(choices)
    return None


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) is list and typing.get_args(annotation):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def _where(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen_nodes: set[int]) -> None:
    """A key given twice in one mapping, at any depth, is a `ConfigError` naming it (PyYAML keeps the later)."""
    if id(node) in seen_nodes:  # an alias of a node already checked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}{key}" if key is not None else path
            if key is not None and key in first:
                raise ConfigError(f"'{dotted}' is given twice ({_where(first[key])} and {_where(key_node)}); YAML "
                                  "would keep only the later one, so remove one of them")
            if key is not None:
                first[key] = key_node
            _refuse_duplicate_keys(value_node, f"{dotted}.", seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, seen_nodes)


def _expanded_values(node: yaml.Node, memo: dict[int, int | None]) -> int | None:
    """How many values `node` holds with every alias expanded (counted once per distinct node); None for a node
    that contains itself."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = None  # seen again below it: a cycle
    children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
        node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1
    for child in children:
        size = _expanded_values(child, memo)
        if size is None:
            return None
        total += size
    memo[key] = total
    return total


def parse_yaml(text: str, path: str = "") -> Any:
    """YAML as the config reads it: safe types, no key given twice in a mapping (`ConfigError` naming the key,
    dotted from `path`, and both lines), and at most MAX_YAML_VALUES values once aliases are expanded."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, path, set())
        size = _expanded_values(node, {})
        where = f"'{path.rstrip('.')}'" if path else "the YAML"
        if size is None:
            raise ConfigError(f"{where} holds a YAML alias that contains itself: write the values out")
        if size > MAX_YAML_VALUES:
            raise ConfigError(f"{where} holds {size:,} values once its YAML aliases (*name) are expanded, more than "
                              f"any config needs (at most {MAX_YAML_VALUES:,}): write the values out")
        return loader.construct_document(node)  # the composed node, not parsed a second time
    finally:
        loader.dispose()


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def parse_override(text: str) -> tuple[str, Any]:
    """Split `a.b=value` and parse the value as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {shown(text)} must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {shown(text)} has an empty key")
    try:
        value = parse_yaml(raw, f"{key}.") if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {shown(text)}: value is not valid YAML ({yaml_error_line(exc)})") from None
    except ConfigError as exc:
        raise ConfigError(f"override {shown(text)}: {exc}") from None
    return key, value
