"""node/net/: networking — the libp2p stream transport, identity keys, the DHT process, membership
and the manifest check, routing, state sync for joiners, replica averaging, the py-libp2p probe,
and every patch of hivemind's behaviour (``hivemind_patches.py``). Above ``node.base``, below
``node.runtime``.

The names other rooms may use; each module is imported on first use of one of its names, so
``import node.net`` pulls in no hivemind (the py-libp2p probe process must never load it)."""

from node import lazy_face

# name -> the module that defines it; loaded on first use, so importing this package
# imports nothing heavy (hivemind, py-libp2p) until a name that needs it is used
_EXPORTS = {
    "Verified": "node.net.state_verify",
    "fetch_verified": "node.net.state_verify",
    "ForgeryCounter": "node.net.records",
    "RunScope": "node.net.records",
    "ephemeral_identity": "node.net.identity",
    "run_namespace": "node.net.membership",
    "BootstrapError": "node.net.dht",
    "CapacityMeter": "node.net.routing",
    "ConnectionTracker": "node.net.connections",
    "DaemonMetrics": "node.net.connections",
    "is_relayed": "node.net.connections",
    "poll_connections": "node.net.connections",
    "IdentityInUse": "node.net.dht",
    "ManifestMismatch": "node.net.membership",
    "Membership": "node.net.membership",
    "PeerBusy": "node.net.calling",
    "PeerRecord": "node.net.membership",
    "MAX_MADDRS": "node.net.membership",
    "PeerRejected": "node.net.calling",
    "PeerUnreachable": "node.net.calling",
    "ReplicaAverager": "node.net.averaging",
    "Router": "node.net.routing",
    "StateSyncError": "node.net.state_sync",
    "Transport": "node.net.p2p",
    "anonymous_identity_in_use": "node.net.presence",
    "averaging_prefix": "node.net.averaging",
    "check_identity": "node.net.identity",
    "choose_stage": "node.net.membership",
    "copy_state": "node.net.state_sync",
    "fetch_from_replicas": "node.net.state_sync",
    "p2p_options": "node.net.dht",
    "parameters_of": "node.net.state_sync",
    "serve_state": "node.net.state_sync",
    "start_daemon": "node.net.p2pd",
    "dht_result": "node.net.dht",
    "start_dht": "node.net.dht",
    "start_failure_line": "node.net.reach",
    "stop_dht": "node.net.dht",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_face(__name__, _EXPORTS, globals())
