"""A memory plan: the RSS ceiling of one process, as the sum of the parts it may hold.

Each process computes its own at start (api_proc/memory_plan.py, engine_proc/memory_plan.py)
from its budgets and its RSS measured then; `flatserve serve` prints every process's plan in
one table, refuses to start when their sum exceeds the memory the processes may use
(`memory_limit`), and exports them in /metrics beside the measured RSS. The soak fails a
process whose peak RSS goes above its plan.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.config_args import parse_human_int

MiB = 1 << 20
# cgroup v1 writes "no limit" as a huge number (the largest page-aligned int64)
_NO_LIMIT_ABOVE = 1 << 60


@dataclass(frozen=True)
class MemoryPart:
    """One thing a process may hold, at most `nbytes`; `note` says where the figure comes from."""

    name: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The parts of one process ("api", "engine 0"); its ceiling is their sum."""

    process: str
    parts: tuple[MemoryPart, ...]

    @property
    def total(self) -> int:
        return sum(p.nbytes for p in self.parts)


def largest_parts(plans: Sequence[MemoryPlan], n: int = 3) -> list[tuple[str, MemoryPart]]:
    everything = [(plan.process, part) for plan in plans for part in plan.parts]
    return sorted(everything, key=lambda item: -item[1].nbytes)[:n]


def over_limit_message(plans: Sequence[MemoryPlan], limit: int, source: str) -> str | None:
    """None when the plans' sum fits in `limit`; else one line naming the largest parts. The
    limit applies to the sum: the processes share the host (or the container)."""
    total = sum(p.total for p in plans)
    if total <= limit:
        return None
    largest = ", ".join(f"{process} {part.name} {_mib(part.nbytes)}"
                        for process, part in largest_parts(plans))
    return (f"the memory plan needs {_mib(total)} and {source} allows {_mib(limit)}: "
            f"largest parts {largest} (lower those budgets, or raise the limit)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:,.1f} MiB"


def format_table(plans: Sequence[MemoryPlan]) -> str:
    """One table: process, part, bytes, MiB, where the figure comes from; a total per process
    and for all of them."""
    rows = [("process", "part", "bytes", "MiB", "from")]
    for plan in plans:
        for part in plan.parts:
            rows.append((plan.process, part.name, f"{part.nbytes:,}", f"{part.nbytes / MiB:,.1f}",
                         part.note))
        rows.append((plan.process, "total", f"{plan.total:,}", f"{plan.total / MiB:,.1f}", ""))
    if len(plans) > 1:
        total = sum(p.total for p in plans)
        rows.append(("all", "total", f"{total:,}", f"{total / MiB:,.1f}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4]]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_size(text: str) -> int:
    """A byte count: 25769803776, 24G (GiB), 24g (10^9), 512M, 1.5g (the same readable
    integers as --max-model-len)."""
    import argparse

    try:
        value = parse_human_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a byte count, or with a suffix (24G: GiB, 24g: 10^9 "
            "bytes; K/k, M/m as well)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the limit must be above zero")
    return value


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup"),
                        proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, v1 memory.limit_in_bytes);
    None when there is none ('max', or v1's huge number)."""
    for path in _cgroup_limit_files(root, proc_cgroup):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _NO_LIMIT_ABOVE else value
    return None


def _cgroup_limit_files(root: Path, proc_cgroup: Path) -> list[Path]:
    """v2: memory.max of this process's own cgroup, then of the root mount; v1: the memory
    controller's memory.limit_in_bytes."""
    paths = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            paths.append(root / relative / "memory.max")
        elif "memory" in controllers.split(","):
            paths.append(root / "memory" / relative / "memory.limit_in_bytes")
    paths += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    return [p for p in paths if os.path.exists(p)]


def memory_limit(host_memory_limit: int | None) -> tuple[int, str] | None:
    """(bytes, what sets them): --host-memory-limit when given, else the cgroup's limit, or
    None when neither is set."""
    if host_memory_limit:
        return host_memory_limit, "--host-memory-limit"
    limit = cgroup_memory_limit()
    return (limit, "the cgroup's memory limit") if limit else None
