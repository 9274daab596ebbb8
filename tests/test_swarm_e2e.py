"""End to end: a bootstrap peer and three stage nodes, each its own process with its own p2pd on
loopback, train stages/runs/test.toml; the tail's loss falls clearly below its start; the metrics
endpoint tells the story; SIGTERM drains every node, which exits 0 leaving no p2pd behind.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from node.ops import LocalSwarm, metric_sum
from node.ops.local_swarm import p2pd_pids_of
from tests.helpers.swarm import basic_verifier_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


TRAIN_STEPS = 120  # tail optimizer steps before the loss is judged
SHUTDOWN_BOUND_S = 20.0  # --drain-timeout 10 s plus checkpoint, offline announce and p2pd stop


def logged_losses(text: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"step (\d+) loss ([0-9.]+)", text)]


def test_bootstrap_and_three_stages_train_and_leave_cleanly(tmp_path):
    sw = LocalSwarm(basic_verifier_manifest(tmp_path), workdir=tmp_path / "swarm")
    try:
        sw.start_bootstrap()
        head, body, tail = [sw.start_node(i, name=f"stage{i}", checkpoint_dir=str(tmp_path / f"ckpt{i}"))
                            for i in range(3)]
        sw.wait_ready(timeout=180)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and sw.value(tail, "swarm_node_steps_total") < TRAIN_STEPS:
            assert all(n.proc.poll() is None for n in (head, body, tail)), [n.logs()[-2000:] for n in sw.nodes]
            time.sleep(0.5)
        mt = sw.metrics(tail)
        mh, mb = sw.metrics(head), sw.metrics(body)
        assert metric_sum(mt, "swarm_node_steps_total") >= TRAIN_STEPS, tail.logs()[-3000:]

        # ---- the tail's loss falls clearly below its start (first logged loss is step 1)
        losses = logged_losses(tail.logs())
        assert losses and losses[0][0] == 1, tail.logs()[-2000:]
        start = losses[0][1]
        end = sum(v for _, v in losses[-3:]) / len(losses[-3:])
        assert start > 5.0  # a fresh byte-level model: about ln 256 = 5.55
        assert end < start - 1.5, losses
        assert mt["swarm_node_loss_ema"] < start - 1.5

        # ---- every stage trained on every microbatch; the head's in-flight work is bounded
        for m in (mh, mb, mt):
            assert metric_sum(m, "swarm_node_steps_total") >= TRAIN_STEPS - 10
            assert metric_sum(m, "swarm_node_state", state="online") == 1
            for s in range(3):  # every node sees one online peer per stage
                assert metric_sum(m, "swarm_node_peers", stage=str(s)) == 1
        assert mh["swarm_node_inflight_microbatches"] <= 2  # stages/runs/test.toml: train.max_inflight = 2
        # the metrics are read one node after the other while training goes on: a microbatch the tail
        # has stepped on may still be on its way back (at most train.max_inflight = 2 of them), so
        # what the stages before it count on the way back may trail the tail's steps by that much
        lag = 2
        assert metric_sum(mh, "swarm_node_microbatch_rtt_seconds_count") >= TRAIN_STEPS - lag
        assert metric_sum(mh, "swarm_node_staleness_steps_count") >= TRAIN_STEPS - lag

        # ---- the verifier saw every accepted tensor: activations at body and tail, gradients at head and body
        assert metric_sum(mb, "swarm_node_verifier_verdicts_total", direction="act", verdict="accept") >= TRAIN_STEPS
        assert metric_sum(mt, "swarm_node_verifier_verdicts_total", direction="act", verdict="accept") >= TRAIN_STEPS
        assert metric_sum(mh, "swarm_node_verifier_verdicts_total", direction="grad", verdict="accept") >= TRAIN_STEPS - lag
        assert metric_sum(mb, "swarm_node_verifier_verdicts_total", direction="grad", verdict="accept") >= TRAIN_STEPS - lag

        # ---- wire bytes: k = 8 float32 codes + int32 ids forward, 8 float32 back, plus small headers
        tokens = metric_sum(mh, "swarm_node_tokens_total")
        fwd_out = metric_sum(mh, "swarm_node_wire_bytes_total", protocol="fwd", direction="out")
        bwd_in = metric_sum(mh, "swarm_node_wire_bytes_total", protocol="bwd", direction="in")
        assert 36 <= fwd_out / tokens < 60, fwd_out / tokens
        assert 32 <= bwd_in / tokens < 60, bwd_in / tokens
        assert metric_sum(mt, "swarm_node_loss") > 0

        # ---- health and readiness endpoints
        for n in (head, body, tail):
            assert sw.get(n, "/healthz")[0] == 200
            status, text = sw.get(n, "/readyz")
            assert status == 200 and '"state": "online"' in text
            assert sw.get(n, "/nope")[0] == 404

        # ---- SIGTERM every node mid-training: drain, checkpoint, leave; exit 0 in bound; no p2pd left
        pids = [n.pid for n in (head, body, tail)]
        assert len(p2pd_pids_of(pids)) == 3
        t0 = time.monotonic()
        for n in (head, body, tail):
            n.proc.send_signal(signal.SIGTERM)
        codes = [n.proc.wait(SHUTDOWN_BOUND_S + 10) for n in (head, body, tail)]
        took = time.monotonic() - t0
        assert codes == [0, 0, 0], [n.logs()[-2000:] for n in (head, body, tail)]
        assert took < SHUTDOWN_BOUND_S, took
        time.sleep(0.5)
        assert p2pd_pids_of(pids) == []
        for i, n in enumerate((head, body, tail)):
            assert "left the swarm" in n.logs()
            assert list((tmp_path / f"ckpt{i}").glob("ckpt-*.safetensors")), f"stage {i} wrote no checkpoint"
        assert sw.stop(sw.bootstrap, timeout=15) == 0
        assert p2pd_pids_of([sw.bootstrap.pid]) == []
    finally:
        sw.close()
