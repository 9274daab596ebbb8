"""libp2p transport: our frame protocols on hivemind's binary streams (go-libp2p daemon ``p2pd``).

One libp2p stream carries one exchange. For ``fwd``, ``bwd`` and ``health`` the caller writes one
request frame and reads one reply frame (``ack``, ``reject`` or a typed reply); for ``state`` the
server answers one request with a stream of frames and closes. Frames are the sans-I/O format of
``protocol.frames``; this module only moves their bytes, enforces the limits while reading (a
frame is refused from its prefix and header, before its body is allocated), and turns replies
into exceptions.

Why binary streams and not hivemind's protobuf handlers: a tensor then crosses the wire as its own
bytes, with no protobuf message around it and no split/re-join, and a received body goes from the
socket straight into the buffer its tensors view (see ``scripts/bench_transport.py`` for the
measured difference).

The two sides are ``node.net.serving.Serving`` (answering streams, with explicit backpressure)
and ``node.net.calling.Calling`` (requests, and the errors they raise); ``Transport`` holds the
state both use, counts every frame, and owns the daemon's lifecycle (``node.net.p2pd``).

hivemind is imported lazily (inside functions) so ``import node.net.p2p`` stays cheap."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from node.net.calling import Calling, PeerUnreachable
from node.net.p2pd import daemon_multiaddr, split_peer, start_daemon
from node.net.serving import Serving
from node.net.streams import read_frame, write_frame
from protocol import Frame, Limits


@dataclass
class TransportStats:
    """Counters for the metrics exporter: bytes per (protocol, direction), exchanges and outcomes.

    Direction is ``"in"`` (read from the network) or ``"out"`` (written to it), for both the
    serving and the calling side.
    """

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # the same bytes by (protocol, role, direction): role "client" for exchanges we opened,
    # "server" for those a peer opened (which neighbour a protocol's bytes went to follows from it)
    role_bytes: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    frames: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (protocol, reason) for rejects we sent, and for rejects we received
    rejects_sent: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    rejects_received: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    handler_errors: int = 0

    def snapshot(self) -> dict:
        """A plain, JSON-friendly copy."""
        return {
            "bytes": {f"{p} {d}": n for (p, d), n in self.bytes.items()},
            "frames": {f"{p} {d}": n for (p, d), n in self.frames.items()},
            "served": dict(self.served),
            "requests": dict(self.requests),
            "rejects_sent": {f"{p} {r}": n for (p, r), n in self.rejects_sent.items()},
            "rejects_received": {f"{p} {r}": n for (p, r), n in self.rejects_received.items()},
            "handler_errors": self.handler_errors,
        }


class Transport(Serving, Calling):
    """Our stream protocols on one ``hivemind.P2P`` (one go-libp2p daemon).

    Build it with :meth:`start` (owns a new daemon) or around a P2P you already have, e.g. the
    replica from ``await hivemind.DHT(...).replicate_p2p()`` so that the DHT and the tensor streams
    share one daemon and one peer id (the DHT then owns the daemon; :meth:`close` only detaches).
    """

    def __init__(
        self,
        p2p: Any,
        *,
        limits: Limits | None = None,
        max_streams_per_peer: int = 8,
        max_inflight_handlers: int = 64,
        read_timeout: float = 120.0,
        linger_after_reply: bool = True,
        _owns_p2p: bool = False,
    ):
        self.p2p = p2p
        self.limits = limits if limits is not None else Limits()
        self.max_streams_per_peer = max_streams_per_peer
        self.max_inflight_handlers = max_inflight_handlers
        self.stats = TransportStats()
        self._owns_p2p = _owns_p2p
        self._served: list[str] = []
        self._incoming: dict[str, int] = defaultdict(int)
        self._inflight = 0
        self._outgoing: dict[str, asyncio.Semaphore] = {}
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # exchanges being served
        # a stream that has not delivered its request frame within this many seconds is dropped
        self.read_timeout = read_timeout
        # after a reply, wait for the requester's close before closing (False: close at once, the
        # old behaviour, kept for scripts/bench_replies.py to compare with)
        self.linger_after_reply = linger_after_reply

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def start(cls, *, host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",), announce_maddrs: Sequence[str] = (),
                    initial_peers: Sequence[str] = (), identity_path: str | os.PathLike | None = None,
                    use_relay: bool = False, use_auto_relay: bool = False, nat_port_map: bool = False,
                    auto_nat: bool = False, trusted_relays: Sequence[str] = (), startup_timeout: float = 30,
                    **transport_kwargs: Any) -> Transport:
        """Start a new p2pd with these switches (``start_daemon``) and wrap it; this transport owns it."""
        p2p = await start_daemon(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, initial_peers=initial_peers,
                                 identity_path=identity_path, use_relay=use_relay, use_auto_relay=use_auto_relay,
                                 nat_port_map=nat_port_map, auto_nat=auto_nat, trusted_relays=trusted_relays,
                                 startup_timeout=startup_timeout)
        return cls(p2p, _owns_p2p=True, **transport_kwargs)

    async def close(self) -> None:
        """Stop serving. If this transport started the daemon, stop it and remove its sockets."""
        if self._closed:
            return
        self._closed = True
        if not self._owns_p2p:  # a shared daemon: stop it sending us new streams first
            for protocol_id in self._served:
                with contextlib.suppress(Exception):
                    await self.p2p.remove_binary_stream_handler(protocol_id)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        # owned: stops p2pd and removes both unix sockets; a replica: only our client and socket
        await self.p2p.shutdown()

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """Full multiaddrs other peers can dial, each ending in ``/p2p/<peer id>``."""
        return [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]

    async def connect(self, maddr: str, timeout: float = 10) -> str:
        """Dial a full multiaddr (``.../p2p/<id>``) so later requests to that peer id work without
        a DHT lookup; returns the peer id."""
        from hivemind.p2p import PeerID
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

        head, peer_id = split_peer(maddr)
        try:
            if not head or not peer_id or "/" in peer_id:
                raise ValueError(maddr)
            PeerID.from_base58(peer_id)
            addr = daemon_multiaddr(head)
        except Exception as e:
            raise ValueError(f"{maddr}: a full multiaddr ending in /p2p/<peer id> is needed") from e
        try:
            async with asyncio.timeout(timeout):
                await self.p2p._client.connect(PeerID.from_base58(peer_id), [addr])
        except P2PDaemonError as e:
            raise PeerUnreachable(f"cannot dial {maddr}: {e}") from e
        return peer_id

    # ------------------------------------------------------------------ frame I/O

    async def _read_frame(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol_id: str,
        limits: Limits | None = None, role: str = "server",
    ) -> Frame | None:
        """One frame (``streams.read_frame``, limits checked before the body is allocated), counted."""
        frame, nbytes = await read_frame(reader, writer, limits or self.limits)
        if frame is not None:
            self.stats.bytes[(protocol_id, "in")] += nbytes
            self.stats.role_bytes[(protocol_id, role, "in")] += nbytes
            self.stats.frames[(protocol_id, "in")] += 1
        return frame

    async def _write(self, writer: asyncio.StreamWriter, protocol_id: str, buffers: list, role: str,
                     peer: str | None = None) -> None:
        """Write an encoded frame (``streams.write_frame``: bounded in time), counted."""
        n = await write_frame(writer, buffers, peer=peer)
        self.stats.bytes[(protocol_id, "out")] += n
        self.stats.role_bytes[(protocol_id, role, "out")] += n
        self.stats.frames[(protocol_id, "out")] += 1

    # ------------------------------------------------------------------ connections

    async def connections(self) -> list[tuple[str, Any]]:
        """The daemon's open libp2p connections: ``(peer id, remote multiaddr)``, one per connection
        (a peer may have several; a relayed one's address has ``/p2p-circuit``, see
        ``node.net.connections``)."""
        return [(info.peer_id.to_base58(), info.addrs[0] if info.addrs else None)
                for info in await self.p2p.list_peers()]

