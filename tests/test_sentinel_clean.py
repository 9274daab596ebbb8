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

    def __init__(self):
        self.sentinel = Sentinel(SentinelParams(warmup=30))
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
    out as well, so the move cost one flag more per replica)."""
    _, verdicts = run(move_b=True, a_versions="stuck", factor=factor)
    a, b = verdicts["a"], verdicts["b"]
    assert not a[0].accept and a[0].reason == "sentinel:scale"
    assert b[0].accept and b[0].basis == "shift"
    assert all(j.accept for j in a[-10:] + b[-10:])  # both followed


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
