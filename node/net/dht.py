"""The DHT process: start ``hivemind.DHT`` (and its ``p2pd``) bootstrapped from the initial peers
with retries, and stop it without leaving a ``p2pd`` behind.

The DHT runs in a child process (hivemind's design) that starts its own ``p2pd``; the node's
stream transport shares that daemon through ``await dht.replicate_p2p()``. ``SwarmDHT``
(``node.net.hivemind_patches``) makes both children die with the node even on ``kill -9``
(Linux parent-death signal). What the node keeps in the DHT is ``node.net.membership``'s.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import hivemind

from node.base import children_of
from node.net.connections import free_tcp_port
from node.net.hivemind_patches import SwarmDHT
from node.net.reach import unreachable_line
from node.net.records import ForgeryCounter, RunScope, SwarmRecordValidator
from security import PeerKey

log = logging.getLogger("swarm_node.dht")


class BootstrapError(Exception):
    """No initial peer answered; the message names them and the fix."""


class IdentityInUse(Exception):
    """Another online peer already uses this identity key."""


def p2p_options(local: bool, initial_peers: list[str] | tuple = ()) -> dict:
    """hivemind P2P options: loopback swarms switch off NAT port mapping, relays and AutoNAT.

    A public node has all of them: it relays for others (circuit relay v2, p2pd's relay service),
    answers AutoNAT dial-backs and hole-punches (p2pd enables DCUtR with AutoNAT), maps a port
    by UPnP/NAT-PMP where the router offers it, and runs auto-relay with its initial peers as
    static relays: when AutoNAT finds that nobody can dial it (behind NAT), it reserves a slot at
    one of them and announces ``/p2p/<relay>/p2p-circuit`` addresses, which the other nodes dial
    (docs/NODE.md, "Behind NAT")."""
    if local:
        return dict(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)
    opts = dict(use_relay=True, use_auto_relay=False, auto_nat=True, nat_port_map=True)
    if initial_peers:
        opts.update(use_auto_relay=True, trusted_relays=list(initial_peers))
    return opts


def start_dht(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    identity_path: str | None = None,
    local: bool = False,
    retries: int = 4,
    timeout: float = 15.0,
    retry_delay: float = 1.0,
    forgeries: ForgeryCounter | None = None,
    daemon_metrics: bool | None = None,
    scope: RunScope | None = None,
) -> SwarmDHT:
    """Start the DHT (and its p2pd), bootstrapping from ``initial_peers`` with retries.

    Every record passes ``records.SwarmRecordValidator``: this node's own announcements are signed
    with the key in ``identity_path`` (a node started without one validates only), and forged ones
    are refused and counted in ``forgeries``. Raises ``BootstrapError`` naming the peers and the fix
    when none answers after ``retries`` attempts, ``IdentityInUse`` when the key's peer id is
    already online. Call from the main thread.

    ``scope``: the run this node is in (``RunScope.of(manifest)``): under that run's keys its
    validator takes only the record type each key is for; without one (a bootstrap peer, which
    serves any run) it checks every record's form, bounds, key and signature alone.

    ``daemon_metrics``: p2pd serves its own Prometheus metrics on a free loopback port
    (``dht.daemon_metrics_url``); default: when hole punching is on (``auto_nat``), since its
    outcomes are what the node re-exports from there. The port is picked free just before the
    daemon starts; should another process take it meanwhile, p2pd only logs that and runs on
    without the endpoint, and the node reports no hole-punch numbers.
    """
    if daemon_metrics is None:
        daemon_metrics = bool(p2p_options(local)["auto_nat"])
    key = PeerKey(open(identity_path, "rb").read()) if identity_path else None
    kwargs = dict(
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        identity_path=identity_path or None,
        record_validators=[SwarmRecordValidator(key, forgeries, scope)],
        startup_timeout=timeout,
        bootstrap_timeout=min(timeout, 5.0),
        wait_timeout=3,
        shutdown_timeout=5,
        # hivemind's own check assumes RSA keys and spawns a second daemon; `swarm-node run`
        # checks with node.net.presence.anonymous_identity_in_use before starting the DHT
        check_if_identity_free=False,
        **p2p_options(local, initial_peers),
    )
    last: Exception | None = None
    for attempt in range(max(1, retries)):
        dht = SwarmDHT(initial_peers=initial_peers or None, start=False, **kwargs)
        if daemon_metrics:
            dht.daemon_metrics_addr = f"127.0.0.1:{free_tcp_port()}"
        try:
            dht.run_in_background(await_ready=True, timeout=timeout + 5)
            return dht
        except Exception as e:  # noqa: BLE001 - classified below, re-raised with the fix
            last = e
            _stop(dht)
            text = str(e)
            if "already taken" in text or "identity" in text.lower() and "taken" in text.lower():
                raise IdentityInUse(
                    f"identity {identity_path} is already online in this swarm (peer id in use); "
                    "stop the other node or use another key (swarm-node keygen)"
                ) from None
            # p2pd connects to its initial peers before it says it is ready: a start that ends in
            # "failed to connect to bootstrap peers", or that times out (a peer that never answers
            # or never completes the libp2p handshake), is a reachability problem
            reach = "bootstrap" in text.lower() or "failed to start in" in text or isinstance(e, TimeoutError)
            if not initial_peers or not reach:
                raise  # not a reachability problem: retrying will not help
            log.warning("bootstrap attempt %d/%d failed: %s", attempt + 1, retries, text.strip()[:200])
            if attempt + 1 < retries:
                time.sleep(retry_delay * 2**attempt)
    log.info("p2pd's last word: %s", str(last).strip()[:300])
    raise BootstrapError(unreachable_line(initial_peers, max(1, retries)))


def _stop(dht: hivemind.DHT) -> None:
    try:
        if dht.is_alive():
            dht.shutdown()
    except Exception:  # noqa: BLE001 - best effort on a failed start
        pass
    if dht.is_alive():
        dht.terminate()
        dht.join(3)


def stop_dht(dht: hivemind.DHT, timeout: float = 5.0) -> None:
    """Shut the DHT process and its p2pd down; kill leftovers by pid if they do not go in time."""
    pid = dht.pid
    daemons = children_of(pid) if pid else []
    try:
        dht.shutdown()
    except Exception:  # noqa: BLE001
        pass
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout)
    deadline = time.monotonic() + timeout
    for d in daemons:
        while time.monotonic() < deadline:
            try:
                os.kill(d, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(d, signal.SIGKILL)
            except ProcessLookupError:
                pass


def dht_result(future, timeout: float, what: str):
    """The result of a hivemind DHT call made with ``return_future=True``, waited for at most
    ``timeout`` seconds: a DHT that does not answer is one ``TimeoutError`` naming the call
    (``what``), and the call is cancelled."""
    try:
        return future.result(timeout)
    except TimeoutError:  # concurrent.futures.TimeoutError is this one
        future.cancel()
        raise TimeoutError(f"the DHT did not answer the {what} within {timeout:g} s") from None
