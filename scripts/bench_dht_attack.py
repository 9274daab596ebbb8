"""Control-plane attack benchmark: a signed three-stage loopback swarm trains while a stranger's DHT
client (``tests/helpers/dht_stranger.py``: its own DHT node, its DHT id chosen next to the run's
``peers`` key) forges, floods, plays the cache and expiry tricks, replays old records, stores
another run's manifest and sends costly RSA keys, for ``--window`` seconds.

Prints one JSON object: the tail's optimizer steps in the window before the attack and in the
window of the attack (and their ratio), what the stranger sent and how much of it the storing
nodes took, every DHT node's answer for the run's ``peers`` key (entries, bytes) before and at
the end of the attack, the bootstrap process tree's resident memory before and after, the
forged records each node counted, and whether the head still routes to every honest peer.

    python scripts/bench_dht_attack.py            # 60 s windows (about 4 minutes on 2 cores)
    python scripts/bench_dht_attack.py --quick    # 20 s windows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_tree(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (from /proc)."""
    from node.base import processes

    children: dict[int, list[int]] = {}
    for p in processes():
        if p.alive:
            children.setdefault(p.ppid, []).append(p.pid)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def summary(answers: dict) -> dict:
    return {peer[-8:]: {"entries": n, "bytes": b} if n >= 0 else {"error": str(e)[:120]}
            for peer, (n, b, e) in answers.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=60.0, help="seconds before and during the attack")
    p.add_argument("--quick", action="store_true", help="20 s windows")
    p.add_argument("--flood", type=int, default=300, help="junk subkeys per round")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between the stranger's rounds")
    p.add_argument("--manifest", default="test", help="shipped manifest the run is signed from")
    p.add_argument("--workdir", default="", help="keep the nodes' logs here")
    p.add_argument("--control", choices=["idle", "decoy"], default="idle",
                   help="the stranger in the window before the attack: idle, or attacking a decoy (a guarded "
                        "DHT node of the swarm's DHT that trains nothing), so that both windows carry its own "
                        "work on these shared cores")
    p.add_argument("--no-attack", action="store_true",
                   help="the stranger joins but never attacks: the ratio of two quiet windows (the drift)")
    args = p.parse_args(argv)
    if args.no_attack and args.control == "decoy":
        p.error("--no-attack and --control decoy: the decoy control is a window of attack")
    window = 20.0 if args.quick else args.window

    from node.ops import LocalSwarm, sign_manifest
    from security import OrganiserKey
    from stages import load_manifest, manifest_toml
    from tests.helpers.attack_drill import peer_id_of
    from tests.helpers.dht_stranger import Stranger

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-dht-attack-"))
    work.mkdir(parents=True, exist_ok=True)
    organiser = OrganiserKey.generate()
    base = load_manifest(args.manifest)
    signed = sign_manifest(base, organiser)
    other = sign_manifest(base.replace(run={"id": base.run.id + "-b"}, optim={"lr": 0.5}), organiser)
    path = work / "run.toml"
    path.write_text(manifest_toml(signed))
    out: dict = {"settings": {"window_s": window, "attack": not args.no_attack, "control": args.control,
                              "flood_per_round": args.flood,
                              "pause_s": args.pause,
                              "manifest": args.manifest, "stages": 3, "stranger_nice": 19}}
    sw = LocalSwarm(str(path), workdir=work / "swarm")
    stranger = decoy = None
    t0 = time.monotonic()
    try:
        peers = sw.start_bootstrap()
        head, body, tail = [sw.start_node(i, name=f"stage{i}") for i in range(3)]
        sw.wait_ready(timeout=240)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_steps_total") < 10:
            time.sleep(0.5)
        # the stranger runs on another machine in a real attack: here its own work (making keys,
        # records and requests) gets this machine's CPU only when the swarm leaves some (nice 19,
        # inherited by its DHT process); what its requests cost the swarm's nodes is all counted
        os.nice(19)
        if args.control == "decoy":
            from node.net import start_dht

            decoy = start_dht(peers, ["/ip4/127.0.0.1/tcp/0"], local=True)  # started niced: the stranger's cost
        stranger = Stranger(peers, signed, other, flood=args.flood, pause=args.pause)
        stranger.victims = [x for x in (peer_id_of(n) for n in (head, body, tail)) if x]
        out["answers_before"] = summary(stranger.answers())
        out["bootstrap_rss_mib_before"] = round(rss_tree(sw.bootstrap.pid) / 2**20, 1)

        if args.control == "decoy":  # the stranger's rounds go to the decoy alone before the attack
            stranger.only = [decoy.peer_id.to_base58()]
            stranger.start()
        s0 = sw.value(tail, "swarm_node_steps_total")
        time.sleep(window)
        s1 = sw.value(tail, "swarm_node_steps_total")
        out["replays_captured"] = stranger.capture_replays()  # the records as they are now, replayed once older
        if args.control == "decoy":
            stranger.only = None
            stranger.spare = [decoy.peer_id.to_base58()]
            out["decoy_rounds"] = stranger.rounds
        elif not args.no_attack:
            stranger.start()
        time.sleep(window)
        s2 = sw.value(tail, "swarm_node_steps_total")
        stranger.stop()
        out["tail_steps_before"] = int(s1 - s0)
        out["tail_steps_during"] = int(s2 - s1)
        out["ratio"] = round((s2 - s1) / max(1.0, s1 - s0), 3)
        out["attack"] = {"rounds": stranger.rounds, "sent": stranger.sent, "stored": stranger.stored,
                         "refused": stranger.refused}
        out["answers_during"] = summary(stranger.answers())
        out["bootstrap_rss_mib_after"] = round(rss_tree(sw.bootstrap.pid) / 2**20, 1)
        out["forged_counted"] = {n.name: {k: sw.value(n, "swarm_node_forged_records_total", kind=k)
                                          for k in ("peer", "manifest", "averaging", "plain", "unknown", "unread")}
                                 for n in (head, body, tail)}
        out["head_routes_to"] = {s: sw.value(head, "swarm_node_peers", stage=str(s)) for s in range(3)}
        out["alive"] = all(n.proc.poll() is None for n in (head, body, tail))
        out["mismatch_logged"] = any("manifest mismatch" in n.logs() for n in (head, body, tail))
    finally:
        if stranger is not None:
            stranger.close()
        if decoy is not None:
            decoy.shutdown()
        out["exit_codes"] = sw.close()
        out["seconds"] = round(time.monotonic() - t0, 1)
        out["logs"] = str(work)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
