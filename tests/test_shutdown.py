"""Leaving: SIGTERM and SIGINT drain and exit 0 within a bound, leaving no p2pd process and no p2pd
socket behind; a signal to the whole process group (systemd, `timeout`, Ctrl-C in a terminal)
does too; and a node killed with -9 takes its DHT process and p2pd with it.

Four lone nodes (each the first peer of its own swarm) start concurrently to keep this quick.
The drain of in-flight microbatches mid-training is covered by tests/test_swarm_e2e.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from node.ops import LocalSwarm
from node.ops.local_swarm import p2pd_pids_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BOUND_S = 15.0


def p2pd_sockets(pids: list[int]) -> list[str]:
    """The unix control sockets of the p2pd processes of these nodes (from their command lines)."""
    out = []
    for pid in p2pd_pids_of(pids):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        for a in args:
            if a.startswith(b"-listen=/unix"):
                out.append(a.decode()[len("-listen=/unix"):])
    return out


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0); it is gone for our purpose
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    except OSError:
        return True


def test_signals_leave_cleanly_and_kill_9_takes_p2pd_along(tmp_path):
    sw = LocalSwarm("test", workdir=tmp_path)
    try:
        nodes = {name: sw.start_node(0, name=name) for name in ("term", "int", "group", "kill9")}
        sw.wait_ready(timeout=150)
        pids = {name: n.pid for name, n in nodes.items()}
        sockets = {name: p2pd_sockets([pid]) for name, pid in pids.items()}
        daemons = {name: p2pd_pids_of([pid]) for name, pid in pids.items()}
        assert all(len(d) == 1 for d in daemons.values()), daemons
        assert all(len(s) == 1 and os.path.exists(s[0]) for s in sockets.values()), sockets

        t0 = time.monotonic()
        nodes["term"].proc.send_signal(signal.SIGTERM)
        nodes["int"].proc.send_signal(signal.SIGINT)
        os.killpg(pids["group"], signal.SIGTERM)  # the whole group, as systemd and `timeout` do
        os.kill(pids["kill9"], signal.SIGKILL)  # the node only: its children must follow
        codes = {}
        for name in ("term", "int", "group"):
            codes[name] = nodes[name].proc.wait(BOUND_S + 10)
        took = time.monotonic() - t0
        assert codes == {"term": 0, "int": 0, "group": 0}, {k: n.logs()[-1500:] for k, n in nodes.items()}
        assert took < BOUND_S, took
        nodes["kill9"].proc.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(d) for ds in daemons.values() for d in ds):
            time.sleep(0.1)
        for name, ds in daemons.items():
            assert all(gone(d) for d in ds), f"{name}: p2pd {ds} still running"
            assert not os.path.exists(sockets[name][0]), f"{name}: p2pd socket {sockets[name][0]} left behind"
        for name in ("term", "int", "group"):
            assert "left the swarm" in nodes[name].logs()
            assert "Traceback" not in nodes[name].logs()
    finally:
        sw.close()


def test_nodes_die_with_their_launcher(tmp_path):
    """A launcher killed outright (a test or benchmark killed by a timeout) leaves no node behind:
    every node gets SIGTERM when the process that started it dies."""
    import subprocess
    import sys

    from tests.helpers.scripts import ROOT

    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from node.ops import LocalSwarm\n"
        f"sw = LocalSwarm('test', workdir={str(tmp_path / 'swarm')!r})\n"
        "sw.start_bootstrap()\n"
        "n = sw.start_node(0)\n"
        "print(sw.bootstrap.pid, n.pid, flush=True)\n"
        "time.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        launcher.kill()  # SIGKILL: no finally, no atexit in the launcher
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
        assert p2pd_pids_of(pids) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _alive(pid: int) -> bool:
    from node.base import processes

    return any(p.pid == pid and p.alive for p in processes())
