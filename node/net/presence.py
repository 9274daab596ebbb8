"""Is an identity already online? Two daemons with one peer id break routing for both, so
``swarm-node run`` asks the swarm before it starts its own daemon with its key: a throwaway daemon
with a random identity dials the key's peer id (``anonymous_identity_in_use``).

The key files themselves are ``node.net.identity``'s; this module needs a daemon
(``node.net.p2p``).
"""

from __future__ import annotations

import asyncio
import logging
import os

from node.net.identity import check_identity
from node.net.p2p import Transport

log = logging.getLogger("swarm_node.identity")


async def identity_in_use(p2p_or_transport, peer_id: str, maddrs=(), *, timeout: float = 5.0) -> bool:
    """Whether a peer with ``peer_id`` is online: try to dial it through ``p2p_or_transport``.

    ``maddrs`` are addresses to try (e.g. where this identity was last seen); with none, the
    daemon looks the peer up in the libp2p DHT it bootstrapped from its initial peers. Call it
    from a daemon that does *not* use this identity (e.g. ``anonymous_identity_in_use``).
    A dial that fails or takes longer than ``timeout`` seconds means "not in use".
    """
    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
    from hivemind.utils.multiaddr import Multiaddr

    p2p = getattr(p2p_or_transport, "p2p", p2p_or_transport)
    if p2p.peer_id.to_base58() == peer_id:
        raise ValueError("identity_in_use must dial from a daemon with a different peer id")
    addrs = []
    for m in maddrs:
        ma = Multiaddr(str(m))
        if "p2p" in [p.name for p in ma.protocols()]:
            if ma.value_for_protocol("p2p") != peer_id:
                continue
            ma = ma.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
        addrs.append(ma)
    try:
        async with asyncio.timeout(timeout):
            await p2p._client.connect(PeerID.from_base58(peer_id), addrs)
    except (P2PDaemonError, TimeoutError, ConnectionError, OSError):
        return False
    return True


async def anonymous_identity_in_use(
    identity_path: str | os.PathLike, initial_peers, *, timeout: float = 5.0, **start_kwargs
) -> bool | None:
    """Start a throwaway daemon with a random identity, bootstrapped from ``initial_peers``, and
    ask :func:`identity_in_use` about the peer id of ``identity_path``. For ``swarm-node run``
    before it starts its own daemon with that identity. None (logged) when the question could
    not be asked: the throwaway daemon did not start, e.g. it reached none of ``initial_peers``
    (the caller's own join then retries them and reports that failure in one line)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    peer_id = check_identity(identity_path)
    if not initial_peers:
        return False  # a first node of a swarm has nobody to collide with
    try:
        transport = await Transport.start(initial_peers=list(initial_peers), **start_kwargs)
    except (P2PDaemonError, OSError) as e:
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log.info("could not ask the swarm whether identity %s is online: %s", identity_path, text[:300])
        return None
    try:
        return await identity_in_use(transport, peer_id, (), timeout=timeout)
    finally:
        await transport.close()
