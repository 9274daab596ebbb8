"""The go-libp2p daemon (``p2pd``) under hivemind: start one with the node's switches, name the
peer in a full multiaddr, and write a multiaddr the way p2pd reads it.

hivemind is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from node.net.identity import check_identity


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

    from node.net.hivemind_patches import static_relays_only

    static_relays_only()
    kwargs: dict[str, Any] = {}
    if identity_path is not None:
        check_identity(identity_path)
        kwargs["identity_path"] = os.fspath(identity_path)
        # hivemind's own check assumes RSA keys and spawns a second daemon; the node calls
        # node.net.presence.identity_in_use through its DHT instead.
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


def daemon_multiaddr(text: str) -> Any:
    """``text`` as the multiaddr object hivemind hands to p2pd, which may name peers inside it (a
    relay: ``/ip4/R/tcp/P/p2p/RELAY/p2p-circuit``). hivemind's own multiaddr library writes a
    ``/p2p/`` value as a CID, which p2pd cannot read ("length greater than remaining number of
    bytes"); the ``multiaddr`` package (a dependency of py-libp2p) writes the multiaddr spec's
    form, the peer id's multihash, and hivemind's object is built from those bytes. Raises
    ``ValueError`` for text that is not a multiaddr."""
    from hivemind.utils.multiaddr import Multiaddr
    from multiaddr import Multiaddr as SpecMultiaddr

    return Multiaddr(SpecMultiaddr(text).to_bytes())
