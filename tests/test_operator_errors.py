"""Operator mistakes: each gives exactly one clear error line (what is wrong and how to fix it), no
traceback, and a non-zero exit, before anything is left running.

The cases run concurrently against one bootstrap peer (and, for "identity already online", one
node that holds the identity), so the whole file costs about one node start-up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.ops import LocalSwarm
from node.ops.local_swarm import free_port, p2pd_pids_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent


def _keygen(path: Path) -> str:
    from node.net.identity import write_identity

    return write_identity(path)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Start every bad invocation at once; collect (exit code, stderr) per case."""
    tmp = tmp_path_factory.mktemp("operator-errors")
    sw = LocalSwarm("test", workdir=tmp / "swarm")
    held = []
    try:
        peers = sw.start_bootstrap()
        boot_id = peers[0].rsplit("/p2p/", 1)[1]
        # a node that is online with identity `taken`
        taken = tmp / "taken.key"
        _keygen(taken)
        owner = sw.start_node(0, name="owner", identity=str(taken))
        # a world-readable key
        open_key = tmp / "open.key"
        _keygen(open_key)
        os.chmod(open_key, 0o644)
        # a manifest that differs from the swarm's in two consensus fields (and one local one)
        other = tmp / "other.toml"
        text = (ROOT / "runs" / "test.toml").read_text()
        other.write_text(text.replace("seq_len = 32", "seq_len = 16").replace('lr = 3e-3', 'lr = 1e-2')
                         .replace("max_inflight = 2", "max_inflight = 3"))
        # a stage far bigger than this machine's memory (first node of its own swarm: no peers)
        from node.ops import write_manifest
        from stages import load_manifest

        # signed by an organiser key, then changed: the signature no longer verifies
        from node.ops.manifest_cmd import sign_manifest
        from security import OrganiserKey
        from stages import manifest_toml

        signed = sign_manifest(load_manifest("test"), OrganiserKey.generate())
        tampered = tmp / "tampered.toml"
        tampered.write_text(manifest_toml(signed).replace("seed = 7", "seed = 8"))
        huge = write_manifest(load_manifest("test").replace(model={"d_model": 16384, "n_heads": 16}),
                              tmp / "huge.toml")
        # ports held by someone else
        busy_metrics = socket.socket()
        busy_metrics.bind(("127.0.0.1", 0))
        busy_metrics.listen()
        busy_listen = socket.socket()
        busy_listen.bind(("127.0.0.1", 0))
        busy_listen.listen()
        held += [busy_metrics, busy_listen]
        mport, lport = busy_metrics.getsockname()[1], busy_listen.getsockname()[1]
        dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{boot_id}"
        base = ["run", "--local", "--allow-unsigned", "--manifest", "test", "--stage", "0", "--torch-threads", "1"]
        cases = {
            "unreachable": base + ["--metrics-port", "-1", "--initial-peers", dead,
                                   "--bootstrap-retries", "2", "--bootstrap-timeout", "3"],
            "mismatch": ["run", "--local", "--allow-unsigned", "--manifest", str(other), "--stage", "0", "--metrics-port", "-1",
                         "--initial-peers", *peers],
            "metrics_port": base + ["--metrics-port", str(mport), "--initial-peers", *peers],
            "listen_port": base + ["--metrics-port", "-1", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{lport}",
                                   "--initial-peers", *peers],
            "world_readable": base + ["--metrics-port", "-1", "--identity", str(open_key), "--initial-peers", *peers],
            "too_big": ["run", "--local", "--allow-unsigned", "--manifest", str(huge), "--stage", "1", "--metrics-port", "-1"],
            "no_manifest": ["run", "--local", "--allow-unsigned", "--manifest", str(tmp / "nope.toml"), "--metrics-port", "-1"],
            "stage_range": base[:-4] + ["--stage", "7", "--metrics-port", "-1"],
            "unsigned": ["run", "--local", "--manifest", "test", "--metrics-port", "-1"],
            "unsigned_public": ["run", "--allow-unsigned", "--manifest", "test", "--metrics-port", "-1"],
            "tampered": ["run", "--local", "--manifest", str(tampered), "--metrics-port", "-1"],
        }
        procs = {}
        for name, argv in cases.items():
            procs[name] = subprocess.Popen([sys.executable, "-m", "node.ops.cli", *argv], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, start_new_session=True, env=sw.env)
        sw.wait_ready([owner], timeout=150)
        procs["identity_in_use"] = subprocess.Popen(
            [sys.executable, "-m", "node.ops.cli", *base, "--metrics-port", "-1", "--identity", str(taken),
             "--initial-peers", *peers],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=sw.env)
        results = {}
        for name, p in procs.items():
            t0 = time.monotonic()
            try:
                out, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                out, err = p.communicate()
            results[name] = (p.returncode, err, out, time.monotonic() - t0, p.pid)
        yield {**results, "_ports": (mport, lport), "_dead": dead, "_other": other, "_open_key": open_key}
    finally:
        for s in held:
            s.close()
        sw.close()


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("swarm-node: error:")]
    assert len(lines) == 1, err
    assert err.rstrip().splitlines()[-1] == lines[0], err  # the error is the last word
    return lines[0]


def check(outcomes, name: str) -> str:
    code, err, out, _, pid = outcomes[name]
    assert code not in (0, None), (code, err)
    assert p2pd_pids_of([pid]) == []  # nothing left running
    line = one_error_line(err)
    print(f"{name}: {line}")
    return line


def test_unreachable_bootstrap_names_the_multiaddr_and_the_fix(outcomes):
    line = check(outcomes, "unreachable")
    assert outcomes["_dead"] in line
    assert "after 2 attempts" in line and "bootstrap peer is running" in line


def test_manifest_mismatch_names_the_differing_fields(outcomes):
    line = check(outcomes, "mismatch")
    assert "manifest mismatch" in line and "model.seq_len, optim.lr" in line
    assert "train.max_inflight" not in line  # a local choice, not a consensus field
    assert "use the swarm's manifest" in line


def test_an_unsigned_manifest_is_refused_unless_local_and_allowed(outcomes):
    line = check(outcomes, "unsigned")
    assert "is not signed" in line and "swarm-node manifest sign" in line and "--allow-unsigned" in line
    line = check(outcomes, "unsigned_public")
    assert "--allow-unsigned is for a swarm on this machine only" in line


def test_a_tampered_manifest_is_refused_before_anything_starts(outcomes):
    line = check(outcomes, "tampered")
    assert "signature does not verify" in line and "get the signed manifest from the run's organisers" in line
    assert outcomes["tampered"][3] < 60  # refused at once, before the DHT


def test_metrics_port_in_use(outcomes):
    line = check(outcomes, "metrics_port")
    assert f"metrics port {outcomes['_ports'][0]} on 127.0.0.1 is already in use" in line
    assert "--metrics-port" in line


def test_listen_port_in_use(outcomes):
    line = check(outcomes, "listen_port")
    assert f"listen port {outcomes['_ports'][1]} on 127.0.0.1 is already in use" in line
    assert "--host-maddrs" in line


def test_world_readable_identity_key(outcomes):
    line = check(outcomes, "world_readable")
    assert str(outcomes["_open_key"]) in line and "chmod 600" in line


def test_identity_already_online(outcomes):
    line = check(outcomes, "identity_in_use")
    assert "already online" in line and "swarm-node keygen" in line


def test_stage_that_does_not_fit_in_memory(outcomes):
    line = check(outcomes, "too_big")
    assert "stage 1 needs about" in line and "GiB" in line and "free" in line


def test_missing_manifest_and_bad_stage(outcomes):
    assert "manifest file not found" in check(outcomes, "no_manifest")
    assert "--stage 7: the manifest has 3 stages" in check(outcomes, "stage_range")
