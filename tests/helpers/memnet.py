"""An in-memory stand-in for ``node.net.p2p.Transport``: the runtime's frames are encoded and decoded
with ``protocol.frames`` exactly as on a libp2p stream, and the same exceptions come back
(busy, rejected, unreachable), but nothing leaves the process.

Used by the test suite (tests/test_runtime.py) and by ``scripts/bench_device.py``, which runs
real ``StageRuntime`` pipelines on one machine's CPU or GPU without p2pd or py-libp2p.
"""

from __future__ import annotations

import asyncio
import inspect

from node.net import PeerBusy, PeerRejected, PeerUnreachable
from protocol import FrameDecoder, ProtocolError, encode_frame, make_reject, parse_reply


def frame_of(buffers, limits=None):
    """Decode the buffers of exactly one frame (``limits`` as the receiving handler's)."""
    data = b"".join(bytes(memoryview(b)) for b in buffers)
    frames = FrameDecoder(limits).feed(data)
    if len(frames) != 1:
        raise ValueError(f"expected one whole frame, decoded {len(frames)}")
    return frames[0]


def buffers_of(header, tensors=()):
    """A frame's buffers: ``header`` if it already is a list of buffers, else encoded."""
    if isinstance(header, list):
        return header
    return encode_frame(header, list(tensors))


class Net:
    """The peers of one in-memory swarm, by peer id."""

    def __init__(self):
        self.peers: dict[str, MemTransport] = {}


class MemTransport:
    """node.net.p2p.Transport's interface over memory: same frames, same exceptions."""

    def __init__(self, net: Net, peer_id: str):
        self.net, self.peer_id = net, peer_id
        self.handlers, self.stream_handlers, self.limits = {}, {}, {}
        self.down = False  # an unreachable peer (kill -9)
        self.sent: list[tuple[str, str, dict]] = []
        self.undialled: set[str] = set()  # peers whose (new) address this transport does not know
        self.dialled: list[str] = []
        # (peer, protocol id, request header) -> True: the peer handles the request, but its reply
        # never reaches us (on libp2p: a stream reset that overtook the reply, or a timeout)
        self.lose_reply = None
        net.peers[peer_id] = self

    async def serve(self, protocol_id, handler, *, limits=None):
        self.handlers[protocol_id] = handler
        self.limits[protocol_id] = limits

    async def serve_stream(self, protocol_id, handler, *, limits=None):
        self.stream_handlers[protocol_id] = handler
        self.limits[protocol_id] = limits

    def _target(self, peer):
        t = self.net.peers.get(peer)
        if t is None or t.down or self.down or peer in self.undialled:
            raise PeerUnreachable(f"cannot reach {peer}")
        return t

    async def connect(self, maddr, timeout=10):
        """Like p2pd learning a peer's new address: ``undialled`` peers become reachable."""
        peer = maddr.rsplit("/p2p/", 1)[-1]
        self.dialled.append(maddr)
        if peer not in self.net.peers or self.net.peers[peer].down:
            raise PeerUnreachable(f"cannot dial {maddr}")
        self.undialled.discard(peer)
        return peer

    async def request(self, peer, protocol_id, header, tensors=(), *, timeout):
        target = self._target(peer)
        try:
            frame = frame_of(buffers_of(header, tensors), target.limits.get(protocol_id))
        except ProtocolError as e:
            raise PeerRejected(e.reason.value, e.detail) from None
        self.sent.append((peer, protocol_id, dict(frame.header)))
        try:
            reply = target.handlers[protocol_id](frame, self.peer_id)
            if inspect.isawaitable(reply):
                reply = await asyncio.wait_for(reply, timeout)
        except ProtocolError as e:
            reply = make_reject(e.reason, e.detail)
        if self.lose_reply is not None and self.lose_reply(peer, protocol_id, dict(frame.header)):
            raise PeerUnreachable(f"{peer} closed the {protocol_id} stream without a reply")
        reply = frame_of(buffers_of(*reply) if isinstance(reply, tuple) else reply)
        if reply.header["type"] == "reject":
            if reply.header["reason"] == "busy":
                raise PeerBusy(reply.header.get("detail", ""))
            rejected = parse_reply(reply)
            raise PeerRejected(rejected.reason_code, rejected.detail, score=rejected.score, epoch=rejected.epoch)
        return reply

    async def request_stream(self, peer, protocol_id, header, tensors=(), *, timeout):
        target = self._target(peer)
        frame = frame_of(buffers_of(header, tensors))
        async for reply in target.stream_handlers[protocol_id](frame, self.peer_id):
            yield frame_of(reply)
