"""The false-flag bursts of clean swarms, reproduced on hand-made tensors (security/sentinel.py and
security/bans.py, composed as node/runtime/guard.py composes them).

What a burst in a clean real swarm is (docs/SENTINEL.md, "False flags in clean swarms"): the
swarm stalls (a loaded machine; an averaging round's all-reduce competing for the CPU), the
head's look-ahead extrapolation changes with its measured delays, and its output moves; both
body replicas compute from that output, so the tail sees *both* replicas move, one after the
other. The first one is judged against its own reference while its partner's latest tensor is
still inside the fences, so it is rejected; rejected microbatches bring no gradient back, so it
does not step and sends its next microbatches at the same version, rejected alike. Before: each
of those counted as an independent flag (a ban after three clear ones), and the partner's first
tensor out was rejected too (shift mode needed two tensors out of each replica).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from security import BanList, ban_weight
from security.bans import flag_weight
from security.sentinel import Sentinel, SentinelParams

K = 8
MARGIN = 0.5  # stages/runs/default.toml's sentinel.ban_margin


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def traffic(seed: int, B: int = 8, L: int = 64, vocab: int = 64):
    """Endless honest activations with token structure: x_t = E[id_t] + noise."""
    E = torch.randn(vocab, K, generator=torch.Generator().manual_seed(1234)) + 0.7
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (B, L), generator=g)
        yield ids, E[ids] + 0.5 * torch.randn(B, L, K, generator=g)


class Receiver:
    """The tail of a clean swarm: SENTINEL, then the ban list, as the node's guard does."""

    def __init__(self, **params):
        self.sentinel = Sentinel(SentinelParams(warmup=30, **params))
        self.bans = BanList(flags_to_ban=3, memory=20)
        self.banned: set[str] = set()

    def judge(self, sender: str, x, ids, version: int, t: float):
        j = self.sentinel.judge(sender, "act", x, ids)
        if self.bans.record(sender, not j.accept, t, reason=str(j.reason), weight=ban_weight(j, MARGIN),
                            version=version):
            self.banned.add(sender)
        return j


def run(move_b: bool, a_versions: str, factor: float, stuck: int = 4):
    """Two honest replicas a and b alternate for 80 tensors. Then the upstream move: a's outputs
    grow by ``factor`` (the head's output moved), and a sends ``stuck`` microbatches in a row
    while b is stalled; then they alternate for 20 more tensors each. ``move_b``: b moves the
    same way (the stage-wide move of a clean swarm) or not (a alone jumped, as a replica turning
    malicious does). ``a_versions``: a's tensors after the move come with new versions
    (``"steps"``: it keeps training), the first ``stuck`` with the version it is stuck at and
    then new ones (``"stuck"``: an honest replica whose microbatches were refused), or all with
    one version (``"held"``)."""
    rx = Receiver()
    src = traffic(7)
    version = {"a": 0, "b": 0}
    t = 0.0
    for i in range(80):
        r = "ab"[i % 2]
        version[r] += 1
        ids, x = next(src)
        t += 1.0
        rx.judge(r, x, ids, version[r], t)
    assert rx.banned == set()
    verdicts = {"a": [], "b": []}
    scale = {"a": factor, "b": factor if move_b else 1.0}
    for r in ["a"] * stuck + ["b", "a"] * 20:
        if r == "b" or a_versions == "steps":
            version[r] += 1
        elif a_versions == "stuck" and len(verdicts["a"]) >= stuck:
            version["a"] += 1  # its microbatches get through again: it steps
        ids, x = next(src)
        t += 1.0
        verdicts[r].append(rx.judge(r, x * scale[r], ids, version[r], t))
    return rx, verdicts


@pytest.mark.parametrize("factor", [1.05, 1.25])
def test_the_second_replica_a_stage_wide_move_reaches_is_excused_at_once(factor):
    """a and b both move (by 5%: marginal flags; by 25%: clear ones). a's tensors out before b's
    are rejected against a's own reference; b's first tensor out is accepted as a stage-wide
    shift, since a's latest was out too (before: rejected; shift mode needed b's previous tensor
    out as well, so the move cost one flag more per replica). A small move may not leave b's
    fence at all: the scale is judged against the token table's norms (``position_lognorms``),
    which a's first accepted tensor after the move has already moved."""
    _, verdicts = run(move_b=True, a_versions="stuck", factor=factor)
    a, b = verdicts["a"], verdicts["b"]
    assert not a[0].accept and a[0].reason == "sentinel:scale"
    assert b[0].accept and (b[0].basis == "shift" or b[0].score <= 1.0)
    assert all(j.accept for j in a[-10:] + b[-10:])  # both followed


def first_mover(shift_memory: int, b_inside: int):
    """The trace of an honest ban in a clean real swarm: two replicas alternate; a move reaches
    a first (rejected: b's latest tensor is inside), then b (excused: a is out); b, accepted,
    steps and sends ``b_inside`` tensors back inside; a, refused, gets no gradient, cannot step,
    and sends two more tensors at the same version, moved as before. Returns the receiver and
    a's, then b's, verdicts after the move."""
    rx = Receiver(shift_memory=shift_memory)
    src = traffic(7)
    t = 0.0
    for i in range(80):
        ids, x = next(src)
        t += 1.0
        rx.judge("ab"[i % 2], x, ids, i, t)
    a, b = [], []
    for r, f in [("a", 1.25), ("b", 1.2)] + [("b", 1.0)] * b_inside + [("a", 1.25), ("a", 1.25)]:
        ids, x = next(src)
        t += 0.3
        (a if r == "a" else b).append(rx.judge(r, x * f, ids, 100 if r == "a" else 200 + len(b), t))
    return rx, a, b


def test_the_first_replica_a_stage_wide_move_reaches_is_excused_once_its_partner_moved_too():
    """Before, only the partner's latest tensor counted in the shift vote: a's three clear
    refusals banned it though b had shown the same move (the clean swarm's ban: refusals at
    scores 1.85, 1.65, 1.59 within 1.3 s). A partner out among the direction's last
    ``shift_memory`` tensors counts: a's later tensors are excused and it is not banned. The
    memory is short: four tensors later the same tensor is refused as before."""
    rx, a, b = first_mover(4, 1)
    assert not a[0].accept and a[0].score > 1.5 and b[0].basis == "shift"
    assert [j.accept for j in a[1:]] == [True, True] and {j.basis for j in a[1:]} == {"shift"}
    assert rx.banned == set()
    rx, a, _ = first_mover(0, 1)  # the latest tensors only: the rule before
    assert not any(j.accept for j in a) and rx.banned == {"a"}
    rx, a, b = first_mover(4, 4)  # the partner's move four tensors back
    assert b[0].basis == "shift" and not a[1].accept


@pytest.mark.parametrize("a_versions", ["steps", "held"])
def test_a_replica_jumping_alone_is_still_banned(a_versions):
    """The control: a jumps by 25% (clear flags) and b does not move: no stage-wide shift, and a
    is banned whether it keeps stepping or holds its version (clear flags always count)."""
    rx, verdicts = run(move_b=False, a_versions=a_versions, factor=1.25)
    assert not any(j.accept for j in verdicts["a"][:3])
    assert rx.banned == {"a"}
    assert not any(j.basis == "shift" for j in verdicts["b"])


def test_ban_list_counts_the_marginal_flags_of_one_version_once():
    bans = BanList(flags_to_ban=3, memory=20, version_cap=4)
    # five marginal flags of version 7 weigh 0.5, not 2.5 (four discounted); the sixth counts
    for i in range(5):
        bans.record("p", True, float(i), weight=0.5, version=7)
    assert sum(bans._peers["p"].recent) == pytest.approx(0.5)
    bans.record("p", True, 5.0, weight=0.5, version=7)
    assert sum(bans._peers["p"].recent) == pytest.approx(1.0)
    assert bans.flag_rate("p") == 1.0  # all six were flags, whatever they weighed
    # a sender changing its claimed version every other tensor saves at most version_cap flags
    # between two accepted tensors: ten marginal flags of 0.5 weigh 3, a ban (without: 5)
    juggler = [bans.record("j", True, float(i), weight=0.5, version=i // 2) for i in range(10)]
    assert juggler[-1] and not any(juggler[:-1])
    # an accepted tensor starts a new run of flags that may be discounted
    bans.record("k", True, 0.0, weight=0.5, version=1)
    bans.record("k", True, 1.0, weight=0.5, version=1)
    bans.record("k", False, 2.0)
    bans.record("k", True, 3.0, weight=0.5, version=1)
    assert sum(bans._peers["k"].recent) == pytest.approx(1.0)
    # the largest weight of a version is what counts: 0.25 then 0.75 add up to 0.75
    bans.record("q", True, 0.0, weight=0.25, version=1)
    bans.record("q", True, 1.0, weight=0.75, version=1)
    assert sum(bans._peers["q"].recent) == pytest.approx(0.75)
    # a burst as logged in a clean swarm that banned an honest replica: ten marginal flags
    # (scores 1.10-1.23) within two seconds, all of one version: now one flag and a few more
    burst = [flag_weight(s, MARGIN) for s in (1.10, 1.12, 1.23, 1.15, 1.18, 1.21, 1.11, 1.19, 1.22, 1.14)]
    assert sum(burst) >= 3  # counted one by one: a ban
    assert not any(bans.record("h", True, 10 + i / 10, weight=w, version=77) for i, w in enumerate(burst))
    # clear flags (weight 1) always count in full: a refused poisoner never steps either
    assert [bans.record("r", True, float(i), weight=1.0, version=3) for i in range(3)] == [False, False, True]
    # and so does every flag without a version, as before
    assert [bans.record("s", True, float(i), weight=1.0) for i in range(3)] == [False, False, True]


def moving_away(cap: float, c_end: float = 0.6, n: int = 90, third: bool = False, shuffle_last: int = 0):
    """Replicas a (twice as busy) and b; from tensor 60 on, b's token vectors turn, over ``n``
    tensors, from 0.1 to ``c_end`` of a fixed per-token offset toward another direction (norms
    kept): b's outputs move away from the token table, which holds mostly a's. This is the
    faster replica of a clean real swarm whose look-ahead grew (nine `tok` flags in a row at
    1.18–1.30, banned). ``third``: a third replica like a. ``shuffle_last``: b's last tensors have
    their positions permuted (tokens lost). Returns b's rejections after tensor 60, and the last
    one's verdict."""
    E = torch.randn(64, K, generator=torch.Generator().manual_seed(1234)) + 0.7
    Rb = torch.randn(64, K, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(0)
    s = Sentinel(SentinelParams(warmup=30, own_fence_cap=cap))
    order = "abc" if third else "aab"
    rejected, last = 0, None
    for i in range(60 + n):
        r = order[i % 3]
        ids = torch.randint(0, 64, (8, 64), generator=g)
        rows = E[ids]
        if r == "b":
            c = 0.1 + (c_end - 0.1) * min(1.0, max(0.0, (i - 60) / n))
            turned = rows + c * Rb[ids]
            rows = turned * (rows.norm(dim=-1, keepdim=True) / turned.norm(dim=-1, keepdim=True))
        x = rows + 0.5 * torch.randn(8, 64, K, generator=g)
        if r == "b" and i >= 60 + n - shuffle_last:
            x = x.reshape(-1, K)[torch.randperm(8 * 64, generator=g)].reshape(x.shape)
        j = s.judge(r, "act", x, ids)
        if r == "b" and i >= 60:
            rejected += not j.accept
            last = j
    return rejected, last


def test_a_replica_moving_slowly_away_from_the_shared_token_table_is_judged_by_its_own_level():
    """With two replicas, a replica's token-table distances are fenced by its own accepted values
    (at most ``own_fence_cap`` times the direction's fence): the old rule (cap 1) flags the one
    whose outputs move away from the table, the new one does not; a shuffle is still caught, and
    a move too fast for its own window is still flagged."""
    old, _ = moving_away(cap=1.0)
    assert old >= 3
    new, _ = moving_away(cap=1.5)
    assert new == 0
    _, shuffled = moving_away(cap=1.5, shuffle_last=1)
    assert not shuffled.accept and shuffled.reason == "sentinel:tok" and shuffled.score > 3
    fast, _ = moving_away(cap=1.5, c_end=1.0, n=30)
    assert fast >= 3
    # three voters: the median of their own fences is the fence, and the rule does not apply
    with_third = [moving_away(cap, third=True)[0] for cap in (1.0, 1.5)]
    assert with_third[0] == with_third[1] >= 3


def test_an_averaged_distance_counts_only_beyond_the_spread_of_the_other_voters():
    """tokc / ctxc: two groups of honest replicas (averages 0.40–0.42 and 0.50–0.52): the upper
    group is not above the others by more than two MADs; a sender far above still is."""
    from security.sentinel import excess_over

    others = [0.40, 0.41, 0.42, 0.50, 0.51, 0.52]  # median 0.46, MAD 0.05
    assert excess_over(0.52, others, 0.0) == pytest.approx(0.06)  # the old rule: flagged at a tight fence
    assert excess_over(0.52, others, 2.0) == 0.0
    assert excess_over(0.80, others, 2.0) == pytest.approx(0.18)  # spread over all seven: MAD 0.08 > 0.05
    assert excess_over(0.30, others, 2.0) == 0.0


def test_the_spread_of_an_averaged_distance_counts_the_judged_sender_too():
    """With three other voters, two of which agree, their MAD is 0 and a fourth honest replica a
    little apart was flagged (clean real swarms of four body replicas); counted over all four
    values the spread is that of the replicas, and a sender far above is still flagged."""
    from security.sentinel import excess_over

    others = [0.74, 0.74, 0.78]
    assert statistics.median(abs(o - 0.74) for o in others) == 0.0  # the others' MAD alone
    assert excess_over(0.83, others, 2.0) == pytest.approx(0.05)  # MAD of all four: 0.02
    assert excess_over(0.83, others, 2.0) < 0.06 <= 0.83 - 0.74  # under the floor fence (3 x 0.02)
    assert excess_over(1.20, others, 2.0) == pytest.approx(0.42)
