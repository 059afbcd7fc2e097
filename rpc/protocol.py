"""Envelopes (message kinds) and how a batch of them is laid out in one zmq multipart message.

Multipart layout (a ROUTER sees the peer's routing id in front of it):

    [body, buffers of envelope 1 ..., buffers of envelope n ...]
    body = header + the n msgpack envelopes back to back
    header = little-endian u8 PROTOCOL_VERSION, u32 n, then n pairs (u32 length, u32 buffers)

Each envelope is a msgpack array [kind, call_id, ...]; its out-of-band buffer indices count
from its own first buffer, so an envelope is encoded once, when it is posted, and batching
only concatenates. Envelopes for one peer posted in the same event-loop tick share one send
and one frame: zmq's cost is per message and frame, not per byte.

client -> server
    CALL    [CALL, id, method, args, timeout_s | None]
    STREAM  [STREAM, id, method, args, timeout_s | None, window]
    CREDIT  [CREDIT, id, n]        the client consumed n more items: the server may send n more
    CANCEL  [CANCEL, id]
    PING    [PING, 0]
server -> client
    RESULT  [RESULT, id, value]
    ITEM    [ITEM, id, value]      at most `window` items beyond the credits granted
    END     [END, id]
    ERROR   [ERROR, id, code, type_name, message, traceback]
    PONG    [PONG, 0]
"""

from __future__ import annotations

import struct
import traceback
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from rpc.codec import Buffer, Codec
from rpc.errors import (
    DeadlineExceeded,
    DecodeError,
    ProtocolError,
    RemoteError,
    RpcError,
    ServerUnavailable,
)

PROTOCOL_VERSION = 1
_HEADER = struct.Struct("<BI")
_HEADER_ONE = struct.Struct("<BIII")

CALL = 1
STREAM = 2
CREDIT = 3
CANCEL = 4
PING = 5
RESULT = 6
ITEM = 7
END = 8
ERROR = 9
PONG = 10

KIND_NAMES = {
    CALL: "CALL", STREAM: "STREAM", CREDIT: "CREDIT", CANCEL: "CANCEL", PING: "PING",
    RESULT: "RESULT", ITEM: "ITEM", END: "END", ERROR: "ERROR", PONG: "PONG",
}

# ERROR codes
ERR_REMOTE = "remote"  # the handler raised
ERR_DEADLINE = "deadline"
ERR_UNAVAILABLE = "unavailable"  # server shutting down
ERR_UNKNOWN_METHOD = "unknown_method"
ERR_BAD_REQUEST = "bad_request"  # the request did not decode
ERR_PROTOCOL = "protocol"
ERR_BUSY = "busy"  # too many calls in flight from this peer

MAX_TRACEBACK_CHARS = 16_384

Encoded = tuple[bytes, list[Buffer]]  # one envelope: msgpack document + its buffers


def pack_envelope(codec: Codec, envelope: list[Any]) -> Encoded:
    buffers: list[Buffer] = []
    return codec.pack(envelope, buffers), buffers


def batch_frames(items: Sequence[Encoded]) -> list[Buffer]:
    """Frames of one multipart message carrying `items` in order."""
    n = len(items)
    if n == 1:
        doc, bufs = items[0]
        return [_HEADER_ONE.pack(PROTOCOL_VERSION, 1, len(doc), len(bufs)) + doc, *bufs]
    sizes = []
    for doc, bufs in items:
        sizes += (len(doc), len(bufs))
    parts = [_HEADER.pack(PROTOCOL_VERSION, n), struct.pack(f"<{2 * n}I", *sizes)]
    parts += [doc for doc, _ in items]
    frames: list[Buffer] = [b"".join(parts)]
    for _, bufs in items:
        frames.extend(bufs)
    return frames


def split_batch(frames: Sequence[Buffer]) -> list[tuple[Buffer, Sequence[Buffer]]]:
    """Inverse of `batch_frames`: [(envelope document, its buffers)]. Raises DecodeError."""
    if not frames:
        raise DecodeError("empty message")
    body = frames[0]
    body = body.buffer if isinstance(body, zmq.Frame) else memoryview(body)
    size = body.nbytes
    if size < _HEADER.size:
        raise DecodeError(f"message body of {size} bytes is shorter than its header")
    version, n = _HEADER.unpack_from(body, 0)
    if version != PROTOCOL_VERSION:
        raise DecodeError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    start = _HEADER.size + 8 * n
    if start > size:
        raise DecodeError(f"header announces {n} envelopes, body has only {size} bytes")
    sizes = struct.unpack_from(f"<{2 * n}I", body, _HEADER.size)
    if start + sum(sizes[0::2]) != size:
        raise DecodeError("envelope lengths do not add up to the body size")
    if 1 + sum(sizes[1::2]) != len(frames):
        raise DecodeError(
            f"header announces {sum(sizes[1::2])} buffers, message has {len(frames) - 1}"
        )
    out: list[tuple[Buffer, Sequence[Buffer]]] = []
    pos = 1
    for i in range(n):
        length, count = sizes[2 * i], sizes[2 * i + 1]
        out.append((body[start : start + length], frames[pos : pos + count]))
        start += length
        pos += count
    return out


def unpack_envelope(codec: Codec, doc: Buffer, buffers: Sequence[Buffer]) -> list[Any]:
    envelope = codec.unpack(doc, buffers)
    if not (
        isinstance(envelope, list)
        and len(envelope) >= 2
        and type(envelope[0]) is int
        and type(envelope[1]) is int
    ):
        raise DecodeError("envelope is not [kind, call_id, ...]")
    return envelope


def peek_call(doc: Buffer) -> tuple[int, int] | None:
    """(kind, call_id) of an envelope whose payload did not decode, to answer it with an
    error; None when even that much is unreadable."""
    try:
        if isinstance(doc, zmq.Frame):
            doc = doc.buffer
        envelope = msgpack.unpackb(doc, ext_hook=lambda code, data: None, strict_map_key=False)
    except Exception:
        return None
    if isinstance(envelope, list) and len(envelope) >= 2:
        kind, call_id = envelope[0], envelope[1]
        if type(kind) is int and type(call_id) is int:
            return kind, call_id
    return None


def error_envelope(call_id: int, code: str, exc: BaseException) -> list[Any]:
    tp = type(exc)
    type_name = tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"
    tb = "".join(traceback.format_exception(tp, exc, exc.__traceback__))
    if len(tb) > MAX_TRACEBACK_CHARS:
        tb = "...\n" + tb[-MAX_TRACEBACK_CHARS:]
    return [ERROR, call_id, code, type_name, str(exc), tb]


def plain_error_envelope(call_id: int, code: str, type_name: str, message: str) -> list[Any]:
    return [ERROR, call_id, code, type_name, message, ""]


def exception_from_error(envelope: list[Any]) -> RpcError:
    """The exception a client raises for an ERROR envelope."""
    if len(envelope) != 6:
        return ProtocolError(f"malformed ERROR envelope of {len(envelope)} items")
    _, _, code, type_name, message, tb = envelope
    type_name, message, tb = str(type_name), str(message), str(tb)
    if code == ERR_DEADLINE:
        return DeadlineExceeded(message or "deadline exceeded on the server")
    if code == ERR_UNAVAILABLE:
        return ServerUnavailable(message or "server unavailable")
    return RemoteError(type_name, message, tb)
