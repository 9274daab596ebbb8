"""Benchmark smoke runs: each ``scripts/bench_*.py --quick`` prints one JSON object, and its key
figures are asserted.

Quality figures at the quick settings are seeded and deterministic: two runs on this machine
print the same digits (and for optim, subspace and asyncmesh, so does a run with two torch
threads instead of one, a different reduction order).
They are pinned close to the measured value (``approx`` below: a few units in the last printed
digit), so a change to a method shows here and the pin is updated on purpose, and checked
against the bench's own target where the quick setting can reach it. The quick settings are the
tiny test model trained for a few steps, so some documented targets (SENTINEL's F1 >= 0.9 and
false-positive rate <= 0.01, the Subspace compression ratio >= 30, asyncmesh's look-ahead gap
<= 0.02) hold only for the full runs in docs/SENTINEL.md, docs/SUBSPACE.md and docs/ASYNCMESH.md;
the pins guard those figures here. Timing figures (throughput, utilisation, overhead) move ~1.6x
between runs of the same code on a shared CPU and get loose floors or ceilings only.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.procs import assert_no_p2pd_left
from tests.helpers.scripts import ROOT


def run_bench(name: str, *args: str, timeout: float = 170) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def approx(expected, tol: float):
    """``expected`` (a number or a flat dict of numbers) within ``tol`` absolute."""
    return pytest.approx(expected, abs=tol, rel=0)


# ------------------------------------------------------------------------------------ SENTINEL

# --quick detection (test model, 4 replicas with 1 malicious, 70 steps, attacks from step 30):
# F1 over the attack phase per attack; 20 malicious and 60 honest tensors each
SENTINEL_QUICK_F1 = {"constant": 0.7442, "zeros": 0.8511, "random": 0.7727, "scaling": 0.8, "negation": 0.8,
                     "sign_flip": 0.7727, "delayed": 0.8511, "bias": 0.4242, "invisible": 0.1429,
                     "adaptive": 0.4865, "mixed": 0.7907}
SENTINEL_QUICK_DELAY = {"constant": 9.0, "zeros": 9.0, "random": 17.0, "scaling": 9.0, "negation": 9.0,
                        "sign_flip": 9.0, "delayed": 9.0, "bias": 33.0, "invisible": None, "adaptive": 29.0,
                        "mixed": 17.0}


@pytest.mark.timeout(150)
def test_bench_sentinel_quick_detection():
    """Part 1 at --quick: F1 and false-positive rate of every classic attack, who is banned and
    when (the same figures as the plain --quick run of parts 1 and 2)."""
    from security import ADAPTIVE_FAMILIES, ATTACKS

    r = run_bench("bench_sentinel", "--quick", "--part", "detection")
    assert r["part"] == "detection" and r["quick"] is True
    attacks = r["attacks"]
    assert set(attacks) == set(ATTACKS) - set(ADAPTIVE_FAMILIES)  # part 1's list: the classic attacks
    # one tensor more or less in any attack's counts moves its F1 by more than 0.004: exact pins
    assert {a: v["f1"] for a, v in attacks.items()} == approx(SENTINEL_QUICK_F1, 0.002)
    assert {a: v["delay_steps"] for a, v in attacks.items()} == SENTINEL_QUICK_DELAY
    for a, v in attacks.items():
        assert set(v) >= {"precision", "recall", "f1", "delay_steps", "delay_sends"}, a
        t = v["tensors"]
        assert t["tp"] + t["fn"] == 20 and t["fp"] + t["tn"] == 60, a
        # the malicious replica is banned by every attack but the one built to pass (invisible)
        assert v["banned_malicious"] == ([] if a == "invisible" else ["body-3"]), a
    # the blatant attacks: at least 4 of 5 tensors rejected in each direction
    for a in ("constant", "zeros", "random", "scaling", "negation", "sign_flip", "delayed", "mixed"):
        assert min(attacks[a]["recall_by_direction"].values()) >= 0.8, a
    # honest false positives over the run after warm-up: 10 of 264 verdicts (one is 0.0038)
    assert r["fpr"] == approx(0.03788, 0.001) and r["detection"]["fpr_tensors"] == 264
    # overhead is timing (the tiny model's forward is ~3 ms): 2.5 and 3.0 measured; a ceiling only
    assert 0 < r["overhead_frac"] < 10


@pytest.mark.timeout(150)
def test_bench_sentinel_quick_damage():
    """Part 2 at --quick: the closed-loop damage of the strongest attack with and without SENTINEL
    (60 steps, attack from step 15), and the bench's target: within 2% of the clean run."""
    r = run_bench("bench_sentinel", "--quick", "--part", "damage")
    assert r["part"] == "damage" and r["damage"]["settings"]["steps"] == 60
    vl = r["val_loss"]
    assert r["val_loss_attack"] == "adaptive"
    assert vl == approx({"clean": 3.3158, "attacked_with_sentinel": 3.3634,
                         "attacked_without_sentinel": 3.3669}, 0.002)
    assert r["targets_met"]["with_sentinel_within_2pct"] is True
    assert vl["attacked_with_sentinel"] <= 1.02 * vl["clean"]
    assert vl["attacked_with_sentinel"] < vl["attacked_without_sentinel"]
    detail = r["damage"]["detail"]["attacked_with_sentinel"]
    assert detail["banned_at_step"] == {"body-3": [51]} and detail["no_replica_steps"] == 0


@pytest.mark.timeout(150)
def test_bench_sentinel_quick_harm():
    """--part harm at --quick: the honest replicas' natural harm (the threshold), the honest
    false-positive rate, and which attack families pass the harm criterion (recall >= 0.9 where
    the harm exceeds the threshold, and nothing above it accepted from an attacker never banned)."""
    r = run_bench("bench_sentinel", "--quick", "--part", "harm")
    h = r["harm"]
    assert h["settings_used"]["steps"] == 50 and h["settings_used"]["attack_start"] == 25
    assert h["threshold_basis"] == "pair"
    assert h["threshold"] == approx({"act": 0.02054, "grad": 0.23227}, 2e-5)
    assert {d: h["natural_harm"]["pair"][d]["median"] for d in ("act", "grad")} == h["threshold"]
    assert h["fpr"] == approx(0.10417, 0.001)
    ok = {f for f, v in h["families"].items() if v["ok"]}
    assert ok == {"zeros", "negation", "delayed", "drift"}
    assert r["targets_met"]["harm_every_family"] == {f: f in ok for f in h["families"]}
    # the blatant attacks are rejected or banned: nothing of theirs accepted above zero harm
    for f in ("constant", "zeros", "random", "negation", "sign_flip", "delayed", "adaptive", "mixed"):
        assert h["families"][f]["under_fence"] == {"act": 0.0, "grad": 0.0}, f
    for f in ("zeros", "negation", "delayed"):
        assert h["families"][f]["recall_above_threshold"] == {"act": 1.0, "grad": 1.0}, f
    # the white-box rider that bisects against the receiver's own verdict passes at this size
    assert h["families"]["fence"]["under_fence"] == approx({"act": 1.0552, "grad": 0.97218}, 2e-4)


# ------------------------------------------------------------------------------ optimizers


@pytest.mark.timeout(150)
def test_bench_optim_quick():
    """NuMuon vs Muon vs AdamW and the warm-up experiment at --quick (d 32, 4 layers, 12 steps)."""
    out = run_bench("bench_optim", "--quick")
    assert out["settings"]["quick"] is True
    assert out["optim_settings"]["numuon"]["rank_start"] == 0.5
    assert out["val_loss"] == approx({"adamw": 4.9639, "muon": 4.9752, "numuon": 4.9443,
                                      "numuon_vs_muon": 0.9938}, 0.002)
    trunc = out["trunc_loss_increase"]
    assert trunc["adamw"] == approx({"0.25": 0.0516, "0.5": 0.0179}, 0.001)
    assert trunc["muon"] == approx({"0.25": 0.1283, "0.5": 0.0253}, 0.001)
    assert trunc["numuon"] == approx({"0.25": 0.0444, "0.5": 0.0047}, 0.001)
    energy = out["weight_tail_energy"]
    assert energy["adamw"] == approx({"0.25": 0.5161, "0.5": 0.2488}, 0.001)
    assert energy["muon"] == approx({"0.25": 0.5505, "0.5": 0.2691}, 0.001)
    assert energy["numuon"] == approx({"0.25": 0.4088, "0.5": 0.1428}, 0.001)
    # the two optimizer targets (docs/TRAINING.md), met at the quick settings too
    t = out["targets"]
    assert t["numuon_trunc_below_muon_and_adamw"] is True and t["numuon_val_within_3pct_of_muon"] is True
    assert t["numuon_trunc_below_on_every_seed"] == {"muon": 1, "adamw": 1}
    assert all(trunc["numuon"][f] < min(trunc["muon"][f], trunc["adamw"][f]) for f in ("0.25", "0.5"))
    assert out["val_loss"]["numuon_vs_muon"] <= 1.03
    for name in ("adamw", "muon", "numuon"):
        # removing more of every matrix removes more of its energy; NuMuon's tails are the lightest
        assert energy[name]["0.25"] > energy[name]["0.5"]
        assert set(out["trunc_by_kind"][name]["0.25"]) >= {"qkv_proj", "out_proj", "down_proj"}
    assert energy["numuon"]["0.25"] < min(energy["muon"]["0.25"], energy["adamw"]["0.25"])
    # warm-up experiment: the sweep's first lr already fails the baseline; at 12 steps every run
    # stalls (the warm-up's advantage needs the full schedule, docs/TRAINING.md)
    w = out["warmup"]
    assert set(w) >= {"how_lr_chosen", "lr_sweep", "per_seed", "settings", "sharpness_trace"}
    assert w["lr"] == 0.1 and w["seeds"] == [0, 1]
    assert {"baseline": w["baseline_final"], "warmup": w["warmup_final"]} == approx(
        {"baseline": 3.6743, "warmup": 3.9447}, 0.002)
    assert w["baseline_failed"] == 2 and w["warmup_failed"] == 2
    assert w["unigram_val_loss"] == approx(3.445, 0.001)
    assert w["baseline_spikes"] == 1 and w["warmup_spikes"] == 1
    assert w["max_sharpness"]["baseline"] > 0 and w["eos_bound_at_peak_lr"] == approx(380.0, 0.1)


# -------------------------------------------------------------------------------- Subspace


@pytest.mark.timeout(150)
def test_bench_subspace_quick():
    """Dense vs subspace at --quick (test model, d 64, k 8, 8 steps): the codec is exact, the chain
    equals the unsplit model, and the validation gap is within the 5% target."""
    out = run_bench("bench_subspace", "--quick", "--threads", "1")
    s = out["settings"]
    assert s["steps"] == 8 and s["d_model"] == 64 and s["threads"] == 1
    assert out["bytes_per_token"] == {"dense": {"fwd": 129, "bwd": 128}, "subspace": {"fwd": 17, "bwd": 16}}
    # d 64: 257 / 33 bytes per token; the >= 30 target is the d-256 model's
    assert out["compression_ratio"] == round((129 + 128) / 33, 3)
    # round-trip through the bf16 wire: float32 rounding, 3.0e-7 measured (target: exact)
    assert out["codec_max_rel_error"] <= 1e-6
    assert out["chain_vs_unsplit_max_abs_logit_diff"] <= 2e-6  # 4.2e-7 measured
    assert {"dense": out["val_loss_dense"], "subspace": out["val_loss_subspace"]} == approx(
        {"dense": 4.5374, "subspace": 4.668}, 0.002)
    assert out["val_loss_gap_rel"] == approx(0.0288, 0.0005) and out["val_loss_gap_rel"] <= 0.05
    assert out["train_loss_curve"]["subspace"][-1][1] < out["train_loss_curve"]["subspace"][0][1] - 0.5
    # timing is the benchmark's to report, not a test's to bound: on a shared machine a busy
    # neighbour halved subspace's throughput against dense's in one run (measured idle: codec
    # 0.077-0.079 of a stage's forward, subspace throughput 1.4x-9x dense's). Here: it was measured
    assert 0 < out["codec_time_frac"] < 1
    tps = out["tokens_per_s"]
    assert tps["dense"] > 0 and tps["subspace"] > 0


# ------------------------------------------------------------------------------- asyncmesh


@pytest.mark.timeout(150)
def test_bench_asyncmesh_quick():
    """Pipeline modes and sparse averaging at --quick (test model, 8 steps of 2 x 16 tokens)."""
    out = run_bench("bench_asyncmesh", "--quick", "--avg-every-extra", "3", "--other-targets", "update",
                    "--manifest-optim", "--other-horizon", "--lookahead-horizon", "pipeline")
    s = out["settings"]
    assert s["steps"] == 8 and s["lookahead_target"] == "momentum"  # the manifest's default
    # --lookahead-horizon overrides the manifest's for the main runs; the other one runs beside
    assert s["lookahead_horizon"] == "pipeline"
    assert out["val_loss"] == approx({"gpipe": 4.7822, "async_none": 4.9009, "async_lookahead": 4.9013,
                                      "async_lookahead_update": 4.8861,
                                      "async_lookahead_stage_horizon": 4.9009,
                                      "gpipe_extrapolated": 4.7824}, 0.002)
    assert all(v < math.log(256) for v in out["val_loss"].values())  # every mode trained
    # the synchronous run with the extrapolation is not the plain GPipe run; the stage horizon
    # is not the pipeline horizon
    assert out["val_loss"]["gpipe_extrapolated"] != out["val_loss"]["gpipe"]
    assert out["val_loss"]["async_lookahead_stage_horizon"] != out["val_loss"]["async_lookahead"]
    assert out["lookahead_gap_rel"] == approx(0.0249, 0.0005)
    assert out["none_gap_rel"] == approx(0.0248, 0.0005)
    # the shipped manifest's optimizer (AdamW) as a second regime next to NAdam's: there look-ahead
    # beats plain async (docs/ASYNCMESH.md's target, met with the shipped optimizer)
    assert out["manifest_optim_settings"]["name"] == "adamw" and s["pipeline_optim"]["name"] == "nadam"
    assert out["val_loss_manifest_optim"] == approx({"gpipe": 4.6364, "async_none": 4.8088,
                                                     "async_lookahead": 4.7919,
                                                     "async_lookahead_update": 4.7835,
                                                     "async_lookahead_stage_horizon": 4.8084,
                                                     "gpipe_extrapolated": 4.6305}, 0.002)
    assert out["lookahead_beats_none_manifest_optim"] is True
    assert out["val_loss_manifest_optim"]["async_lookahead"] < out["val_loss_manifest_optim"]["async_none"]
    # prediction error of Ŵ vs plain async's stash, per stage; the tail (τ = 0) has none
    for errs in out["lookahead_prediction_error_rel"].values():
        assert errs[-1] is None and all(0 < e < 10 for e in errs[:-1])
    # sparse averaging: replicas and their consensus within 2% of full averaging every step (the
    # target), at a quarter of its bytes (the >= 10 bytes ratio needs a smaller slice)
    assert out["averaging_val_loss"] == approx({"full_every_step": 4.6695, "sparse": 4.722,
                                                "sparse_corrected": 4.7207}, 0.002)
    assert out["averaging_consensus_val_loss"]["sparse"] == approx(4.742, 0.002)
    # identical replicas (full averaging every step): the consensus is each replica
    full = out["averaging_val_loss"]["full_every_step"]
    assert out["averaging_consensus_val_loss"]["full_every_step"] == full
    assert out["sparse_avg_gap_rel"] == approx(0.011, 0.0005) and out["sparse_avg_gap_rel"] <= 0.02
    gap = out["sparse_avg_consensus_gap_rel"]
    assert gap == approx(0.016, 0.0005) and gap <= 0.02
    # a quarter of the parameters every 2nd step; the corrected variant also sends first moments
    sent = out["avg_bytes_per_replica"]
    assert out["avg_bytes_ratio"] == 4.0 and sent["full"] == 4 * sent["sparse_corrected"] == 8 * sent["sparse"]
    h3 = out["averaging_other_H"]["3"]
    assert h3["avg_every"] == 3 and h3["avg_bytes_ratio"] == {"sparse": 16.0, "sparse_corrected": 8.0}
    assert h3["gap_rel"] == approx({"sparse": 0.0096, "sparse_corrected": 0.0063}, 0.0005)
    assert set(h3["consensus_gap_rel"]) == {"sparse", "sparse_corrected"}
    assert max(h3["consensus_gap_rel"].values()) <= 0.02
    # utilisation is simulated from measured stage times: async 0.60 and 0.48, GPipe 0.59 and 0.62
    # measured; a floor at 0.3 of the documented 0.932
    u = out["utilisation"]
    assert u["async"] > 0.28 and u["async_max_inflight_8"] > 0.28 and u["gpipe"] > 0


# ------------------------------------------------------------------------------- transport


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_transport_quick():
    """Two processes with their p2pd daemons: our frames vs hivemind's protobuf path vs a bare
    stream, 8 MiB payloads. Goodput is timing only: floors well under the targets."""
    r = run_bench("bench_transport", "--quick")
    g = r["goodput_mib_s"]
    assert set(g) == {"ours", "protobuf", "raw"} and all(v > 0 for v in g.values())
    assert r["ratio_vs_protobuf"] == round(g["ours"] / g["protobuf"], 2)
    assert r["ratio_vs_raw_stream"] == round(g["ours"] / g["raw"], 2)
    assert r["targets"]["ratio_vs_protobuf"] == ">= 3" and r["targets"]["ratio_vs_raw_stream"] == ">= 0.8"
    # measured 3.75 and 2.24 vs protobuf, 1.22 and 0.85 vs the bare stream: floors at 0.3 and
    # 0.5 of the targets
    assert r["ratio_vs_protobuf"] >= 0.9 and r["ratio_vs_raw_stream"] >= 0.4
    assert 0 < r["rtt_small_p50_ms"] <= r["rtt_small_p99_ms"]
    assert {(m["path"], m["payload_mib"], m["streams"]) for m in r["matrix"]} == {
        ("ours", 8, 1), ("protobuf", 8, 1), ("raw", 8, 1)}
    assert all(m["errors"] == 0 and m["cpu_s_per_gib"] > 0 for m in r["matrix"])
    assert r["settings"]["quick"] is True
    assert_no_p2pd_left()
