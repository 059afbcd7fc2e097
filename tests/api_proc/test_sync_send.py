"""SyncSend: an ASGI send written from synchronous callbacks. Bodies go out inline while the
send does not suspend; once it does (a paused transport), later bodies wait, joined, and
follow in order; a failed send is reported by flush()."""

from __future__ import annotations

import asyncio

import pytest

from api_proc.sync_send import SyncSend


class _Transport:
    """An ASGI send over a transport that pauses while `paused` is clear (as uvicorn's does
    when the client reads slower than the server writes)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.fail: Exception | None = None

    async def send(self, message: dict) -> None:
        if not self.resumed.is_set():
            await self.resumed.wait()
        if self.fail is not None:
            raise self.fail
        assert message["type"] == "http.response.body" and message["more_body"]
        self.written.append(message["body"])


async def test_bodies_go_out_inline_while_the_transport_takes_them():
    t = _Transport()
    out = SyncSend(t.send)
    out(b"a")
    out(b"b")
    assert t.written == [b"a", b"b"]  # no await in between: written inside the calls
    await out.flush()


def _paused(*bodies: bytes) -> tuple[_Transport, SyncSend]:
    """A SyncSend over a paused transport, `bodies` written to it."""
    t = _Transport()
    out = SyncSend(t.send)
    t.resumed.clear()
    for body in bodies:
        out(body)
    return t, out


async def test_bodies_written_while_paused_follow_in_order_joined():
    t, out = _paused(b"1", b"2", b"3")
    await asyncio.sleep(0.01)
    assert t.written == []
    t.resumed.set()
    await out.flush()
    assert t.written == [b"1", b"23"]
    out(b"4")  # inline again
    assert t.written == [b"1", b"23", b"4"]


async def test_a_failed_send_is_raised_by_flush_and_stops_writing():
    t = _Transport()
    out = SyncSend(t.send)
    t.fail = OSError("client gone")
    out(b"x")
    out(b"y")
    with pytest.raises(OSError, match="client gone"):
        await out.flush()
    t.resumed.clear()
    t.fail = None
    out(b"z")  # nothing more is tried
    await asyncio.sleep(0)
    assert t.written == []


async def test_cancel_drops_what_waits_behind_a_paused_send():
    t, out = _paused(b"1", b"2")
    await asyncio.sleep(0)
    out.cancel()
    t.resumed.set()
    await asyncio.sleep(0.01)
    assert t.written == []
    with pytest.raises(asyncio.CancelledError):
        await out.flush()
