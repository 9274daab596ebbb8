"""Every frame write is bounded in time (node/net/streams.py ``write_frame``): a peer that stops
reading gets its stream aborted within the bound, the stall counted and logged once at INFO, and
the writer (a handler's slot) is free again; a peer that reads gets the whole frame."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

import node.net.streams as streams
from node.net.streams import STALLS, WriteStalled, write_bound, write_frame

pytestmark = pytest.mark.timeout(60)

BIG = 8 << 20  # far more than a socket's buffers: drain() must wait for the reader


def test_the_bound_grows_with_the_frame_above_a_floor():
    assert write_bound(0) == streams.WRITE_FLOOR_S == 10.0
    assert write_bound(64 * 1024 * 100) == pytest.approx(100.0)
    assert write_bound(64 * 1024 * 5) == 10.0


@pytest.mark.asyncio
async def test_a_peer_that_stops_reading_is_aborted_within_the_bound(caplog):
    left, right = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=left)
    before = STALLS.count
    caplog.set_level(logging.INFO, logger="node.net.streams")
    try:
        t0 = time.monotonic()
        with pytest.raises(WriteStalled) as e:
            await write_frame(writer, [bytes(BIG)], peer="12D3KooWpeer", bound_s=0.3)
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 2.0
        assert isinstance(e.value, ConnectionError) and e.value.nbytes == BIG
        assert writer.transport.is_closing()  # aborted: nothing more goes out, the socket is released
        assert STALLS.count == before + 1
        lines = [r for r in caplog.records if r.name == "node.net.streams"]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO and "12D3KooWpeer" in lines[0].getMessage()
    finally:
        writer.close()
        right.close()


@pytest.mark.asyncio
async def test_a_server_handler_is_freed_when_its_client_stops_reading(monkeypatch):
    """A loopback server answers each request with a large frame; its client sends the request
    and never reads. With the default bound (its floor made small here) the handler's write
    raises, the stream is aborted and the handler's slot is free again."""
    # the default bound made small: a 0.3 s floor, and a minimum rate so high that the floor rules
    monkeypatch.setattr(streams, "WRITE_FLOOR_S", 0.3)
    monkeypatch.setattr(streams, "WRITE_MIN_RATE", 1 << 40)
    slots = {"busy": 0, "freed": 0}
    outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        slots["busy"] += 1
        try:
            await reader.readexactly(4)
            await write_frame(writer, [bytes(BIG)])
            outcome.set_result("written")
        except WriteStalled as e:
            outcome.set_result(e)
        finally:
            slots["busy"] -= 1
            slots["freed"] += 1

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ping")
        await writer.drain()
        t0 = time.monotonic()
        result = await asyncio.wait_for(outcome, 10)
        assert isinstance(result, WriteStalled) and time.monotonic() - t0 < 3.0
        assert await _until(lambda: slots == {"busy": 0, "freed": 1})
        # the client sees the stream end (reset or EOF after what was buffered), not a hang
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(BIG), 10)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.asyncio
async def test_the_transport_frees_a_handler_slot_whose_requester_stops_reading(monkeypatch):
    """The node's own serving path (``Transport``'s stream handler) on a socket pair: the request
    is read, the reply's write stalls, the stream is aborted and the slot counts are back to 0."""
    from types import SimpleNamespace

    from node.net import Transport
    from protocol import Limits, encode_frame_bytes

    monkeypatch.setattr(streams, "WRITE_FLOOR_S", 0.3)
    monkeypatch.setattr(streams, "WRITE_MIN_RATE", 1 << 40)
    t = Transport(None)
    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=left)
    info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "12D3KooWslow"))
    seen = []

    async def respond(frame, peer, w):
        seen.append((frame.header["type"], peer, t._inflight))
        await t._write(w, "/test/1", [bytes(BIG)], "server")

    right.sendall(encode_frame_bytes({"type": "health-request"}))  # the request; then this side reads nothing
    try:
        t0 = time.monotonic()
        await asyncio.wait_for(t._on_stream("/test/1", info, reader, writer, respond, Limits()), 10)
        assert time.monotonic() - t0 < 3.0
        assert seen == [("health-request", "12D3KooWslow", 1)]  # the handler held a slot while it wrote
        assert t._inflight == 0 and not t._incoming  # and gave it back
        assert writer.transport.is_closing()
    finally:
        writer.close()
        right.close()


@pytest.mark.asyncio
async def test_a_peer_that_reads_gets_the_whole_frame():
    left, right = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=left)
    reader, other = await asyncio.open_connection(sock=right)
    before = STALLS.count
    try:
        payload = [bytes(range(256)) * (BIG // 256 // 2), b"tail"]
        sent, got = await asyncio.gather(write_frame(writer, payload, bound_s=5.0),
                                         reader.readexactly(BIG // 2 + 4))
        assert sent == BIG // 2 + 4 and got == b"".join(payload)
        assert STALLS.count == before
    finally:
        writer.close()
        other.close()


async def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False
