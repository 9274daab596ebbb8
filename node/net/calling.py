"""The calling side of the stream transport: one request, one reply frame (``request``), or one
request and a stream of reply frames (``request_stream``), and the errors a call raises.

A reply ``reject`` becomes :class:`PeerRejected` (``busy``: :class:`PeerBusy`, so a router can
pick another replica at once); a peer we cannot reach, or a stream that breaks before a complete
reply, :class:`PeerUnreachable`. At most ``max_streams_per_peer`` of our own calls go to one peer
at a time, so we never provoke ``busy`` ourselves.

``Calling`` is the half of ``node.net.p2p.Transport`` that does this; it uses the transport's
``p2p``, ``limits``, ``stats``, ``max_streams_per_peer`` and frame I/O (``_read_frame``,
``_write``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from node.net.streams import abort_stream, close_stream, encode_reply
from protocol import Frame, Limits, ProtocolError, Reason, parse_reply

Tensors = Sequence[tuple[str, Any]]


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


class Calling:
    """Requests to other peers: the calling half of ``node.net.p2p.Transport``."""

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
        write_task = asyncio.ensure_future(self._write(writer, protocol_id, buffers, "client", peer_id))
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
                    await self._write(writer, protocol_id, buffers, "client", peer_id)
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

