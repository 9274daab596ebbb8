"""How a request stream may end (docs/PROTOCOL.md, "Ending a stream"), tried with py-libp2p (another
libp2p implementation, in its own process) against our hivemind/go-libp2p node.

The node's libp2p side is go-libp2p-daemon (p2pd): it hands each inbound stream to the node over a
unix socket and closes that socket in both directions when the requester closes its write side.
So a requester that keeps its write side open until it has read the reply always gets it; one
that half-closes first gets the whole reply or none (whether the node wrote it before p2pd saw
the half-close), never a part of one; and a frame cut short by the requester's half-close gets no
reply at all (the ``bad-frame`` reject the node writes has nowhere to go).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from node.net import Transport
from protocol import HEALTH, make_health, validate_health_request

N = 20


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_requests_that_keep_or_close_their_write_side():
    from tests.helpers.procs import assert_no_p2pd_left

    node = await Transport.start()
    served = []
    try:
        async def health(frame, peer):
            validate_health_request(frame)
            served.append(peer)
            return make_health({"peer": node.peer_id, "n": len(served)})

        await node.serve(HEALTH, health)
        maddr = (await node.visible_maddrs())[0]
        modes = ["keep", "half-close", "garbage", "truncated", "keep"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.libp2p_requester", maddr, *[a for m in modes for a in ("--mode", m)],
            "--n", str(N), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 150)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()[-3000:]
        got = json.loads(out)
        print({mode: [o.get("reply") or o["error"] for o in outcomes] for mode, outcomes in got.items()})
        # "keep" ran twice into one list: before and after the half-closed and broken streams
        assert got["keep"] == [{"reply": "health", "reason": None}] * (2 * N)
        assert got["garbage"] == [{"reply": "reject", "reason": "bad-frame"}] * N
        # a half-closing requester: the whole reply or none, never part of one
        for o in got["half-close"]:
            assert o in ({"reply": "health", "reason": None}, {"error": "reset"}, {"error": "eof"}), o
        # a frame cut short by a half-close: no reply, never anything that looks like one
        assert all(o in ({"error": "reset"}, {"error": "eof"}) for o in got["truncated"]), got["truncated"]
        # every complete request reached the handler, whatever became of its reply
        assert len(served) == 3 * N
        assert node.stats.handler_errors == 0
    finally:
        await node.close()
    assert_no_p2pd_left()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_responder_closes_only_after_the_requester():
    """Our node keeps a stream it answered open until the requester closes it (at most
    ``streams.LINGER_S``): closing first lets p2pd reset the stream, and a reset can discard the
    reply before the requester's daemon passed it on (scripts/bench_replies.py counts that)."""
    from node.net.streams import LINGER_S, read_frame
    from protocol import Limits, make_health_request
    from tests.helpers.procs import assert_no_p2pd_left

    a, b = await Transport.start(), await Transport.start()
    try:
        async def health(frame, peer):
            validate_health_request(frame)
            return make_health({"peer": b.peer_id})

        await b.serve(HEALTH, health)
        await a.connect((await b.visible_maddrs())[0])
        for close_first in (False, True):
            b.linger_after_reply = not close_first
            reader, writer = await a._open(b.peer_id, HEALTH)
            writer.writelines(make_health_request())
            await writer.drain()
            reply, _ = await read_frame(reader, writer, Limits())
            assert reply.header["type"] == "health"
            t0 = asyncio.get_running_loop().time()
            try:  # what follows the reply: the responder's end of stream, or nothing until we close
                rest = await asyncio.wait_for(reader.read(1), timeout=min(1.0, LINGER_S / 2))
            except TimeoutError:
                rest = None
            waited = asyncio.get_running_loop().time() - t0
            writer.close()
            if close_first:
                assert rest == b"" and waited < 1.0  # the old way: closed right after the reply
            else:
                assert rest is None  # still open: it waits for us
        assert await _until(lambda: not b._tasks, 10), "the responder did not finish after our close"
    finally:
        await a.close()
        await b.close()
    assert_no_p2pd_left()


async def _until(cond, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()
