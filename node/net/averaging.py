"""Sparse background averaging between the replicas of one stage (AsyncMesh data axis).

Every ``avg_every`` local steps a replica snapshots the current partition S of its parameters
(``stages.asyncmesh.PartitionSchedule``: a fraction p of all elements, a different slice each
round) and hands it to hivemind's ``DecentralizedAverager``, which finds the other replicas of
the stage through the DHT (matchmaking under one key per stage) and all-reduces the slice. The
training loop never waits: ``maybe_average`` only starts a round when one is due and none is in
flight, and applies a finished round as a delta against its snapshot,
``θ[S] += λ·(avg − θ^snap[S])``, so the steps taken while the round ran are kept. With the
staleness correction on (``asyncmesh.avg_correction``), the optimizer's first moments on the
same slice are averaged too, their delta scaled by β^s for a round that took s steps
(``stages.asyncmesh.StalenessCorrection``; docs/ASYNCMESH.md has the measurement).

Rounds start on the wall clock. Time is cut into *slots* of ``period`` seconds (unix time, the
same on every replica); a slot's number picks the slice and is the group key of the matchmaking
(hivemind's group bits), so only replicas joining the same slot ever meet, and they meet at its
start (hivemind's ``scheduled_time``): any number of replicas average one slice, whatever their
step rates. After its first H local steps a replica joins every slot that is a multiple of its
*stride*, the power of two whose span is nearest H of its steps (and holds one whole round): it
averages about every H steps, replicas of one speed join the same slots, and a slower replica's
slots are a subset of every faster one's. The snapshot is taken just before the slot (``lead`` seconds
plus one local step ahead), so the averaged values are a few seconds old at most. Replicas' clocks
must agree well within ``lead``; one whose clock is far off falls out of its group, and after
three failed rounds in a row with other replicas online the averager logs a warning that points
at the clock (NTP).

A round that fails or times out is dropped (the next one is H steps later); a replica whose
``peers_fn`` says it is alone does not even start one. An applied round's parameter delta
reaches the weights over ``blend_steps`` local steps (``stages.BlendedDelta``), so the
replica's outputs do not jump. Each replica also sends its slot number in hivemind's gather, and
a group whose numbers differ throws the result away (never a wrong average). In a morphing run
(docs/MORPH.md) each replica also sends its morph epoch: replicas in different epochs hold their
weights in different bases, so a group whose epochs differ, or a round during which this replica
entered a new epoch, is thrown away too (``rounds_epoch_discarded``): averages are taken within
one epoch only.

Who may average, and what is applied (docs/ASYNCMESH.md has the design): the matchmaking key
lives in the run's namespace (``averaging_prefix``: run id and organiser fingerprint); before
each round the averager process learns which peers hold a live signed record for this stage
(``members_fn``) and shares a group with no one else; every member has weight one; each member
reduces its range of the buffer with ``stages.robust_mean`` (a member outside the group's
spread is dropped and counted) and refuses a range another reducer returns that lies too far
from its own values (``stages.refused_reducers``); the round applies with the rest.

hivemind constraints handled here: the averager is a child process (fork, dying with the node:
``node.net.hivemind_patches.SwarmAverager``) that must be started from the main thread (it sets a SIGINT handler; we restore the caller's afterwards); the
averaged buffer is shared memory updated in place under the averager's lock; hivemind calls
that wait on its process run on one worker thread, never on the caller's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from typing import Callable, Iterable, Sequence

import torch

from node.net.averaging_judge import read_members
from node.net.averaging_round import AveragingStats, Round, run_round
from node.net.averaging_slots import SlotClock
from node.net.run_keys import averaging_key_prefix
from stages import (
    AveragingLayout, BlendedDelta, PartitionSchedule, StalenessCorrection, apply_average_delta, first_moments, snapshot,
)

log = logging.getLogger("swarm.averaging")


averaging_prefix = averaging_key_prefix  # a stage's matchmaking key prefix, in the run's namespace


class ReplicaAverager:
    """Background sparse averaging of ``params`` with the other replicas of one stage.

    Wiring (``node.daemon.slot``): ``start()`` on the main thread once, ``maybe_average(local_step)``
    after each optimizer step, ``close()`` at the end.

    ``maybe_average`` mutates ``params`` in place (when a round finished), so call it between
    optimizer steps, never during a backward. ``peers_fn`` (optional) returns how many replicas
    of this stage are online, this one included; with fewer than two no round starts.
    ``members_fn`` (optional) returns the peer ids that hold a live signed record for this stage
    (this node aside): only they may share a group with this replica (read when a round starts;
    without it anyone who matches the key may).
    ``optimizer`` gives the first moments the correction averages; without it (or with the
    correction off) only parameters are averaged. The buffer (and so the hivemind schema every
    replica must share) depends only on ``correction``: 1 or 2 float32 slices of ``max_size``,
    interleaved block by block (``stages.AveragingLayout``).
    """

    def __init__(
        self,
        dht,
        params: Sequence[torch.Tensor],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        prefix: str,
        fraction: float,
        every: int,
        seed: int,
        correction: bool = True,
        timeout: float = 30.0,
        min_matchmaking_time: float = 2.0,
        request_timeout: float = 1.0,
        target_group_size: int | None = None,
        peers_fn: Callable[[], int] | None = None,
        max_round_bytes: int = 256 << 20,
        epoch_fn: Callable[[], int] | None = None,
        period: float = 5.0,
        clock: Callable[[], float] = time.time,
        blend_steps: int = 1,
        members_fn: Callable[[], Iterable[str]] | None = None,
    ):
        if every < 1:
            raise ValueError(f"avg_every must be >= 1, got {every}")
        if not period > 0:
            raise ValueError(f"averaging period must be > 0 seconds, got {period}")
        if timeout <= min_matchmaking_time:
            raise ValueError(
                f"averaging timeout {timeout}s must exceed min_matchmaking_time {min_matchmaking_time}s"
            )
        self.params = list(params)
        self.schedule = PartitionSchedule([p.shape for p in self.params], fraction, seed)
        slices = 2 if correction else 1
        self.layout = AveragingLayout(slices, self.schedule.max_size)
        buffer_bytes = 4 * self.layout.total
        if buffer_bytes > max_round_bytes:
            raise ValueError(
                f"one averaging round would send {buffer_bytes} bytes (> {max_round_bytes}); "
                "lower asyncmesh.avg_fraction"
            )
        self.dht, self.prefix, self.every, self.timeout = dht, prefix, every, timeout
        self.optimizer = optimizer
        self.correction = StalenessCorrection(correction)
        self.peers_fn = peers_fn
        self.members_fn = members_fn
        self.epoch_fn = epoch_fn  # the stage's morph epoch (read where maybe_average runs: the compute thread)
        self.stats = AveragingStats()
        # a round's parameter delta is applied over this many local steps (stages/avg_blend.py)
        self.blend = BlendedDelta(blend_steps)
        self._buffer = torch.zeros(self.layout.total, dtype=torch.float32)
        self._request_timeout = min(request_timeout, min_matchmaking_time / 2)
        self._averager_kwargs = dict(
            prefix=prefix,
            min_group_size=2,
            target_group_size=target_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=self._request_timeout,
            allreduce_timeout=timeout,
            next_chunk_timeout=timeout,
            allow_state_sharing=False,
            shutdown_timeout=5,
        )
        self._averager = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._round: Round | None = None
        self._next_due: int | None = None
        # the clock slots (module docstring): a slot is joined `lead` seconds ahead, enough for
        # hivemind's matchmaking (min_matchmaking_time) and one request round trip
        self.period, self.clock = float(period), clock
        self.lead = min_matchmaking_time + 1.0
        self.slots = SlotClock(self.period, self.lead, self._request_timeout, every)
        self._target: int | None = None  # the slot this replica will join (due, snapshot not yet taken)
        self._no_group_streak = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start hivemind's averager process (blocks until it is ready; main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ReplicaAverager.start() must run on the main thread (hivemind forks and sets signals)")
        previous = signal.getsignal(signal.SIGINT)
        from node.net.hivemind_patches import SwarmAverager

        averager = SwarmAverager([self._buffer], self.dht, start=False, layout=self.layout, **self._averager_kwargs)
        try:
            averager.run_in_background(await_ready=True, timeout=max(30.0, self.timeout))
        except BaseException:
            if averager.is_alive():
                averager.terminate()
                averager.join(5)
            raise
        finally:
            if previous is not None:  # hivemind leaves SIGINT ignored in the parent
                signal.signal(signal.SIGINT, previous)
        self._averager = averager
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="averaging")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the averager process; an unfinished round is dropped. Idempotent."""
        worker, self._worker = self._worker, None
        averager, self._averager = self._averager, None
        rnd, self._round = self._round, None
        if rnd is not None and not rnd.future.done():
            control = rnd.control
            if control is not None and not control.done():
                try:
                    control.cancel()
                except Exception:  # noqa: BLE001 - best effort while closing
                    pass
            try:
                rnd.future.result(timeout=timeout)
            except Exception:  # noqa: BLE001
                pass
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)
        if averager is not None and averager.is_alive():
            averager.shutdown()
            averager.join(timeout)
            if averager.is_alive():
                averager.terminate()
                averager.join(timeout)

    def __enter__(self) -> ReplicaAverager:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the training-loop hook

    def maybe_average(self, local_step: int, params: Sequence[torch.Tensor] | None = None) -> bool:
        """Non-blocking: apply a finished round (returns True), start a round when one is due."""
        if self._averager is None:
            raise RuntimeError("ReplicaAverager.maybe_average before start() (or after close())")
        if params is not None:
            params = list(params)
            if [p.shape for p in params] != [p.shape for p in self.params]:
                raise ValueError("maybe_average: parameter shapes differ from the ones averaging was set up for")
            self.params = params
        now = self.clock()
        self.slots.called(now)
        self._read_report()
        if self.blend.pending:
            if self.blend.epoch != self._epoch():  # re-based by a morph: the rest is for weights that are gone
                log.info("averaging: %d parts of the last round's delta dropped (morph epoch changed)", self.blend.drop())
            else:
                self.blend.step(self.params)
        applied = False
        if self._round is not None and self._round.future.done():
            applied = self._finish(local_step)
        if self._next_due is None:
            self._next_due = local_step + self.every  # the first round after H local steps
        if local_step < self._next_due:
            return applied
        if self._target is None:
            if self.peers_fn is not None and self.peers_fn() < 2:
                self.stats.skipped_alone += 1
                self._next_due = local_step + self.every
                return applied
            self._target = self.next_slot(now)
        start = self._target * self.period
        # take the snapshot now if the next call (one local step away) could come too late
        if now >= start - self.lead - self.slots.call_seconds:
            if self._round is not None:  # the last round still runs: this slot goes without us
                self.stats.skipped_busy += 1
                self.slots.last, self._target = self._target, None
            elif start - now < self.lead - 0.5:  # a step took longer than usual: the slot is missed
                self.slots.last, self._target = self._target, None
            else:
                number, self._target = self._target, None
                self.slots.last = number
                self._begin(local_step, number)
        return applied

    def state_replaced(self) -> None:
        """The replica took other weights (a re-sync from another replica, a checkpoint): a round
        in flight averages a snapshot of weights that are gone, so it is discarded when it ends,
        and the next round comes H local steps after the new weights' version."""
        if self._round is not None:
            self._round.replaced = True
        self.blend.drop()  # the rest of an applied round's delta was for the weights that are gone
        self._target, self._next_due = None, None

    def stride(self) -> int:
        """The power of two whose multiples are the slots this replica joins (``SlotClock.stride``)."""
        return self.slots.stride()

    def next_slot(self, now: float) -> int:
        """The first slot this replica can join (``SlotClock.next_slot``)."""
        return self.slots.next_slot(now)

    @property
    def pending_slot(self) -> int | None:
        """The slot this replica will join once it is near (None: none chosen yet)."""
        return self._target

    def _begin(self, local_step: int, number: int) -> None:
        indices = self.schedule.indices(number)
        self.blend.before_snapshot(self.params, self.schedule.partition(number))
        snap = snapshot(self.params, indices)
        moment_snap, mask = None, [False] * len(self.params)
        if self.correction.enabled:
            moments, _ = self._moments()
            mask = [m is not None for m in moments]
            moment_snap = snapshot(moments, indices)
        rnd = Round(number, local_step, indices, snap, moment_snap, mask, time.monotonic(), self._epoch())
        if self.members_fn is not None:
            rnd.members = read_members(self.members_fn)
        rnd.find_until = self.slots.find_until(number)
        rnd.future = self._worker.submit(self._run_round, rnd)
        self._round = rnd
        self.stats.rounds_started += 1

    def _finish(self, local_step: int) -> bool:
        rnd, self._round = self._round, None
        self.stats.last_round_seconds = time.monotonic() - rnd.started
        try:
            averaged, rounds, masks, epochs = rnd.future.result()
        except Exception as e:  # noqa: BLE001 - any failure of a round only skips it
            self.stats.rounds_failed += 1
            log.info("averaging round %d failed (skipped): %s", rnd.number, str(e).strip()[:200] or type(e).__name__)
            self._no_group_streak += 1
            if self._no_group_streak == 3:
                log.warning("3 averaging rounds in a row failed while other replicas were online; "
                            "rounds start on the wall clock (%gs slots), so a clock that is off keeps a replica "
                            "apart: check that NTP is on", self.period)
            return False
        self._no_group_streak = 0
        if rnd.replaced or local_step < rnd.start_step:  # (a version that went back: replaced too)
            self.stats.rounds_state_replaced += 1
            log.info("averaging round %d discarded: this replica's weights were replaced while it ran", rnd.number)
            return False
        if self._epoch() != rnd.epoch or any(e != rnd.epoch for e in epochs):
            # weights of different morph epochs are in different bases: never averaged together
            self.stats.rounds_epoch_discarded += 1
            log.info("averaging round %d spans morph epochs (ours %d -> %d, group %s): discarded", rnd.number,
                     rnd.epoch, self._epoch(), sorted(set(epochs)))
            return False
        g = len(rounds)
        self.stats.last_group_size = g
        payload = 4 * self.layout.segments * self.layout.size * 2 * (g - 1) // max(g, 1)
        self.stats.bytes_sent += payload
        self.stats.bytes_received += payload
        if any(r != rnd.number for r in rounds):
            # the slot is the group key, so only a peer whose clock slot differs yet shares the
            # key (numbers equal modulo the key's 2^16) gets here: never average different slices
            self.stats.rounds_mismatched += 1
            log.info("averaging slot numbers disagree %s: discarded", sorted(rounds))
            return False
        elapsed = local_step - rnd.start_step
        self.correction.observe(elapsed)
        n = rnd.snap.numel()
        try:
            norm = self.blend.add(self.params, rnd.indices, rnd.snap, averaged[:n],
                                  partition=self.schedule.partition(rnd.number), epoch=rnd.epoch)
            lam_m = [0.0] * len(self.params)
            if rnd.moment_snap is not None:
                moments, decays = self._moments()
                agreed = [all(col) and m is not None for col, m in zip(zip(rnd.moment_mask, *masks), moments)]
                lam_m = [lam if ok else 0.0 for lam, ok in zip(self.correction.moment_lambdas(elapsed, decays), agreed)]
                m0 = self.schedule.max_size
                apply_average_delta(moments, rnd.indices, rnd.moment_snap, averaged[m0 : m0 + n], lam_m)
        except ValueError as e:
            self.stats.rounds_failed += 1
            log.warning("averaging round %d rejected: %s", rnd.number, e)
            return False
        self.stats.rounds_applied += 1
        self.slots.applied(rnd.number, self.clock())
        log.info("averaging round %d applied: group of %d, %d elements, delta norm %.4g, %d local steps after the snapshot",
                 rnd.number, g, n, norm, elapsed)
        self.stats.last_elapsed_steps, self.stats.last_delta_norm = elapsed, norm
        self.stats.last_round, self.stats.last_snapshot_step = rnd.number, rnd.start_step
        self.stats.last_moment_lambda = sum(lam_m) / max(1, len(lam_m))
        return True

    def _read_report(self) -> None:
        """The averager process's counts of judged contributions and refused strangers."""
        report = getattr(self._averager, "report", None)
        if report is None:
            return
        before = (self.stats.contributions_dropped, self.stats.parts_refused, self.stats.groups_refused)
        for name, value in report().items():
            setattr(self.stats, name, value)
        after = (self.stats.contributions_dropped, self.stats.parts_refused, self.stats.groups_refused)
        if after != before:
            log.warning("averaging: %d member contribution(s) dropped as outside the group's spread, %d returned "
                        "part(s) refused, %d group(s) with a peer outside this stage refused (since start)", *after)

    def _epoch(self) -> int:
        return int(self.epoch_fn()) if self.epoch_fn is not None else 0

    def _moments(self) -> tuple[list[torch.Tensor | None], list[float]]:
        if self.optimizer is None:
            return [None] * len(self.params), [0.0] * len(self.params)
        return first_moments(self.optimizer, self.params)

    # ------------------------------------------------------------------ worker thread

    def _run_round(self, rnd: Round) -> tuple[torch.Tensor, list[int], list[list[bool]], list[int]]:
        averager = self._averager
        if averager is None:
            raise RuntimeError("closed")
        return run_round(averager, rnd, layout=self.layout, period=self.period, lead=self.lead,
                         timeout=self.timeout, clock=self.clock)
