"""A py-libp2p requester for the stream-ending tests (tests/test_stream_ending.py): for each
``--mode`` in turn it sends one kind of request ``--n`` times, each on its own stream, and prints
one JSON object with what came back on each (``{mode: [outcome, ...]}``).

Run as ``python -m tests.helpers.libp2p_requester MULTIADDR --mode MODE [--mode MODE ...] [--n N]`` in its own
process: py-libp2p (Trio) and hivemind never share one (see node/net/probe_libp2p.py). Modes:

- ``keep``: write a ``health-request``, read the reply, then close (what docs/PROTOCOL.md asks);
- ``half-close``: write a ``health-request``, close the write side at once, then read;
- ``garbage``: write 16 bytes that are not a frame and keep the write side open;
- ``truncated``: write the first half of a ``health-request`` frame, then close the write side
  (the stream ends inside the frame).

Each outcome is ``{"reply": TYPE, "reason": REASON}`` when a reply frame arrived, or
``{"error": KIND}`` when none did: ``reset`` (the node's side reset the stream), ``eof`` (it
ended without a byte) or ``cut`` (it ended inside a reply frame).
"""

from __future__ import annotations

import argparse
import json
import sys

from node.net.probe_libp2p import FrameError, NoReply, encode, read_frame
from protocol import HEALTH

MODES = ("keep", "half-close", "garbage", "truncated")


async def run(maddr: str, modes: list[str], n: int, timeout: float) -> dict:
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
    from libp2p.custom_types import TProtocol
    from libp2p.host.exceptions import StreamFailure
    from libp2p.network.stream.exceptions import StreamError, StreamReset
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE
    from libp2p.security.noise.transport import Transport as Noise
    from libp2p.stream_muxer.exceptions import MuxedStreamError

    request = encode({"type": "health-request"})
    payloads = {"keep": request, "half-close": request, "garbage": b"NOT A FRAME AT 1",
                "truncated": request[: len(request) // 2]}
    info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
    key = create_new_key_pair()
    host = new_host(key_pair=key, sec_opt={NOISE: Noise(key, noise_privkey=create_x25519().private_key)},
                    muxer_preference="YAMUX")
    results: dict[str, list[dict]] = {}
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        with trio.fail_after(timeout):
            await host.connect(info)
            for mode, _ in [(m, i) for m in modes for i in range(n)]:
                outcomes = results.setdefault(mode, [])
                stream = await host.new_stream(info.peer_id, [TProtocol(HEALTH)])
                try:
                    await stream.write(payloads[mode])
                    if mode in ("half-close", "truncated"):
                        await stream.close_write()
                    header = await read_frame(stream)
                    outcomes.append({"reply": header.get("type"), "reason": header.get("reason")})
                except (StreamReset, StreamFailure, MuxedStreamError):
                    outcomes.append({"error": "reset"})
                except NoReply:
                    outcomes.append({"error": "eof"})
                except (FrameError, StreamError) as e:
                    outcomes.append({"error": "cut", "detail": f"{type(e).__name__}: {e}"})
                finally:
                    try:
                        await stream.close()
                    except Exception:  # noqa: BLE001 - already reset or closed
                        pass
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.libp2p_requester")
    parser.add_argument("maddr")
    parser.add_argument("--mode", choices=MODES, action="append", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args(argv)
    import trio

    print(json.dumps(trio.run(run, args.maddr, args.mode, args.n, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
