"""Operator mistakes: each gives exactly one clear error line (what is wrong and how to fix it), no
traceback, and a non-zero exit, before anything is left running.

The cases run concurrently against one bootstrap peer (and, for "identity already online", one
node that holds the identity), so the whole file costs about one node start-up.

Failures of the network (nothing listening, no route, no answer, a wrong peer id, a relay that
does not relay) end the same way whatever flags are given, including the README's own join
command. As root, the cases that need a network this machine does not have (no route, a firewall
that drops) and the README's command as printed (a public node: NAT port mapping, AutoNAT and
relays on) run in a network namespace of their own with only a loopback interface, so nothing
they send leaves it; without root those are skipped, and the README's command runs with
``--local`` added.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
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


CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("iptables") is not None
DROPPED_PORT = 4444  # inside the namespace, a firewall drops every SYN to 127.0.0.1:4444


@contextlib.contextmanager
def loopback_namespace():
    """A network namespace with only ``lo`` up, and a rule dropping TCP to ``DROPPED_PORT`` (its
    name; removed on exit). None without root."""
    if not CAN_NETNS:
        yield None
        return
    name = f"swn-operr-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(DROPPED_PORT), "-j", "DROP"]):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def readme_join_command() -> list[str]:
    """The operators' `swarm-node run` command from README.md, as printed there."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("### Operators: join"):]
    m = re.search(r"^swarm-node run (?:.*\\\n)*.*$", block, re.M)
    assert m, "README.md: no `swarm-node run` command under 'Operators: join'"
    return shlex.split(m.group(0).replace("\\\n", " "))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Start every bad invocation at once; collect (exit code, stderr) per case."""
    tmp = tmp_path_factory.mktemp("operator-errors")
    sw = LocalSwarm("test", workdir=tmp / "swarm")
    held = []
    stack = contextlib.ExitStack()
    try:
        peers = sw.start_bootstrap()
        boot_id = peers[0].rsplit("/p2p/", 1)[1]
        # a node that is online with identity `taken` (a middle stage: it loads no data, its
        # start-up is the path to the "identity already online" case)
        taken = tmp / "taken.key"
        _keygen(taken)
        owner = sw.start_node(1, name="owner", identity=str(taken))
        # a world-readable key
        open_key = tmp / "open.key"
        _keygen(open_key)
        os.chmod(open_key, 0o644)
        # a manifest that differs from the swarm's in two consensus fields (and one local one)
        other = tmp / "other.toml"
        text = (ROOT / "stages" / "runs" / "test.toml").read_text()
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
        # ---- failures of the network, with and without --identity (which adds a check that asks
        # the swarm first whether the key is online)
        home = tmp / "home" / ".swarm-node"  # the README's ~/.swarm-node
        home.mkdir(parents=True)
        _keygen(home / "identity.key")
        other_id = _keygen(tmp / "stranger.key")  # a peer id nobody runs
        quick = ["--bootstrap-retries", "2", "--bootstrap-timeout", "5"]
        live = peers[0].rsplit("/p2p/", 1)[0]
        unreachable = cases["unreachable"]
        cases.update({
            "unreachable_identity": unreachable + ["--identity", str(home / "identity.key")],
            "wrong_peer_id": base + ["--metrics-port", "-1", "--identity", str(home / "identity.key"),
                                     "--initial-peers", f"{live}/p2p/{other_id}", *quick],
            "relay_refused": base + ["--metrics-port", "-1", "--identity", str(home / "identity.key"),
                                     "--initial-peers", f"{peers[0]}/p2p-circuit/p2p/{other_id}", *quick],
        })
        # the README's join command with its placeholders filled in: a signed manifest, the
        # bootstrap peer's id at 127.0.0.1:31337 where nothing listens (in the namespace), the
        # README's paths under a temporary home; the CPU where there is no CUDA
        ns = stack.enter_context(loopback_namespace())
        signed_path = tmp / "RUN.toml"
        signed_path.write_text(manifest_toml(signed))
        readme = [tok.replace("RUN.toml", str(signed_path)).replace("BOOTSTRAP_IP", "127.0.0.1")
                  .replace("BOOTSTRAP_PEER_ID", boot_id).replace("~/.swarm-node", str(home))
                  for tok in readme_join_command()[1:]]
        import torch

        if not torch.cuda.is_available():
            readme[readme.index("--device") + 1] = "cpu"
        if ns is None:  # no namespace to keep a public node's traffic in: loopback only
            readme[readme.index("--metrics-port") + 1] = str(free_port())
            dead_port = dead.split("/tcp/")[1].split("/")[0]
            readme = [tok.replace("/tcp/31337/", f"/tcp/{dead_port}/") for tok in readme] + ["--local"]
        i = readme.index("--identity")
        no_identity = readme[:i] + readme[i + 2:]
        # the two run side by side (in one namespace)
        no_identity[no_identity.index("--metrics-port") + 1] = "9101" if ns is not None else str(free_port())
        in_ns = {"readme_join": readme, "readme_join_no_identity": no_identity}
        if ns is not None:
            in_ns.update({
                # a signed run: --allow-unsigned dials loopback peers only
                "no_route": ["run", "--local", "--manifest", str(signed_path), "--stage", "0", "--torch-threads", "1",
                             "--metrics-port", "-1", "--identity", str(home / "identity.key"),
                             "--initial-peers", f"/ip4/192.0.2.1/tcp/31337/p2p/{boot_id}", *quick],
                # nothing ever answers there: each attempt waits out its whole --bootstrap-timeout
                # (this case ends last), so the 3 s of "unreachable"; the line does not depend on it
                "no_answer": base + ["--metrics-port", "-1", "--identity", str(home / "identity.key"),
                                     "--initial-peers", f"/ip4/127.0.0.1/tcp/{DROPPED_PORT}/p2p/{boot_id}",
                                     "--bootstrap-retries", "2", "--bootstrap-timeout", "3"],
            })
        procs = {}
        for name, argv in [*cases.items(), *in_ns.items()]:
            prefix = ["ip", "netns", "exec", ns] if name in in_ns and ns is not None else []
            procs[name] = subprocess.Popen([*prefix, sys.executable, "-m", "node.cli", *argv],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True, env=sw.env)
        sw.wait_ready([owner], timeout=150)
        procs["identity_in_use"] = subprocess.Popen(
            [sys.executable, "-m", "node.cli", *base, "--metrics-port", "-1", "--identity", str(taken),
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
        yield {**results, "_ports": (mport, lport), "_dead": dead, "_other": other, "_open_key": open_key,
               "_live": live, "_other_id": other_id, "_boot_id": boot_id, "_ns": ns}
    finally:
        for s in held:
            s.close()
        sw.close()
        stack.close()


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
    port = outcomes["_dead"].split("/tcp/")[1].split("/")[0]
    assert f"after 2 attempts: {outcomes['_dead']}: nothing listens at 127.0.0.1:{port} (connection refused)" in line
    assert "bootstrap peer is running" in line


def test_unreachable_bootstrap_with_identity_is_the_same_one_line(outcomes):
    # with --identity, a throwaway daemon first asks the swarm whether the key is online; when it
    # reaches nobody, the join's own retries decide, and the line is the one without --identity
    assert check(outcomes, "unreachable_identity") == check(outcomes, "unreachable")


def test_the_readme_join_command_with_a_bootstrap_that_does_not_answer(outcomes):
    line = check(outcomes, "readme_join")
    assert "could not reach any initial peer after 4 attempts" in line
    assert f"/p2p/{outcomes['_boot_id']}: nothing listens at 127.0.0.1:" in line
    assert "check that the bootstrap peer is running" in line
    assert line == check(outcomes, "readme_join_no_identity")


def test_a_wrong_peer_id_at_a_live_address(outcomes):
    line = check(outcomes, "wrong_peer_id")
    assert f"{outcomes['_live']}/p2p/{outcomes['_other_id']}: 127.0.0.1:" in line
    assert "answers, but no libp2p connection to the peer was made" in line and "/p2p/ id" in line


def test_a_relay_that_does_not_relay(outcomes):
    line = check(outcomes, "relay_refused")
    assert "p2p-circuit" in line and "the relay at 127.0.0.1:" in line
    assert "no relayed connection" in line and "use the peer's direct multiaddr" in line


@pytest.mark.skipif(not CAN_NETNS, reason="needs root (ip netns, iptables) for a network without a route")
def test_no_route_to_the_bootstrap_peer(outcomes):
    line = check(outcomes, "no_route")
    assert "this machine has no route to 192.0.2.1 (network is unreachable)" in line
    assert "check this machine's network connection" in line


@pytest.mark.skipif(not CAN_NETNS, reason="needs root (ip netns, iptables) for a firewall that drops")
def test_a_bootstrap_address_that_does_not_answer(outcomes):
    line = check(outcomes, "no_answer")
    assert f"127.0.0.1:{DROPPED_PORT} does not answer (no answer within 3 s)" in line
    assert f"a firewall drops TCP port {DROPPED_PORT}" in line


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


def test_free_port_hands_out_each_port_once_and_below_the_ephemeral_range():
    """LocalSwarm gives every node a metrics port chosen before the node binds it: two nodes of
    one swarm once got the same one, and ports in the kernel's ephemeral range can be taken
    meanwhile by an outgoing connection's local port (a clean bench run failed on both)."""
    import socket

    from node.ops.local_swarm import _ephemeral_low

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out
