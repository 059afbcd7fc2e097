"""Keys inside chat messages that the server does not know: ignored, as vLLM ignores them
(agent frameworks add their own, such as a message id or a part's cache hint), then logged at
debug level by name and counted in /metrics. Their values are never logged or kept: they go
with the request model (R1). Unknown top-level fields are refused by name instead
(protocol.py): there they would change generation."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from pydantic import BaseModel

from api_proc.protocol import ChatMessage

logger = logging.getLogger(__name__)

MAX_LOGGED = 8  # key names per request in the debug line
MAX_NAME_CHARS = 64  # of each logged name: names come from the client


def _extra(item: BaseModel) -> list[str]:
    return list(item.model_extra or ())


def unknown_keys(messages: list[ChatMessage]) -> Iterator[tuple[str, str]]:
    """(where, path) of every unknown key: where is "message", "part" or "tool_call"."""
    for i, m in enumerate(messages):
        for key in _extra(m):
            yield "message", f"messages.{i}.{key}"
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                for key in _extra(part):
                    yield "part", f"messages.{i}.content.{j}.{key}"
                image_url = getattr(part, "image_url", None)
                for key in _extra(image_url) if image_url is not None else ():
                    yield "part", f"messages.{i}.content.{j}.image_url.{key}"
        for j, call in enumerate(m.tool_calls or ()):
            for key in _extra(call):
                yield "tool_call", f"messages.{i}.tool_calls.{j}.{key}"
            for key in _extra(call.function):
                yield "tool_call", f"messages.{i}.tool_calls.{j}.function.{key}"


def note_unknown_keys(messages: list[ChatMessage], count) -> None:
    """Log (debug) and count the unknown keys of `messages`; count(where) per key."""
    paths = []
    for where, path in unknown_keys(messages):
        count(where)
        paths.append(path[:MAX_NAME_CHARS])
    if paths and logger.isEnabledFor(logging.DEBUG):
        more = f" and {len(paths) - MAX_LOGGED} more" if len(paths) > MAX_LOGGED else ""
        logger.debug("ignored unknown keys inside messages: %s%s",
                     ", ".join(paths[:MAX_LOGGED]), more)
