"""scripts/bench_device.py: the reference trainer and the node's runtime pipeline (real
StageRuntimes and verifiers over tests.helpers.memnet), per device, in one JSON object."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_device.py"
pytestmark = pytest.mark.timeout(200)


def _run(*args, timeout=170):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_quick_run_trains_through_the_runtime_and_prints_one_json():
    proc = _run("--quick", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert set(out["devices"]) == {"cpu"}  # --quick stays on the CPU
    cpu = out["devices"]["cpu"]
    ref, pipe = cpu["reference"], cpu["pipeline"]
    assert ref["steps"] == 6 and ref["tokens_per_s"] > 0
    # the reference trainer is seeded: 4.7317 in every run (the pipeline below is timed, not pinned)
    assert ref["val_loss"] == pytest.approx(4.7317, abs=0.002) and ref["val_loss"] < math.log(256)
    # the runtime pipeline trained: the tail stepped (the quick window lasts until 20 tail steps,
    # however slow the machine), every stage kept up, losses finite and falling from the initial
    # ~ln(256), every activation and gradient went through a verifier
    assert pipe["tail_steps"] >= 20 and pipe["tokens_per_s"] > 0 and pipe["losses_finite"]
    assert pipe["loss_last10"] < pipe["loss_first10"]
    assert min(pipe["versions"]) > 10
    assert pipe["verifier_judged"] >= 2 * pipe["tail_steps"]
    assert pipe["verifier_rejected"] < pipe["verifier_judged"] and pipe["bans"] == 0
    s = out["settings"]
    assert s["manifest"] == "test" and s["sentinel"] is True and s["torch"] == torch.__version__


def test_a_device_that_is_not_here_is_refused_clearly():
    proc = _run("--devices", "cpu,cuda:99", "--parts", "reference", "--steps", "1", timeout=60)
    assert proc.returncode != 0
    assert "CUDA is not available here" in proc.stderr or "CUDA device(s) visible" in proc.stderr
    proc = _run("--parts", "reference,nonsense", timeout=60)
    assert proc.returncode != 0 and "unknown ['nonsense']" in proc.stderr


def _bench_module():
    from tests.helpers.scripts import load_script

    return load_script("bench_device")


def test_a_deeper_model_is_split_evenly_over_the_manifests_stages():
    bd = _bench_module()
    m = bd.make_manifest(bd.parse_args(["--quick", "--n-layers", "7", "--d-model", "32", "--batch-size", "3"]))
    assert m.model.n_layers == 7 and m.model.d_model == 32 and m.data.batch_size == 3
    assert [list(x) for x in m.stages.layout] == [[0, 2], [2, 5], [5, 7]]
    with pytest.raises(SystemExit, match="fewer than the manifest's 3 stages"):
        bd.make_manifest(bd.parse_args(["--quick", "--n-layers", "2"]))
