"""node/net/hivemind_patches.py: each patch changes what it says it changes, and each fails loudly,
naming what is missing, when hivemind no longer has the private name it relies on."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2P

from node.net import hivemind_patches


def _plain_builder(*args, **kwargs) -> list[str]:
    return [*map(str, args)] + [f"-{k}={v}" for k, v in kwargs.items()]


def test_static_relays_turn_relay_discovery_off_only_with_trusted_relays(monkeypatch):
    monkeypatch.setattr(P2P, "_make_process_args", staticmethod(_plain_builder))  # restored after the test
    hivemind_patches.static_relays_only()
    hivemind_patches.static_relays_only()  # idempotent: one wrapper
    assert P2P._make_process_args("p2pd", trustedRelays="R", autoRelay=True) == [
        "p2pd", "-trustedRelays=R", "-autoRelay=True", "-relayDiscovery=0"]
    assert P2P._make_process_args("p2pd", autoRelay=True) == ["p2pd", "-autoRelay=True"]
    hivemind_patches.add_daemon_flag("metricsAddr", "127.0.0.1:9")
    hivemind_patches.static_relays_only()  # still applied under the flag's wrapper: not wrapped again
    assert P2P._make_process_args("p2pd") == ["p2pd", "-metricsAddr=127.0.0.1:9"]
    assert hivemind_patches._applied() == {"static-relays", "p2pd -metricsAddr"}


def test_a_missing_argument_builder_fails_loudly(monkeypatch):
    monkeypatch.delattr(P2P, "_make_process_args")
    for patch in (hivemind_patches.static_relays_only, lambda: hivemind_patches.add_daemon_flag("x", "1")):
        with pytest.raises(hivemind_patches.HivemindPatchError, match=r"P2P\._make_process_args .*1\.1\.12"):
            patch()


def test_a_dht_without_its_parent_pid_fails_loudly(monkeypatch):
    original, made = hivemind.DHT.__init__, []

    def renamed(self, *args, **kwargs):  # a hivemind that keeps the parent's pid under another name
        original(self, *args, **kwargs)
        self._owner_pid = self.__dict__.pop("_parent_pid")
        made.append(self)

    monkeypatch.setattr(hivemind.DHT, "__init__", renamed)
    with pytest.raises(hivemind_patches.HivemindPatchError, match=r"DHT\._parent_pid.*SwarmDHT"):
        hivemind_patches.SwarmDHT(start=False)
    for dht in made:  # hivemind's own __del__ reads the name
        dht._parent_pid = dht._owner_pid


def test_the_child_process_bodies_overridden_are_hiveminds_own():
    """An override of an inherited ``run`` would still be called; one of a ``run`` hivemind no longer
    defines itself would replace multiprocessing's, so the import-time guard asks for hivemind's."""
    assert "run" in hivemind.DHT.__dict__ and "run" in DecentralizedAverager.__dict__
    assert hivemind_patches.SwarmDHT.run is not hivemind.DHT.run
    assert hivemind_patches.SwarmAverager.run is not DecentralizedAverager.run
    with pytest.raises(hivemind_patches.HivemindPatchError, match="hivemind .* has no X.run"):
        hivemind_patches._require(False, "X.run", "test")
