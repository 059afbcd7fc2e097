"""Which processes a soak samples, and what to call them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil

_TITLE = re.compile(r"flatserve:\s*(\S.*)")
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"}


@dataclass
class Target:
    role: str
    pid: int
    process: psutil.Process = field(repr=False)
    uss_ok: bool = True  # False once memory_full_info was refused
    gone: bool = False


def role_of(process: psutil.Process) -> str:
    """'flatserve: engine 0' (process title or command line) -> 'engine 0'; else 'pid N'."""
    try:
        title = " ".join(process.cmdline()).strip()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        title = ""
    match = _TITLE.search(title)
    return " ".join(match.group(1).split()) if match else f"pid {process.pid}"


def make_targets(pids: list[int]) -> list[Target]:
    """Targets for these pids, in order, each role made unique with its pid when repeated."""
    targets: list[Target] = []
    seen: set[str] = set()
    for pid in pids:
        process = psutil.Process(pid)
        role = role_of(process)
        if role in seen:
            role = f"{role} ({pid})"
        seen.add(role)
        targets.append(Target(role, pid, process))
    return targets


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants, the root first, children in pid order."""
    children = psutil.Process(root).children(recursive=True)
    return [root, *sorted(c.pid for c in children)]


def listening_pid(url: str) -> int | None:
    """The pid of the local process listening on `url`'s port, when it can be found."""
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for conn in connections:  # an entry without a pid (another user's, say) is passed over
        if (conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                and conn.pid is not None):
            return conn.pid
    return None
