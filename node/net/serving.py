"""The serving side of the stream transport: answer each stream of a protocol with one reply
frame (``serve``) or a stream of them (``serve_stream``), never letting one stream take the node
down.

Backpressure is explicit: a server that already runs ``max_streams_per_peer`` exchanges for one
peer, or ``max_inflight_handlers`` in total, answers ``reject``/``busy`` at once without reading
the request. A stream that delivers no complete request frame within ``read_timeout`` seconds is
dropped; a handler's ``ProtocolError`` becomes a ``reject`` with its reason, any other failure
``reject``/``internal``. After a reply the server waits (bounded) for the requester's close
before closing (``linger_after_reply``; docs/REFERENCES.md §7).

``Serving`` is the half of ``node.net.p2p.Transport`` that does this; it uses the transport's
``p2p``, ``limits``, ``stats``, counters and frame I/O (``_read_frame``, ``_write``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from node.net.streams import abort_stream, close_stream, encode_reply, linger_close
from protocol import Frame, Limits, ProtocolError, Reason, make_reject

logger = logging.getLogger(__name__)

# a reply: (header, [(name, tensor), ...]) or an encoded frame (the buffer list of protocol.messages.make_*)
Handler = Callable[[Frame, str], Any]  # -> reply | Awaitable[reply]
StreamHandler = Callable[[Frame, str], AsyncIterator[Any]]  # yields replies


class Serving:
    """Answering other peers' streams: the serving half of ``node.net.p2p.Transport``."""

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
            await self._write(writer, protocol_id, encode_reply(reply), "server", peer)

        await self._register(protocol_id, respond, limits)

    async def serve_stream(
        self, protocol_id: str, handler: StreamHandler, *, limits: Limits | None = None
    ) -> None:
        """Answer each stream of ``protocol_id`` with every frame ``handler(frame, peer)`` yields
        (same forms as for :meth:`serve`), then close it (``/swarm-node/state/1``)."""

        async def respond(frame: Frame, peer: str, writer: asyncio.StreamWriter) -> None:
            async for reply in handler(frame, peer):
                await self._write(writer, protocol_id, encode_reply(reply), "server", peer)

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
