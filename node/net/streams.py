"""Frame I/O on one libp2p stream (the unix-socket connection p2pd hands us for it): read exactly
one frame with every limit checked before its body is allocated, the body received straight into
its final buffer; write a frame's buffers without joining them, within a time bound; close or
abort a stream the way p2pd needs (a reject must not be overtaken by a reset)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import numpy as np

from protocol import (
    PREFIX_LEN,
    Frame,
    Limits,
    ProtocolError,
    Reason,
    encode_frame,
    parse_header,
    parse_prefix,
)

# One read from the daemon's unix socket: large reads keep the per-byte cost of Python low.
READ_CHUNK = 1 << 20
# After a reject sent before the whole request was read, keep reading (and dropping) for up to
# this long: closing a libp2p stream with unread data resets it, and a reset can overtake the
# reject. The caller aborts the stream as soon as it has the reject, which ends the wait.
LINGER_S = 3.0
# A frame's write waits for the peer to take its bytes at most max(WRITE_FLOOR_S, its bytes at
# WRITE_MIN_RATE); then the stream is aborted. A peer that stops reading must not hold the
# handler slot (or the sender) for ever; a slow link still gets a frame through at 64 KiB/s.
WRITE_FLOOR_S = 10.0
WRITE_MIN_RATE = 64 * 1024  # bytes/s

log = logging.getLogger(__name__)


class WriteStalled(ConnectionError):
    """The peer did not take a frame's bytes within the write bound; the stream was aborted.
    A ``ConnectionError``: every caller already treats it as a broken stream."""

    def __init__(self, nbytes: int, bound_s: float, peer: str | None):
        super().__init__(f"{peer or 'the peer'} took no {nbytes}-byte frame within {bound_s:.1f} s")
        self.nbytes, self.bound_s, self.peer = nbytes, bound_s, peer


class WriteStalls:
    """How many frame writes this process aborted because the peer stopped reading."""

    def __init__(self):
        self.count = 0
        self.bytes = 0  # the sizes of those frames

    def note(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes


STALLS = WriteStalls()


def write_bound(nbytes: int) -> float:
    """Seconds a write of ``nbytes`` may wait for the peer (see ``WRITE_FLOOR_S``)."""
    return max(WRITE_FLOOR_S, nbytes / WRITE_MIN_RATE)


async def read_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     limits: Limits) -> tuple[Frame | None, int]:
    """Read exactly one frame and nothing past it: (frame, its wire bytes); ``(None, 0)`` on EOF
    before its first byte.

    Prefix and header come through the StreamReader; every limit is checked on them (by
    ``protocol.frames``) before the body is allocated. The body is then received straight into
    its final buffer (see :class:`_BodyReceiver`), so tensor bytes are copied once, kernel to
    body, as on a bare socket. ``ProtocolError`` on a bad or cut frame.
    """
    try:
        prefix = await reader.readexactly(PREFIX_LEN)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None, 0
        parse_prefix(e.partial, limits)  # a wrong magic is the better error
        raise ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame prefix") from None
    hlen = parse_prefix(prefix, limits)
    try:
        head = parse_header(await reader.readexactly(hlen), limits)
    except asyncio.IncompleteReadError:
        raise ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame header") from None
    body = np.empty(head.body_len, dtype=np.uint8)  # size checked by parse_header
    await _receive_into(reader, writer, memoryview(body))
    return head.assemble(body), PREFIX_LEN + hlen + head.body_len


async def write_frame(writer: asyncio.StreamWriter, buffers: list, *, peer: str | None = None,
                      bound_s: float | None = None) -> int:
    """Write an encoded frame: the buffers go to the socket as they are (no join, no copy);
    returns its bytes. The wait for the peer to take them is bounded (``bound_s``, default
    ``write_bound`` of the frame's size): past it the stream is aborted, the stall counted in
    ``STALLS`` and logged once (``peer``: who, for that line), and ``WriteStalled`` raised."""
    nbytes = sum(memoryview(b).nbytes for b in buffers)
    writer.writelines(buffers)
    bound = write_bound(nbytes) if bound_s is None else bound_s
    try:
        async with asyncio.timeout(bound):
            await writer.drain()
    except TimeoutError:
        abort_stream(writer)
        STALLS.note(nbytes)
        log.info("%s stopped reading: a %d-byte frame not taken within %.1f s; stream aborted",
                 peer or "a peer", nbytes, bound)
        raise WriteStalled(nbytes, bound, peer) from None
    return nbytes


def encode_reply(reply: Any) -> list:
    """``(header, tensors)`` -> buffers; an already encoded frame (list of buffers) passes through."""
    if isinstance(reply, list):
        return reply
    if isinstance(reply, tuple) and len(reply) == 2:
        header, tensors = reply
        if isinstance(header, list):
            if tensors:
                raise ValueError("an encoded frame was given together with extra tensors")
            return header
        if isinstance(header, dict):
            return encode_frame(header, list(tensors))
    raise TypeError(
        f"expected (header dict, [(name, tensor), ...]) or an encoded frame, got {type(reply).__name__}"
    )


# Bodies smaller than this are read through the StreamReader (switching protocols costs more).
DIRECT_BODY_MIN = 64 * 1024


class _BodyReceiver(asyncio.BufferedProtocol):
    """Takes over a connection to receive exactly ``len(view)`` bytes into ``view``.

    The event loop then ``recv``s straight into the frame body (no StreamReader buffer, no
    intermediate ``bytes``), asking for all the bytes still missing at once. It never asks for
    more than the body, so no byte of a following frame lands here, and it hands the connection
    back to the stream's own protocol the moment the body is full (or the peer is gone).
    """

    def __init__(self, transport: asyncio.Transport, previous: asyncio.BaseProtocol, view: memoryview):
        self.transport, self.previous, self.view = transport, previous, view
        self.filled = 0
        self.done = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == len(self.view):
            self._hand_back(None)

    def eof_received(self) -> bool | None:
        self._hand_back(ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame body"))
        return self.previous.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._hand_back(exc or ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame body"))
        self.previous.connection_lost(exc)

    # the writing side keeps its flow control (StreamWriter.drain) while we read
    def pause_writing(self) -> None:
        self.previous.pause_writing()

    def resume_writing(self) -> None:
        self.previous.resume_writing()

    def _hand_back(self, exc: BaseException | None) -> None:
        if self.transport.get_protocol() is self:
            self.transport.set_protocol(self.previous)
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


async def _receive_into(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, view: memoryview) -> None:
    """Fill ``view`` with the next ``len(view)`` bytes of the stream."""
    buffered = getattr(reader, "_buffer", None)  # asyncio keeps the read-ahead in a private bytearray
    transport = writer.transport
    if len(view) < DIRECT_BODY_MIN or not isinstance(buffered, bytearray) or transport.is_closing():
        filled = 0
        while filled < len(view):
            try:
                chunk = await reader.readexactly(min(READ_CHUNK, len(view) - filled))
            except asyncio.IncompleteReadError:
                raise ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame body") from None
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return
    # 1) what the StreamReader already read ahead (synchronously: nothing can arrive meanwhile)
    n = min(len(buffered), len(view))
    view[:n] = buffered[:n]
    del buffered[:n]
    if n == len(view):
        return
    if reader.at_eof() or reader.exception() is not None:
        raise ProtocolError(Reason.BAD_FRAME, "stream ended inside the frame body")
    # 2) the rest straight from the socket
    receiver = _BodyReceiver(transport, transport.get_protocol(), view)
    receiver.filled = n
    transport.set_protocol(receiver)
    transport.resume_reading()  # the StreamReader may have paused it when its buffer was full
    try:
        await receiver.done
    finally:
        if transport.get_protocol() is receiver:  # cancelled: give the connection back
            transport.set_protocol(receiver.previous)


async def linger_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close after a reject without resetting it away (see ``LINGER_S``)."""
    with contextlib.suppress(ConnectionError, OSError, TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(READ_CHUNK):
                pass
    await close_stream(writer)


def abort_stream(writer: asyncio.StreamWriter) -> None:
    """Drop the connection to the daemon now; p2pd resets the libp2p stream."""
    with contextlib.suppress(Exception):
        writer.transport.abort()


async def close_stream(writer: asyncio.StreamWriter) -> None:
    """Flush and close; p2pd then closes the libp2p stream after delivering what we wrote."""
    try:
        writer.close()
        async with asyncio.timeout(5):
            await writer.wait_closed()
    except (ConnectionError, OSError, TimeoutError):
        abort_stream(writer)
