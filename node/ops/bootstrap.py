"""`swarm-node bootstrap`: a DHT-only entry peer. It holds no stage and trains nothing; it gives
new nodes a first address to dial (``--initial-peers``) and stores DHT records like any peer.

It prints its full multiaddrs (one per line, each starting with ``/``) as soon as it is ready,
then runs until SIGTERM/SIGINT and leaves cleanly (p2pd stopped, exit 0). With ``--manifest``
it also publishes that run's manifest, so the first stage node is already checked against it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from node.base import CliError

log = logging.getLogger("swarm_node.bootstrap")


def add_arguments(p) -> None:
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                   help="multiaddr(s) to listen on (default /ip4/0.0.0.0/tcp/31337; /ip4/127.0.0.1/tcp/0 with --local)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="public multiaddr(s) to announce (behind a port forward)")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="other bootstrap peers to connect to (optional)")
    p.add_argument("--identity", default="", help="identity key file (swarm-node keygen) so the multiaddr stays stable")
    p.add_argument("--local", action="store_true", help="loopback only: no NAT port mapping, relay or AutoNAT")
    p.add_argument("--manifest", default="", help="also publish this run manifest (a file or a shipped name)")
    p.add_argument("--organiser", default="", metavar="FINGERPRINT",
                   help="publish the manifest only if the organiser with this key fingerprint signed it")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="LOCAL SWARMS ONLY: publish an unsigned --manifest (refused unless every --host-maddrs and "
                        "--initial-peers is loopback, or --local, and nothing is announced), as `run` does")
    p.add_argument("--maddrs-file", default="", help="also write the multiaddrs to this file (one per line)")


def main(args) -> int:
    from node.ops.startup import run_and_exit

    return run_and_exit(_main, args)


def _main(args) -> int:
    from node.net import check_identity
    from node.ops.config import check_local_only, tcp_ports
    from node.ops.startup import check_port_free, check_signed

    host = args.host_maddrs or (["/ip4/127.0.0.1/tcp/0"] if args.local else ["/ip4/0.0.0.0/tcp/31337"])
    for m in list(host) + list(args.announce_maddrs) + list(args.initial_peers):
        if not m.startswith("/"):
            raise CliError(f"multiaddr {m!r} must start with '/', e.g. /ip4/0.0.0.0/tcp/31337")
    for h, port in tcp_ports(host):
        check_port_free(h, port, "listen", "--host-maddrs")
    if args.identity:
        check_identity(args.identity)
    manifest = None
    if args.manifest:
        from node.ops.startup import load_manifest_arg

        manifest = load_manifest_arg(args.manifest)
        from node.ops.config import check_fingerprint

        # a tampered file is refused, an unsigned one as by `run`, and with --organiser another organiser's
        if args.allow_unsigned:
            check_local_only(host, args.initial_peers, args.announce_maddrs)
        check_signed(manifest, args.manifest, allow_unsigned=args.allow_unsigned,
                     organiser=check_fingerprint(args.organiser))

    from node.net import BootstrapError, ManifestMismatch, Membership, start_dht, start_failure_line, stop_dht

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # daemon_metrics off: a bootstrap peer exports no metrics, so its p2pd needs no endpoint for them
        dht = start_dht(list(args.initial_peers), list(host), list(args.announce_maddrs), args.identity or None,
                        local=args.local, daemon_metrics=False)
    except BootstrapError as e:
        raise CliError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - p2pd refused to start: say why in one line
        raise CliError(start_failure_line(e, list(host))) from None
    try:
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        print(f"swarm-node: bootstrap peer {dht.peer_id.to_base58()} is up; nodes join with --initial-peers "
              "and one of:", flush=True)
        for m in maddrs:
            print(m, flush=True)
        if args.maddrs_file:
            with open(args.maddrs_file, "w") as f:
                f.write("\n".join(maddrs) + "\n")
        membership = None
        if manifest is not None:
            membership = Membership(dht, manifest)
            try:
                membership.check_and_publish_manifest()
            except (ManifestMismatch, TimeoutError) as e:
                raise CliError(str(e)) from None
            print(f"swarm-node: published the manifest of run {manifest.run.id}", flush=True)
        last = time.monotonic()
        while not stop.wait(1.0):
            if membership is not None and time.monotonic() - last > membership.ttl:
                last = time.monotonic()
                try:
                    membership.check_and_publish_manifest()
                except Exception as e:  # noqa: BLE001 - keep serving the DHT
                    log.warning("manifest refresh: %s", e)
        log.info("stopping")
        return 0
    finally:
        stop_dht(dht)
        for s, h in previous.items():
            signal.signal(s, h)
