"""Command-line flags read off frozen config dataclasses: one source for defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Iterable
from typing import Any


def opt(default: Any, help: str, *, parse: Any = None, choices: Any = None,
        aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with a default and the help text of its flag; `parse` turns the
    flag's text into the value (argparse `type`: raise argparse.ArgumentTypeError with the
    reason), `choices` lists the values the flag takes, `aliases` are other spellings of
    the flag (vLLM's names for the same setting)."""
    metadata = {"help": help, "parse": parse, "choices": choices, "aliases": aliases}
    return dataclasses.field(default=default, metadata=metadata)


def parse_human_int(text: str) -> int:
    """vLLM's readable integers: '4096', '32k' (x1000), '32K' (x1024), '1.5m', '2M'."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 4096, 32k, 32K)")
    number, suffix = match.groups()
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: binary suffixes take whole numbers")
        return int(number) * 1024 ** " KMG".index(suffix)
    if "." in number and not suffix:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(float(number) * 1000 ** " kmg".index(suffix or " "))


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
        parser.add_argument("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()),
                            **kwargs)


def dataclass_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
