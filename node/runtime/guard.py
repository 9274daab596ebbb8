"""The guard of a stage: SENTINEL verdicts on every accepted tensor, bans, the downstream rule,
and re-sync while this replica is banned elsewhere.

- **Every accepted tensor passes the verifier first** (activations on ``fwd``, gradients on
  ``bwd``), off the event loop on its own thread with its own small torch thread count (so it
  never competes with the compute worker for cores); verdicts are counted by reason, and a sender
  flagged ``sentinel.flags_to_ban`` times among its last 20 verdicts is banned, routed around, and
  forgotten by the verifier (a later return is judged afresh, as a newcomer).
- **Downstream rule**: a next hop whose *own output* the stage after it refused several times in
  a row (its ``skip`` with ``refused: own``) is banned here too, so the stage before a poisoner
  stops sending it work.
- **Re-sync**: while a neighbour answers ``banned`` to us, this replica keeps fetching another
  replica's weights, so it does not come back with weights a whole ban old; and when the next
  stage refuses one of our outputs clearly, or ``resync_after_refusals`` in a row, it fetches
  them once before any ban (``own_output_refused``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import torch

from node.runtime.options import RuntimeOptions
from node.runtime.worker import Tasks, pin_torch_threads
from protocol import Reason
from security import BanList, OneVersion, ban_weight, describe_rejection, refusal_weight_of
from stages import SentinelConfig

log = logging.getLogger("swarm_node.runtime")

# after the next stage refuses a replica's output, the next this many microbatches for its stage go
# to other replicas when there are any (``Router.cool``)
REFUSAL_COOL_CHOICES = 2


class Guard:
    """Verdicts and bans of one stage (``index``); see the module docstring."""

    def __init__(self, index: int, sentinel: SentinelConfig, options: RuntimeOptions, *, verifier, router,
                 metrics, tasks: Tasks, resync: Callable[[], Awaitable[bool]], verdict_log=None):
        self.index, self.sentinel, self.options = index, sentinel, options
        self.verdict_log = verdict_log  # a text file: one JSON object per verdict (``--verdict-log``)
        self.verifier, self.router, self.metrics, self.tasks = verifier, router, metrics, tasks
        self.resync = resync  # fetch and adopt another replica's weights; False when none gave them
        self.banlist = BanList(flags_to_ban=sentinel.flags_to_ban, memory=max(20, sentinel.flags_to_ban),
                               base_s=options.ban_flags_seconds)
        # next hop -> (refused?, what the refusal weighed) of its recent outputs, and its versions
        self.downstream: dict[str, collections.deque] = {}
        self.downstream_versions: dict[str, OneVersion] = {}
        # sender -> tensors of it our verifier accepted since we last banned it (``last_replica``)
        self.passed: collections.Counter = collections.Counter()
        self.banned_at: float | None = None  # when a neighbour last answered "banned"
        self.last_accepted = 0.0  # when a neighbour last accepted a fwd or a gradient of ours
        self.resync_task: asyncio.Task | None = None
        self.refused_in_a_row = 0  # our outputs the next stage's verifier refused since one was accepted
        self.refusal_resync_at = -math.inf  # when ``own_output_refused`` last started a re-sync
        self.stopping = False
        self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="verify")

    def start(self) -> None:
        pin_torch_threads(self._verify_pool, self.options.verify_threads)

    def stop(self) -> None:
        self.stopping = True
        self._verify_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ verdicts

    async def verify(self, peer: str, direction: str, tensor: torch.Tensor, version: int,
                     ids: torch.Tensor | None, mb: int):
        """Run the verifier off the event loop; count the verdict; ban a sender whose recent
        tensors keep being flagged (``security.bans.BanList``: flags_to_ban of the last 20, each
        flag weighted by how far its score is over the fence, ``sentinel.ban_margin``; the flags
        of tensors of one sender ``version`` count once, see ``BanList.record``)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        call = functools.partial(self.verifier.verify, peer, direction, tensor, step=version, ids=ids, mb=mb)
        verdict = await loop.run_in_executor(self._verify_pool, call)
        self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        label = "accept" if verdict.accept else "reject"
        if verdict.accept:
            self.passed[peer] += 1
            if len(self.passed) > 4096:  # peers come and go: keep the ones we still know
                self.passed = collections.Counter({p: n for p, n in self.passed.items() if p in self.router.peers})
        self.metrics.verdicts.labels(direction=direction, verdict=label, reason=verdict.reason or "ok").inc()
        if self.verdict_log is not None:
            self._log_verdict(peer, direction, version, mb, verdict)
        if not verdict.accept:
            log.warning("verifier rejected %s from %s: %s", direction, peer[-8:], describe_rejection(verdict))
        now = time.monotonic()
        mostly_ok = self.banlist.flag_rate(peer) < 0.5
        weight = ban_weight(verdict, self.sentinel.ban_margin)
        if self.banlist.record(peer, not verdict.accept, now, reason=str(verdict.reason or ""), weight=weight,
                               version=version) \
                and mostly_ok and self.last_replica(peer, self.index - 1 if direction == "act" else self.index + 1):
            # A ban exists to route around a peer. With no other replica of its stage it would only
            # stop the pipeline, so a sender whose tensors mostly pass is spared (its flagged tensors
            # are still dropped one by one); one whose tensors mostly fail is banned all the same.
            self.banlist.spare(peer, now)
            log.warning("%s keeps failing verification (%s) but no other replica of its stage is established "
                        "here: not banned; its flagged tensors are dropped", peer[-8:], verdict.reason)
        elif self.banlist.is_banned(peer, now) and peer not in self.router.banned():
            self._ban(peer, now, "verifier", f"its {direction} tensors keep failing verification ({verdict.reason})")
        return verdict

    def _log_verdict(self, peer: str, direction: str, version: int, mb: int, verdict) -> None:
        """One line of the ``--verdict-log``: who sent what, the verdict, every distance and
        those over their fences (what a false flag needs to be traced; the log line names the
        worst only)."""
        def num(v):
            v = float(v)
            return round(v, 5) if math.isfinite(v) else str(v)

        rec = {"time": round(time.time(), 3), "peer": peer, "direction": direction, "version": version, "mb": mb,
               "accept": bool(verdict.accept), "reason": verdict.reason, "score": num(verdict.score or 0.0),
               "basis": verdict.basis, "over": {k: num(v) for k, v in (getattr(verdict, "over", None) or {}).items()},
               "distances": {k: num(v) for k, v in (verdict.distances or {}).items()}}
        try:
            self.verdict_log.write(json.dumps(rec) + "\n")
            self.verdict_log.flush()
        except (OSError, ValueError) as e:  # a full disk or a closed file: stop logging, keep verifying
            log.error("verdict log: cannot write (%s); not logging verdicts any more", e)
            self.verdict_log = None

    def _ban(self, peer: str, now: float, cause: str, why: str) -> None:
        """``peer`` collected enough flags (``banlist`` banned it): route around it for the ban's
        duration, and make the verifier forget it, so its references no longer vote in the
        stage's median (with two replicas, half of it) and its return after the ban is judged
        from its first tensor against the honest majority, as a newcomer."""
        until = self.banlist.banned(now).get(peer, now)
        self.router.ban(peer, until - now, cause)
        self.passed.pop(peer, None)  # back from the ban, it proves itself again (``last_replica``)
        self.metrics.bans.labels(cause=cause).inc()
        forget = getattr(self.verifier, "forget", None)
        if forget is not None:  # on the verifier's thread, after the verdicts already queued there
            with contextlib.suppress(RuntimeError):  # the pool is shut down: we are stopping
                self._verify_pool.submit(forget, peer)
        log.warning("banned %s for %.0f s: %s", peer, until - now, why)

    def downstream_outcome(self, peer: str, refused: bool, score: float | None = None, detail: str = "",
                           version: int | None = None) -> None:
        """What became of the output of ``peer`` (our next hop): the next stage refused it (``peer``
        itself reports that with a ``skip`` marked ``refused: own``, carrying the next stage's
        verifier score when a fence refused) or it got through (a gradient came back from
        ``peer``). Without this a replica whose activations are always refused never returns a
        gradient for us to judge, and we would keep routing work to it.

        Its own rule, not flags in ``banlist``: ban when the last ``flags_to_ban + 2`` outputs were
        ALL refused and those refusals weigh at least ``flags_to_ban``. A poisoner's are (it is
        banned after that many microbatches); an honest replica's are refused at the next stage's
        false-positive rate, a few percent, and mixing those into the 3-of-20 rule with our own
        false positives on its gradients banned an honest replica in a real run.

        Weights: a refusal counts the next stage's own flag weight of its score (``refusal_weight_of``:
        a score of 1 + ``ban_margin`` or more, a rule's rejection without a score, or a ban there:
        1; barely over the fence: 0.25). Honest refusals are not independent: when a replica's
        statistics drift they come in bursts of marginal scores (six in a row at 1.08–1.14 in a
        clean real swarm, which banned an honest replica under the unweighted rule); those no
        longer ban here. A replica that keeps sending marginal tensors is still refused each time
        (nothing reaches the model) and is banned by the next stage's weighted flags, whose
        "banned by the next stage" refusals then count fully here. The last replica of a stage is
        never banned this way (nothing to route to instead; the next stage drops what it refuses
        anyway).

        ``version``: the hop's version its skip came with; marginal refusals of one version count
        once (``security.bans.OneVersion``, as in the ban list): a replica whose outputs are
        refused does not step, and an honest one's burst of six marginal refusals of one version
        banned it here in a clean real swarm."""
        flags_to_ban = self.sentinel.flags_to_ban
        recent = self.downstream.setdefault(peer, collections.deque(maxlen=flags_to_ban + 2))
        versions = self.downstream_versions.setdefault(peer, OneVersion())
        if not refused:
            recent.append((False, 0.0))
            versions.accepted()
            self.router.cool(peer, 0)
            return
        recent.append((True, versions.count(refusal_weight_of(score, self.sentinel.ban_margin), version)))
        self.router.cool(peer, REFUSAL_COOL_CHOICES)
        log.info("the next stage refused the output of %s (%s)", peer[-8:], detail)
        if len(recent) < recent.maxlen or not all(r for r, _ in recent) or sum(w for _, w in recent) < flags_to_ban \
                or peer in self.router.banned() or self.last_replica(peer, self.index + 1):
            return
        recent.clear()
        versions.reset()
        now = time.monotonic()
        self.banlist.ban(peer, now, reason="downstream")
        self._ban(peer, now, "verifier-downstream", f"the next stage refused its last {recent.maxlen} outputs ({detail})")

    def last_replica(self, peer: str, stage: int) -> bool:
        """True if no other replica of ``peer``'s stage could take its work: none online, unbanned
        and **established** with us (``established``). A ban exists to route around a peer; a
        replica that has just joined, or whose tensors mostly fail here, is no replacement. Without
        this, an honest replica that collected marginal flags while it was alone (the statistics
        move fast early in training) was banned the moment a newcomer appeared, which left the
        newcomer alone in the stage: a way for a poisoner to take a stage over by joining it.

        ``stage`` is the stage its tensors tell (the one before ours for activations, the one
        after for gradients and for a next hop's outputs), not its DHT record's: a record missing
        from one DHT read (an announcement late on a loaded machine, an expired record) drops the
        peer from the router (``Router.update``), and a peer we could not place was treated as
        replaceable, so a lone honest replica with a few marginal flags was banned."""
        return not [p for p in self.router.stage_peers(stage) if p.peer_id != peer and self.established(p.peer_id)]

    def established(self, peer: str) -> bool:
        """``peer`` has sent us at least ``max(sentinel.warmup, flags_to_ban)`` tensors that our
        verifier accepted (since its last ban here), most of its recent ones pass, and, where it is
        our next hop, the next stage refused fewer than half of its recent outputs
        (``downstream``). Our verifier sees only what a next hop sends back (gradients); a
        poisoner whose gradients pass here while the stage after it refuses its activations is
        no replacement for anyone."""
        need = max(self.sentinel.warmup, self.sentinel.flags_to_ban)
        if self.passed[peer] < need or self.banlist.flag_rate(peer) >= 0.5:
            return False
        recent = self.downstream.get(peer)
        return not recent or 2 * sum(refused for refused, _ in recent) < len(recent)

    def is_banned_sender(self, peer: str) -> bool:
        return self.banlist.is_banned(peer, time.monotonic())

    def banned_by_next_stage(self) -> bool:
        """A replica of the next stage answered ``banned`` to us and its ban in our router (that
        answer's cause) still runs."""
        now = time.monotonic()
        return any(p.ban_cause == Reason.BANNED.value and p.banned_until > now
                   for p in self.router.stage_peers(self.index + 1, include_banned=True))

    # ------------------------------------------------------------------ re-sync after a ban

    def note_accepted(self) -> None:
        """A neighbour accepted a fwd or a gradient of ours."""
        self.last_accepted = time.monotonic()
        self.refused_in_a_row = 0

    def own_output_refused(self, score: float | None = None) -> bool:
        """The next stage's verifier refused an output of ours (its answer to our fwd, with the
        refusing verifier's ``score``). After ``resync_after_refusals`` in a row, with nothing of
        ours accepted in between, or at once for a clear refusal (one that counts fully toward a
        ban there, ``refusal_weight_of`` 1: a score of 1 + ``ban_margin`` or more, or none), fetch
        another replica's weights (at most once per ``resync_every``); True if that started.

        A refused output brings no gradient back, so a replica whose outputs the next stage
        refuses does not step: nothing it does changes what it sends, and its next outputs are
        refused too until it is banned. In clean real swarms that was how honest replicas were
        banned: one of two body replicas, after an averaging round, sent outputs a little out of
        its own fences (scores 1.03–1.34) for twenty seconds at one version while its partner,
        accepted, kept stepping; thirteen refusals and a ban (docs/SENTINEL.md). Its partner's
        weights are what the next stage accepts. Three clear refusals ban a sender, and the outputs
        already on their way when the first comes back are refused too (two or three within a
        second in clean swarms), so a clear one starts the re-sync at once. A malicious next stage
        can make an honest replica re-sync once per ``resync_every`` this way; it can already
        refuse all its work."""
        self.refused_in_a_row += 1
        every = self.options.resync_after_refusals
        clear = refusal_weight_of(score, self.sentinel.ban_margin) >= 1.0
        now = time.monotonic()
        if every <= 0 or (self.refused_in_a_row < every and not clear) or self.stopping \
                or now - self.refusal_resync_at < self.options.resync_every \
                or (self.resync_task is not None and not self.resync_task.done()):
            return False
        log.info("the next stage refused %d output(s) of ours in a row (the last at score %s): fetching another "
                 "replica's weights", self.refused_in_a_row, "-" if score is None else f"{score:.2f}")
        self.refused_in_a_row = 0
        self.refusal_resync_at = now
        self.resync_task = self.tasks.spawn(self.resync())
        return True

    def note_banned(self) -> None:
        """A neighbour answered "banned": while nothing of ours is accepted, keep this replica's
        weights caught up with another replica of the stage (``_resync_while_banned``)."""
        self.banned_at = time.monotonic()
        if self.options.resync_every > 0 and not self.stopping and (
                self.resync_task is None or self.resync_task.done()):
            self.resync_task = self.tasks.spawn(self._resync_while_banned())

    async def _resync_while_banned(self) -> None:
        """Every ``resync_every`` seconds, until a fwd or bwd of ours is accepted again (or four
        first-ban lengths have passed), fetch another replica's weights. A banned replica gets no
        work, so without this it came back with weights a whole ban old, was judged (as a
        newcomer) against the replica that kept training, and was banned again at once: in every
        clean real swarm that banned an honest replica (docs/SENTINEL.md)."""
        limit = time.monotonic() + 4 * self.options.ban_flags_seconds
        while not self.stopping and time.monotonic() < limit:
            await asyncio.sleep(self.options.resync_every)
            if self.stopping or (self.banned_at is not None and self.last_accepted > self.banned_at):
                return
            await self.resync()
