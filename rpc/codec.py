"""The wire form of shared/messages.py: a msgpack document plus out-of-band pixel frames.

    frames = encode(message)   # [document, *pixel buffers]: send with copy=False
    message = decode(frames)   # zmq.Frames in, the same message out; DecodeError if malformed

A message is a msgpack array headed by an extension marker that names its type, followed by
its field values (nested messages the same way). A uint8 array of at least INLINE_BYTES is
not copied into the document: its own memory is one more frame, zmq sends it without a
copy, and the receiver builds the array over the received frame (np.frombuffer). Nothing is
pickled; only the types in WIRE_TYPES and uint8 arrays can cross.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from shared.memory_plan import MemoryPart, MemoryPlan
from shared.messages import (
    WIRE_TYPES,
    AddRequest,
    EncoderKeyNews,
    EngineStats,
    RequestOutput,
    StepOutputs,
)

EXT_STRUCT = 1  # data: one byte, the index of the type in WIRE_TYPES
EXT_ARRAY = 2  # [marker, shape, buffer index | inline bytes]
INLINE_BYTES = 1024
MAX_NDIM = 4


class EncodeError(ValueError):
    """A value cannot be put on the wire."""


class DecodeError(ValueError):
    """Bytes received from a peer are not a valid message."""


_FIELDS = [tuple(f.name for f in dataclasses.fields(t)) for t in WIRE_TYPES]
_MARKERS = [msgpack.ExtType(EXT_STRUCT, bytes([i])) for i in range(len(WIRE_TYPES))]
_INDEX = {t: i for i, t in enumerate(WIRE_TYPES)}
_ARRAY = msgpack.ExtType(EXT_ARRAY, b"")
_STEP_INDEX = _INDEX[StepOutputs]
_STEP_MARKER = _MARKERS[_STEP_INDEX]
_STEP_HEAD = msgpack.packb([_STEP_MARKER, None, None, None, None])[:4]  # array of 5, the marker
_STATS_FIELDS = _FIELDS[_INDEX[EngineStats]]
_local = threading.local()  # one Encoder (a reusable msgpack Packer) per thread


class _Marker:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_ARRAY_MARKER = _Marker(-1)


def encode(message: Any) -> list[Any]:
    if type(message) not in _INDEX:
        raise EncodeError(f"{type(message).__name__} is not a wire message")
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = _Encoder()
    return encoder.encode(message)


def decode(frames: Sequence[Any]) -> Any:
    if not frames:
        raise DecodeError("empty message")
    doc = frames[0].buffer if isinstance(frames[0], zmq.Frame) else memoryview(frames[0])
    if doc[:4] == _STEP_HEAD and len(frames) == 1:
        return _decode_step(doc)
    decoder = _Decoder(frames[1:])
    try:
        value = msgpack.unpackb(doc, ext_hook=decoder.ext_hook, list_hook=decoder.list_hook,
                                raw=False, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as e:  # msgpack, numpy and __post_init__ errors alike
        raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from None
    if decoder.open_markers or type(value) not in _INDEX:
        raise DecodeError("the message is not a wire message")
    return value


def _decode_step(doc: Any) -> StepOutputs:
    """The hot path: [marker, rows of plain values, stats values or None, encoder key news
    as [reset, added, removed] or None, memory plan as [process, [[part, bytes, note],
    ...]] or None], no hooks."""
    try:
        _, rows, stats, keys, plan = msgpack.unpackb(doc, raw=False)
        return StepOutputs([RequestOutput(*row) for row in rows],
                           None if stats is None else EngineStats(*stats),
                           None if keys is None else EncoderKeyNews(*keys),
                           None if plan is None else _plan(*plan))
    except Exception as e:
        raise DecodeError(f"malformed StepOutputs: {type(e).__name__}: {e}") from None


def _plan(process: str, parts: list) -> MemoryPlan:
    if not isinstance(process, str):
        raise TypeError("a memory plan's process is not a string")
    return MemoryPlan(process, tuple(MemoryPart(str(n), int(b), str(note))
                                     for n, b, note in parts))


def peek_request_id(frames: Sequence[Any]) -> str | None:
    """The request id of an AddRequest that did not decode, to refuse it by name."""
    try:
        doc = frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0]
        value = msgpack.unpackb(doc, ext_hook=lambda code, data: (code, data), raw=False)
        if value[0] == (EXT_STRUCT, bytes([_INDEX[AddRequest]])) and isinstance(value[1], str):
            return value[1]
    except Exception:
        pass
    return None


class _Encoder:
    __slots__ = ("buffers", "packer")

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True)

    def encode(self, message: Any) -> list[Any]:
        self.buffers = []
        try:
            doc = self.packer.pack(message)
        except (TypeError, ValueError, OverflowError) as e:
            self.packer.reset()
            raise EncodeError(f"cannot encode {type(message).__name__}: {e}") from None
        finally:
            buffers, self.buffers = self.buffers, []  # R1: keep nothing after the call
        return [doc, *buffers]

    def default(self, obj: Any) -> Any:
        if type(obj) is StepOutputs:  # the hot path: rows of plain values, no marker per output
            stats, keys, plan = obj.stats, obj.encoder_keys, obj.memory_plan
            return [_STEP_MARKER, [(o.request_id, o.new_token_ids, o.finish_reason,
                                    o.num_prompt_tokens, o.num_completion_tokens, o.error,
                                    o.error_code, o.logprobs, o.queued_s, o.prompt_logprobs)
                                   for o in obj.outputs],
                    None if stats is None else [getattr(stats, n) for n in _STATS_FIELDS],
                    None if keys is None else [keys.reset, keys.added, keys.removed],
                    None if plan is None else [plan.process, [(p.name, p.nbytes, p.note)
                                                              for p in plan.parts]]]
        index = _INDEX.get(type(obj))
        if index is not None:
            return [_MARKERS[index], *[getattr(obj, name) for name in _FIELDS[index]]]
        if isinstance(obj, np.ndarray):
            if obj.dtype != np.uint8 or obj.ndim > MAX_NDIM:
                raise EncodeError(f"only uint8 arrays of up to {MAX_NDIM} dims cross, "
                                  f"got {obj.dtype} of shape {obj.shape}")
            flat = np.ascontiguousarray(obj).reshape(-1)
            if flat.nbytes < INLINE_BYTES:
                return [_ARRAY, list(obj.shape), flat.tobytes()]
            self.buffers.append(flat)
            return [_ARRAY, list(obj.shape), len(self.buffers) - 1]
        raise EncodeError(f"a {type(obj).__name__} cannot cross the process boundary")


class _Decoder:
    """msgpack hooks: a marker decodes to a _Marker, and the array it heads becomes the
    message (or uint8 array) once msgpack has completed it (inner arrays complete first)."""

    __slots__ = ("buffers", "open_markers")

    def __init__(self, buffers: Sequence[Any]) -> None:
        self.buffers = buffers
        self.open_markers = 0

    def ext_hook(self, code: int, data: bytes) -> _Marker:
        if code == EXT_STRUCT and len(data) == 1 and data[0] < len(WIRE_TYPES):
            marker = _Marker(data[0])
        elif code == EXT_ARRAY and not data:
            marker = _ARRAY_MARKER
        else:
            raise DecodeError(f"unknown msgpack extension {code}")
        self.open_markers += 1
        return marker

    def list_hook(self, items: list[Any]) -> Any:
        if not items or type(items[0]) is not _Marker:
            return items
        self.open_markers -= 1
        index = items[0].index
        if index < 0:
            return self.array(items)
        names = _FIELDS[index]
        if len(items) - 1 != len(names):
            raise DecodeError(f"{WIRE_TYPES[index].__name__} with {len(items) - 1} fields, "
                              f"expected {len(names)}")
        return WIRE_TYPES[index](*items[1:])

    def array(self, items: list[Any]) -> np.ndarray:
        if len(items) != 3:
            raise DecodeError("bad array")
        _, shape, data = items
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(type(d) is int and d >= 0 for d in shape)):
            raise DecodeError(f"bad array shape {shape!r}")
        if isinstance(data, bytes):
            buf: Any = bytearray(data)
        elif type(data) is int and 0 <= data < len(self.buffers):
            frame = self.buffers[data]
            buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        else:
            raise DecodeError(f"bad array buffer {data!r}")
        arr = np.frombuffer(buf, dtype=np.uint8)
        if arr.size != int(np.prod(shape)):
            raise DecodeError(f"array of shape {shape} over {arr.size} bytes")
        return arr.reshape(shape)
