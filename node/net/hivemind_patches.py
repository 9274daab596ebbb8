"""Every change swarm-node makes to hivemind's own behaviour, in one place.

hivemind (pinned to 1.1.12 in pyproject.toml) has no switch for a few things the node needs, so
each is done here by replacing or overriding one of its private names: the extra p2pd flags
(``static_relays_only``, ``add_daemon_flag``), and child processes that die with the node
(``SwarmDHT``, ``SwarmAverager``). Each patch names the hivemind version it was written against
and checks, before it patches, that the private name it relies on is still there: an upgraded
hivemind that moved it fails at once with :class:`HivemindPatchError` naming the name, instead of
running unpatched (a node stuck unreachable behind NAT, or a ``p2pd`` left behind by a crash).

Importing this module imports hivemind; ``node.net``'s other modules import it where they start
a daemon, a DHT or an averager.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2P

from node.base import children_of, set_parent_death_signal

WRITTEN_AGAINST = "1.1.12"  # the hivemind version every patch here was written and tested against


class HivemindPatchError(RuntimeError):
    """The installed hivemind lacks a private name one of our patches relies on."""


def _require(found: bool, name: str, patch: str) -> None:
    """Fail loudly when ``name`` (a private part of hivemind) is not what ``patch`` relies on."""
    if not found:
        raise HivemindPatchError(
            f"hivemind {hivemind.__version__} has no {name}, which swarm-node's {patch} patch relies on "
            f"(written against hivemind {WRITTEN_AGAINST}, node/net/hivemind_patches.py): install "
            f"hivemind=={WRITTEN_AGAINST}, or port the patch to this version"
        )


def _patch_process_args(patch: str, wrap) -> None:
    """Replace ``P2P._make_process_args`` (the static method that turns keyword arguments into
    p2pd's command line, ``-key=value``) by ``wrap(the current one)``; the new one remembers
    which patches it carries (``_applied``)."""
    build = P2P.__dict__.get("_make_process_args")
    _require(isinstance(build, staticmethod), "P2P._make_process_args (a staticmethod)", patch)
    patched = wrap(build.__func__)
    patched._swarm_patches = _applied() | {patch}
    P2P._make_process_args = staticmethod(patched)


def _applied() -> frozenset[str]:
    """The patches ``P2P._make_process_args`` of this process carries."""
    build = P2P.__dict__.get("_make_process_args")
    return frozenset(getattr(getattr(build, "__func__", None), "_swarm_patches", ()))


# ----------------------------------------------------------------------------- p2pd's command line


def static_relays_only() -> None:
    """Make p2pd take ``trusted_relays`` as its only relays (``-relayDiscovery=0``).

    Why: hivemind passes ``-trustedRelays`` but not p2pd's ``-relayDiscovery`` switch, which
    defaults to on; with it on, p2pd's auto-relay waits for four relay candidates from its DHT or
    for its three-minute boot delay before it reserves a slot anywhere, so a node behind NAT stays
    unreachable for minutes in a small swarm. With static relays it reserves at one of them as
    soon as AutoNAT reports it private (about 15 s after start, measured in the network lab).

    Patches ``P2P._make_process_args`` (hivemind 1.1.12) of this process, idempotent; it changes
    nothing for a daemon started without trusted relays. Call it in every process that starts a
    p2pd (``SwarmDHT`` does in its child)."""
    if "static-relays" in _applied():
        return

    def wrap(build):
        def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            if kwargs.get("trustedRelays") and kwargs.get("autoRelay"):
                kwargs.setdefault("relayDiscovery", 0)
            return build(*args, **kwargs)

        return make_process_args

    _patch_process_args("static-relays", wrap)


def add_daemon_flag(name: str, value: str) -> None:
    """Every p2pd that hivemind starts from now on in this process gets ``-name=value``.

    Why: hivemind has no argument for p2pd's flags beyond its own list, and the node needs
    ``-metricsAddr`` (go-libp2p's Prometheus endpoint, where hole-punch outcomes are counted).
    Patches ``P2P._make_process_args`` (hivemind 1.1.12); call it only in a process of its own
    (the DHT's child), since it applies to every daemon started after it."""

    def wrap(build):
        def with_flag(*args: Any, **kwargs: Any) -> list[str]:
            return build(*args, **{**kwargs, name: value})

        return with_flag

    _patch_process_args(f"p2pd -{name}", wrap)


# ----------------------------------------------------------------------------- child processes


_DEATH_SIGNAL = signal.SIGUSR2

_require("run" in hivemind.DHT.__dict__, "DHT.run (the DHT child process's body)", "SwarmDHT")
_require("run" in DecentralizedAverager.__dict__, "DecentralizedAverager.run (the averager child process's body)",
         "SwarmAverager")


class SwarmDHT(hivemind.DHT):
    """``hivemind.DHT`` whose child process (and its ``p2pd``) dies with the node.

    Why: hivemind's DHT child and its p2pd outlive a node killed with ``kill -9`` (nothing tells
    them), and a Ctrl-C to the node's process group kills them under the node's feet. Overrides
    ``DHT.run``, the child process's body, and reads ``DHT._parent_pid`` (hivemind 1.1.12).

    Must be started from the main thread: the parent-death signal fires when the *thread* that
    forked the child exits.

    ``daemon_metrics_addr`` (``host:port``, set before starting): p2pd also serves go-libp2p's own
    Prometheus metrics there (``-metricsAddr``, through :func:`add_daemon_flag` in the child),
    which is where hole-punch outcomes are counted (``node.net.connections.DaemonMetrics``).
    """

    daemon_metrics_addr: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _require(isinstance(getattr(self, "_parent_pid", None), int), "DHT._parent_pid", "SwarmDHT")

    @property
    def daemon_metrics_url(self) -> str | None:
        return f"http://{self.daemon_metrics_addr}/metrics" if self.daemon_metrics_addr else None

    def run(self) -> None:
        parent = self._parent_pid
        if self.daemon_metrics_addr:
            add_daemon_flag("metricsAddr", self.daemon_metrics_addr)
        # Our own process group: a signal to the node's group (Ctrl-C in a terminal, `timeout`,
        # systemd) must not kill the DHT or its p2pd under the node's feet; the node stops them in
        # order. If the node itself dies, the parent-death signal takes them down.
        try:
            os.setpgid(0, 0)
        except OSError:
            pass

        def on_parent_death(signum, frame):
            for child in children_of(os.getpid()):  # our p2pd
                try:
                    os.kill(child, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os._exit(0)

        signal.signal(_DEATH_SIGNAL, on_parent_death)
        signal.signal(signal.SIGTERM, on_parent_death)
        set_parent_death_signal(_DEATH_SIGNAL)
        if os.getppid() != parent:  # the node died before we set the signal
            on_parent_death(_DEATH_SIGNAL, None)
        static_relays_only()  # this process starts the p2pd
        super().run()


class SwarmAverager(DecentralizedAverager):
    """hivemind's averager whose child process dies with the node, like :class:`SwarmDHT`.

    Why: the averager is a forked child that hivemind stops only on a clean shutdown; after
    ``kill -9`` of the node alone it would run on. Overrides ``DecentralizedAverager.run``, the
    child process's body (hivemind 1.1.12)."""

    def run(self) -> None:
        set_parent_death_signal(signal.SIGKILL)
        super().run()
