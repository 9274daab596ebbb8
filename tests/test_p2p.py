"""Transport over real go-libp2p daemons on loopback: fwd/bwd exchange, rejects for malformed
frames sent as raw bytes, busy backpressure, timeouts, cancellation, state streams, a daemon
shared with hivemind's DHT, and no p2pd or socket left behind."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import pytest
import pytest_asyncio
import torch

from node.net import PeerBusy, PeerRejected, PeerUnreachable, Transport
from protocol import (
    BWD,
    FWD,
    HEALTH,
    STATE,
    Expect,
    FrameDecoder,
    Limits,
    ProtocolError,
    Reason,
    make_ack,
    make_bwd,
    make_fwd,
    make_health,
    make_reject,
    make_state_request,
    parse_reply,
    state_chunks,
    validate_bwd,
    validate_fwd,
    validate_state_request,
)
from tests.helpers.procs import assert_no_p2pd_left, p2pd_descendants

RUN, MANIFEST, K = "swarm-test", "m" * 16, 8


def sockets_of(t: Transport) -> list[str]:
    return [m["unix"] for m in (t.p2p._daemon_listen_maddr, t.p2p._client_listen_maddr)]


@pytest_asyncio.fixture
async def pair():
    """Two transports on loopback; b bootstraps from a, so each can open streams to the other."""
    assert p2pd_descendants() == []
    a = await Transport.start()
    b = None
    try:
        b = await Transport.start(initial_peers=await a.visible_maddrs())
        yield a, b
    finally:
        paths = sockets_of(a) + (sockets_of(b) if b else [])
        if b is not None:
            await b.close()
        await a.close()
        assert_no_p2pd_left()
        assert [p for p in paths if os.path.exists(p)] == [], "a unix socket outlived its daemon"


def fwd_frame(sender: str, mb: int = 0, run: str = RUN, c: torch.Tensor | None = None):
    c = torch.randn(2, 4, K) if c is None else c
    ids = torch.randint(0, 256, (2, 4))
    return make_fwd(run, MANIFEST, mb, 0, 0, [sender], c, ids), c, ids


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_two_nodes_exchange_fwd_and_bwd(pair):
    a, b = pair  # a is stage 1, b is stage 0
    got = {}
    expect_fwd = Expect.fwd(RUN, MANIFEST, 1, K, max_batch=4, max_seq=8)
    expect_bwd = Expect.bwd(RUN, MANIFEST, 0, K, max_batch=4, max_seq=8)

    async def on_fwd(frame, peer):
        f = validate_fwd(frame, expect_fwd, peer)
        if f.mb == 99:  # a verifier refusal with its score
            return make_reject(Reason.REJECTED_BY_VERIFIER, "sentinel:swd", mb=f.mb, score=1.25)
        if f.mb == 98:  # a malformed score: still a refusal, the score is not trusted
            return {"type": "reject", "reason": "rejected-by-verifier", "detail": "odd", "score": "high"}, []
        got["fwd"] = (f.c.clone(), f.ids.clone(), peer)
        return make_ack(f.mb, 1, 0, queue=0)

    def on_bwd(frame, peer):  # a plain function works too
        g = validate_bwd(frame, expect_bwd, peer)
        got["bwd"] = g.grad.clone()
        return {"type": "ack", "mb": g.mb, "stage": 0, "version": 3}, []

    await a.serve(FWD, on_fwd)
    await b.serve(BWD, on_bwd)

    frame, c, ids = fwd_frame(b.peer_id, mb=7)
    reply = await b.request(a.peer_id, FWD, frame, timeout=20)
    r = parse_reply(reply)
    assert r.ok and r.mb == 7 and r.stage == 1 and r.queue == 0
    assert torch.equal(got["fwd"][0], c) and torch.equal(got["fwd"][1], ids) and got["fwd"][2] == b.peer_id

    grad = torch.randn(2, 4, K, dtype=torch.bfloat16)
    bwd = make_bwd(RUN, MANIFEST, 7, 1, 0, [b.peer_id, a.peer_id], grad)
    reply = await a.request(b.peer_id, BWD, bwd, timeout=20)
    assert parse_reply(reply).version == 3
    assert torch.equal(got["bwd"], grad)

    # a wrong run id and a wrong stage are refused with their reason codes
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, FWD, fwd_frame(b.peer_id, run="other-run")[0], timeout=20)
    assert e.value.reason == "wrong-run" and "other-run" in e.value.detail and e.value.score is None
    bad_stage = make_fwd(RUN, MANIFEST, 1, 1, 0, [b.peer_id, b.peer_id], c, ids)
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, FWD, bad_stage, timeout=20)
    assert e.value.reason == "wrong-stage"

    # the reject's typed score reaches the caller through the exception
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, FWD, fwd_frame(b.peer_id, mb=99)[0], timeout=20)
    assert (e.value.reason, e.value.detail, e.value.score) == ("rejected-by-verifier", "sentinel:swd", 1.25)
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, FWD, fwd_frame(b.peer_id, mb=98)[0], timeout=20)
    assert (e.value.reason, e.value.detail, e.value.score) == ("rejected-by-verifier", "odd", None)

    # byte counters per protocol and direction (metrics)
    n = sum(len(bytes(x)) for x in frame)
    assert a.stats.bytes[(FWD, "in")] >= 3 * n and b.stats.bytes[(FWD, "out")] >= 3 * n
    assert a.stats.rejects_sent[(FWD, "wrong-run")] == 1 and b.stats.rejects_received[(FWD, "wrong-stage")] == 1
    assert a.stats.snapshot()["served"][FWD] == 5
    assert b.stats.rejects_received[(FWD, "rejected-by-verifier")] == 2


async def raw_exchange(t: Transport, peer: str, protocol: str, data: bytes):
    """Write raw bytes on a bare stream (no framing by us) and decode whatever comes back."""
    from hivemind.p2p import PeerID

    _, reader, writer = await t.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
    try:
        writer.write(data)
        await writer.drain()
        decoder = FrameDecoder()
        async with asyncio.timeout(10):
            while True:
                chunk = await reader.read(decoder.bytes_needed)
                assert chunk, "the node closed the stream without a reply"
                frames = decoder.feed(chunk)
                if frames:
                    return frames[0]
    finally:
        writer.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_malformed_frames_are_rejected_and_the_node_keeps_serving(pair):
    a, b = pair
    a.limits = Limits(max_body_bytes=1 << 20)
    calls = []

    async def on_fwd(frame, peer):
        calls.append(frame.header.get("mb"))
        if frame.header.get("mb") == 666:
            raise RuntimeError("bug in a handler")
        return make_ack(frame.header.get("mb"), 1, 0)

    await a.serve(FWD, on_fwd)

    garbage = await raw_exchange(b, a.peer_id, FWD, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert garbage.type == "reject" and garbage.header["reason"] == "bad-frame"
    assert "magic" in garbage.header["detail"]

    huge_header = b"SWN1" + (10 << 20).to_bytes(4, "big") + b"\x80" * 100
    r = await raw_exchange(b, a.peer_id, FWD, huge_header)
    assert r.header["reason"] == "too-large" and "header length" in r.header["detail"]

    # a 2 GiB body announced in a valid header: refused from the header alone, nothing allocated
    header = msgpack.packb({"v": 1, "type": "fwd", "tensors": [{"name": "c", "dtype": "uint8", "shape": [2**31]}],
                            "body_len": 2**31})
    r = await raw_exchange(b, a.peer_id, FWD, b"SWN1" + len(header).to_bytes(4, "big") + header + b"\0" * 1000)
    assert r.header["reason"] == "too-large" and "body_len" in r.header["detail"]

    not_msgpack = b"SWN1" + (5).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1"
    r = await raw_exchange(b, a.peer_id, FWD, not_msgpack)
    assert r.header["reason"] == "bad-frame"

    # a body cut short (the caller vanishes mid-frame): the stream is dropped, its slot freed
    from hivemind.p2p import PeerID

    header = msgpack.packb({"v": 1, "type": "fwd", "tensors": [{"name": "c", "dtype": "uint8", "shape": [500_000]}],
                            "body_len": 500_000})
    _, _, writer = await b.p2p.call_binary_stream_handler(PeerID.from_base58(a.peer_id), FWD)
    writer.write(b"SWN1" + len(header).to_bytes(4, "big") + header + b"\0" * 100_000)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    for _ in range(100):
        if a._inflight == 0:
            break
        await asyncio.sleep(0.05)
    assert a._inflight == 0 and not a._incoming

    assert calls == []  # no malformed frame reached the handler

    # a handler that raises: reject/internal, not a crash
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 666}, timeout=20)
    assert e.value.reason == "internal"
    assert a.stats.handler_errors == 1

    # ... and the node still serves well-formed frames
    reply = await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 5}, [("c", torch.ones(3))], timeout=20)
    assert parse_reply(reply).ok and calls == [666, 5]
    # limits per protocol: a tight one on bwd, the transport's on fwd
    await a.serve(BWD, lambda frame, peer: make_ack(0, 1, 0), limits=Limits(max_body_bytes=64))
    with pytest.raises(PeerRejected) as e:
        await b.request(a.peer_id, BWD, {"type": "bwd"}, [("g", torch.zeros(17))], timeout=20)
    assert e.value.reason == "too-large"
    assert parse_reply(await b.request(a.peer_id, BWD, {"type": "bwd"}, [("g", torch.zeros(16))], timeout=20)).ok
    # a reply that breaks the requester's limits is refused on the requester's side too
    b.limits = Limits(max_body_bytes=8)

    def fat_reply(frame, peer):
        return {"type": "health", "status": {}}, [("x", torch.zeros(100))]

    await a.serve(HEALTH, fat_reply)
    with pytest.raises(ProtocolError) as e:
        await b.request(a.peer_id, HEALTH, {"type": "health-request"}, timeout=20)
    assert e.value.reason == Reason.TOO_LARGE


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_busy_backpressure_timeout_and_cancellation(pair):
    a, b = pair
    a.max_streams_per_peer = 2
    release = asyncio.Event()
    started = []

    async def slow(frame, peer):
        started.append(frame.header["mb"])
        await release.wait()
        return make_ack(frame.header["mb"], 1, 0)

    await a.serve(FWD, slow)
    payload = [("c", torch.zeros(1 << 18))]  # 1 MiB: the busy reply must not wait for the body

    first = [asyncio.create_task(b.request(a.peer_id, FWD, {"type": "fwd", "mb": i}, payload, timeout=30))
             for i in range(2)]
    for _ in range(200):
        if len(started) == 2:
            break
        await asyncio.sleep(0.05)
    assert sorted(started) == [0, 1]

    t0 = time.monotonic()
    with pytest.raises(PeerBusy):
        await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 2}, payload, timeout=30)
    assert time.monotonic() - t0 < 10
    assert a.stats.rejects_sent[(FWD, "busy")] == 1 and sorted(started) == [0, 1]

    release.set()
    assert [parse_reply(await t).mb for t in first] == [0, 1]

    # the global in-flight limit also answers busy
    a.max_streams_per_peer, a.max_inflight_handlers = 8, 1
    release.clear()
    hold = asyncio.create_task(b.request(a.peer_id, FWD, {"type": "fwd", "mb": 3}, timeout=30))
    while len(started) < 3:
        await asyncio.sleep(0.05)
    with pytest.raises(PeerBusy):
        await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 4}, timeout=30)
    release.set()
    await hold
    a.max_inflight_handlers = 64

    # timeout: the whole exchange is bounded
    release.clear()
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 5}, timeout=0.5)
    assert time.monotonic() - t0 < 5

    # cancellation resets the stream; our slot is freed and later calls work
    task = asyncio.create_task(b.request(a.peer_id, FWD, {"type": "fwd", "mb": 6}, timeout=30))
    while 6 not in started:
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    reply = await b.request(a.peer_id, FWD, {"type": "fwd", "mb": 7}, timeout=20)
    assert parse_reply(reply).mb == 7
    for _ in range(100):  # the server finishes the abandoned exchanges and frees their slots
        if a._inflight == 0:
            break
        await asyncio.sleep(0.05)
    assert a._inflight == 0 and not a._incoming


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_state_stream_health_and_unreachable_peer(pair):
    a, b = pair
    state = {"w": torch.randn(64, 32), "b": torch.randn(32), "big": torch.randn(5000)}

    async def on_state(frame, peer):
        req = validate_state_request(frame, RUN, MANIFEST, 1)
        for buffers in state_chunks(RUN, MANIFEST, 1, 42, state, max_chunk_bytes=req.max_chunk_bytes or 4096):
            yield buffers

    await a.serve_stream(STATE, on_state)
    await a.serve(HEALTH, lambda frame, peer: make_health({"peer": a.peer_id, "stage": 1}))

    frames = [f async for f in b.request_stream(a.peer_id, STATE, make_state_request(RUN, MANIFEST, 1, 8192),
                                                timeout=20)]
    assert len(frames) > 3 and frames[-1].header["last"] and not any(f.header["last"] for f in frames[:-1])
    assert [f.header["seq"] for f in frames] == list(range(len(frames)))
    assert torch.equal(frames[0].tensors["w"], state["w"])

    with pytest.raises(PeerRejected) as e:
        async for _ in b.request_stream(a.peer_id, STATE, make_state_request(RUN, MANIFEST, 2), timeout=20):
            pass
    assert e.value.reason == "wrong-stage"

    reply = await b.request(a.peer_id, HEALTH, {"type": "health-request"}, timeout=20)
    assert reply.header["status"] == {"peer": a.peer_id, "stage": 1} and reply.header["v"] == 1

    from security import new_ed25519_key, peer_id_from_key

    nobody = peer_id_from_key(new_ed25519_key())
    t0 = time.monotonic()
    with pytest.raises((PeerUnreachable, asyncio.TimeoutError)):
        await b.request(nobody, FWD, {"type": "fwd"}, timeout=8)
    assert time.monotonic() - t0 < 10
    with pytest.raises(PeerUnreachable):  # protocol not served by a
        await b.request(a.peer_id, BWD, {"type": "bwd"}, timeout=10)

    # an address claimed for another peer id: the handshake proves who answers there, so dialling
    # a's address as `nobody` fails (a record cannot point a peer id at someone else's node)
    a_addr = (await a.visible_maddrs())[0].rsplit("/p2p/", 1)[0]
    with pytest.raises(PeerUnreachable):
        await b.connect(f"{a_addr}/p2p/{nobody}", timeout=8)
    assert await b.connect(f"{a_addr}/p2p/{a.peer_id}", timeout=8) == a.peer_id


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_transport_shares_the_daemon_of_a_hivemind_dht():
    import hivemind

    assert p2pd_descendants() == []
    dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False,
        nat_port_map=False, auto_nat=False,
    )
    caller = None
    try:
        served = Transport(await dht.replicate_p2p())
        assert served.peer_id == dht.peer_id.to_base58()
        await served.serve(FWD, lambda frame, peer: make_ack(frame.header["mb"], 1, 0))
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        caller = await Transport.start(initial_peers=maddrs)
        reply = await caller.request(served.peer_id, FWD, {"type": "fwd", "mb": 9}, [("c", torch.ones(4))],
                                     timeout=20)
        assert parse_reply(reply).mb == 9
        await served.close()  # detaches from the daemon the DHT owns ...
        assert dht.is_alive() and len(p2pd_descendants()) == 2
        with pytest.raises(PeerUnreachable):  # ... and unregisters our protocol there
            await caller.request(served.peer_id, FWD, {"type": "fwd", "mb": 10}, timeout=10)
    finally:
        if caller is not None:
            await caller.close()
        dht.shutdown()
    assert_no_p2pd_left()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_frames_are_received_straight_into_their_body_without_reading_past_them(monkeypatch):
    """The read path on a plain socket pair: bodies arrive in odd pieces, go straight into the
    body buffer (BufferedProtocol), and the next frame's bytes are left for the next read."""
    import socket

    import node.net.streams as streams
    from protocol import encode_frame_bytes

    direct = []
    original = streams._BodyReceiver.buffer_updated

    def counting(self, nbytes):
        direct.append(nbytes)
        return original(self, nbytes)

    monkeypatch.setattr(streams._BodyReceiver, "buffer_updated", counting)
    x, y = torch.randn(300, 1000), torch.arange(70000)
    data = encode_frame_bytes({"type": "fwd", "mb": 1}, [("x", x)]) + encode_frame_bytes(
        {"type": "bwd", "mb": 2}, [("y", y)]) + encode_frame_bytes({"type": "ack", "mb": 3})

    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=left)
    t = Transport(None)

    async def trickle(sock, payload):
        loop = asyncio.get_running_loop()
        for i in range(0, len(payload), 100_003):
            await loop.sock_sendall(sock, payload[i : i + 100_003])
            await asyncio.sleep(0.001)
        sock.close()

    right.setblocking(False)
    sender = asyncio.create_task(trickle(right, data))
    try:
        f1 = await t._read_frame(reader, writer, "p")
        f2 = await t._read_frame(reader, writer, "p")
        f3 = await t._read_frame(reader, writer, "p")
        assert await t._read_frame(reader, writer, "p") is None  # clean EOF at a frame boundary
    finally:
        await sender
        writer.close()
    assert torch.equal(f1.tensors["x"], x) and torch.equal(f2.tensors["y"], y) and f3.header["mb"] == 3
    assert f1.tensors["x"].data_ptr() == f1.body.__array_interface__["data"][0]  # a view, not a copy
    assert sum(direct) > len(data) // 2  # most bytes went socket -> body directly
    assert t.stats.bytes[("p", "in")] == len(data) and t.stats.frames[("p", "in")] == 3

    # a stream cut inside a body is a bad-frame, not a hang
    left, right = socket.socketpair()
    right.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=left)
    sender = asyncio.create_task(trickle(right, data[: len(data) // 4]))
    with pytest.raises(ProtocolError, match="inside the frame body"):
        await asyncio.wait_for(t._read_frame(reader, writer, "p"), 5)
    await sender
    writer.close()


# scripts/bench_transport.py --quick and its figures: tests/test_bench_smoke.py


def test_a_relayed_multiaddr_is_written_the_way_p2pd_reads_it():
    """`/p2p/ID` inside an address (a relay's) goes to p2pd as the peer id's multihash, not the CID
    hivemind's multiaddr library writes (p2pd refused that: "length greater than remaining")."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from node.net.p2pd import daemon_multiaddr

    relay = "12D3KooWMZv6U3ZjD5sLvFuDvwdoa2dHwUnJEusVvuJNJcHnYkxd"
    text = f"/ip4/7.77.1.2/tcp/31337/p2p/{relay}/p2p-circuit"
    raw = daemon_multiaddr(text).to_bytes()
    mh = PeerID.from_base58(relay).to_bytes()
    assert raw == Multiaddr("/ip4/7.77.1.2/tcp/31337").to_bytes() + b"\xa5\x03" + bytes([len(mh)]) + mh + b"\xa2\x02"
    assert str(daemon_multiaddr(text)) == text
    assert daemon_multiaddr("/ip4/127.0.0.1/tcp/5").to_bytes() == Multiaddr("/ip4/127.0.0.1/tcp/5").to_bytes()
    with pytest.raises(ValueError):
        daemon_multiaddr("/ip4/not-an-address/tcp/5")
