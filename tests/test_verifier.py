"""The verifier interface (security/verifier.py) and the ban list (security/bans.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from security import BanList, BasicVerifier, SentinelVerifier, ban_weight, describe_rejection, make_verifier
from security.bans import flag_weight
from security.verifier import Verdict, Verifier
from stages import load_manifest

K = 8


def good(B=2, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, K, generator=g), torch.randint(0, 256, (B, L), generator=g)


@pytest.mark.parametrize("cls", [BasicVerifier, SentinelVerifier])
def test_basic_checks(cls):
    v = cls(K, seq_len=16, max_batch=4)
    assert isinstance(v, Verifier)
    x, ids = good()
    assert v.verify("p", "act", x, ids=ids).accept
    cases = {
        "bad-dtype": [x.long(), x.to(torch.float64)],
        "bad-shape": [x[..., :-1], x[0], torch.zeros(2, 17, K), torch.zeros(5, 16, K), torch.zeros(0, 16, K)],
        "non-finite": [x.clone().index_fill_(0, torch.tensor([1]), float("nan")),
                       x.clone().index_fill_(2, torch.tensor([3]), float("inf"))],
    }
    for reason, tensors in cases.items():
        for t in tensors:
            verdict = v.verify("p", "grad", t)
            assert not verdict.accept and verdict.reason == reason, (reason, t.shape, t.dtype, verdict)
    assert v.verify("p", "act", x, ids=ids[:, :-1]).reason == "bad-shape"
    assert v.verify("p", "act", x, ids=ids.float()).reason == "bad-dtype"
    with pytest.raises(ValueError, match="direction"):
        v.verify("p", "forward", x)


def test_sentinel_verifier_from_manifest_and_disabled():
    m = load_manifest("test")
    v = make_verifier(m.sentinel, k=m.k, seq_len=m.model.seq_len, max_batch=8, seed=m.run.seed)
    assert isinstance(v, SentinelVerifier)
    p = v.sentinel.params
    assert (p.warmup, p.window, p.kappa, p.beta_act, p.beta_grad) == (
        m.sentinel.warmup, m.sentinel.window, m.sentinel.kappa, m.sentinel.beta_act, m.sentinel.beta_grad)
    off = make_verifier(m.replace(sentinel={"enabled": False}).sentinel, k=m.k)
    assert type(off) is BasicVerifier
    # the basic verifier accepts what SENTINEL would reject after warm-up
    for i in range(12):
        x, ids = good(seed=i)
        assert v.verify("p", "act", x, ids=ids, mb=i).accept
    x, ids = good(seed=99)
    bad = v.verify("p", "act", x * 50, ids=ids, mb=99)
    assert not bad.accept and bad.reason.startswith("sentinel:") and bad.score > 1
    assert off.verify("p", "act", x * 50, ids=ids).accept


def test_a_rejection_lists_every_distance_over_its_fence():
    """``over`` holds each distance past its fence (distance / fence, largest first, the first one
    the reason); the log line shows them all. A tensor scaled x50 is out on scale and on the
    moments; the same tensor with positions exchanged too is out on the token checks as well."""
    m = load_manifest("test")
    v = make_verifier(m.sentinel, k=K, seq_len=16, max_batch=8, seed=0)
    table = torch.randn(256, K, generator=torch.Generator().manual_seed(5))

    def honest(seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 256, (2, 16), generator=g)
        return table[ids] + 0.3 * torch.randn(2, 16, K, generator=g), ids

    for i in range(40):
        x, ids = honest(i)
        assert v.verify("p", "act", x, ids=ids, mb=i).accept
    x, ids = honest(100)
    scaled = v.verify("p", "act", x * 50, ids=ids, mb=100)
    assert not scaled.accept
    assert list(scaled.over)[0] == scaled.reason.split(":")[1] and "scale" in scaled.over
    assert all(r > 1 for r in scaled.over.values()) and list(scaled.over.values()) == sorted(scaled.over.values(),
                                                                                            reverse=True)
    assert max(scaled.over.values()) == pytest.approx(scaled.score)
    assert "tok" not in scaled.over  # the table's correlation is blind to scale
    x, ids = honest(101)
    both = v.verify("p", "act", x.flip(1) * 50, ids=ids, mb=101)
    assert {"scale", "tok"} <= set(both.over)
    line = describe_rejection(both)
    assert line.startswith(f"{both.reason} (score {both.score:.2f}; over: ")
    assert f"tok {both.over['tok']:.2f}" in line and f"scale {both.over['scale']:.2f}" in line
    # a rule's rejection has no fences to list
    assert describe_rejection(Verdict(False, "non-finite")) == "non-finite"
    assert v.verify("p", "act", x, ids=ids, mb=102).over == {}  # accepted: nothing over


def test_bf16_payloads_are_judged():
    v = SentinelVerifier(K)
    for i in range(14):
        x, ids = good(seed=i)
        assert v.verify("p", "grad", x.to(torch.bfloat16), ids=ids, mb=i).accept
    x, ids = good(seed=50)
    assert not v.verify("p", "grad", (x * 40).to(torch.bfloat16), ids=ids, mb=50).accept


def test_replayed_payload_and_reasons_listed():
    from security.verifier import BASIC_REASONS, SENTINEL_REASONS

    v = SentinelVerifier(K)
    x, ids = good()
    assert v.verify("a", "act", x, ids=ids, mb=1).accept
    assert v.verify("a", "act", x.clone(), ids=ids, mb=1).accept  # retransmission
    r = v.verify("b", "act", x.clone(), ids=ids, mb=2)
    assert r.reason == "replay" and r.reason in SENTINEL_REASONS
    assert set(BASIC_REASONS) == {"bad-dtype", "bad-shape", "non-finite"}
    assert Verdict(True).basis == "basic"


def test_verify_is_safe_from_threads():
    v = SentinelVerifier(K)
    errors = []

    def work(tid):
        try:
            for i in range(20):
                x, ids = good(seed=tid * 100 + i)
                assert isinstance(v.verify(f"p{tid}", "grad", x, ids=ids, mb=(tid, i)), Verdict)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(r["seen"] for r in v.sentinel.peer_report("grad").values()) == 80


# ---------------------------------------------------------------------------- bans


def test_ban_after_flags_in_memory_with_exponential_backoff():
    b = BanList(flags_to_ban=3, memory=5, base_s=10, factor=2, max_s=35)
    assert not b.record("x", True, 0) and not b.record("x", False, 1) and not b.record("x", True, 2)
    assert b.record("x", True, 3, reason="sentinel:tok")  # third flag among the last 5
    assert b.is_banned("x", 12.9) and not b.is_banned("x", 13.0)
    assert b.banned(5) == {"x": 13.0} and b.reason("x") == "sentinel:tok" and b.strikes("x") == 1
    assert not b.record("x", True, 5)  # ignored while banned
    for t in (14, 15):
        b.record("x", True, t)
    assert b.record("x", True, 16) and b.banned(16)["x"] == 36  # second ban: 20 s
    for t in (37, 38, 39):
        b.record("x", True, t)
    assert b.banned(39)["x"] == 39 + 35  # third: 40 s capped at 35
    b.forgive("x")
    assert not b.is_banned("x", 40) and b.strikes("x") == 0


def test_spread_out_flags_never_ban_and_strikes_decay():
    b = BanList(flags_to_ban=3, memory=20, base_s=10, max_s=100, decay_s=50)
    for t in range(200):  # one flag in every 10 verdicts: never 3 in 20
        assert not b.record("honest", t % 10 == 0, t)
    for t in range(3):
        b.record("y", True, t)
    assert b.strikes("y") == 1
    for t in range(200, 203):  # long after the ban ended: the backoff starts over
        b.record("y", True, t)
    assert b.strikes("y") == 1 and b.banned(203)["y"] == 212
    with pytest.raises(ValueError):
        BanList(flags_to_ban=5, memory=3)


def test_flag_weight_by_score_over_the_fence():
    assert flag_weight(1.05, 0.5) == 0.25  # barely over: the floor
    assert flag_weight(1.25, 0.5) == pytest.approx(0.5)
    assert flag_weight(1.5, 0.5) == 1.0 and flag_weight(6.0, 0.5) == 1.0
    # rule rejections (bad shape: score 0; replay: inf) and NaN scores count fully
    assert flag_weight(0.0, 0.5) == 1.0 and flag_weight(float("inf"), 0.5) == 1.0
    assert flag_weight(float("nan"), 0.5) == 1.0
    assert flag_weight(1.05, 0.0) == 1.0  # margin 0: the unweighted rule
    assert ban_weight(Verdict(False, "sentinel:tok", 1.05), 0.5) == 0.25
    assert ban_weight(Verdict(False, "bad-shape"), 0.5) == 1.0  # no score: a rule, counts fully
    with pytest.raises(ValueError):
        flag_weight(1.2, -1.0)


def test_marginal_flags_ban_later_than_clear_ones():
    """Three clear flags ban at once; three marginal ones (weight 0.25) do not, and twelve in
    twenty do (a sender most of whose tensors fail is still banned)."""
    clear, marginal = BanList(flags_to_ban=3), BanList(flags_to_ban=3)
    for t in range(3):
        banned_clear = clear.record("x", True, float(t), weight=flag_weight(3.0, 0.5))
        banned_marg = marginal.record("x", True, float(t), weight=flag_weight(1.05, 0.5))
    assert banned_clear and clear.is_banned("x", 3.0)
    assert not banned_marg and not marginal.is_banned("x", 3.0)
    assert marginal.flag_rate("x") == 1.0  # the spare rule still sees every flag
    hits = [marginal.record("x", True, float(t), weight=0.25) for t in range(3, 12)]
    assert hits[-1] and not any(hits[:-1]) and marginal.is_banned("x", 12.0)
    with pytest.raises(ValueError):
        BanList().record("y", True, 0.0, weight=0.0)
