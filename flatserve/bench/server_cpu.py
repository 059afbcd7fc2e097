"""The server's CPU time per output token over the measured requests, where the server runs
on this machine: the process listening on its port (the API process, flatserve's or a
peer's) and, apart, the processes under it (engines, workers). What a streamed token costs
the host, which bounds the tokens per second one API process can serve whatever the device
does. Nothing for a server on another machine or processes this user may not read. The
processes under it are those alive at both ends of the run, plus what the API process's
children that ended and were reaped used (an engine restarted mid-run); one started during
the run is not counted. The kernel counts in 10 ms ticks: read short runs as rough."""

from __future__ import annotations

import psutil

from flatserve.soak.processes import listening_pid

REAPED = -1  # the key of the API process's children that ended and were reaped


def _cpu_s(process: psutil.Process) -> tuple[float, float] | None:
    """(the process's own CPU seconds, its reaped children's)."""
    try:
        t = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return t.user + t.system, getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)


class ServerCpu:
    """`with ServerCpu(base_url) as cpu:` around the measured requests, then
    `cpu.per_token_us(tokens)`: {"api": us, "others": us} or None."""

    def __init__(self, base_url: str) -> None:
        pid = listening_pid(base_url)
        try:
            self._api = psutil.Process(pid) if pid is not None else None
        except psutil.Error:
            self._api = None
        self._start: dict[int, float] = {}
        self._end: dict[int, float] = {}

    def _read(self) -> dict[int, float]:
        if self._api is None:
            return {}
        try:
            processes = [self._api, *self._api.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return {}
        read = {p.pid: s for p in processes if (s := _cpu_s(p)) is not None}
        if self._api.pid not in read:
            return {}
        times = {pid: own for pid, (own, _) in read.items()}
        times[REAPED] = read[self._api.pid][1]
        return times

    def __enter__(self) -> ServerCpu:
        self._start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        self._end = self._read()

    def per_token_us(self, tokens: int) -> dict[str, float] | None:
        api = None if self._api is None else self._api.pid
        if api not in self._start or api not in self._end or tokens <= 0:
            return None
        start, end = self._start, self._end
        alive = [pid for pid in end if pid in start and pid not in (api, REAPED)]
        # a pid that ended and was taken by a new process reads less than it started at
        others = sum(max(0.0, end[pid] - start[pid]) for pid in alive)
        # children reaped during the run: their whole lives, less what those alive at the
        # start had used by then
        ended = sum(s for pid, s in start.items() if pid not in end and pid not in (api, REAPED))
        others += max(0.0, end[REAPED] - start[REAPED] - ended)
        return {"api": 1e6 * (end[api] - start[api]) / tokens, "others": 1e6 * others / tokens}
