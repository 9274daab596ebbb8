"""Restart: a node killed with -9 and started again with the same identity and checkpoint dir
resumes at its newest checkpoint (same peer id, same stage, optimizer version = the checkpoint's
step) and the swarm trains on.

A two-stage variant of stages/runs/test.toml keeps this to three processes (bootstrap, head, tail).
"""

from __future__ import annotations

import re
import time

import pytest

from node.ops import LocalSwarm
from node.base import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

def test_killed_node_resumes_from_its_checkpoint_with_the_same_identity(tmp_path):
    from node.net.identity import write_identity
    from node.ops import write_manifest
    from stages import load_manifest

    # two stages; the basic verifier instead of SENTINEL (see tests/test_swarm_e2e.py)
    manifest = write_manifest(load_manifest("test").replace(stages={"layout": [[0, 2], [2, 3]]},
                                                            sentinel={"enabled": False}),
                              tmp_path / "two-stage.toml")
    key = tmp_path / "tail.key"
    peer_id = write_identity(key)
    ckpt = tmp_path / "ckpt"
    sw = LocalSwarm(str(manifest), workdir=tmp_path / "swarm")
    try:
        sw.start_bootstrap()
        sw.start_node(0, name="head")
        tail_args = dict(identity=str(key), checkpoint_dir=str(ckpt), extra=["--checkpoint-every", "10"])
        tail = sw.start_node(1, name="tail", **tail_args)
        sw.wait_ready(timeout=150)
        assert f"peer {peer_id} holds stage 1/2" in tail.output()

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_version") < 25:
            time.sleep(0.25)
        sw.kill(tail)
        saved = list_checkpoints(ckpt)
        assert saved, "no checkpoint was written"
        newest = saved[0][0]
        assert newest >= 20 and newest % 10 == 0

        again = sw.start_node(1, name="tail-again", **tail_args)  # the same key and directory
        sw.wait_ready([again], timeout=150)
        out = again.output()
        assert f"resumed stage 1 from checkpoint step {newest}" in out
        assert f"peer {peer_id} holds stage 1/2" in out  # the same identity
        assert re.search(rf"online: stage 1, version {newest}\b", out), out
        # it trains on from there, and the head is back to full speed
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sw.value(again, "swarm_node_version") < newest + 20:
            time.sleep(0.25)
        assert sw.value(again, "swarm_node_version") >= newest + 20, (
            "tail:\n" + again.logs()[-3000:] + "\nhead:\n" + sw.nodes[0].logs()[-6000:])
        assert sw.value(again, "swarm_node_steps_total") >= 20
        losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", again.logs())]
        assert losses and max(losses) < 5.0  # a resumed model, not a fresh one (ln 256 = 5.55)
    finally:
        codes = sw.close()
    assert codes["head"] == 0 and codes["tail-again"] == 0, codes
