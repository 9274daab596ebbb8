"""The py-libp2p side of ``swarm-node probe``: a second, independent libp2p stack dials a node.

Run as ``python -m node.net.probe_libp2p MULTIADDR [--run RUN] [--timeout S]``; prints one JSON
object to stdout. ``node.net.probe`` starts it as a subprocess, because py-libp2p (Trio) and hivemind
(asyncio, go-libp2p daemon) register the same protobuf symbols and can never share a process.
Never import hivemind (or node.net.p2p) here.

The frames are written from the byte-level spec (docs/PROTOCOL.md), not with ``protocol/``'s
encoder: ``b"SWN1"``, u32 big-endian header length, msgpack header, raw little-endian tensor
bytes. So the probe checks two things at once: that another libp2p implementation can reach the
node over Noise + yamux, and that the node's framing is what the spec says. Only the names come
from ``protocol/`` (the stream protocol ids and the version, defined there once); ``protocol``
imports torch, msgpack and numpy, never hivemind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import struct
import sys
import time

import msgpack

from protocol import FWD, HEALTH
from protocol import PROTOCOL_VERSION as VERSION

MAGIC = b"SWN1"  # written out from the spec on purpose (see above), not protocol.frames.MAGIC
MAX_REPLY_HEADER = 64 * 1024
MAX_REPLY_BODY = 1 << 20  # health/ack/reject carry no tensors; allow a little


def encode(header: dict, tensors: list[tuple[str, str, list[int], bytes]] = ()) -> bytes:
    """A frame from the spec: tensors as (name, dtype, shape, little-endian C-order bytes)."""
    table = [{"name": n, "dtype": d, "shape": s} for n, d, s, _ in tensors]
    body = b"".join(b for *_, b in tensors)
    head = msgpack.packb({"v": VERSION, **header, "tensors": table, "body_len": len(body)}, use_bin_type=True)
    return MAGIC + struct.pack(">I", len(head)) + head + body


class FrameError(Exception):
    pass


class NoReply(FrameError):
    """The stream ended before the first byte of a reply."""


async def read_frame(stream) -> dict:
    """Read one reply frame and return its header (bodies are skipped, bounded)."""
    buf = bytearray()

    async def fill(n: int) -> None:
        while len(buf) < n:
            try:
                chunk = await stream.read(n - len(buf))
            except EOFError:
                chunk = b""
            if not chunk:
                raise (NoReply if not buf else FrameError)(f"stream ended after {len(buf)} of {n} bytes")
            buf.extend(chunk)

    await fill(8)
    if bytes(buf[:4]) != MAGIC:
        raise FrameError(f"reply does not start with {MAGIC!r}: {bytes(buf[:4])!r}")
    (hlen,) = struct.unpack(">I", bytes(buf[4:8]))
    if not 0 < hlen <= MAX_REPLY_HEADER:
        raise FrameError(f"reply header length {hlen} out of range")
    await fill(8 + hlen)
    header = msgpack.unpackb(bytes(buf[8 : 8 + hlen]), raw=False)
    if not isinstance(header, dict):
        raise FrameError("reply header is not a map")
    body_len = header.get("body_len", 0)
    if not isinstance(body_len, int) or not 0 <= body_len <= MAX_REPLY_BODY:
        raise FrameError(f"reply body_len {body_len!r} out of range")
    await fill(8 + hlen + body_len)
    return header


async def probe(maddr: str, run: str, timeout: float) -> dict:
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
    from libp2p.custom_types import TProtocol
    from libp2p.host.exceptions import StreamFailure
    from libp2p.network.stream.exceptions import StreamReset
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE
    from libp2p.security.noise.transport import Transport as Noise

    out: dict = {"maddr": maddr, "implementation": "py-libp2p", "security": str(NOISE), "muxer": "/yamux/1.0.0"}
    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
    except Exception as e:
        out.update(reachable=False, error=f"bad multiaddr {maddr!r}: {e}; it must end in /p2p/<peer id>")
        return out
    out["peer_id"] = info.peer_id.to_base58()
    key = create_new_key_pair()
    host = new_host(
        key_pair=key,
        sec_opt={NOISE: Noise(key, noise_privkey=create_x25519().private_key)},  # Noise only
        muxer_preference="YAMUX",
    )
    out["probe_peer_id"] = host.get_id().to_base58()
    step = "connect"

    async def request(protocol: str, frame: bytes) -> dict:
        """One request stream. A stream that is reset (while its protocol is being negotiated,
        py-libp2p's ``StreamFailure``, or after), or ends before the first byte of a reply, is
        retried once on a new stream and reported in ``retried``. Which of the three a reset
        shows as depends on timing: whether it reaches us before or after py-libp2p has finished
        negotiating the stream's protocol. (Rarely, the first
        stream py-libp2p opens to a node that has just started is reset before its reply is
        read: about 1 in 30 fresh nodes on loopback; a second stream on the same connection then
        works. A node that does it to every stream still fails the probe.)"""
        async def once() -> dict:
            stream = await host.new_stream(info.peer_id, [TProtocol(protocol)])
            try:
                await stream.write(frame)
                return await read_frame(stream)
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()

        try:
            return await once()
        except (StreamFailure, StreamReset, NoReply) as e:
            out.setdefault("retried", []).append(f"{step}: {type(e).__name__}: {e}".rstrip(": "))
        return await once()

    try:
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(timeout):
                t0 = time.perf_counter()
                await host.connect(info)
                out["connect_ms"] = round(1000 * (time.perf_counter() - t0), 2)
                out["reachable"] = True

                step = "health"
                t0 = time.perf_counter()
                reply = await request(HEALTH, encode({"type": "health-request"}))
                out["health"] = {
                    "rtt_ms": round(1000 * (time.perf_counter() - t0), 2),
                    "type": reply.get("type"),
                    "version": reply.get("v"),
                    "status": reply.get("status"),
                }

                step = "fwd"
                me = out["probe_peer_id"]
                ids = struct.pack("<q", 0)
                c = struct.pack("<8f", *([0.0] * 8))
                frame = encode(
                    {
                        "type": "fwd", "run": run, "manifest": "0" * 64, "mb": 0, "stage": 0,
                        "version": 0, "route": [me], "codec": "subspace", "sent_ms": int(time.time() * 1000),
                    },
                    [("ids", "int64", [1, 1], ids), ("c", "float32", [1, 1, 8], c)],
                )
                t0 = time.perf_counter()
                reply = await request(FWD, frame)
                out["fwd"] = {
                    "rtt_ms": round(1000 * (time.perf_counter() - t0), 2),
                    "run": run,
                    "type": reply.get("type"),
                    "reason": reply.get("reason"),
                    "detail": reply.get("detail"),
                }
    except trio.TooSlowError:
        out.setdefault("reachable", False)
        out["error"] = f"{step}: no answer within {timeout:g} s"
    except Exception as e:  # report, never traceback: the parent prints our JSON
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # Trio nurseries wrap errors
            e = e.exceptions[0]
        out.setdefault("reachable", False)
        out["error"] = f"{step}: {type(e).__name__}: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.net.probe_libp2p")
    parser.add_argument("maddr")
    parser.add_argument("--run", default=None, help="run id for the fwd frame (default: a surely wrong one)")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    import trio

    run = args.run or f"swarm-node-probe-{secrets.token_hex(4)}"
    result = trio.run(probe, args.maddr, run, args.timeout)
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
