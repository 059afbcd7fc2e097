"""Codec: exact round trips of every supported type, zero-copy on both ends, clear errors,
and a decoder that only ever raises DecodeError (hypothesis)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpc import Codec, DecodeError, EncodeError
from rpc.codec import EXT_NDARRAY, EXT_NPSCALAR, EXT_STRUCT, EXT_TENSOR, EXT_TUPLE
from rpc.protocol import split_batch, unpack_envelope
from shared.messages import WIRE_TYPES, EngineStats, GenerateRequest, ImageInput, RequestOutput
from shared.sampling_params import SamplingParams

NUMPY_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16", "float8_e4m3fn", "float8_e5m2"]
# () 0-d, empty, empty in the middle, small (inline), large (out-of-band)
SHAPES = [(), (0,), (3, 0, 2), (5,), (7, 3), (64, 65)]


def same(a: Any, b: Any) -> bool:
    """Equal values and equal container / scalar types, recursively."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def roundtrip(codec: Codec, value: Any) -> Any:
    frames = codec.encode(value)
    return codec.decode([bytes(memoryview(f)) if i == 0 else f for i, f in enumerate(frames)])


def random_numpy(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        values = rng.integers(0, 2, size=shape).astype(bool)
    elif dtype.startswith("complex"):
        values = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    elif dtype.startswith("float"):
        values = rng.standard_normal(shape)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return np.asarray(values).astype(dtype)


def random_tensor(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype in NUMPY_DTYPES:
        return torch.from_numpy(random_numpy(dtype, shape).copy())
    return torch.randn(shape).to(getattr(torch, dtype))


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() == 1:  # float8: compare the bits
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


# -- plain values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, -0.0, float("inf"),
        float("nan"), "", "héllo wörld ✓", b"", b"\x00\xff" * 100, [], {}, (), (1,),
        ((1, 2), [3, (4,)], {"k": (5, [6])}),
        {"a": {"b": [1, (2, 3)]}, 1: "int key", (1, 2): "tuple key", None: 0.5},
        [[[[[[[[[["deep"]]]]]]]]]],
    ],
    ids=repr,
)
def test_roundtrip_plain_values(codec: Codec, value: Any) -> None:
    assert same(roundtrip(codec, value), value)


def test_bytes_likes_and_subclasses_come_back_as_base_types(codec: Codec) -> None:
    import enum

    class Color(str, enum.Enum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    value = [bytearray(b"ab"), memoryview(b"cd"), Color.RED, Level.HIGH]
    assert same(roundtrip(codec, value), [b"ab", b"cd", "red", 3])


@pytest.mark.parametrize("value", [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(7),
                                   np.complex64(1 + 2j), np.float16(0.25)], ids=repr)
def test_numpy_scalars_keep_their_type(codec: Codec, value: Any) -> None:
    out = roundtrip(codec, value)
    assert type(out) is type(value) and out == value


# -- arrays ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_every_dtype_and_shape(codec: Codec, dtype: str, shape: tuple[int, ...]) -> None:
    arr = random_numpy(dtype, shape)
    out = roundtrip(codec, arr)
    assert type(out) is np.ndarray
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr, equal_nan=dtype.startswith(("float", "complex")))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_every_dtype_and_shape(codec: Codec, dtype: str, shape: tuple[int, ...]) -> None:
    t = random_tensor(dtype, shape)
    out = roundtrip(codec, t)
    assert type(out) is torch.Tensor
    assert tensors_equal(out, t)


def _numpy_views() -> list[np.ndarray]:
    base = np.arange(4 * 6 * 8 * 5, dtype=np.float32).reshape(4, 6, 8, 5)
    return [
        base[::2],  # strided: copied
        base[:, 1:5, ::-1],  # negative stride: copied
        base.transpose(2, 0, 3, 1),  # a permutation of dense memory: zero-copy
        np.asfortranarray(base),  # Fortran order: zero-copy
        base[1],  # offset view of dense memory
        np.broadcast_to(np.arange(5.0), (300, 5)),  # stride 0
        base.astype(">f4"),  # non-native byte order
    ]


@pytest.mark.parametrize("arr", _numpy_views(), ids=lambda a: f"{a.shape}/{a.strides}")
def test_numpy_non_contiguous(codec: Codec, arr: np.ndarray) -> None:
    out = roundtrip(codec, arr)
    assert out.shape == arr.shape and out.dtype.name == arr.dtype.name
    assert np.array_equal(out, arr)


def _torch_views() -> list[torch.Tensor]:
    base = torch.arange(4 * 6 * 8 * 5, dtype=torch.float32).reshape(4, 6, 8, 5)
    cplx = torch.randn(40, 40, dtype=torch.complex64)
    return [
        base[::2],
        base[:, 1:5, :, 2],
        base.permute(2, 0, 3, 1),
        base.mT,
        base[1, 2:],
        torch.arange(5.0).expand(300, 5),
        cplx.conj(),  # lazy conjugate bit
        torch.randn(50, 50)._neg_view(),  # lazy negation bit
        torch.randn(30, 30, requires_grad=True),
        base.to(torch.bfloat16).permute(3, 2, 1, 0),
    ]


@pytest.mark.parametrize("t", _torch_views(), ids=lambda t: f"{tuple(t.shape)}/{t.stride()}")
def test_torch_non_contiguous(codec: Codec, t: torch.Tensor) -> None:
    out = roundtrip(codec, t)
    assert out.shape == t.shape and out.dtype == t.dtype and not out.requires_grad
    assert torch.equal(out, t.detach().resolve_conj().resolve_neg())


def test_permuted_views_are_sent_without_a_copy(codec: Codec) -> None:
    base = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    chw = base.transpose(2, 0, 1)
    frames = codec.encode(chw)
    assert len(frames) == 2 and np.shares_memory(frames[1], base)
    out = codec.decode(frames)
    assert out.strides == chw.strides and np.array_equal(out, chw)
    t = torch.from_numpy(base.astype(np.float32)).permute(2, 0, 1)
    frames = codec.encode(t)
    assert frames[1].ctypes.data == t.data_ptr()


# -- dataclasses ----------------------------------------------------------------------------


def _request() -> GenerateRequest:
    pixels = np.random.default_rng(1).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    return GenerateRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=5, temperature=0.0, seed=7, stop_token_ids=(2, 3)),
        images=[ImageInput(pixels, (1, 4, 6)), ImageInput(pixels[:28, :28].copy(), (1, 2, 2))],
    )


def test_wire_types_roundtrip(codec: Codec) -> None:
    req = _request()
    values = [req, RequestOutput("req-1", [5, 6], "stop", 3, 2), EngineStats(1, 2, 3, 4, 5)]
    out = roundtrip(codec, values)
    assert [type(v) for v in out] == [GenerateRequest, RequestOutput, EngineStats]
    got = out[0]
    assert got.sampling == req.sampling and type(got.sampling.stop_token_ids) is tuple
    assert type(got.images[0].grid_thw) is tuple and got.images[0].grid_thw == (1, 4, 6)
    for a, b in zip(got.images, req.images, strict=True):
        assert np.array_equal(a.pixels, b.pixels)
    assert out[1:] == values[1:]


def test_dataclass_array_fields_are_not_copied(codec: Codec) -> None:
    req = _request()
    frames = codec.encode(req)
    assert len(frames) == 3  # both images out-of-band
    assert np.shares_memory(frames[1], req.images[0].pixels)
    assert np.shares_memory(frames[2], req.images[1].pixels)


def test_registration_names_and_errors() -> None:
    @dataclasses.dataclass
    class Point:
        x: int
        y: int = 0

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Opts:
        a: int
        b: tuple[int, ...] = ()

    codec = Codec({"geo.Point": Point, "Opts": Opts})
    assert codec.type_names == ("geo.Point", "Opts")
    assert roundtrip(codec, [Point(1, 2), Opts(a=1, b=(2,))]) == [Point(1, 2), Opts(a=1, b=(2,))]
    def make_class() -> type:
        @dataclasses.dataclass
        class Same:
            x: int

        return Same

    with pytest.raises(ValueError, match="two wire types named"):
        Codec([make_class(), make_class()])
    with pytest.raises(ValueError, match="registered twice"):
        Codec({"A": Point, "B": Point})
    with pytest.raises(TypeError, match="only dataclasses"):
        Codec([dict])
    # an unregistered dataclass, an unknown wire name, a payload __init__ rejects
    with pytest.raises(EncodeError, match="not registered"):
        Codec().encode(Point(1))
    frames = codec.encode(Point(1, 2))
    with pytest.raises(DecodeError, match="unknown wire type 'geo.Point'"):
        Codec([Opts]).decode(frames)
    bad = msgpack.packb([msgpack.ExtType(EXT_STRUCT, b"SamplingParams"), 0] + [None] * 6)
    with pytest.raises(DecodeError, match="cannot rebuild SamplingParams"):
        Codec(WIRE_TYPES).decode([bad])
    with pytest.raises(DecodeError, match="expected 7 field values"):
        Codec(WIRE_TYPES).decode([msgpack.packb([msgpack.ExtType(EXT_STRUCT, b"SamplingParams")])])


def test_markers_outside_the_head_of_an_array_are_rejected(codec: Codec) -> None:
    tuple_marker = msgpack.ExtType(EXT_TUPLE, b"")
    for doc in ({"k": tuple_marker}, [1, tuple_marker], tuple_marker, {tuple_marker: 1}):
        with pytest.raises(DecodeError):
            codec.decode([msgpack.packb(doc)])
    assert codec.decode([msgpack.packb([tuple_marker, 1])]) == (1,)


def _complex32() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        return torch.zeros(3, dtype=torch.complex32)


@pytest.mark.parametrize(
    "value, match",
    [
        (object(), "cannot encode a builtins.object"),
        ({1, 2}, "builtins.set"),
        (2**64, "cannot encode value"),
        (np.array([object()]), "numpy dtype object"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "numpy dtype datetime64"),
        (np.zeros(3, dtype=[("a", "i4")]), "cannot be sent"),
        (_complex32(), "torch dtype torch.complex32"),
        (torch.zeros(4, 4).to_sparse(), "only dense tensors"),
        (torch.zeros(3, device="meta"), "move it to the CPU"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_values_raise_encode_error(codec: Codec, value: Any, match: str) -> None:
    buffers: list[Any] = []
    with pytest.raises(EncodeError, match=match):
        codec.pack([np.zeros(10_000), value], buffers)
    assert buffers == []  # nothing half-encoded left behind


# -- zero copy on the receiving side ---------------------------------------------------------


@pytest.fixture
def socket_pair(ipc_dir: Any) -> Any:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = ipc_dir.address("pair")
    a.bind(address)
    b.connect(address)
    yield a, b
    a.close(0)
    b.close(0)


def buffer_owner(arr: np.ndarray) -> Any:
    """The object whose memory a numpy array views (following .base to the buffer)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def _frame_address(frame: zmq.Frame) -> int:
    return np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data


def test_received_arrays_alias_the_zmq_frames(codec: Codec, socket_pair: Any) -> None:
    a, b = socket_pair
    arr = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    t = torch.arange(1 << 18, dtype=torch.bfloat16).reshape(512, 512)
    a.send_multipart(codec.encode({"arr": arr, "t": t, "small": np.arange(3)}), copy=False)
    frames = b.recv_multipart(copy=False)
    out = codec.decode(frames)
    got, got_t = out["arr"], out["t"]
    # numpy: no own memory; the base is the zmq frame's buffer, same address
    assert not got.flags.owndata and got.flags.writeable
    assert buffer_owner(got) is frames[1]
    assert got.ctypes.data == _frame_address(frames[1])
    # torch: the tensor's storage is the frame's memory
    assert got_t.data_ptr() == _frame_address(frames[2])
    # aliasing, shown by a write through the array
    got[0, 0] = -1.0
    assert np.frombuffer(frames[1].buffer, dtype=np.float32)[0] == -1.0
    assert np.array_equal(got[1:], arr[1:]) and torch.equal(got_t, t)
    # small arrays are inline (one document + two buffers) and writable copies
    assert len(frames) == 3 and out["small"].flags.writeable


# -- the decoder raises DecodeError and nothing else ------------------------------------------


def _expect_decode_error_or_value(codec: Codec, frames: list[Any]) -> None:
    try:
        codec.decode(frames)
    except DecodeError:
        pass


_int64 = st.integers(-(2**63), 2**64 - 1)
_leaf = st.one_of(
    st.none(), st.booleans(), _int64, st.floats(), st.text(max_size=8),
    st.binary(max_size=40), st.sampled_from(["float32", "bfloat16", "uint8", "bogus", "Nope"]),
)


_markers = st.builds(
    msgpack.ExtType,
    st.sampled_from([EXT_NDARRAY, EXT_TENSOR, EXT_TUPLE, EXT_STRUCT, EXT_NPSCALAR, 0, 99]),
    st.sampled_from([b"", b"SamplingParams", b"ImageInput", b"RequestOutput", b"Nope", b"\xff"]),
)


def _ext(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Marker-headed arrays (what the encoder emits, with random contents) or bare markers."""
    return st.one_of(
        st.builds(lambda m, rest: [m, *rest], _markers, st.lists(children, max_size=6)),
        _markers,
    )


_docs = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=4), _int64), children, max_size=4),
        _ext(children),
    ),
    max_leaves=20,
)

_fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_fuzz_random_bytes(frames: list[bytes]) -> None:
    codec = Codec(WIRE_TYPES)
    _expect_decode_error_or_value(codec, frames)


@_fuzz
@given(_docs, st.lists(st.binary(max_size=64), max_size=3))
def test_fuzz_structured_documents(doc: Any, buffers: list[bytes]) -> None:
    codec = Codec(WIRE_TYPES)
    _expect_decode_error_or_value(codec, [msgpack.packb(doc), *buffers])


_array_docs = st.builds(
    lambda code, dtype, shape, data, perm: [msgpack.ExtType(code, b""), dtype, shape, data, perm],
    st.sampled_from([EXT_NDARRAY, EXT_TENSOR]),
    st.sampled_from(["uint8", "float32", "bfloat16", "complex128", "bool", "float8_e5m2", "x", 3]),
    st.one_of(st.lists(st.integers(-2, 70), max_size=4), _int64, st.none()),
    st.one_of(st.integers(-2, 3), st.binary(max_size=80), st.none(), st.text(max_size=3)),
    st.one_of(st.none(), st.lists(st.integers(-1, 4), max_size=4), st.text(max_size=2)),
)


@_fuzz
@given(st.lists(_array_docs, min_size=1, max_size=3), st.lists(st.binary(max_size=300), max_size=3))
def test_fuzz_array_payloads(docs: list[Any], buffers: list[bytes]) -> None:
    codec = Codec(WIRE_TYPES)
    _expect_decode_error_or_value(codec, [msgpack.packb(docs), *buffers])


@_fuzz
@given(st.data())
def test_fuzz_mutated_valid_messages(data: st.DataObject) -> None:
    codec = Codec(WIRE_TYPES)
    value = [_request(), torch.ones(700, dtype=torch.bfloat16), np.zeros((3, 4)), (1, "x")]
    frames = [bytes(memoryview(f)) for f in codec.encode(value)]
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop"]))
    if action == "flip" and frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del frame[data.draw(st.integers(0, len(frame))):]
    elif action == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=16))
    frames[i] = bytes(frame)
    if action == "drop":
        del frames[i]
    _expect_decode_error_or_value(codec, frames)


@_fuzz
@given(st.lists(st.binary(max_size=120), min_size=0, max_size=5))
def test_fuzz_batch_framing(frames: list[bytes]) -> None:
    codec = Codec(WIRE_TYPES)
    try:
        for doc, buffers in split_batch(frames):
            unpack_envelope(codec, doc, buffers)
    except DecodeError:
        pass
