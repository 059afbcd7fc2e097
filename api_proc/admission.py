"""Admission control on multimodal bytes in flight, in the API process and the engines (R4).

Three phases share one budget. A large request body is reserved as it arrives (its bytes
and the strings parsed from them), before more of it is read, so a crowd of clients
uploading base64 images cannot hold more than the budget in request bodies, and one that
declares a length it never sends holds nothing. Once its images' headers are read, the
request exchanges that reservation for the bytes decoding and resizing will need. Once
decoded, it keeps only its resized pixels' bytes (once per engine request: each of `n`
choices sends its own copy), and each engine request gives its share back when its first
output arrives: by then the engine has encoded the images and dropped their pixels and
embeddings (R3). So the budget bounds image bytes queued in the engines too, not only
those being prepared here.

Requests that do not fit wait in FIFO order; a waiter at the head blocks the ones behind it,
so big requests are not starved by a stream of small ones. An exchange gives its body bytes
back and waits ahead of every new request (`priority`): a request that has already been
read is never stuck behind bodies that are not, and exchanges cannot deadlock each other by
holding body bytes while waiting for pixel bytes. Waiting ends with a 429 after the timeout;
a single request larger than the whole budget gets a 413 at once.
"""

from __future__ import annotations

import asyncio
from collections import deque

from api_proc.errors import OverBudget, PayloadTooLarge


class Reservation:
    """Bytes held by one request; release() is idempotent and may be called in parts."""

    __slots__ = ("_controller", "nbytes")

    def __init__(self, controller: AdmissionController, nbytes: int):
        self._controller = controller
        self.nbytes = nbytes

    def release(self, nbytes: int | None = None) -> None:
        """Give back `nbytes` (all that is left when None)."""
        n = self.nbytes if nbytes is None else min(nbytes, self.nbytes)
        if n <= 0:
            return
        self.nbytes -= n
        self._controller._give_back(n)

    def transfer(self) -> Reservation:
        """Move what is left into a new Reservation (for a callback that outlives the
        caller's `finally`); this one then holds nothing."""
        return self.split(self.nbytes)

    def split(self, nbytes: int) -> Reservation:
        """Move `nbytes` of this one (at most what it holds) into a new Reservation."""
        n = min(nbytes, self.nbytes)
        self.nbytes -= n
        return Reservation(self._controller, n)

    def absorb(self, other: Reservation) -> None:
        """Take over what `other` holds (a reservation grown in steps)."""
        self.nbytes += other.nbytes
        other.nbytes = 0

    def shrink_to(self, nbytes: int) -> None:
        """Keep only `nbytes` (e.g. the resized pixels once decoding is done)."""
        self.release(max(0, self.nbytes - nbytes))


class _Expired(Exception):
    pass


class _Waiter:
    __slots__ = ("nbytes", "future", "priority")

    def __init__(self, nbytes: int, future: asyncio.Future, priority: bool):
        self.nbytes = nbytes
        self.future = future
        self.priority = priority


class AdmissionController:
    def __init__(self, budget_bytes: int, timeout_s: float):
        if budget_bytes < 1:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def can_admit(self, nbytes: int, priority: bool = False) -> bool:
        ahead = self._num_priority_waiting() if priority else len(self._waiters)
        return not ahead and self._in_flight + nbytes <= self.budget_bytes

    def _num_priority_waiting(self) -> int:
        n = 0
        for waiter in self._waiters:
            if not waiter.priority:
                break
            n += 1
        return n

    async def acquire(self, nbytes: int, timeout_s: float | None = None, *,
                      priority: bool = False) -> Reservation:
        """Reserve nbytes, waiting in FIFO order (ahead of every non-priority waiter when
        `priority`). Call `release()` on the result in a `finally`."""
        if nbytes > self.budget_bytes:
            raise PayloadTooLarge(
                f"the request's images need {nbytes} bytes to decode and resize; the whole "
                f"multimodal budget (mm_inflight_budget) is {self.budget_bytes} bytes",
                code="mm_budget_too_small")
        if self.can_admit(nbytes, priority):
            self._in_flight += nbytes
            return Reservation(self, nbytes)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, loop.create_future(), priority)
        if priority:
            self._waiters.insert(self._num_priority_waiting(), waiter)
        else:
            self._waiters.append(waiter)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        # Not asyncio.wait_for: on 3.11 it can swallow a cancel that lands with the grant.
        timer = loop.call_later(timeout, self._expire, waiter)
        try:
            await waiter.future
        except BaseException as e:
            if waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.exception() is None:
                self._give_back(nbytes)  # granted in the same tick as the cancel
            else:
                self._remove(waiter)
            if isinstance(e, _Expired):
                raise OverBudget(
                    f"waited {timeout:g} s for {nbytes} bytes of multimodal budget "
                    f"({self._in_flight} of {self.budget_bytes} bytes in use, "
                    f"{len(self._waiters)} requests waiting); retry later") from None
            raise
        finally:
            timer.cancel()
        return Reservation(self, nbytes)

    async def exchange(self, held: Reservation, nbytes: int) -> Reservation:
        """Swap `held` (a request's body bytes) for a reservation of `nbytes`: kept as it is
        when it already covers them, else given back and re-acquired with priority."""
        if held.nbytes >= nbytes:
            moved = held.transfer()
            moved.shrink_to(nbytes)
            return moved
        if nbytes > self.budget_bytes:
            return await self.acquire(nbytes)  # raises the 413; `held` is the caller's
        held.release()
        return await self.acquire(nbytes, priority=True)

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(_Expired())
            self._remove(waiter)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        self._grant()  # the head may have left: the next ones may fit now

    def _give_back(self, nbytes: int) -> None:
        self._in_flight -= nbytes
        assert self._in_flight >= 0, "admission released more bytes than it granted"
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            if self._in_flight + head.nbytes > self.budget_bytes:
                return
            self._waiters.popleft()
            self._in_flight += head.nbytes
            head.future.set_result(None)
