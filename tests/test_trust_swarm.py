"""A stranger with a plain hivemind DHT client and the bootstrap address tries to stop a signed run:
it publishes a forged manifest before anyone joins, then keeps re-publishing forged manifests and
forged records for every peer (draining, huge capacity, newer time), plain values that would replace
the run's dictionaries, and a peer that does not exist. Nothing of it is believed: the swarm joins,
trains without a pause, takes a new replica, and counts the forgeries. A node holding a manifest
signed by another key runs alone, in its own namespace: honest nodes never route to it."""

from __future__ import annotations

import threading
import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from node.net.membership import run_namespace
from node.net.records import manifest_subkey, peer_subkey
from node.ops import LocalSwarm
from node.ops.local_swarm import p2pd_pids_of
from node.ops.manifest_cmd import sign_manifest
from security import OrganiserKey, PeerKey, new_ed25519_key
from tests.helpers.attack_drill import peer_id_of
from stages import consensus_dict, load_manifest, manifest_hash, manifest_toml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ROGUE_WATCH_S = 5.0  # the least time the forger's own node is online, unrouted to, before the counts are read
LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False, auto_nat=False,
                nat_port_map=False)


def _write(tmp_path, name, manifest):
    path = tmp_path / name
    path.write_text(manifest_toml(manifest))
    return path


class Forger:
    """A plain DHT client (hivemind's, no validator) rewriting a run's records as fast as it can."""

    def __init__(self, initial_peers, manifest, forged_manifest):
        self.dht = hivemind.DHT(initial_peers=initial_peers, start=True, **LOOPBACK)
        ns = run_namespace(manifest)
        self.key_manifest, self.key_peers = f"{ns}/manifest", f"{ns}/peers"
        self.organiser = manifest.run.organiser
        self.forged = forged_manifest
        self.victims: list[str] = []
        self.fake = PeerKey(new_ed25519_key()).peer_id  # a peer that does not exist
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def forge_once(self) -> None:
        exp = get_dht_time() + 240
        forged = {"hash": manifest_hash(self.forged), "manifest": consensus_dict(self.forged), "protocol": 1,
                  "organiser": self.forged.run.organiser, "signature": self.forged.signature.ed25519}
        self.dht.store(self.key_manifest, {**forged, "organiser": self.organiser}, exp,
                       subkey=manifest_subkey(self.organiser))  # under the organiser's name
        self.dht.store(self.key_manifest, forged, exp, subkey=manifest_subkey(self.forged.run.organiser))
        self.dht.store(self.key_manifest, forged, exp)  # a plain value: would replace the dictionary
        self.dht.store(self.key_peers, {"x": 1}, exp)
        for pid in [*self.victims, self.fake]:
            rec = {"peer_id": pid, "stage": 1, "state": "draining" if pid != self.fake else "online",
                   "throughput": 1e9, "capacity": 1e9, "queue": 0, "version": 10**6, "protocol": 1,
                   "maddrs": [f"/ip4/127.0.0.1/tcp/9/p2p/{pid}"], "time": time.time() + 3600}
            self.dht.store(self.key_peers, rec, exp, subkey=peer_subkey(pid))
            self.dht.store(self.key_peers, rec, exp, subkey=f"forger:{pid}")
        self.rounds += 1

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.forge_once()
            except Exception:  # noqa: BLE001 - a forger keeps trying
                pass
            self._stop.wait(0.5)

    def start(self):
        self._thread.start()

    def close(self):
        self._stop.set()
        self._thread.join(30)
        self.dht.shutdown()


def test_a_dht_forger_changes_nothing_in_a_signed_run(tmp_path):
    base = load_manifest("test").replace(sentinel={"enabled": False})
    signed = sign_manifest(base, OrganiserKey.generate())
    path = _write(tmp_path, "run.toml", signed)
    # the forger's own "run": the same run id, other training settings, signed with the forger's key
    forged = sign_manifest(base.replace(optim={"lr": 0.5}), OrganiserKey.generate())
    forged_path = _write(tmp_path, "forged.toml", forged)

    sw = LocalSwarm(str(path), workdir=tmp_path / "swarm")
    forger = None
    try:
        peers = sw.start_bootstrap(publish_manifest=False)
        forger = Forger(peers, signed, forged)
        forger.forge_once()  # the forged manifest is published before any honest node joins
        forger.start()
        head, body, tail = [sw.start_node(i, name=f"stage{i}") for i in range(3)]
        sw.wait_ready(timeout=200)
        forger.victims = [n for n in (peer_id_of(x) for x in (head, body, tail)) if n]
        assert len(forger.victims) == 3
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_steps_total") < 20:
            time.sleep(0.25)
        assert sw.value(tail, "swarm_node_steps_total") >= 20, tail.logs()[-3000:]

        # ---- forging goes on; training never pauses; a new replica and the forger's own node join.
        # The window lasts until both are online, the joiner has been given work and the forger
        # has forged 10 rounds in it, and the rogue has been online twice as long as the joiner
        # took from online to its first microbatch (ROGUE_WATCH_S at least): time enough for a head
        # that believed the rogue's records to have sent it work too
        rounds0 = forger.rounds
        joiner = sw.start_node(1, name="stage1-new")
        rogue = sw.start_node(1, name="rogue", extra=["--manifest", str(forged_path)])  # the last --manifest wins
        steps, last_change, worst_gap = sw.value(tail, "swarm_node_steps_total"), time.monotonic(), 0.0
        joiner_online = joiner_served = rogue_online = None
        window_end = time.monotonic() + 150
        while time.monotonic() < window_end:
            now_steps = sw.value(tail, "swarm_node_steps_total")
            now = time.monotonic()
            if now_steps > steps:
                steps, worst_gap, last_change = now_steps, max(worst_gap, now - last_change), now
            assert all(n.proc.poll() is None for n in (head, body, tail, joiner, rogue)), [n.logs()[-2000:] for n in sw.nodes]
            if joiner_online is None and sw.ready(joiner):
                joiner_online = now
            if joiner_served is None and sw.value(joiner, "swarm_node_served_total", protocol="fwd", result="ack") > 0:
                joiner_online, joiner_served = joiner_online or now, now
            if rogue_online is None and sw.ready(rogue):
                rogue_online = now
            if (joiner_served is not None and rogue_online is not None and forger.rounds - rounds0 >= 10
                    and now - rogue_online >= max(ROGUE_WATCH_S, 2 * (joiner_served - joiner_online))):
                break
            time.sleep(0.25)
        worst_gap = max(worst_gap, time.monotonic() - last_change)
        print(f"forging rounds in the window: {forger.rounds - rounds0}; longest gap between tail steps {worst_gap:.1f} s")
        assert forger.rounds - rounds0 >= 10  # it really kept forging during the window
        assert worst_gap < 8.0, worst_gap  # the tail kept stepping
        assert rogue_online is not None, rogue.logs()[-3000:]  # the forger's node runs, alone
        assert time.monotonic() - rogue_online >= ROGUE_WATCH_S

        # the honest joiner came online and was given work
        assert sw.value(joiner, "swarm_node_state", state="online") == 1, joiner.logs()[-3000:]
        assert sw.value(joiner, "swarm_node_served_total", protocol="fwd", result="ack") > 0
        # routing believes only signed, bound records: two replicas of stage 1, the fake and the
        # forger's node (another namespace) are not among them
        assert sw.value(head, "swarm_node_peers", stage="1") == 2
        assert sw.value(rogue, "swarm_node_served_total", protocol="fwd") == 0
        for n in (head, body, tail, joiner):
            assert "manifest mismatch" not in n.logs(), n.logs()[-2000:]
        forged_counts = sum(sw.value(n, "swarm_node_forged_records_total") for n in (head, body, tail, joiner))
        assert forged_counts > 0
        assert sw.value(head, "swarm_node_forged_records_total", kind="peer") > 0
    finally:
        if forger is not None:
            forger.close()
        pids = [n.pid for n in sw.nodes]
        sw.close()
        assert p2pd_pids_of(pids) == []


@pytest.mark.parametrize("attack", ["state-random"])
def test_a_joiner_refuses_a_replica_that_serves_poisoned_state(tmp_path, attack):
    """Two honest replicas of the middle stage and one that trains honestly but serves joiners
    poisoned weights: the joiner downloads from all three, refuses the poisoner's state (banned,
    said on its output), takes an honest one and trains."""
    base = load_manifest("test").replace(sentinel={"enabled": False})
    path = _write(tmp_path, "run.toml", sign_manifest(base, OrganiserKey.generate()))
    sw = LocalSwarm(str(path), workdir=tmp_path / "swarm")
    try:
        sw.start_bootstrap()
        # the honest replicas start together (the first online, or both, start from the run seed;
        # a later one downloads the other's state); the poisoner joins once both are online, so
        # that it, too, takes an honest state verified by agreement, then trains honestly
        head, a, b, tail = (sw.start_node(0, name="head"), sw.start_node(1, name="a"), sw.start_node(1, name="b"),
                            sw.start_node(2, name="tail"))
        sw.wait_ready(timeout=200)
        poisoner = sw.start_node(1, name="poisoner", extra=["--attack", attack, "--allow-attacks"])
        sw.wait_ready([poisoner], timeout=120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sw.value(head, "swarm_node_peers", stage="1") < 3:
            time.sleep(0.25)
        joiner = sw.start_node(1, name="joiner")
        sw.wait_ready([joiner], timeout=150)
        bad = peer_id_of(poisoner)
        assert f"refused the stage 1 state of {bad}" in joiner.output(), joiner.logs()[-3000:]
        assert "verified against" in joiner.output()
        assert sw.value(joiner, "swarm_node_bans_total", cause="poisoned-state") == 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sw.value(joiner, "swarm_node_steps_total") < 5:
            time.sleep(0.25)
        assert sw.value(joiner, "swarm_node_steps_total") >= 5, joiner.logs()[-3000:]  # it trains
        assert all(n.proc.poll() is None for n in (head, a, b, tail, joiner))
    finally:
        pids = [n.pid for n in sw.nodes]
        sw.close()
        assert p2pd_pids_of(pids) == []
