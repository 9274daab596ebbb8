"""Frames: the byte layout every swarm-node stream speaks (sans-I/O, no sockets, no asyncio).

A frame is::

    b"SWN1" | u32 big-endian header length H | H bytes of msgpack header (a map) | body

and the body is the raw bytes of the tensors the header lists in ``tensors``, concatenated in
header order with no padding, each little-endian and C-contiguous. Because the header says how
long everything is, a receiver checks every size *before* it allocates: the header length
against ``Limits.max_header_bytes`` before reading the header, and the body length (``body_len``,
which must equal the sum of the listed tensors' sizes) against ``Limits.max_body_bytes`` before
allocating the body. The received body is one uninitialised uint8 numpy buffer; tensors are
``torch.frombuffer`` views into it, so a 64 MiB activation is copied once (socket -> body) and never again.

This module knows framing only: magic, lengths, the msgpack header, the tensor table, the
protocol version and the set of message types. What a ``fwd`` or ``reject`` must contain is
``protocol.messages``. ``docs/PROTOCOL.md`` is the normative description; keep them in step.

Reading a frame from a stream with exact reads (never past the end of the frame)::

    dec = FrameDecoder(limits)
    while True:
        data = await reader.read(dec.bytes_needed)   # <= bytes still missing from this frame
        if not data:
            dec.eof()                                  # raises ProtocolError if mid-frame
            raise EOFError
        frames = dec.feed(data)
        if frames:
            return frames[0]

or, with ``readexactly``: ``parse_prefix`` -> ``parse_header`` -> ``FrameHead.assemble``.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("swarm-node's wire format needs a little-endian host (x86-64, aarch64)")

MAGIC = b"SWN1"
PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
PREFIX_LEN = len(MAGIC) + 4  # magic + u32 header length
MAX_NDIM = 8
MAX_NAME_LEN = 256
_U32 = struct.Struct(">I")

# Message types of protocol version 1 (the ``type`` header field). Order = docs/PROTOCOL.md table.
MESSAGE_TYPES = (
    "fwd",
    "bwd",
    "ack",
    "reject",
    "state-request",
    "state-chunk",
    "health-request",
    "health",
    "morph-seed",
)


class Reason(str, enum.Enum):
    """Why a frame was refused; the ``reason`` field of a ``reject`` reply."""

    BAD_FRAME = "bad-frame"  # malformed bytes, header, tensor table, message or values
    TOO_LARGE = "too-large"  # header, body or tensor count beyond the receiver's limits
    WRONG_RUN = "wrong-run"  # run id or manifest hash differs from the receiver's
    WRONG_STAGE = "wrong-stage"  # sender is not the stage this receiver takes input from
    STALE = "stale"  # sender's optimizer step lags the receiver's by more than allowed
    BUSY = "busy"  # receiver is at capacity; retry elsewhere or later
    REJECTED_BY_VERIFIER = "rejected-by-verifier"  # SENTINEL refused the tensors
    BANNED = "banned"  # the sending peer is on the receiver's ban list
    WRONG_EPOCH = "wrong-epoch"  # the frame belongs to another morph epoch (basis) than the receiver's
    INTERNAL = "internal"  # the receiver failed; not the sender's fault

    def __str__(self) -> str:
        return self.value


class ProtocolError(Exception):
    """A frame or message violates the protocol. ``reason`` is what goes into the reject reply."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{Reason(reason).value}: {detail}")
        self.reason = Reason(reason)
        self.detail = detail


# Wire dtype name -> torch dtype. Names are torch's without the "torch." prefix.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts. Checked before any allocation that depends on the peer's numbers."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tensors: int = 1024
    dtypes: frozenset[str] = field(default_factory=lambda: frozenset(DTYPES))

    def __post_init__(self):
        unknown = set(self.dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"Limits.dtypes: unknown dtype(s) {sorted(unknown)}; known: {list(DTYPES)}")
        if not 0 < self.max_header_bytes <= 0xFFFFFFFF or self.max_body_bytes < 0 or self.max_tensors < 0:
            raise ValueError("Limits: max_header_bytes must be in 1..2**32-1, the others >= 0")


_DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class TensorEntry:
    """One row of the header's tensor table, with its byte range in the body."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Frame:
    """A decoded frame. ``tensors`` are views into one body buffer (or fresh tensors if empty)."""

    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    wire_bytes: int = 0  # prefix + header + body as received
    body: np.ndarray | bytearray | memoryview | None = field(default=None, repr=False)  # what tensors view

    @property
    def type(self) -> str:
        return self.header["type"]

    @property
    def nbytes(self) -> int:
        """Body bytes (the tensors' payload)."""
        return int(self.header.get("body_len", 0))


@dataclass(frozen=True)
class FrameHead:
    """A validated header and its tensor table: everything needed to read and split the body."""

    header: dict
    entries: tuple[TensorEntry, ...]
    header_len: int

    @property
    def body_len(self) -> int:
        return self.header["body_len"]

    def assemble(self, body: bytes | bytearray | memoryview | np.ndarray) -> Frame:
        """Split ``body`` (exactly ``body_len`` bytes) into tensors.

        A writable buffer (``bytearray``, uint8 ``np.ndarray``, writable memoryview) gives
        zero-copy tensors; a read-only ``bytes`` (what ``StreamReader.readexactly`` returns) is
        copied once first, since tensors over immutable memory would let stage code write into
        an immutable object.
        """
        if len(body) != self.body_len:
            raise ProtocolError(Reason.BAD_FRAME, f"body is {len(body)} bytes, header says {self.body_len}")
        if not isinstance(body, (bytearray, np.ndarray)):
            mv = memoryview(body)
            if mv.readonly:
                body = np.frombuffer(mv.cast("B"), dtype=np.uint8).copy()
            else:
                body = mv.cast("B")
        tensors = {e.name: _view(body, e) for e in self.entries}
        return Frame(self.header, tensors, PREFIX_LEN + self.header_len + self.body_len, body)


def _view(body, e: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    itemsize = ITEMSIZE[e.dtype]
    t = torch.frombuffer(body, dtype=dtype, count=e.nbytes // itemsize, offset=e.offset)
    if e.offset % itemsize:
        # Element-misaligned (the sender ordered e.g. a float16 before an int64): some kernels
        # assume natural alignment, so this one tensor is copied. make_fwd/make_bwd order
        # tensors by element size, so our own frames never take this path.
        t = t.clone()
    return t.view(e.shape)


# ---------------------------------------------------------------------------------------------
# Encoding


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The wire bytes of ``t`` (little-endian, C order), without a copy when ``t`` is a contiguous
    CPU tensor. bfloat16 has no numpy dtype, so every tensor is reinterpreted as uint8 first."""
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire; use one of {list(DTYPES)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pack(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"header is not msgpack-serializable: {e}") from None


def encode_frame(header: dict, tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> list[bytes | memoryview]:
    """Encode a frame as a list of buffers to write in order (``writer.writelines``).

    The header gets ``v`` (unless given), ``tensors`` and ``body_len``; tensor payloads are
    memoryviews of the tensors themselves (no copy for contiguous CPU tensors), so keep the
    tensors alive and unmodified until the buffers are written.
    """
    if "tensors" in header or "body_len" in header:
        raise ValueError("header fields 'tensors' and 'body_len' are set by encode_frame")
    if header.get("type") not in MESSAGE_TYPES:
        raise ValueError(f"header type {header.get('type')!r} is not one of {MESSAGE_TYPES}")
    table, views, seen, total = [], [], set(), 0
    for name, t in tensors:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN or name in seen:
            raise ValueError(f"tensor name {name!r}: must be a unique non-empty str <= {MAX_NAME_LEN} chars")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"tensor {name!r} has {t.dim()} dims; at most {MAX_NDIM} go on the wire")
        seen.add(name)
        mv = tensor_bytes(t)
        table.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
        views.append(mv)
        total += mv.nbytes
    full = {"v": PROTOCOL_VERSION, **header, "tensors": table, "body_len": total}
    head = _pack(full)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(head)} bytes; the protocol allows {MAX_HEADER_BYTES}")
    return [MAGIC + _U32.pack(len(head)) + head, *(v for v in views if v.nbytes)]


def encode_frame_bytes(header: dict, tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> bytes:
    """``encode_frame`` joined into one ``bytes`` (one copy; for tests and small frames)."""
    return b"".join(encode_frame(header, tensors))


# ---------------------------------------------------------------------------------------------
# Decoding


def parse_prefix(prefix: bytes | bytearray | memoryview, limits: Limits | None = None) -> int:
    """Check the 8-byte prefix (magic + header length); return the header length to read next.

    Accepts a shorter buffer too: it then only checks the magic bytes seen so far and returns
    ``-1`` (more bytes needed), so a bad magic is refused from its first wrong byte.
    """
    limits = limits or _DEFAULT_LIMITS
    n = min(len(prefix), len(MAGIC))
    if bytes(prefix[:n]) != MAGIC[:n]:
        raise ProtocolError(Reason.BAD_FRAME, f"bad magic {bytes(prefix[:n])!r}; expected {MAGIC!r}")
    if len(prefix) < PREFIX_LEN:
        return -1
    (hlen,) = _U32.unpack_from(prefix, len(MAGIC))
    if hlen > limits.max_header_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"header length {hlen} > limit {limits.max_header_bytes}")
    if hlen == 0:
        raise ProtocolError(Reason.BAD_FRAME, "header length is 0")
    return hlen


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(data: bytes | bytearray | memoryview, limits: Limits | None = None) -> FrameHead:
    """Decode and check a msgpack header: protocol version, message type, tensor table, sizes.

    Unknown fields are kept (and ignored by this node) so newer senders can add fields.
    """
    limits = limits or _DEFAULT_LIMITS
    try:
        header = msgpack.unpackb(
            data, raw=False, strict_map_key=True, timestamp=0, use_list=True
        )
    except Exception as e:  # msgpack raises ValueError subclasses, UnicodeDecodeError, TypeError...
        raise ProtocolError(Reason.BAD_FRAME, f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(Reason.BAD_FRAME, f"header is a msgpack {type(header).__name__}, not a map")
    v = header.get("v")
    if not _int(v) or v < 1:
        raise ProtocolError(Reason.BAD_FRAME, f"header field 'v' (protocol version) is {v!r}; need an int >= 1")
    if v > PROTOCOL_VERSION:
        raise ProtocolError(
            Reason.BAD_FRAME,
            f"protocol version {v} is newer than this node's {PROTOCOL_VERSION}; "
            f"speak version {PROTOCOL_VERSION} to this peer or upgrade it",
        )
    mtype = header.get("type")
    if mtype not in MESSAGE_TYPES:
        raise ProtocolError(Reason.BAD_FRAME, f"unknown message type {mtype!r}; v{PROTOCOL_VERSION} knows {MESSAGE_TYPES}")
    table = header.get("tensors")
    body_len = header.get("body_len")
    if not isinstance(table, list):
        raise ProtocolError(Reason.BAD_FRAME, "header field 'tensors' must be a list")
    if not _int(body_len) or body_len < 0:
        raise ProtocolError(Reason.BAD_FRAME, f"header field 'body_len' is {body_len!r}; need an int >= 0")
    if body_len > limits.max_body_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"body_len {body_len} > limit {limits.max_body_bytes}")
    if len(table) > limits.max_tensors:
        raise ProtocolError(Reason.TOO_LARGE, f"{len(table)} tensors > limit {limits.max_tensors}")
    entries, names, offset = [], set(), 0
    for i, row in enumerate(table):
        if not isinstance(row, dict):
            raise ProtocolError(Reason.BAD_FRAME, f"tensors[{i}] is not a map")
        name, dtype, shape = row.get("name"), row.get("dtype"), row.get("shape")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise ProtocolError(Reason.BAD_FRAME, f"tensors[{i}].name must be a non-empty str <= {MAX_NAME_LEN}")
        if name in names:
            raise ProtocolError(Reason.BAD_FRAME, f"tensor name {name!r} appears twice")
        if not isinstance(dtype, str) or dtype not in limits.dtypes:
            raise ProtocolError(
                Reason.BAD_FRAME, f"tensor {name!r}: dtype {dtype!r} not allowed; allowed: {sorted(limits.dtypes)}"
            )
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_int(d) and d >= 0 for d in shape):
            raise ProtocolError(
                Reason.BAD_FRAME, f"tensor {name!r}: shape {shape!r} must be a list of <= {MAX_NDIM} ints >= 0"
            )
        nbytes = ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        if offset + nbytes > body_len:
            raise ProtocolError(
                Reason.BAD_FRAME, f"tensor {name!r} ends at byte {offset + nbytes}, past body_len {body_len}"
            )
        names.add(name)
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    if offset != body_len:
        raise ProtocolError(Reason.BAD_FRAME, f"tensors add up to {offset} bytes but body_len is {body_len}")
    return FrameHead(header, tuple(entries), len(data))


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes in any chunking, get back the frames they complete.

    Sans-I/O (h11 style): it never reads or blocks. ``bytes_needed`` says how many more bytes
    finish the current step without reading past the end of the current frame. After a
    ``ProtocolError`` the decoder is dead (every later call raises the same error): the stream
    must be answered with a reject and closed, since its framing can no longer be trusted.
    """

    _PREFIX, _HEADER, _BODY = 0, 1, 2

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or _DEFAULT_LIMITS
        self._error: ProtocolError | None = None
        self._reset()

    def _reset(self):
        self._state = self._PREFIX
        self._buf = bytearray()  # prefix or header bytes so far
        self._want = PREFIX_LEN
        self._head: FrameHead | None = None
        self._body: np.ndarray | None = None
        self._body_mv: memoryview | None = None
        self._filled = 0

    @property
    def bytes_needed(self) -> int:
        """Bytes still missing before the decoder can take its next step (>= 1)."""
        if self._state == self._BODY:
            return self._head.body_len - self._filled
        return self._want - len(self._buf)

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return self._error is None and self._state == self._PREFIX and not self._buf

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for the frame in progress (bounded by the limits; for tests and metrics)."""
        return len(self._buf) + (len(self._body) if self._body is not None else 0)

    def eof(self) -> None:
        """The stream ended. Raises ``ProtocolError(bad-frame)`` if it ended inside a frame."""
        if self._error is not None:
            raise self._error
        if not self.at_boundary:
            self._fail(ProtocolError(Reason.BAD_FRAME, "stream ended inside a frame (truncated)"))

    def _fail(self, err: ProtocolError):
        self._error = err
        self._buf = bytearray()
        self._body = self._body_mv = None
        raise err

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Consume ``data``; return the frames it completes (possibly none, possibly several)."""
        if self._error is not None:
            raise self._error
        mv = memoryview(data).cast("B")
        frames: list[Frame] = []
        pos, n = 0, len(mv)
        try:
            while pos < n:
                if self._state == self._BODY:
                    take = min(n - pos, self._head.body_len - self._filled)
                    self._body_mv[self._filled : self._filled + take] = mv[pos : pos + take]
                    self._filled += take
                    pos += take
                    if self._filled == self._head.body_len:
                        frames.append(self._finish())
                    continue
                take = min(n - pos, self._want - len(self._buf))
                self._buf += mv[pos : pos + take]
                pos += take
                if self._state == self._PREFIX:
                    hlen = parse_prefix(self._buf, self.limits)
                    if hlen >= 0:
                        self._state, self._want, self._buf = self._HEADER, hlen, bytearray()
                elif len(self._buf) == self._want:
                    self._head = parse_header(self._buf, self.limits)
                    self._buf = bytearray()
                    self._state, self._filled = self._BODY, 0
                    # Size checked in parse_header. np.empty: no zero-fill pass (every byte is
                    # written before anyone sees it), large-page hint, and tracemalloc sees it.
                    self._body = np.empty(self._head.body_len, dtype=np.uint8)
                    self._body_mv = memoryview(self._body)
                    if self._head.body_len == 0:
                        frames.append(self._finish())
        except ProtocolError as e:
            self._fail(e)
        return frames

    def _finish(self) -> Frame:
        frame = self._head.assemble(self._body)
        self._reset()
        return frame
