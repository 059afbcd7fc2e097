"""Command-line flags read off frozen config dataclasses: one source for defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any


def opt(default: Any, help: str, *, parse: Any = None, choices: Any = None) -> Any:
    """A dataclass field with a default and the help text of its flag; `parse` turns the
    flag's text into the value (argparse `type`: raise argparse.ArgumentTypeError with the
    reason), `choices` lists the values the flag takes."""
    metadata = {"help": help, "parse": parse, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def add_dataclass_args(parser: argparse.ArgumentParser | Any, cls: type,
                       names: Iterable[str] | None = None) -> None:
    """Add one --flag per field of `cls` (or per field in `names`)."""
    hints = typing.get_type_hints(cls)
    wanted = set(names) if names is not None else None
    for f in dataclasses.fields(cls):
        if wanted is not None and f.name not in wanted:
            continue
        hint = hints[f.name]
        kwargs: dict = {"default": f.default, "help": f.metadata.get("help", ""), "dest": f.name}
        if f.metadata.get("choices") is not None:
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("parse") is not None:
            kwargs["type"] = f.metadata["parse"]
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif tuple in (typing.get_origin(h) for h in (hint, *typing.get_args(hint))):
            kwargs["nargs"] = "*"
        else:
            kwargs["type"] = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
