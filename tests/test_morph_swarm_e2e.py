"""End to end with morphing: a bootstrap peer and three stage nodes, each its own process with its own
p2pd on loopback, train stages/runs/test.toml with Muon and ``[morph] every = 20``. Every node goes through
at least five morph epochs (seeds dealt over ``/swarm-node/morph/1``, both sides folding their own
side), and the tail's loss falls as far as the same swarm's without morphing.
"""

from __future__ import annotations

import re
import time

import pytest

from node.ops import LocalSwarm, metric_sum
from tests.helpers.swarm import morph_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY = 20
TRAIN_STEPS = 6 * EVERY  # tail steps: the head enters epochs 1..5 at versions 20..100 (and 6 at 120)


def logged_losses(text: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"step (\d+) loss ([0-9.]+)", text)]


def train(tmp_path, every: int):
    """Run the three-stage swarm to TRAIN_STEPS tail steps; returns (losses by step, metrics per node)."""
    sw = LocalSwarm(morph_manifest(tmp_path, every, name=f"morph-{every}.toml"), workdir=tmp_path / f"swarm-{every}")
    try:
        sw.start_bootstrap()
        # the head draws from one fixed shard, so both runs train on the same microbatches in the same order
        nodes = [sw.start_node(i, name=f"stage{i}", extra=["--data-shard", "0"] if i == 0 else None)
                 for i in range(3)]
        sw.wait_ready(timeout=180)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and sw.value(nodes[2], "swarm_node_steps_total") < TRAIN_STEPS:
            assert all(n.proc.poll() is None for n in nodes), [n.logs()[-2000:] for n in sw.nodes]
            time.sleep(0.5)
        metrics = [sw.metrics(n) for n in nodes]
        assert metric_sum(metrics[2], "swarm_node_steps_total") >= TRAIN_STEPS, nodes[2].logs()[-3000:]
        return dict(logged_losses(nodes[2].logs())), metrics, [n.logs() for n in nodes]
    finally:
        sw.close()


def test_three_stage_swarm_trains_across_five_morph_epochs_as_without(tmp_path):
    losses, metrics, logs = train(tmp_path, EVERY)
    for i, m in enumerate(metrics):
        # every stage entered every epoch the head began, by folding (never by a re-download)
        assert metric_sum(m, "swarm_node_morph_epoch") >= 5, (i, logs[i][-3000:])
        assert metric_sum(m, "swarm_node_morphs_total") == metric_sum(m, "swarm_node_morph_epoch")
        assert 0 < metric_sum(m, "swarm_node_morph_seconds") < 5
        assert metric_sum(m, "swarm_node_state", state="online") == 1
        assert "downloading the stage's state again" not in logs[i]
    # the seeds went only where they belong: one dealer per boundary and epoch, each to the one
    # replica across its boundary (the receivers' counts)
    served = [metric_sum(m, "swarm_node_served_total", protocol="morph", result="ack") for m in metrics]
    assert served[0] == 0 and served[1] >= 5 and served[2] >= 5, served
    plain, plain_metrics, _ = train(tmp_path, 0)
    curves = f"morph {sorted(losses.items())}, plain {sorted(plain.items())}"
    print(curves)
    assert losses[1] > 5.0 and plain[1] > 5.0, curves  # a fresh byte-level model: about ln 256 = 5.55
    # the tail's loss EMA (0.9) after TRAIN_STEPS steps on the same microbatches, with and without morphing
    ema = [metric_sum(m[2], "swarm_node_loss_ema") for m in (metrics, plain_metrics)]
    print("loss ema: morph %.3f, plain %.3f" % tuple(ema))
    assert ema[0] < losses[1] - 1.5, (ema, curves)
    assert abs(ema[0] - ema[1]) < 0.3, (ema, curves)
