"""Checking an http(s) image URL part by part before anything connects: every malformed URL
is a 400 that names the part at fault (scheme, host, port), never an error escaping from
the URL parser as a 500."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

import httpx

from api_proc.errors import BadRequest

# A name whose last label is a number is an IPv4 address to a browser (WHATWG URL), where
# 0177.0.0.1 is octal for 127.0.0.1 and 0x7f.1 is hex; DNS never sees it. Only the
# unambiguous dotted-decimal form is taken.
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)
_HOST_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_MAX_HOST_CHARS = 253


class _Malformed(Exception):
    def __init__(self, part: str, problem: str):
        super().__init__(f"{part}: {problem}")


def _part_at(url: str, index: int) -> str:
    scheme_end = url.find("://")
    if scheme_end < 0 or index < scheme_end:
        return "scheme"
    host_start = scheme_end + 3
    host_end = min((i for i in (url.find(c, host_start) for c in "/?#") if i >= 0),
                   default=len(url))
    if index < host_end:
        return "host"
    return "path"


def _check_characters(url: str) -> None:
    for i, ch in enumerate(url):
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            raise _Malformed(_part_at(url, i), f"control character {ch!r} at position {i}")


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as e:  # an unclosed or invalid [IPv6] host
        raise _Malformed("host", str(e)) from None


def _check_port(parts: SplitResult) -> None:
    try:
        port = parts.port
    except ValueError:
        port_text = parts.netloc.rpartition(":")[2]
        raise _Malformed("port", f"{port_text!r} is not a port number (1-65535)") from None
    if port == 0:
        raise _Malformed("port", "0 is not a port number (1-65535)")


def _check_ip_literal(netloc: str) -> None:
    bracketed = netloc.rpartition("@")[2]
    if not bracketed.startswith("["):
        return
    inner = bracketed[1:bracketed.find("]")]
    try:
        ipaddress.IPv6Address(inner)
    except ValueError:
        raise _Malformed("host", f"[{inner}] is not an IPv6 address") from None


def _check_host_name(host: str) -> None:
    if not host:
        raise _Malformed("host", "missing")
    if ":" in host:  # an IPv6 literal, checked with its brackets
        return
    labels = host.rstrip(".").split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _Malformed("host", f"{host!r} is not a dotted-decimal IPv4 address (octal, hex "
                               "and short forms are refused)") from None
        return
    try:
        ascii_host = host.encode("idna").decode("ascii")
        ascii_host.encode("ascii").decode("idna")  # an xn-- label must decode too
    except UnicodeError:
        raise _Malformed("host", f"{host!r} is not a valid domain name") from None
    labels = ascii_host.lower().rstrip(".").split(".")
    if len(ascii_host) > _MAX_HOST_CHARS or not all(_HOST_LABEL.fullmatch(x) for x in labels):
        raise _Malformed("host", f"{host!r} is not a valid domain name")


def parse_http_url(url: str, what: str = "image URL") -> httpx.URL:
    """`url` as httpx reads it, once every part has been checked; a BadRequest naming `what`
    and the part otherwise."""
    try:
        return _parse(url)
    except _Malformed as e:
        raise BadRequest(f"{what} {e}", param="image_url", code="invalid_image_url") from None


def _parse(url: str) -> httpx.URL:
    _check_characters(url)
    parts = _split(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise _Malformed("scheme", f"{parts.scheme!r} is not http or https")
    _check_ip_literal(parts.netloc)
    _check_port(parts)
    _check_host_name(parts.hostname or "")
    try:
        target = httpx.URL(url)
        host = target.host
    except (httpx.InvalidURL, UnicodeError) as e:
        raise _Malformed("as a whole", str(e)) from None
    if not host:
        raise _Malformed("host", "missing")
    return target
