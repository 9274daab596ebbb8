"""The SENTINEL ban flow over real streams: a loopback swarm of separate processes (bootstrap,
head, two replicas of the middle stage, tail; stages/runs/test.toml with SENTINEL on) in which the second
middle replica joins with ``--attack scaling --allow-attacks``. Its neighbours ban it (the tail for
its activations, the head because the tail keeps refusing its output), the honest replica
carries the stage's traffic afterwards, training goes on with a finite loss, nobody honest is
banned, and every process and p2pd is gone at the end. ``tests.helpers.attack_drill`` runs the scenario
(scripts/bench_sentinel.py ``--part real`` reports the same figures); the in-process versions of
each rule are tests/test_sentinel_node.py.

With two replicas the malicious one is not the last of its stage, so the runtime's spare rule
(tests/test_bans_spare.py) does not apply and it must be banned.

The second drill's attacker is adaptive (``swap:fraction=0.5``): it sends the honest codes with
half of the positions' codes permuted among themselves, so the multiset of token vectors -- every
statistic of the paper's (moments, projections, scale) -- is exactly the honest one; only the
checks against the token table (``tok``, ``pos``, ``tokc``, ``shift``) can see it.
"""

from __future__ import annotations

import pytest

from tests.helpers.attack_drill import run_attack_drill

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(150)
def test_a_malicious_replica_is_banned_and_traffic_moves_to_the_honest_one(tmp_path):
    r = run_attack_drill(tmp_path, attack="scaling", honest=1, observe_s=10.0, ban_timeout_s=40.0,
                         ready_timeout_s=90.0)
    logs = f"(logs in {tmp_path / 'swarm'})"
    assert r["banned"], (r, logs)
    # both neighbours ban it: the tail for its activations, the head for its refused output
    assert r["malicious_banned_by"] == ["head", "tail"], (r, logs)
    assert r["bans_by_cause"]["tail"]["verifier"] >= 1
    assert r["bans_by_cause"]["head"]["verifier-downstream"] >= 1
    assert r["rejected_by_tail"] >= 3
    # after the ban the honest replica carries the traffic; the malicious one gets none
    assert r["malicious_served_after_ban"] == 0, r
    assert r["honest_served_after_ban"] >= 5, r
    assert r["malicious_share_after_ban"] == 0.0
    # training goes on, loss finite; nobody honest banned
    assert r["tail_steps_after_ban"] >= 5, r
    assert r["loss_finite"], r
    assert r["honest_banned"] == 0, (r, logs)
    # every node drained and left; no p2pd behind
    assert all(code == 0 for code in r["exit_codes"].values()), r["exit_codes"]
    assert r["p2pd_left"] == 0


@pytest.mark.timeout(180)
def test_an_adaptive_attacker_that_keeps_every_batch_statistic_is_banned(tmp_path):
    r = run_attack_drill(tmp_path, attack="swap:fraction=0.5", honest=1, observe_s=6.0, ban_timeout_s=60.0,
                         ready_timeout_s=90.0)
    logs = f"(logs in {tmp_path / 'swarm'})"
    assert r["banned"], (r, logs)
    assert r["malicious_banned_by"], (r, logs)
    # what caught it: its rejections with a token-table distance over the fence (a swapped tensor
    # is often out on another distance too, e.g. its own pace's scale, and the metrics count
    # each rejection under its worst distance only)
    assert r["malicious_token_flags"] >= 3, (r["malicious_flags_over"], r["reject_reasons"], logs)
    assert r["malicious_served_after_ban"] == 0, r
    assert r["honest_banned"] == 0, (r, logs)
    assert r["loss_finite"], r
    assert all(code == 0 for code in r["exit_codes"].values()), r["exit_codes"]
    assert r["p2pd_left"] == 0
