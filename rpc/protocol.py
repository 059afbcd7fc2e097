"""Envelopes (message kinds) and how a batch of them is laid out in one zmq multipart message.

Multipart layout (a ROUTER sees the peer's routing id in front of it):

    [header, body, buffers of envelope 1 ..., buffers of envelope n ...]
    header = msgpack [PROTOCOL_VERSION, [len_1, ..., len_n], [num_buffers_1, ..., num_buffers_n]]
    body   = the n msgpack envelopes back to back (len_i bytes each)

Each envelope is a msgpack array [kind, call_id, ...]; its out-of-band buffer indices count
from its own first buffer, so an envelope is encoded once, when it is posted, and batching
only concatenates. Envelopes for one peer posted in the same event-loop tick share one send,
and small ones share one frame: zmq's cost is per frame, not per byte.

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
    if len(items) == 1:
        doc, bufs = items[0]
        return [msgpack.packb([PROTOCOL_VERSION, [len(doc)], [len(bufs)]]), doc, *bufs]
    header = msgpack.packb(
        [PROTOCOL_VERSION, [len(doc) for doc, _ in items], [len(bufs) for _, bufs in items]]
    )
    frames: list[Buffer] = [header, b"".join([doc for doc, _ in items])]
    for _, bufs in items:
        frames.extend(bufs)
    return frames


def split_batch(frames: Sequence[Buffer]) -> list[tuple[Buffer, Sequence[Buffer]]]:
    """Inverse of `batch_frames`: [(envelope document, its buffers)]. Raises DecodeError."""
    if len(frames) < 2:
        raise DecodeError(f"message of {len(frames)} frame(s), expected header and body")
    head, body = frames[0], frames[1]
    if isinstance(head, zmq.Frame):
        head = head.buffer
    try:
        header = msgpack.unpackb(head)
    except Exception as e:
        raise DecodeError(f"bad batch header: {type(e).__name__}: {e}") from e
    if not (isinstance(header, list) and len(header) == 3 and header[0] == PROTOCOL_VERSION):
        raise DecodeError(f"bad batch header (protocol version {PROTOCOL_VERSION} expected)")
    lengths, counts = header[1], header[2]
    if not (
        isinstance(lengths, list)
        and isinstance(counts, list)
        and len(lengths) == len(counts)
        and all(type(n) is int and n >= 0 for n in lengths)
        and all(type(n) is int and n >= 0 for n in counts)
    ):
        raise DecodeError("bad lengths or buffer counts in batch header")
    body = body.buffer if isinstance(body, zmq.Frame) else memoryview(body)
    if sum(lengths) != body.nbytes:
        raise DecodeError(f"batch body has {body.nbytes} bytes, header announces {sum(lengths)}")
    if len(frames) != 2 + sum(counts):
        raise DecodeError(
            f"batch announces {sum(counts)} buffers but has {len(frames) - 2} buffer frames"
        )
    out: list[tuple[Buffer, Sequence[Buffer]]] = []
    start = 0
    pos = 2
    for length, count in zip(lengths, counts, strict=True):
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
