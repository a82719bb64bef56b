"""Command-line flags declared on the config dataclass fields they set.

A service's config dataclass is the one place a setting is written: its default, its flag, its
help. `option(...)` declares a field with its flag; `add_flags` adds every such field of a
config class to an argparse parser (the default shown is the field's), and `flag_values` reads
them back as the config's keyword arguments. A deployment TOML table's keys are the flags'
destinations (the flag without its dashes, `-` as `_`), as before.

    @dataclass
    class ExampleConfig:
        max_sessions: int = option(64, "sessions held at once", type=int_between(1))
        adaptive: bool = option(True, "draft a fixed k", flag="--no-adaptive")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# an engine switch: auto turns it on where MLX runs the target on a GPU
GPU_MODES = ("auto", "on", "off")

_KEY = "specd.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    flag: str | None  # None: "--" + the field's name, "_s" dropped, "_" as "-"
    type: Callable | None
    choices: tuple | None
    metavar: str | None
    invert: bool  # the flag means the field's opposite (--float32-weights: half_weights False)


def option(
    default: Any,
    help: str,  # noqa: A002 - argparse's word
    *,
    flag: str | None = None,
    type: Callable | None = None,  # noqa: A002
    choices: tuple | list | None = None,
    metavar: str | None = None,
    invert: bool = False,
) -> Any:
    """A config field with a command-line flag; bool fields become switches."""
    spec = Flag(help, flag, type, tuple(choices) if choices else None, metavar, invert)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def _flag_name(field: dataclasses.Field, spec: Flag) -> str:
    if spec.flag:
        return spec.flag
    return "--" + field.name.removesuffix("_s").replace("_", "-")


def _dest(field: dataclasses.Field, spec: Flag) -> str:
    name = _flag_name(field, spec)
    if name.startswith("--no-"):  # a switch that turns the field off stores into the field
        return field.name
    return name.removeprefix("--").replace("-", "_")


def _flagged(config_type) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(config_type) if _KEY in f.metadata]


def add_flags(parser, config_type, only: tuple[str, ...] | None = None) -> None:
    """One flag per declared field of config_type (of the fields named in `only`, if given)."""
    for field, spec in _flagged(config_type):
        if only is not None and field.name not in only:
            continue
        name, dest = _flag_name(field, spec), _dest(field, spec)
        if isinstance(field.default, bool):  # --no-x clears the field; other switches set it
            off = name.startswith("--no-")
            default = field.default != spec.invert
            action = "store_false" if off else "store_true"
            parser.add_argument(name, dest=dest, action=action, default=default, help=spec.help)
            continue
        parser.add_argument(
            name,
            dest=dest,
            default=field.default,
            type=spec.type,
            choices=spec.choices,
            metavar=spec.metavar,
            help=spec.help,
        )


def flag_values(args, config_type) -> dict[str, Any]:
    """The declared fields' values in parsed args, as config_type's keyword arguments."""
    values = {}
    for field, spec in _flagged(config_type):
        value = getattr(args, _dest(field, spec))
        values[field.name] = (not value) if spec.invert else value
    return values
