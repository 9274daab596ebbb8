"""The last replica of a stage is spared a ban while its tensors mostly pass (liveness), and
banned once most of them fail."""

from __future__ import annotations

from security import BanList


def test_spare_ends_the_ban_but_keeps_the_backoff():
    b = BanList(flags_to_ban=3, memory=20, base_s=60.0)
    now = 0.0
    banned = False
    for i in range(20):  # 1 flag in 4: a false-positive rate an honest peer might see
        banned |= b.record("p", i % 4 == 0, now)
    assert banned and b.flag_rate("p") < 0.5 or b.is_banned("p", now)
    b.spare("p", now)
    assert not b.is_banned("p", now)
    assert b.strikes("p") >= 1
    # the next ban lasts longer (backoff kept)
    for _ in range(3):
        b.record("p", True, now + 1)
    assert b.banned(now + 1)["p"] - (now + 1) == 60.0 * 2 ** (b.strikes("p") - 1)


def test_flag_rate_and_no_overflow_after_many_bans():
    b = BanList(flags_to_ban=1, memory=4, base_s=1.0, max_s=10.0)
    assert b.flag_rate("x") == 0.0
    for _ in range(5000):  # 2**5000 would overflow a float
        b.record("x", True, 0.0)
        b.spare("x", 0.0)
    assert b.strikes("x") == 5000
    b.record("x", True, 1.0)
    assert b.banned(1.0)["x"] - 1.0 == 10.0


def test_verdict_score_is_sent_only_for_a_fence_refusal():
    from security import verdict_score
    from security.verifier import Verdict

    assert verdict_score(Verdict(False, "sentinel:swd", score=1.094)) == 1.094
    assert verdict_score(Verdict(False, "sentinel:l1", score=5)) == 5.0
    for score in (0.0, 1.0, 0.4, float("inf"), float("nan"), -2.0):  # a rule's refusal, or no usable score
        assert verdict_score(Verdict(False, "nan", score=score)) is None, score
    assert verdict_score(object()) is None  # a verdict without a score


def test_refusal_weight_of_the_typed_score():
    from security import refusal_weight_of, verdict_score
    from security.bans import flag_weight
    from security.verifier import Verdict

    assert refusal_weight_of(None, 0.5) == 1.0  # no score: a rule's refusal or a ban there counts fully
    assert refusal_weight_of(1.05, 0.5) == 0.25 and refusal_weight_of(4.0, 0.5) == 1.0
    assert refusal_weight_of(1.3, 0.0) == 1.0  # margin 0: unweighted
    for score in (0.0, 1.0, 1.02, 1.1, 1.3, 1.7, 5.9, float("inf")):
        v = Verdict(False, "sentinel:swd", score=score)
        typed = refusal_weight_of(verdict_score(v), 0.5)
        assert typed == (flag_weight(score, 0.5) if 1.0 < score < float("inf") else 1.0), score
