"""Command-line flags generated from the config's keys (``leaf_keys()``), and ``--set key=value``.

Every dotted key gets a flag: dots and underscores become dashes (``model.num_layers`` ->
``--model-num-layers``, ``timeouts.lookup_ms`` -> ``--timeouts-lookup-ms``), and ``server.*`` keys
drop their prefix (``--pool-size``, ``--workers``); ``server.url`` is the common ``--url``. Flags
are typed from the config structs, so a bad value is a usage error (exit 2) naming the flag.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

import msgspec
import typer

from lmcache_cli.common import user_errors
from lmcache_core.config import LMCacheConfig, leaf_keys
from lmcache_core.errors import ConfigError

PANEL = "Config keys (these flags beat --set, which beats LMCACHE_* variables and the file)"
SKIP = {"server.url"}  # the common --url option


@dataclass(frozen=True)
class ConfigFlag:
    key: str
    param: str
    decls: tuple[str, ...]
    kind: type  # int, float, bool or str; dict or list: given as YAML ('{m: 10GiB}', '[1000]')
    choices: tuple[str, ...] = ()
    int_or_str: bool = False


def _leaves() -> list[tuple[str, Any]]:
    """``(dotted key, field type)`` for every key of ``leaf_keys()``."""
    return [(key, _field_type(key)) for key in leaf_keys()]


def _field_type(key: str) -> Any:
    cls: Any = LMCacheConfig
    tp: Any = None
    for part in key.split("."):
        fields = {f.name: f.type for f in msgspec.structs.fields(_struct_of(cls))}
        tp = cls = fields[part]
    return tp


def _struct_of(tp: Any) -> type[msgspec.Struct]:
    """The struct of a section (``X`` or an optional ``X | None``)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
            return arg
    raise TypeError(f"not a config section: {tp!r}")


def _classify(tp: Any) -> tuple[type, tuple[str, ...], bool]:
    """(python type, choices, int-or-str) of a config field type."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _classify(typing.get_args(tp)[0])
    if origin is typing.Literal:
        return str, tuple(str(a) for a in typing.get_args(tp)), False
    if tp in (bool, int, float, str):
        return tp, (), False
    if origin in (dict, list):
        return origin, (), False
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1:  # X | None
        return _classify(args[0])
    if {typing.get_origin(a) or a for a in args} == {int, str}:
        return str, (), True
    return str, (), False


def config_flags() -> list[ConfigFlag]:
    """One flag per config key (but ``server.url``), in declaration order."""
    flags: list[ConfigFlag] = []
    for key, tp in _leaves():
        if key in SKIP:
            continue
        kind, choices, int_or_str = _classify(tp)
        names = [flag_name(key)]
        if kind is bool:
            names = [f"{n}/--no-{n.removeprefix('--')}" for n in names]
        flags.append(ConfigFlag(key, "cfg_" + key.replace(".", "__"), tuple(names), kind, choices,
                                int_or_str))
    return flags


def flag_name(key: str) -> str:
    """``server.pool_size`` -> ``--pool-size``; ``model.num_layers`` -> ``--model-num-layers``."""
    return "--" + key.removeprefix("server.").replace(".", "-").replace("_", "-")


def flag_parameters(flags: Sequence[ConfigFlag]) -> list[inspect.Parameter]:
    """Keyword parameters (default None) that Typer turns into the flags."""
    params = []
    for flag in flags:
        help_text = flag.key + (" (bytes, or e.g. 4GiB)" if flag.int_or_str else "")
        if flag.choices:
            help_text += f": {'|'.join(flag.choices)}"
        structured = flag.kind in (dict, list)
        if structured:
            help_text += " (YAML, e.g. '{name: 10GiB}')" if flag.kind is dict else " (YAML list)"
        metavar = "YAML" if structured else flag.kind.__name__.upper()
        option = typer.Option(*flag.decls, help=help_text, show_default=False,
                              rich_help_panel=PANEL, show_choices=False,
                              metavar=metavar if flag.kind is not bool else None)
        kind: Any = (choice_enum(flag.key, flag.choices) if flag.choices
                     else str if structured else flag.kind)
        annotation = Annotated[kind | None, option]
        params.append(inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=annotation))
    return params


def with_config_flags(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the generated flags to ``func``'s signature for Typer.

    ``func`` takes a keyword ``config_overrides``: the flags given, keyed by dotted config key.
    """
    flags = config_flags()
    signature = inspect.signature(func, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "config_overrides"]
    by_param = {flag.param: flag for flag in flags}

    def wrapper(**kwargs: Any) -> Any:
        with user_errors():  # a flag's YAML that does not parse: one line, exit 2
            overrides = {by_param[name].key: _flag_value(by_param[name], kwargs.pop(name))
                         for name in list(kwargs) if name in by_param}
        return func(**kwargs, config_overrides=overrides)

    wrapper.__name__ = func.__name__
    wrapper.__qualname__ = func.__qualname__
    wrapper.__doc__ = func.__doc__
    wrapper.__module__ = func.__module__
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*own, *flag_parameters(flags)])
    return wrapper


def choice_enum(name: str, choices: Sequence[str]) -> type[Enum]:
    """A str Enum of ``choices`` (Typer shows and checks it as a choice)."""
    return Enum(name.replace(".", "_"), {c: c for c in choices}, type=str)  # type: ignore[return-value]


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _flag_value(flag: ConfigFlag, value: Any) -> Any:
    """A flag's value as the config takes it (a YAML mapping or list parsed)."""
    if value is None or flag.kind not in (dict, list):
        return _plain(value)
    return _coerce(flag.key, value, flag.kind, (), False, where=flag.decls[0])


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``["model.num_layers=2", ...]`` -> ``{"model.num_layers": 2}``, typed by the config field.

    ConfigError (exit 2) for a missing ``=``, an unknown key or a value of the wrong type."""
    kinds = {key: _classify(tp) for key, tp in _leaves()}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set server.workers=4")
        if key not in kinds:
            raise ConfigError(f"--set {item!r}: unknown config key {key!r} "
                              f"(keys: {', '.join(kinds)})")
        out[key] = _coerce(key, text, *kinds[key])
    return out


def _coerce(key: str, text: str, kind: type, choices: tuple[str, ...], int_or_str: bool,
            where: str | None = None) -> Any:
    where = f"{where} {text}" if where else f"--set {key}={text}"
    if kind in (dict, list):
        return _structured(where, text, kind)
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{where}: expected true or false")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{where}: expected {'an integer' if kind is int else 'a number'}"
                              ) from None
    if choices and text not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}")
    if int_or_str and text.strip().isdigit():
        return int(text)
    return text


def _structured(where: str, text: str, kind: type) -> Any:
    """A mapping or list written in YAML (flow style on one line: ``{m: 10GiB, n: 2GiB}``)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not YAML: {str(exc).splitlines()[0]}") from None
    if value is None:
        return {} if kind is dict else []
    if not isinstance(value, kind):
        example = "{name: 10GiB}" if kind is dict else "[1000, 1001]"
        raise ConfigError(f"{where}: expected a YAML {'mapping' if kind is dict else 'list'}, "
                          f"e.g. '{example}'")
    return value


def merge(*layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Later layers win; None values (flags not given) are dropped."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in (layer or {}).items():
            if value is not None:
                out[key] = value
    return out
