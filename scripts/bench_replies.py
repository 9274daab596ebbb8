"""Replies lost between two nodes: does a reply reach the requester when the responder closes its
stream at once, or only after the requester closed? (docs/PROTOCOL.md, "Ending a stream").

One process, three go-libp2p daemons on loopback: a requester and two responders serving
``/swarm-node/health/1``, one closing each stream as soon as its reply is written (what the node
did before), one waiting for the requester's close first (``Transport.linger_after_reply``, what
it does now). The requester sends ``--n`` requests to each, ``--concurrency`` at a time,
interleaved, and counts the replies that never arrived ("closed the stream without a reply").
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def bench(n: int, concurrency: int) -> dict:
    from node.net import PeerUnreachable, Transport
    from protocol import HEALTH, make_health, make_health_request, validate_health_request

    requester = await Transport.start()
    responders = {"close_at_once": await Transport.start(linger_after_reply=False),
                  "wait_for_close": await Transport.start()}
    try:
        for name, node in responders.items():
            async def health(frame, peer, name=name):
                validate_health_request(frame)
                return make_health({"responder": name})

            await node.serve(HEALTH, health)
            await requester.connect((await node.visible_maddrs())[0])
        counts = {name: {"ok": 0, "lost": 0, "other": 0} for name in responders}
        sem = asyncio.Semaphore(concurrency)

        async def one(name: str) -> None:
            async with sem:
                try:
                    await requester.request(responders[name].peer_id, HEALTH, make_health_request(), timeout=30)
                    counts[name]["ok"] += 1
                except PeerUnreachable as e:
                    counts[name]["lost" if "without a reply" in str(e) else "other"] += 1
                except Exception:  # noqa: BLE001 - counted, the run goes on
                    counts[name]["other"] += 1

        t0 = time.monotonic()
        await asyncio.gather(*[one(name) for _ in range(n) for name in responders])
        wall = time.monotonic() - t0
    finally:
        for node in [requester, *responders.values()]:
            await node.close()
    return {
        "lost": {name: c["lost"] for name, c in counts.items()},
        "lost_per_1000": {name: round(1000 * c["lost"] / n, 3) for name, c in counts.items()},
        "counts": counts,
        "settings": {"requests_per_responder": n, "concurrency": concurrency, "protocol": HEALTH,
                     "wall_s": round(wall, 1)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="requests to each responder")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at a time")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(bench(args.n, args.concurrency))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
