"""msgpack codec for nested values with out-of-band array buffers and registered dataclasses.

One encoded value is a msgpack document plus a list of buffers. A numpy array or torch tensor
of at least `inline_threshold` bytes is not copied into the document: its own memory becomes
one buffer (zmq sends it with copy=False) and the document holds the buffer's index. The
receiver builds the array over the received buffer (np.frombuffer / torch.frombuffer), so a
256 MB tensor crosses the process boundary without a Python-level copy. Smaller arrays travel
inline. Nothing is ever pickled.

Tagged values are msgpack arrays whose first item is a marker (a msgpack extension value
with an empty or name payload); everything after it is plain msgpack, packed in one pass with
no nested documents:
  [ext 1 ndarray, dtype, shape, data, perm]   data: buffer index (int) or inline bytes
  [ext 2 tensor, dtype, shape, data, perm]    perm: None for C order, else the buffer holds
                                              x.transpose(perm) in C order (zero-copy for
                                              transposed / permuted views)
  [ext 3 tuple, items...]                     (plain msgpack arrays come back as lists)
  [ext 4 "Name" struct, field values...]      a dataclass registered with the codec
  [ext 5 npscalar, dtype, bytes]              a numpy scalar such as np.float32(1.5)
msgpack.ExtType values are therefore reserved: user data must not contain them.

Wire byte order is little-endian (the host order of every platform torch supports).
Thread-safety: a Codec is immutable after construction; encode/decode may run in any thread.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from rpc.errors import DecodeError, EncodeError

EXT_NDARRAY = 1
EXT_TENSOR = 2
EXT_TUPLE = 3
EXT_STRUCT = 4
EXT_NPSCALAR = 5

DEFAULT_INLINE_THRESHOLD = 2048
MAX_NDIM = 32

# The dtypes numpy and torch share; torch-only ones are added in _torch_dtypes().
_NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_TORCH_ONLY_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_torch_by_name: dict[str, Any] | None = None
_name_by_torch: dict[Any, str] | None = None

Buffer = Any  # anything with the buffer protocol: zmq.Frame, memoryview, bytes, np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class _Struct:
    name: str
    cls: type
    field_names: tuple[str, ...]
    positional: bool  # no kw_only fields: build with cls(*values)
    marker: msgpack.ExtType  # built once: the encoder emits it as is

    def build(self, values: list[Any]) -> Any:
        if len(values) != len(self.field_names):
            raise DecodeError(f"{self.name}: expected {len(self.field_names)} field values")
        try:
            if self.positional:
                return self.cls(*values)
            return self.cls(**dict(zip(self.field_names, values, strict=True)))
        except Exception as e:
            raise DecodeError(f"cannot rebuild {self.name}: {type(e).__name__}: {e}") from e


class _Tag:
    """What a marker decodes to until the array it heads is complete (see list_hook)."""

    __slots__ = ("code", "struct")

    def __init__(self, code: int, struct: _Struct | None = None) -> None:
        self.code = code
        self.struct = struct


_MARKERS = {code: msgpack.ExtType(code, b"") for code in (EXT_NDARRAY, EXT_TENSOR, EXT_TUPLE, EXT_NPSCALAR)}
_TAGS = {code: _Tag(code) for code in _MARKERS}


class Codec:
    """Encodes nested dicts / lists / tuples / scalars / str / bytes / numpy arrays / torch
    tensors / registered dataclasses; decodes them back to the same types.

    `types` lists the dataclasses allowed on the wire, keyed by their `__qualname__`, or a
    mapping from a stable wire name to the class. Dataclasses are encoded field by field
    (their array fields stay out-of-band; `dataclasses.asdict` would deep-copy them) and
    rebuilt with their own `__init__`, so `__post_init__` validation runs on the receiver.

    Bytes-likes (bytearray, memoryview) come back as bytes; subclasses of str / int / float /
    dict / list (enums included) come back as the plain base type; torch tensors come back
    as plain tensors, detached, on the CPU.
    """

    def __init__(
        self,
        types: Iterable[type] | Mapping[str, type] = (),
        *,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        if inline_threshold < 0:
            raise ValueError(f"inline_threshold must be >= 0, got {inline_threshold}")
        self.inline_threshold = inline_threshold
        self._local = threading.local()  # one _Encoder (and its msgpack Packer) per thread
        self._struct_by_name: dict[str, _Struct] = {}
        self._struct_by_type: dict[type, _Struct] = {}
        self._tag_by_name: dict[bytes, _Tag] = {}
        named = types.items() if isinstance(types, Mapping) else ((t.__qualname__, t) for t in types)
        for name, cls in named:
            self._register(name, cls)

    def _register(self, name: str, cls: type) -> None:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"only dataclasses can be registered, got {cls!r}")
        if name in self._struct_by_name:
            raise ValueError(
                f"two wire types named {name!r}; pass a mapping {{name: class}} to rename one"
            )
        if cls in self._struct_by_type:
            raise ValueError(f"{cls.__qualname__} registered twice")
        fields = [f for f in dataclasses.fields(cls) if f.init]
        struct = _Struct(
            name=name,
            cls=cls,
            field_names=tuple(f.name for f in fields),
            positional=not any(getattr(f, "kw_only", False) for f in fields),
            marker=msgpack.ExtType(EXT_STRUCT, name.encode()),
        )
        self._struct_by_name[name] = struct
        self._struct_by_type[cls] = struct
        self._tag_by_name[name.encode()] = _Tag(EXT_STRUCT, struct)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(self._struct_by_name)

    # -- public convenience form: frames = [document, *buffers] -----------------------------

    def encode(self, obj: Any) -> list[Buffer]:
        """Return `[document, *buffers]`, ready for `socket.send_multipart(..., copy=False)`."""
        buffers: list[Buffer] = []
        doc = self.pack(obj, buffers)
        return [doc, *buffers]

    def decode(self, frames: Sequence[Buffer]) -> Any:
        """Inverse of `encode`; frames may be zmq.Frame (zero-copy), bytes or memoryviews."""
        if len(frames) < 1:
            raise DecodeError("no frames to decode")
        return self.unpack(frames[0], frames[1:])

    # -- the form the protocol uses: several documents sharing one frame list ---------------

    def pack(self, obj: Any, buffers: list[Buffer]) -> bytes:
        """Encode `obj` to a msgpack document; append its out-of-band buffers to `buffers`
        (indices in the document are relative to the length `buffers` had on entry)."""
        base = len(buffers)
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:
            encoder = self._local.encoder = _Encoder(self)
        try:
            return encoder.pack(obj, buffers)
        except EncodeError:
            del buffers[base:]
            raise
        except (TypeError, ValueError, OverflowError) as e:
            del buffers[base:]
            raise EncodeError(f"cannot encode value: {e}") from e

    def unpack(self, doc: Buffer, buffers: Sequence[Buffer]) -> Any:
        """Decode one document; out-of-band indices refer to `buffers`. Raises only
        DecodeError on malformed input."""
        decoder = _Decoder(self, buffers)
        try:
            if isinstance(doc, zmq.Frame):
                doc = doc.buffer
            value = msgpack.unpackb(
                doc, ext_hook=decoder.ext_hook, list_hook=decoder.list_hook,
                raw=False, strict_map_key=False,
            )
        except DecodeError:
            raise
        except Exception as e:  # msgpack, numpy, torch and dataclass __init__ errors alike
            raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from e
        if decoder.num_tags:
            raise DecodeError("a type marker outside the head of an array")
        return value


class _Encoder:
    """msgpack `default` hook around one reusable Packer (`msgpack.packb` allocates a fresh
    256 KiB buffer per call, measured several times slower). Lives in a thread-local of its
    Codec; `buffers` is set for the duration of one `pack` call."""

    __slots__ = ("codec", "buffers", "base", "packer")

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.buffers: list[Buffer] = []
        self.base = 0
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True)

    def pack(self, obj: Any, buffers: list[Buffer]) -> bytes:
        self.buffers, self.base = buffers, len(buffers)
        try:
            return self.packer.pack(obj)
        finally:
            self.buffers = []  # R1: keep no reference to the arrays after the call

    def array_data(self, flat_u8: np.ndarray) -> bytes | int:
        if flat_u8.nbytes < self.codec.inline_threshold:
            return flat_u8.tobytes()
        self.buffers.append(flat_u8)
        return len(self.buffers) - 1 - self.base

    def default(self, obj: Any) -> Any:
        tp = type(obj)
        if tp is tuple:
            return [_MARKERS[EXT_TUPLE], *obj]
        struct = self.codec._struct_by_type.get(tp)
        if struct is not None:
            return [struct.marker, *[getattr(obj, name) for name in struct.field_names]]
        if isinstance(obj, np.ndarray):
            dtype, shape, flat, perm = _ndarray_parts(obj)
            return [_MARKERS[EXT_NDARRAY], dtype, shape, self.array_data(flat), perm]
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            dtype, shape, flat, perm = _tensor_parts(obj)
            return [_MARKERS[EXT_TENSOR], dtype, shape, self.array_data(flat), perm]
        if isinstance(obj, np.generic):
            dtype, _, flat, _ = _ndarray_parts(np.asarray(obj))
            return [_MARKERS[EXT_NPSCALAR], dtype, flat.tobytes()]
        if isinstance(obj, tuple):
            return tuple(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if isinstance(obj, int):
            return int.__index__(obj)
        if isinstance(obj, float):
            return float.__float__(obj)
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if dataclasses.is_dataclass(obj):
            raise EncodeError(
                f"dataclass {tp.__module__}.{tp.__qualname__} is not registered with this "
                f"codec (registered: {', '.join(self.codec.type_names) or 'none'})"
            )
        raise EncodeError(
            f"cannot encode a {tp.__module__}.{tp.__qualname__}: supported are None, bool, "
            "int, float, str, bytes, list, tuple, dict, numpy arrays and scalars, torch "
            "tensors and dataclasses registered with the codec"
        )


class _Decoder:
    """msgpack hooks for one `Codec.unpack` call. A marker decodes to a _Tag; when the array
    it heads is complete, list_hook turns the array into the tagged value. msgpack completes
    inner arrays first, so values nest naturally. `num_tags` counts tags not yet consumed:
    a marker anywhere but at the head of an array is malformed input."""

    __slots__ = ("codec", "buffers", "num_tags")

    def __init__(self, codec: Codec, buffers: Sequence[Buffer]) -> None:
        self.codec = codec
        self.buffers = buffers
        self.num_tags = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_STRUCT:
            tag = self.codec._tag_by_name.get(data)
            if tag is None:
                name = data.decode(errors="replace")
                raise DecodeError(
                    f"unknown wire type {name!r} (registered: "
                    f"{', '.join(self.codec.type_names) or 'none'})"
                )
        else:
            tag = _TAGS.get(code)
            if tag is None or data:
                raise DecodeError(f"unknown msgpack extension type {code}")
        self.num_tags += 1
        return tag

    def list_hook(self, items: list[Any]) -> Any:
        if not items or type(items[0]) is not _Tag:
            return items
        self.num_tags -= 1
        tag = items[0]
        code = tag.code
        if code == EXT_TUPLE:
            return tuple(items[1:])
        if code == EXT_STRUCT:
            return tag.struct.build(items[1:])
        if code == EXT_NDARRAY:
            return _decode_ndarray(items[1:], self.buffers)
        if code == EXT_TENSOR:
            return _decode_tensor(items[1:], self.buffers)
        _expect(len(items) == 3, "bad numpy scalar payload")
        dtype = _numpy_dtype(items[1])
        raw = items[2]
        _expect(isinstance(raw, bytes) and len(raw) == dtype.itemsize, "bad numpy scalar bytes")
        return np.frombuffer(raw, dtype=dtype)[0]


# -- array helpers ---------------------------------------------------------------------------


def _ndarray_parts(arr: np.ndarray) -> tuple[str, list[int], np.ndarray, list[int] | None]:
    """(dtype name, shape, flat uint8 view of dense memory, perm) without copying when the
    array is C-contiguous or a permutation of a C-contiguous block."""
    dtype = arr.dtype
    if dtype.name not in _NUMPY_DTYPES or dtype.fields is not None:
        raise EncodeError(f"numpy dtype {dtype} cannot be sent (no pickle on the wire)")
    if not dtype.isnative:
        arr = arr.astype(dtype.newbyteorder("="))
    shape = list(arr.shape)
    perm = None
    if not arr.flags.c_contiguous:
        if arr.ndim > 1:
            strides = arr.strides
            order = sorted(range(arr.ndim), key=lambda i: -strides[i])
            permuted = arr.transpose(order)
            if permuted.flags.c_contiguous:
                arr, perm = permuted, order
        if perm is None:
            arr = np.ascontiguousarray(arr)
    return dtype.name, shape, arr.reshape(-1).view(np.uint8), perm


def _tensor_parts(t: Any) -> tuple[str, list[int], np.ndarray, list[int] | None]:
    torch = sys.modules["torch"]
    if t.device.type != "cpu":
        raise EncodeError(f"tensor on {t.device} cannot be sent: move it to the CPU first")
    if t.layout != torch.strided:
        raise EncodeError(f"tensor layout {t.layout} cannot be sent: only dense tensors")
    name = _torch_names().get(t.dtype)
    if name is None:
        raise EncodeError(f"torch dtype {t.dtype} cannot be sent")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    shape = list(t.shape)
    perm = None
    if not t.is_contiguous():
        if t.dim() > 1:
            strides = t.stride()
            order = sorted(range(t.dim()), key=lambda i: -strides[i])
            permuted = t.permute(order)
            if permuted.is_contiguous():
                t, perm = permuted, order
        if perm is None:
            t = t.contiguous()
    if t.numel() == 0:
        return name, shape, np.empty(0, dtype=np.uint8), perm
    return name, shape, t.reshape(-1).view(torch.uint8).numpy(), perm


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise DecodeError(what)


def _numpy_dtype(name: Any) -> np.dtype:
    dtype = _NUMPY_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise DecodeError(f"unsupported numpy dtype {name!r}")
    return dtype


def _array_header(payload: Any) -> tuple[Any, tuple[int, ...], Any, list[int] | None]:
    _expect(isinstance(payload, list) and len(payload) == 4, "bad array payload")
    dtype_name, shape, data, perm = payload
    _expect(
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(type(d) is int and d >= 0 for d in shape),
        f"bad array shape {shape!r}",
    )
    if perm is not None:
        _expect(
            isinstance(perm, list) and sorted(perm) == list(range(len(shape)))
            and all(type(p) is int for p in perm),
            f"bad array permutation {perm!r}",
        )
    return dtype_name, tuple(shape), data, perm


def _array_bytes(data: Any, buffers: Sequence[Buffer], nbytes: int) -> memoryview | bytearray:
    """The bytes an array is built over: the received buffer itself (zero-copy) or a
    writable copy of inline bytes."""
    if isinstance(data, bytes):
        buf: memoryview | bytearray = bytearray(data)
        size = len(buf)
    else:
        _expect(type(data) is int and 0 <= data < len(buffers), f"bad buffer index {data!r}")
        frame = buffers[data]
        buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if buf.ndim != 1 or buf.format != "B":
            buf = buf.cast("B")
        size = buf.nbytes
    if size != nbytes:
        raise DecodeError(f"array buffer has {size} bytes, its dtype and shape need {nbytes}")
    return buf


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _decode_ndarray(payload: Any, buffers: Sequence[Buffer]) -> np.ndarray:
    dtype_name, shape, data, perm = _array_header(payload)
    dtype = _numpy_dtype(dtype_name)
    dense_shape = shape if perm is None else tuple(shape[p] for p in perm)
    buf = _array_bytes(data, buffers, math.prod(dense_shape) * dtype.itemsize)
    arr = np.frombuffer(buf, dtype=dtype)
    if not arr.flags.aligned:  # a small frame inside zmq's shared receive buffer
        arr = arr.copy()
    arr = arr.reshape(dense_shape)
    return arr if perm is None else arr.transpose(_inverse(perm))


def _decode_tensor(payload: Any, buffers: Sequence[Buffer]) -> Any:
    dtype_name, shape, data, perm = _array_header(payload)
    torch_dtypes = _torch_dtypes()
    dtype = torch_dtypes.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise DecodeError(f"unsupported torch dtype {dtype_name!r}")
    torch = sys.modules["torch"]
    dense_shape = shape if perm is None else tuple(shape[p] for p in perm)
    itemsize = dtype.itemsize
    buf = _array_bytes(data, buffers, math.prod(dense_shape) * itemsize)
    if len(buf) == 0:
        t = torch.empty(dense_shape, dtype=dtype)
    else:
        if isinstance(buf, memoryview) and buf.readonly:  # torch.frombuffer wants writable
            buf = bytearray(buf)
        t = torch.frombuffer(buf, dtype=dtype)
        if t.data_ptr() % min(itemsize, 8):
            t = t.clone()
        t = t.reshape(dense_shape)
    return t if perm is None else t.permute(_inverse(perm))


def _torch_dtypes() -> dict[str, Any]:
    """Wire name -> torch dtype. Imports torch on first use, so processes that never see a
    tensor never pay for importing it."""
    global _torch_by_name, _name_by_torch
    if _torch_by_name is None:
        import torch

        by_name = {name: getattr(torch, name) for name in _NUMPY_DTYPES}
        by_name.update(
            {name: getattr(torch, name) for name in _TORCH_ONLY_DTYPES if hasattr(torch, name)}
        )
        _name_by_torch = {dtype: name for name, dtype in by_name.items()}
        _torch_by_name = by_name
    return _torch_by_name


def _torch_names() -> dict[Any, str]:
    _torch_dtypes()
    assert _name_by_torch is not None
    return _name_by_torch
