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

Backpressure is explicit: a server that already runs ``max_streams_per_peer`` exchanges for one
peer, or ``max_inflight_handlers`` in total, answers ``reject``/``busy`` at once without reading
the request, and the caller raises :class:`PeerBusy` so its router can pick another replica.

hivemind is imported lazily (inside functions) so ``import node.net.p2p`` stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.net.streams import abort_stream, close_stream, encode_reply, linger_close, read_frame, write_frame
from protocol import (
    Frame,
    Limits,
    ProtocolError,
    Reason,
    make_reject,
    parse_reply,
)

logger = logging.getLogger(__name__)

Tensors = Sequence[tuple[str, Any]]
# (header, [(name, tensor), ...]) or an encoded frame (the buffer list of protocol.messages.make_*)
Reply = "tuple[dict, Tensors] | list"
Handler = Callable[[Frame, str], Any]  # -> Reply | Awaitable[Reply]
StreamHandler = Callable[[Frame, str], AsyncIterator[Any]]  # yields Reply


class TransportError(Exception):
    """Base of the errors a request can raise (besides ``asyncio.TimeoutError``)."""


class PeerUnreachable(TransportError):
    """The daemon could not open a stream to the peer (offline, no address, protocol not served),
    or the stream broke before a complete reply arrived."""


class PeerBusy(TransportError):
    """The peer answered ``busy``: its stream or handler limit is reached; try another replica."""


class PeerRejected(TransportError):
    """The peer answered ``reject`` with a reason code (``wrong-run``, ``stale``, ...).

    ``score``: the reject's optional ``score`` field (with ``rejected-by-verifier``: the peer's
    verifier score, > 0 and finite), None when it sent none or sent a malformed one. ``epoch``: the
    reject's optional ``epoch`` (with ``wrong-epoch``: the peer's morph epoch), or None."""

    def __init__(self, reason: str, detail: str = "", score: float | None = None, epoch: int | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.score = score
        self.epoch = epoch


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


class Transport:
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
        from hivemind.utils.multiaddr import Multiaddr

        head, peer_id = split_peer(maddr)
        try:
            if not head or not peer_id or "/" in peer_id:
                raise ValueError(maddr)
            PeerID.from_base58(peer_id)
            addr = Multiaddr(_multiaddr_bytes(head))
        except Exception as e:
            raise ValueError(f"{maddr}: a full multiaddr ending in /p2p/<peer id> is needed") from e
        try:
            async with asyncio.timeout(timeout):
                await self.p2p._client.connect(PeerID.from_base58(peer_id), [addr])
        except P2PDaemonError as e:
            raise PeerUnreachable(f"cannot dial {maddr}: {e}") from e
        return peer_id

    # ------------------------------------------------------------------ serving

    async def serve(self, protocol_id: str, handler: Handler, *, limits: Limits | None = None) -> None:
        """Answer each stream of ``protocol_id`` with one reply frame from ``handler(frame, peer)``.

        The handler returns ``(header, [(name, tensor), ...])`` or an encoded frame (the buffer
        list of ``protocol.messages.make_*``), or an awaitable of either. It may raise
        :class:`ProtocolError` (the peer gets ``reject`` with its reason); any other exception
        becomes ``reject``/``internal`` and is logged, never propagated. ``limits`` overrides the
        transport's limits for requests of this protocol (e.g. ``Expect.max_body_bytes()`` on fwd).
        """

        async def respond(frame: Frame, peer: str, writer: asyncio.StreamWriter) -> None:
            reply = handler(frame, peer)
            if inspect.isawaitable(reply):
                reply = await reply
            await self._write(writer, protocol_id, encode_reply(reply), "server")

        await self._register(protocol_id, respond, limits)

    async def serve_stream(
        self, protocol_id: str, handler: StreamHandler, *, limits: Limits | None = None
    ) -> None:
        """Answer each stream of ``protocol_id`` with every frame ``handler(frame, peer)`` yields
        (same forms as for :meth:`serve`), then close it (``/swarm-node/state/1``)."""

        async def respond(frame: Frame, peer: str, writer: asyncio.StreamWriter) -> None:
            async for reply in handler(frame, peer):
                await self._write(writer, protocol_id, encode_reply(reply), "server")

        await self._register(protocol_id, respond, limits)

    async def _register(
        self, protocol_id: str, respond: Callable[..., Awaitable[None]], limits: Limits | None
    ) -> None:
        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            self._tasks.add(task)
            try:
                await self._on_stream(protocol_id, info, reader, writer, respond, limits or self.limits)
            except asyncio.CancelledError:
                pass  # close() or loop shutdown; this task is the root of the connection, nobody awaits it
            finally:
                self._tasks.discard(task)

        await self.p2p.add_binary_stream_handler(protocol_id, on_stream)
        self._served.append(protocol_id)

    async def _on_stream(
        self,
        protocol_id: str,
        info: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        respond: Callable[[Frame, str, asyncio.StreamWriter], Awaitable[None]],
        limits: Limits,
    ) -> None:
        peer = info.peer_id.to_base58()
        if self._inflight >= self.max_inflight_handlers or self._incoming[peer] >= self.max_streams_per_peer:
            # answer before reading anything: the caller reads while it writes
            await self._send_reject(writer, protocol_id, Reason.BUSY, "too many concurrent streams")
            await linger_close(reader, writer)
            return
        self._inflight += 1
        self._incoming[peer] += 1
        answered = False
        try:
            try:
                async with asyncio.timeout(self.read_timeout):
                    frame = await self._read_frame(reader, writer, protocol_id, limits, "server")
                if frame is None:
                    raise ProtocolError(Reason.BAD_FRAME, "stream closed before a frame")
                self.stats.served[protocol_id] += 1
                await respond(frame, peer, writer)
            except ProtocolError as e:
                await self._send_reject(writer, protocol_id, e.reason, e.detail)
            except TimeoutError:
                logger.debug("%s from %s: no complete frame in %.0f s", protocol_id, peer, self.read_timeout)
                abort_stream(writer)
                return
            except (ConnectionError, OSError) as e:
                logger.debug("%s from %s: stream broke: %r", protocol_id, peer, e)
                abort_stream(writer)
                return
            except Exception:
                self.stats.handler_errors += 1
                logger.exception("handler for %s failed on a frame from %s", protocol_id, peer)
                await self._send_reject(writer, protocol_id, Reason.INTERNAL, "the handler failed")
            answered = True
        except asyncio.CancelledError:
            abort_stream(writer)
            raise
        except Exception:  # never let one stream take the node down
            logger.exception("%s stream from %s failed", protocol_id, peer)
            abort_stream(writer)
        finally:
            self._inflight -= 1
            self._incoming[peer] -= 1
            if not self._incoming[peer]:
                del self._incoming[peer]
        if answered:
            # the requester closes once it has read the reply; closing first would let p2pd reset
            # the stream, and a reset can discard the reply before the requester's p2pd passed it
            # on (docs/REFERENCES.md §7): wait for its close (bounded), then close
            try:
                if self.linger_after_reply:
                    await linger_close(reader, writer)
                else:
                    await close_stream(writer)
            except asyncio.CancelledError:
                abort_stream(writer)
                raise

    async def _send_reject(self, writer: asyncio.StreamWriter, protocol_id: str, reason: Any, detail: str) -> None:
        self.stats.rejects_sent[(protocol_id, Reason(reason).value)] += 1
        with contextlib.suppress(ConnectionError, OSError):
            await self._write(writer, protocol_id, make_reject(reason, detail), "server")

    # ------------------------------------------------------------------ calling

    async def request(
        self,
        peer_id: str,
        protocol_id: str,
        header: dict | list,
        tensors: Tensors = (),
        *,
        timeout: float,
        limits: Limits | None = None,
    ) -> Frame:
        """Send one frame, return the reply frame.

        ``header`` + ``tensors`` are encoded here; or pass an already encoded frame (the buffer
        list of ``protocol.messages.make_*``) as ``header``. Raises :class:`PeerBusy`,
        :class:`PeerRejected` (``.reason``, ``.detail``, ``.score``), :class:`PeerUnreachable`,
        ``asyncio.TimeoutError`` (the whole exchange took longer than ``timeout`` s), or
        ``ProtocolError`` if the reply itself is malformed or breaks ``limits`` (default: the
        transport's). Cancelling the call resets the stream.
        """
        buffers = encode_reply((header, tensors))
        self.stats.requests[protocol_id] += 1
        async with asyncio.timeout(timeout):
            async with self._peer_slot(peer_id):
                reader, writer = await self._open(peer_id, protocol_id)
                reply = await self._exchange(peer_id, protocol_id, reader, writer, buffers, limits or self.limits)
        if reply is None:
            raise PeerUnreachable(f"{peer_id} closed the {protocol_id} stream without a reply")
        self._raise_if_reject(protocol_id, reply)
        return reply

    async def _exchange(
        self,
        peer_id: str,
        protocol_id: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        buffers: list,
        limits: Limits,
    ) -> Frame | None:
        # Read while writing: a busy or rejecting peer answers before it has read our frame and
        # closes its side; its reply is what the caller needs, not the broken pipe.
        write_task = asyncio.ensure_future(self._write(writer, protocol_id, buffers, "client"))
        read_task = asyncio.ensure_future(self._read_frame(reader, writer, protocol_id, limits, "client"))
        try:
            await asyncio.wait([write_task, read_task], return_when=asyncio.FIRST_COMPLETED)
            if not read_task.done() and write_task.exception() is not None:
                err = write_task.exception()
                if not isinstance(err, (ConnectionError, OSError)):
                    raise err
                # the peer stopped reading; a reject may still be on its way
                await asyncio.wait([read_task], timeout=1.0)
                if not read_task.done():
                    raise PeerUnreachable(f"{peer_id} closed the {protocol_id} stream: {err!r}")
            try:
                reply = await read_task
            except (ConnectionError, OSError) as e:
                raise PeerUnreachable(f"{peer_id} broke the {protocol_id} stream: {e!r}") from e
        except BaseException:
            abort_stream(writer)
            raise
        finally:
            for task in (write_task, read_task):
                if not task.done():
                    task.cancel()
            # retrieve exceptions so asyncio does not log them as never retrieved
            await asyncio.gather(write_task, read_task, return_exceptions=True)
        await close_stream(writer)
        return reply

    async def request_stream(
        self,
        peer_id: str,
        protocol_id: str,
        header: dict | list,
        tensors: Tensors = (),
        *,
        timeout: float,
        limits: Limits | None = None,
    ) -> AsyncIterator[Frame]:
        """Send one frame, then yield the reply frames until the server closes the stream.

        ``timeout`` bounds opening the stream, writing the request and the wait for each next
        frame (a long state download is fine as long as chunks keep coming). A ``reject`` frame
        raises as in :meth:`request`; a stream cut inside a frame raises :class:`PeerUnreachable`.
        Leaving the ``async for`` early (break, exception, cancellation) resets the stream.
        """
        buffers = encode_reply((header, tensors))
        self.stats.requests[protocol_id] += 1
        async with self._peer_slot(peer_id):
            async with asyncio.timeout(timeout):
                reader, writer = await self._open(peer_id, protocol_id)
            try:
                async with asyncio.timeout(timeout):
                    await self._write(writer, protocol_id, buffers, "client")
                while True:
                    try:
                        async with asyncio.timeout(timeout):
                            frame = await self._read_frame(reader, writer, protocol_id, limits or self.limits,
                                                           "client")
                    except (ConnectionError, OSError) as e:
                        raise PeerUnreachable(f"{peer_id} broke the {protocol_id} stream: {e!r}") from e
                    except ProtocolError as e:
                        if "stream ended" in e.detail:
                            raise PeerUnreachable(f"{peer_id} cut the {protocol_id} stream: {e.detail}") from e
                        raise
                    if frame is None:
                        break
                    self._raise_if_reject(protocol_id, frame)
                    yield frame
            except BaseException:
                abort_stream(writer)
                raise
            await close_stream(writer)

    def _raise_if_reject(self, protocol_id: str, frame: Frame) -> None:
        if frame.header.get("type") != "reject":
            return
        reason = str(frame.header.get("reason", "internal"))
        detail = str(frame.header.get("detail", ""))
        self.stats.rejects_received[(protocol_id, reason)] += 1
        if reason == Reason.BUSY.value:
            raise PeerBusy(f"{protocol_id}: {detail}" if detail else protocol_id)
        try:
            reply = parse_reply(frame)
            score, epoch = reply.score, reply.epoch
        except ProtocolError:  # a malformed reject still refuses; only its typed fields are not trusted
            score = epoch = None
        raise PeerRejected(reason, detail, score, epoch)

    @contextlib.asynccontextmanager
    async def _peer_slot(self, peer_id: str) -> AsyncIterator[None]:
        """At most ``max_streams_per_peer`` of our own calls to one peer at a time (callers wait,
        within their timeout), so we never provoke ``busy`` from a peer ourselves."""
        sem = self._outgoing.get(peer_id)
        if sem is None:
            sem = self._outgoing[peer_id] = asyncio.Semaphore(self.max_streams_per_peer)
        async with sem:
            yield

    async def _open(self, peer_id: str, protocol_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        from hivemind.p2p import PeerID
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

        try:
            pid = PeerID.from_base58(peer_id)
        except Exception as e:
            raise ValueError(f"not a peer id: {peer_id!r}") from e
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(pid, protocol_id)
        except P2PDaemonError as e:
            raise PeerUnreachable(f"cannot open {protocol_id} to {peer_id}: {e}") from e
        except (ConnectionError, OSError) as e:
            raise PeerUnreachable(f"the local p2pd is unreachable: {e!r}") from e
        return reader, writer

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

    async def _write(self, writer: asyncio.StreamWriter, protocol_id: str, buffers: list, role: str) -> None:
        """Write an encoded frame (``streams.write_frame``), counted."""
        n = await write_frame(writer, buffers)
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


async def start_daemon(*, host_maddrs: Sequence[str], announce_maddrs: Sequence[str], initial_peers: Sequence[str],
                       identity_path: str | os.PathLike | None, use_relay: bool, use_auto_relay: bool,
                       nat_port_map: bool, auto_nat: bool, startup_timeout: float,
                       trusted_relays: Sequence[str] = ()) -> Any:
    """A new ``hivemind.P2P`` (its own p2pd) with these switches.

    Loopback-only with NAT traversal and relays off is what tests and local swarms pass; a
    public node passes its ``--host-maddrs`` / ``--announce-maddrs`` and turns the switches on.
    ``identity_path`` must be a key written by ``swarm-node keygen`` (checked: mode 0600).
    """
    from hivemind.p2p import P2P

    static_relays_only()
    kwargs: dict[str, Any] = {}
    if identity_path is not None:
        from node.net.identity import check_identity

        check_identity(identity_path)
        kwargs["identity_path"] = os.fspath(identity_path)
        # hivemind's own check assumes RSA keys and spawns a second daemon; the node calls
        # node.net.identity.identity_in_use through its DHT instead.
        kwargs["check_if_identity_free"] = False
    return await P2P.create(
        initial_peers=list(initial_peers) or None, host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None, use_relay=use_relay, use_auto_relay=use_auto_relay,
        nat_port_map=nat_port_map, auto_nat=auto_nat, startup_timeout=startup_timeout,
        trusted_relays=list(trusted_relays) or None, **kwargs,
    )


def split_peer(maddr: str) -> tuple[str, str]:
    """(the address, the peer id) of a full multiaddr ``.../p2p/<id>``; ("", "") without one. The
    LAST /p2p/ names the peer: a relayed address is /ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/PEER."""
    head, sep, peer_id = maddr.rstrip("/").rpartition("/p2p/")
    return (head, peer_id) if sep else ("", "")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _multiaddr_bytes(text: str) -> bytes:
    """The binary multiaddr p2pd expects for ``text``, which may name peers inside it (a relay:
    ``/ip4/R/tcp/P/p2p/RELAY/p2p-circuit``). hivemind's multiaddr library writes a ``/p2p/`` value
    as a CID, which p2pd cannot read ("length greater than remaining number of bytes"); the
    multiaddr spec's form is the peer id's multihash, written here."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    out, rest = b"", text
    while "/p2p/" in rest:
        before, _, after = rest.partition("/p2p/")
        peer, slash, rest = after.partition("/")
        rest = slash + rest
        if before:
            out += Multiaddr(before).to_bytes()
        mh = PeerID.from_base58(peer).to_bytes()
        out += _varint(421) + _varint(len(mh)) + mh
    return out + (Multiaddr(rest).to_bytes() if rest else b"")


def static_relays_only() -> None:
    """Make p2pd take ``trusted_relays`` as its only relays (``-relayDiscovery=0``).

    hivemind passes ``-trustedRelays`` but not p2pd's ``-relayDiscovery`` switch, which defaults
    to on; with it on, p2pd's auto-relay waits for four relay candidates from its DHT or for its
    three-minute boot delay before it reserves a slot anywhere, so a node behind NAT stays
    unreachable for minutes in a small swarm. With static relays it reserves at one of them as
    soon as AutoNAT reports it private (about 15 s after start, measured in the network lab).
    Patches ``hivemind.P2P``'s argument builder of this process (idempotent); it changes nothing
    for a daemon started without trusted relays."""
    from hivemind.p2p import P2P

    build = P2P._make_process_args
    if getattr(build, "_static_relays", False):
        return

    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays") and kwargs.get("autoRelay"):
            kwargs.setdefault("relayDiscovery", 0)
        return build(*args, **kwargs)

    make_process_args._static_relays = True  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(make_process_args)
