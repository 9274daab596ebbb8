"""The last replica of a stage is spared a ban while its tensors mostly pass (liveness), and
banned once most of them fail."""

from __future__ import annotations

from security.bans import BanList


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
