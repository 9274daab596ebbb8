"""Frame encoder/decoder: byte layout, limits before allocation, zero-copy views, any chunking."""

from __future__ import annotations

import asyncio
import ctypes
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX_LEN,
    PROTOCOL_VERSION,
    FrameDecoder,
    Limits,
    ProtocolError,
    Reason,
    encode_frame,
    encode_frame_bytes,
    parse_header,
    parse_prefix,
)


def raw_frame(header: dict, body: bytes = b"") -> bytes:
    """A frame built by hand, bypassing the encoder's own checks."""
    head = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack(">I", len(head)) + head + body


def decode_one(data: bytes, limits: Limits | None = None):
    dec = FrameDecoder(limits)
    frames = dec.feed(data)
    assert len(frames) == 1 and dec.at_boundary
    return frames[0]


def refuse(data: bytes, limits: Limits | None = None) -> ProtocolError:
    dec = FrameDecoder(limits)
    with pytest.raises(ProtocolError) as info:
        dec.feed(data)
        dec.eof()
    return info.value


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, works for bfloat16 and bool)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    """Random bits of any dtype (floats include NaN/Inf/subnormal patterns)."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Layout


def test_layout_matches_the_spec_bytes():
    ids = torch.tensor([[1, 2]], dtype=torch.int64)
    c = torch.tensor([[[1.0], [-2.0]]], dtype=torch.bfloat16)
    data = encode_frame_bytes({"type": "health-request"}, [("ids", ids), ("c", c)])
    assert data[:4] == b"SWN1"
    (hlen,) = struct.unpack(">I", data[4:8])
    header = msgpack.unpackb(data[8 : 8 + hlen])
    assert header == {
        "v": PROTOCOL_VERSION,
        "type": "health-request",
        "tensors": [
            {"name": "ids", "dtype": "int64", "shape": [1, 2]},
            {"name": "c", "dtype": "bfloat16", "shape": [1, 2, 1]},
        ],
        "body_len": 20,
    }
    body = data[8 + hlen :]
    # int64 little-endian, then bfloat16 1.0 = 0x3F80 and -2.0 = 0xC000, little-endian.
    assert body == bytes.fromhex("0100000000000000" "0200000000000000" "803f" "00c0")


def test_encode_frame_is_zero_copy_for_contiguous_cpu_tensors():
    t = torch.arange(1000, dtype=torch.float32)
    bufs = encode_frame({"type": "health"}, [("t", t)])
    assert len(bufs) == 2
    view = bufs[1]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    if addr is None:  # read-only view: compare through numpy's interface
        import numpy as np

        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    assert addr == t.data_ptr()
    t[0] = 42.0  # the frame reflects the tensor: no copy was taken
    assert struct.unpack("<f", bytes(view[:4]))[0] == 42.0


def test_encode_handles_views_and_non_contiguous_tensors():
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    frame = decode_one(encode_frame_bytes({"type": "health"}, [("t", base.t()), ("s", base[1:3, ::2])]))
    assert torch.equal(frame.tensors["t"], base.t()) and torch.equal(frame.tensors["s"], base[1:3, ::2])


def test_encoder_refuses_what_the_decoder_would_refuse():
    with pytest.raises(ValueError, match="type"):
        encode_frame({"type": "nope"})
    with pytest.raises(ValueError, match="unique"):
        encode_frame({"type": "health"}, [("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="dtype"):
        encode_frame({"type": "health"}, [("a", torch.zeros(1, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="header is"):
        encode_frame({"type": "health", "pad": "x" * MAX_HEADER_BYTES})
    with pytest.raises(ValueError, match="set by encode_frame"):
        encode_frame({"type": "health", "body_len": 3})


# ---------------------------------------------------------------------------------------------
# Round trips (property-based)

DTYPE_NAMES = sorted(DTYPES)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)
tables = st.lists(st.tuples(st.sampled_from(DTYPE_NAMES), shapes), min_size=0, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=tables, seed=st.integers(0, 2**31 - 1), cuts=st.lists(st.integers(0, 4000), max_size=12),
       copies=st.integers(1, 3))
def test_round_trip_any_dtypes_shapes_and_chunking(table, seed, cuts, copies):
    gen = torch.Generator().manual_seed(seed)
    tensors = [(f"t{i}", random_tensor(DTYPES[d], s, gen)) for i, (d, s) in enumerate(table)]
    header = {"type": "state-chunk", "extra": {"nested": [1, "x", None, 2.5]}}
    data = encode_frame_bytes(header, tensors) * copies
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    dec, frames = FrameDecoder(), []
    for a, b in zip(points, points[1:]):
        frames += dec.feed(data[a:b])
    dec.eof()
    assert len(frames) == copies
    for frame in frames:
        assert frame.type == "state-chunk" and frame.header["extra"] == header["extra"]
        assert list(frame.tensors) == [n for n, _ in tensors]
        for name, t in tensors:
            assert same_bits(frame.tensors[name], t), name
        assert frame.wire_bytes == len(data) // copies
        assert frame.nbytes == sum(t.numel() * t.element_size() for _, t in tensors)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3000))
def test_byte_at_a_time_equals_all_at_once(seed, n):
    gen = torch.Generator().manual_seed(seed)
    t = random_tensor(torch.bfloat16, (n,), gen)
    data = encode_frame_bytes({"type": "fwd", "mb": seed}, [("c", t)])
    dec, frames = FrameDecoder(), []
    for i in range(len(data)):
        assert dec.bytes_needed >= 1
        frames += dec.feed(data[i : i + 1])
    assert len(frames) == 1 and same_bits(frames[0].tensors["c"], t)


# ---------------------------------------------------------------------------------------------
# Zero copy on the receive side


def test_decoded_tensors_are_views_of_the_received_body():
    ids = torch.randint(0, 100, (3, 7))
    c = torch.randn(3, 7, 8)
    frame = decode_one(encode_frame_bytes({"type": "fwd"}, [("ids", ids), ("c", c)]))
    body = frame.body
    assert memoryview(body).nbytes == frame.nbytes and not memoryview(body).readonly
    start = ctypes.addressof(ctypes.c_char.from_buffer(body))
    offset = 0
    for name in ("ids", "c"):
        t = frame.tensors[name]
        assert t.data_ptr() == start + offset, name
        offset += t.numel() * t.element_size()
    body[0] = 99  # writes to the buffer show through the tensor: no copy was made
    assert frame.tensors["ids"][0, 0].item() == 99
    frame.tensors["c"].mul_(2)  # tensors are writable
    assert torch.equal(frame.tensors["c"], c * 2)


def test_misaligned_tensor_is_copied_to_an_aligned_one():
    a, b = torch.ones(1, dtype=torch.uint8), torch.arange(3, dtype=torch.int64)
    frame = decode_one(encode_frame_bytes({"type": "health"}, [("a", a), ("b", b)]))
    assert torch.equal(frame.tensors["b"], b) and frame.tensors["b"].data_ptr() % 8 == 0


# ---------------------------------------------------------------------------------------------
# Refusals, each with its reason code


def test_bad_magic_is_refused_from_the_first_wrong_byte():
    err = refuse(b"X")
    assert err.reason is Reason.BAD_FRAME and "magic" in err.detail
    err = refuse(b"SWN2" + bytes(100))
    assert err.reason is Reason.BAD_FRAME


def test_header_length_is_checked_before_the_header_is_read():
    dec = FrameDecoder(Limits(max_header_bytes=100))
    with pytest.raises(ProtocolError) as info:
        dec.feed(MAGIC + struct.pack(">I", 101))  # no header bytes follow: refused on the prefix
    assert info.value.reason is Reason.TOO_LARGE
    assert refuse(MAGIC + struct.pack(">I", 0xFFFFFFFF)).reason is Reason.TOO_LARGE
    assert refuse(MAGIC + struct.pack(">I", 0) + b"\x80").reason is Reason.BAD_FRAME
    assert parse_prefix(MAGIC + struct.pack(">I", 7)) == 7
    assert parse_prefix(MAGIC[:2]) == -1


def test_body_length_is_checked_before_allocation():
    header = {"v": 1, "type": "fwd", "tensors": [{"name": "c", "dtype": "uint8", "shape": [2**40]}],
              "body_len": 2**40}
    dec = FrameDecoder()
    with pytest.raises(ProtocolError) as info:
        dec.feed(raw_frame(header))
    assert info.value.reason is Reason.TOO_LARGE
    assert dec.buffered_bytes == 0
    small = Limits(max_body_bytes=1000)
    ok = encode_frame_bytes({"type": "fwd"}, [("c", torch.zeros(250))])
    assert decode_one(ok, small).tensors["c"].numel() == 250
    assert refuse(encode_frame_bytes({"type": "fwd"}, [("c", torch.zeros(251))]), small).reason is Reason.TOO_LARGE


def test_too_many_tensors():
    data = encode_frame_bytes({"type": "health"}, [(f"t{i}", torch.zeros(1)) for i in range(5)])
    assert refuse(data, Limits(max_tensors=4)).reason is Reason.TOO_LARGE


@pytest.mark.parametrize(
    "header, needle",
    [
        ({"type": "fwd", "tensors": [], "body_len": 0}, "'v'"),
        ({"v": "1", "type": "fwd", "tensors": [], "body_len": 0}, "'v'"),
        ({"v": 0, "type": "fwd", "tensors": [], "body_len": 0}, "'v'"),
        ({"v": 1, "type": "gossip", "tensors": [], "body_len": 0}, "unknown message type"),
        ({"v": 1, "tensors": [], "body_len": 0}, "unknown message type"),
        ({"v": 1, "type": "fwd", "body_len": 0}, "'tensors'"),
        ({"v": 1, "type": "fwd", "tensors": []}, "body_len"),
        ({"v": 1, "type": "fwd", "tensors": [], "body_len": -1}, "body_len"),
        ({"v": 1, "type": "fwd", "tensors": [], "body_len": True}, "body_len"),
        ({"v": 1, "type": "fwd", "tensors": [[1]], "body_len": 0}, "not a map"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "", "dtype": "uint8", "shape": []}], "body_len": 1}, "name"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "complex64", "shape": []}], "body_len": 8},
         "dtype"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "uint8", "shape": [-1]}], "body_len": 0},
         "shape"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "uint8", "shape": [1.0]}], "body_len": 1},
         "shape"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "uint8", "shape": [1] * 9}], "body_len": 1},
         "shape"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "uint8", "shape": [3]}] * 2, "body_len": 6},
         "twice"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "int32", "shape": [3]}], "body_len": 11},
         "past body_len"),
        ({"v": 1, "type": "fwd", "tensors": [{"name": "a", "dtype": "int32", "shape": [3]}], "body_len": 13},
         "add up"),
    ],
)
def test_malformed_headers_are_bad_frame(header, needle):
    body = bytes(header.get("body_len", 0)) if isinstance(header.get("body_len"), int) and header.get(
        "body_len", 0) > 0 else b""
    err = refuse(raw_frame(header, body))
    assert err.reason is Reason.BAD_FRAME and needle in err.detail, err.detail


def test_header_must_be_one_msgpack_map():
    for head in (b"\x93\x01\x02\x03", b"\xc1", b"\x81\xa1v\x01\x00", b"\x81\x01\x01", b"\xd6\x05abcd",
                 b"\x81\xa1v\xd6\x05abcd"):
        data = MAGIC + struct.pack(">I", len(head)) + head
        err = refuse(data)
        assert err.reason is Reason.BAD_FRAME, head


def test_dtype_allowlist_is_configurable():
    data = encode_frame_bytes({"type": "health"}, [("a", torch.zeros(2, dtype=torch.float64))])
    err = refuse(data, Limits(dtypes=frozenset({"float32"})))
    assert err.reason is Reason.BAD_FRAME and "float64" in err.detail
    with pytest.raises(ValueError, match="unknown dtype"):
        Limits(dtypes=frozenset({"float8"}))


def test_higher_protocol_version_is_refused_with_a_clear_detail():
    err = refuse(raw_frame({"v": PROTOCOL_VERSION + 1, "type": "fwd", "tensors": [], "body_len": 0}))
    assert err.reason is Reason.BAD_FRAME
    assert f"version {PROTOCOL_VERSION + 1}" in err.detail and "upgrade" in err.detail


def test_unknown_fields_are_kept_and_ignored():
    frame = decode_one(raw_frame({"v": 1, "type": "health-request", "tensors": [], "body_len": 0,
                                  "future": {"x": [1, 2]}, "zzz": b"\x00"}))
    assert frame.type == "health-request" and frame.header["future"] == {"x": [1, 2]}


def test_truncated_stream_and_dead_decoder():
    data = encode_frame_bytes({"type": "fwd"}, [("c", torch.zeros(10))])
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == [] and not dec.at_boundary
    with pytest.raises(ProtocolError) as info:
        dec.eof()
    assert info.value.reason is Reason.BAD_FRAME and "truncated" in info.value.detail
    with pytest.raises(ProtocolError):  # dead after an error, even for good bytes
        dec.feed(data)
    dec2 = FrameDecoder()
    with pytest.raises(ProtocolError):
        dec2.feed(b"junk")
    with pytest.raises(ProtocolError):
        dec2.feed(data)


def test_readexactly_style_helpers():
    ids = torch.arange(6).reshape(2, 3)
    data = encode_frame_bytes({"type": "fwd"}, [("ids", ids)])
    hlen = parse_prefix(data[:PREFIX_LEN])
    head = parse_header(data[PREFIX_LEN : PREFIX_LEN + hlen])
    body = data[PREFIX_LEN + hlen :]
    assert head.body_len == len(body) == 48
    frame = head.assemble(body)  # read-only bytes: copied once into a writable buffer
    assert torch.equal(frame.tensors["ids"], ids)
    frame.tensors["ids"].add_(1)
    with pytest.raises(ProtocolError):
        head.assemble(body[:-1])


async def read_frame(reader: asyncio.StreamReader, limits: Limits | None = None):
    """The recipe from protocol/frames.py's docstring (node/ has the real one)."""
    dec = FrameDecoder(limits)
    while True:
        data = await reader.read(dec.bytes_needed)
        if not data:
            dec.eof()
            raise EOFError
        frames = dec.feed(data)
        if frames:
            return frames[0]


@pytest.mark.asyncio
async def test_exact_reads_never_consume_the_next_frame():
    reader = asyncio.StreamReader()
    a = encode_frame_bytes({"type": "fwd", "n": 1}, [("c", torch.randn(100))])
    b = encode_frame_bytes({"type": "bwd", "n": 2}, [("g", torch.randn(3))])
    reader.feed_data(a + b + b"trailing")
    reader.feed_eof()
    fa = await read_frame(reader)
    fb = await read_frame(reader)
    assert (fa.header["n"], fb.header["n"]) == (1, 2)
    assert await reader.read() == b"trailing"
