"""Why a node could not reach its initial peers, in one line with the fix.

p2pd says only "failed to connect to bootstrap peers", whatever went wrong. When a start fails
that way, each initial peer is dialled once more with a plain TCP connect to its address, which
tells the cases apart: nothing listens there (connection refused), this machine has no route to
it, the address does not answer at all (a firewall that drops, or a host that is down), the name
does not resolve, or the address answers and the libp2p handshake is what failed (a wrong
``/p2p/`` id, or a relay that would not relay). ``swarm-node run`` and ``swarm-node bootstrap``
print the result as their one error line.
"""

from __future__ import annotations

import errno
import socket

from node.net.connections import is_relayed

BOOTSTRAP_FIX = "check that the bootstrap peer is running and the multiaddr (address, port and /p2p/ id) is what " \
                "`swarm-node bootstrap` printed"


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """``(host, port)`` of the first ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT`` in ``maddr`` (for a
    relayed address ``.../p2p/RELAY/p2p-circuit/p2p/PEER``: the relay's), None without one."""
    parts = maddr.strip("/").split("/")
    for i in range(len(parts) - 3):
        if parts[i] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[i + 2] == "tcp":
            try:
                return parts[i + 1], int(parts[i + 3])
            except ValueError:
                return None
    return None


def tcp_problem(host: str, port: int, timeout: float = 3.0) -> str | None:
    """What a plain TCP connect to ``host:port`` says: None when something accepts it, else the
    problem as a phrase ("connection refused", "no route to host", ...)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the name {host} does not resolve ({e.strerror})"
    last = "no address"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout)
            try:
                s.connect(addr)
                return None
            except TimeoutError:
                last = f"no answer within {timeout:g} s"
            except OSError as e:
                last = {
                    errno.ECONNREFUSED: "connection refused",
                    errno.ENETUNREACH: "network is unreachable",
                    errno.EHOSTUNREACH: "no route to host",
                }.get(e.errno, e.strerror or type(e).__name__)
    return last


def diagnose(maddr: str, timeout: float = 3.0) -> tuple[str, str]:
    """``(what happened, the fix)`` for an initial peer that p2pd could not connect to."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return ("it names no TCP address", "give a multiaddr like /ip4/ADDRESS/tcp/PORT/p2p/PEER_ID, as "
                "`swarm-node bootstrap` prints it")
    host, port = endpoint
    problem = tcp_problem(host, port, timeout)
    where = f"{host}:{port}"
    if problem is None:
        if is_relayed(maddr):
            return (f"the relay at {where} answers, but no relayed connection to the peer behind it was made",
                    "the relay refuses to relay, or that peer is not connected to it: use the peer's direct "
                    "multiaddr, or a relay peer that runs with relaying on")
        return (f"{where} answers, but no libp2p connection to the peer was made",
                "check that the /p2p/ id is the one `swarm-node bootstrap` printed (a wrong id, or another "
                "program on that port); on a slow machine, a larger --bootstrap-timeout")
    if problem == "connection refused":
        return (f"nothing listens at {where} (connection refused)", BOOTSTRAP_FIX)
    if problem in ("network is unreachable", "no route to host"):
        return (f"this machine has no route to {host} ({problem})",
                "check this machine's network connection (interface up, default route, VPN), or fix the address")
    if problem.startswith("no answer"):
        return (f"{where} does not answer ({problem})",
                f"the host is down, or a firewall drops TCP port {port} (open it on the bootstrap host), "
                "or the address is wrong")
    if problem.startswith("the name"):
        return (problem, "fix the host name in the multiaddr")
    return (f"connecting to {where} failed ({problem})", BOOTSTRAP_FIX)


def unreachable_line(initial_peers: list[str], attempts: int, timeout: float = 3.0) -> str:
    """The one error line for "no initial peer answered": each peer with what happened, then the
    fix (each different fix once)."""
    found = [(m, *diagnose(m, timeout)) for m in initial_peers]
    said = "; ".join(f"{m}: {what}" for m, what, _ in found)
    fixes = list(dict.fromkeys(fix for *_, fix in found))
    return (f"could not reach any initial peer after {attempts} attempt{'s' if attempts != 1 else ''}: {said}; "
            f"{'; '.join(fixes)}")


def start_failure_line(err: BaseException, host_maddrs: list[str]) -> str:
    """The one error line for a p2pd that refused to start for another reason than its initial
    peers (its last line of output, or a taken listen port with the flag to change)."""
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    if "address already in use" in text.lower():
        return (f"a listen port in --host-maddrs {' '.join(host_maddrs)} is already in use (another swarm-node?); "
                "stop that process or choose another port")
    return f"could not start the p2p daemon: {text[:300]}"
