"""Morph epochs of a stage in the swarm: which basis its boundaries are in, the seeds that change
them, and when it changes (docs/PROTOCOL.md, "Morph epochs"; docs/MORPH.md).

With ``[morph]`` on, every M head steps the swarm enters a new epoch: the basis of each boundary
b (stage b to stage b+1) changes by a fresh random transform drawn from a 32-byte seed that the
replicas of stages b and b+1 share and nobody else sees. This part of a stage:

- **deals** the seed of its output boundary for the next epoch when it is that boundary's dealer
  (the online, settled replica of its stage with the smallest ``rank``), to every settled online
  replica of its own stage and the next one, over ``/swarm-node/morph/1`` (encrypted libp2p
  streams); never to the DHT, never to a log line;
- **takes** seeds of its two boundaries for the next epoch (the smallest rank wins, so replicas
  whose views of the swarm differed still agree);
- **enters** the next epoch when it must (the head at version (e+1)·M after its microbatches in
  flight came back; the others at the first fwd of the next epoch, or when a neighbour's
  ``wrong-epoch`` reject says they are behind): one job on the compute thread folds both sides
  (``Trainer.fold``), then every microbatch still in flight here is dropped with a ``skip``
  upstream, and the seeds are forgotten (a seed it dealt only once every settled replica across
  its boundary has taken it, or at the next epoch: ``_redeal``);
- keeps the **settling table**: the epoch at which it first saw each peer. A peer is *settled*
  after two epoch changes (or when it was seen in epoch 0, a founder): only settled peers get
  this stage's state (``serve_state``'s gate) and seeds, so a joiner receives weights and seeds
  only in a basis at least two epochs after it appeared (why two: docs/PROTOCOL.md).

Morphing off (``every`` = 0): the epoch stays 0 and nothing here runs; frames carry no epoch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from typing import Awaitable, Callable

from node.net import PeerBusy, PeerRejected, PeerUnreachable
from node.runtime.options import RuntimeOptions
from node.runtime.worker import ComputeWorker, Tasks
from protocol import MORPH, MORPH_SEED_BYTES, ProtocolError, Reason, make_ack, make_morph_seed, make_reject
from protocol import validate_morph_seed

log = logging.getLogger("swarm_node.morph")

SETTLE_EPOCHS = 2  # epoch changes before a new peer gets state or seeds


def morph_every(manifest) -> int:
    """M, the head steps per morph epoch; 0 when the manifest does not morph."""
    cfg = getattr(manifest, "morph", None)
    if cfg is None or not getattr(cfg, "enabled", True):
        return 0
    return int(getattr(cfg, "every", 0) or 0)


def dealer_rank(run: str, boundary: int, epoch: int, peer: str) -> bytes:
    """Who deals the seed of ``boundary`` for ``epoch``: the replica of stage ``boundary`` with the
    smallest rank. A hash, so the role rotates among replicas from epoch to epoch and every
    node computes the same order from public facts."""
    return hashlib.sha256(f"{run}|{boundary}|{epoch}|{peer}".encode()).digest()


class MorphEpochs:
    """The morph epoch of one stage (``index`` of ``n_stages``); see the module docstring."""

    def __init__(self, every: int, run_id: str, mhash: str, index: int, n_stages: int, peer_id: str,
                 options: RuntimeOptions, *, transport, router, metrics, worker: ComputeWorker, trainer, tasks: Tasks,
                 state: Callable[[], str], drop_all: Callable[[str, Reason], None],
                 resync: Callable[[], Awaitable[bool]]):
        self.every, self.enabled = every, every > 0
        self.run_id, self.mhash, self.index, self.n, self.peer_id = run_id, mhash, index, n_stages, peer_id
        self.options, self.transport, self.router, self.metrics = options, transport, router, metrics
        self.worker, self.trainer, self.tasks, self.state = worker, trainer, tasks, state
        self.drop_all, self.resync = drop_all, resync
        # (boundary, epoch) -> (dealer rank, seed); held until the fold, then dropped
        self._seeds: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self._dealt: dict[tuple[int, int], set[str]] = {}  # as dealer: peers that took our seed
        self._pushing: set[str] = set()
        self.known: dict[str, int] = {}  # peer -> epoch at which this node first saw it
        self.online_since: dict[str, int] = {}  # peer -> epoch at which this node first saw it online
        self.own_since: int | None = None  # epoch at which this node went online
        self._epoch_began = time.monotonic()  # when this stage entered its epoch
        self.last_cost_s = 0.0
        self.morphs = 0
        self._lock = asyncio.Lock()
        self._waiting_since: dict[int, float] = {}  # epoch -> when a fwd of it first found no seeds here
        self._resync_task: asyncio.Task | None = None
        self._last_resync = -1e9

    # ------------------------------------------------------------------ what others read

    @property
    def epoch(self) -> int:
        return self.trainer.epoch

    def frame_epoch(self, epoch: int | None = None) -> int | None:
        """What a frame's ``epoch`` field says: ``epoch`` (default: ours), or None with morphing off."""
        if not self.enabled:
            return None
        return self.epoch if epoch is None else epoch

    def boundaries(self) -> tuple[int | None, int | None]:
        """(input boundary, output boundary) of this stage; None at the head / the tail."""
        return (self.index - 1 if self.index > 0 else None, self.index if self.index < self.n - 1 else None)

    def settled(self, peer: str) -> bool:
        """A peer this node has seen for SETTLE_EPOCHS epoch changes, or since epoch 0 (a founder)."""
        if not self.enabled:
            return True
        since = self.known.get(peer)
        return since is not None and (since == 0 or self.epoch >= since + SETTLE_EPOCHS)

    def settle_wait(self, peer: str) -> int:
        """Epoch changes ``peer`` still has to wait here before it gets state or seeds."""
        since = self.known.get(peer, self.epoch)
        return 0 if self.settled(peer) else since + SETTLE_EPOCHS - self.epoch

    def has_seed(self, boundary: int, epoch: int) -> bool:
        return (boundary, epoch) in self._seeds

    # ------------------------------------------------------------------ the maintenance beat

    def sweep(self) -> None:
        """Note newly seen peers; deal our boundary's next seed when we are its dealer; the head
        enters the next epoch when its version says so (``Pipeline.drive`` does, between injections)."""
        if not self.enabled:
            return
        for pid, p in list(self.router.peers.items()):
            if p.in_dht:
                self.known.setdefault(pid, self.epoch)
                if p.state == "online":
                    self.online_since.setdefault(pid, self.epoch)
        if self.state() != "online":
            return
        if self.own_since is None:
            self.own_since = self.epoch
        self._redeal()
        self._deal()

    def _self_settled(self) -> bool:
        return self.own_since is not None and (self.own_since == 0 or self.epoch >= self.own_since + SETTLE_EPOCHS)

    def _candidate(self, peer: str) -> bool:
        """A replica that may deal: online here for SETTLE_EPOCHS epoch changes (or since epoch 0),
        as a replica judges itself (``_self_settled``)."""
        since = self.online_since.get(peer)
        return since is not None and (since == 0 or self.epoch >= since + SETTLE_EPOCHS)

    def _deal(self) -> None:
        b = self.boundaries()[1]
        if b is None:
            return
        e1 = self.epoch + 1
        key = (b, e1)
        mine = dealer_rank(self.run_id, b, e1, self.peer_id)
        if key not in self._seeds:
            if not self._self_settled():
                return  # a new replica never deals: its view of who is settled is not yet the others'
            cands = [p.peer_id for p in self.router.stage_peers(b) if self._candidate(p.peer_id)]
            if any(dealer_rank(self.run_id, b, e1, p) < mine for p in cands) and \
                    time.monotonic() - self._epoch_began < self.options.seed_wait / 3:
                # another replica deals; if its seed has not come after a while (it is gone, or it
                # does not count itself settled yet), we deal too: the smaller rank still wins
                return
            self._seeds[key] = (mine, os.urandom(MORPH_SEED_BYTES))
            self._dealt[key] = set()
            log.info("morph: dealing the seed of boundary %d for epoch %d", b, e1)
        if key not in self._dealt or self._seeds[key][0] != mine:
            return  # we are not (or no longer) the dealer
        self._push_all(key)

    def _undelivered(self, key: tuple[int, int]) -> list[str]:
        """The settled online replicas across the boundary of ``key`` that have not taken its seed."""
        b, dealt = key[0], self._dealt.get(key, set())
        return [p.peer_id for stage in (b, b + 1) for p in self.router.stage_peers(stage)
                if p.peer_id not in dealt and self.settled(p.peer_id)]

    def _delivered(self, key: tuple[int, int]) -> bool:
        """Every settled online replica across the boundary took the seed of ``key``, and at least
        one replica of the stage after it did (one we do not see yet may still need it)."""
        after = key[0] + 1
        took = [self.router.peers.get(p) for p in self._dealt.get(key, ())]
        return not self._undelivered(key) and any(p is not None and p.stage == after for p in took)

    def _push_all(self, key: tuple[int, int]) -> bool:
        """Push the seed of ``key`` to every replica that has not taken it yet; True when it is delivered."""
        for peer in self._undelivered(key):
            if peer not in self._pushing:
                self._pushing.add(peer)
                self.tasks.spawn(self._push(peer, key))
        return self._delivered(key)

    def _redeal(self) -> None:
        """The seed this node dealt for the epoch it is in now, to the replicas that have not
        taken it yet (a replica that was not yet online in our view when we dealt, or whose
        push failed): without it that replica could never enter the epoch, and a lone replica
        of its stage would have nobody to re-download its state from. Forgotten once every
        settled replica across the boundary has it, and at the next epoch in any case."""
        b = self.boundaries()[1]
        key = (b, self.epoch)
        if b is None or key not in self._dealt or key not in self._seeds:
            return
        if self._push_all(key):
            del self._seeds[key], self._dealt[key]

    async def _push(self, peer: str, key: tuple[int, int]) -> None:
        b, e1 = key
        try:
            got = self._seeds.get(key)
            if got is None:
                return
            frames = make_morph_seed(self.run_id, self.mhash, self.index, b, e1, got[1])
            del got
            await self.transport.request(peer, MORPH, frames, timeout=self.options.request_timeout)
            self.metrics.request("morph", "ack", peer)
            self._dealt.get(key, set()).add(peer)
        except PeerRejected as e:
            self.metrics.request("morph", e.reason, peer)
            if e.reason == Reason.WRONG_EPOCH.value and (e.epoch is None or e.epoch < e1):
                # it has not entered our epoch yet (its first microbatch of it is on the way): again later
                log.debug("morph: %s is in epoch %s: seed for epoch %d later", peer[-8:], e.epoch, e1)
                return
            # it is past that epoch already, or refuses the frame itself: pushing again would not help
            self._dealt.get(key, set()).add(peer)
            log.info("morph: %s refused the seed of boundary %d for epoch %d: %s", peer[-8:], b, e1, e.reason)
        except (PeerBusy, PeerUnreachable, asyncio.TimeoutError, ConnectionError, OSError) as e:
            self.metrics.request("morph", "failed", peer)
            log.debug("morph: seed of boundary %d for epoch %d to %s failed: %s", b, e1, peer[-8:], type(e).__name__)
        finally:
            self._pushing.discard(peer)

    # ------------------------------------------------------------------ receiving seeds

    async def on_seed(self, frame, peer: str):
        """``/swarm-node/morph/1`` handler: take a seed of one of our boundaries for the next epoch."""
        if not self.enabled:
            raise ProtocolError(Reason.BAD_FRAME, "this run does not morph (no [morph] in its manifest)")
        s = validate_morph_seed(frame, self.run_id, self.mhash, self.index)
        p = self.router.peers.get(peer)
        if p is None or p.stage != s.boundary or p.state != "online" or self.router.is_banned(peer):
            # not (yet) an online replica of that stage in our view of the swarm: it may have just
            # come online (the DHT catches up within an announce period), so: ask again later
            self.metrics.served.labels(protocol="morph", result=Reason.BUSY.value).inc()
            return make_reject(Reason.BUSY, f"this node takes seeds of boundary {s.boundary} only from replicas of "
                                            f"stage {s.boundary} it sees online", retry_ms=1000)
        if s.epoch != self.epoch + 1:
            self.metrics.served.labels(protocol="morph", result=Reason.WRONG_EPOCH.value).inc()
            return make_reject(Reason.WRONG_EPOCH, f"seed for epoch {s.epoch}; this node is in epoch {self.epoch} "
                                                   f"and takes seeds for epoch {self.epoch + 1}", epoch=self.epoch)
        key = (s.boundary, s.epoch)
        rank = dealer_rank(self.run_id, s.boundary, s.epoch, peer)
        held = self._seeds.get(key)
        if held is None or rank < held[0]:
            self._seeds[key] = (rank, s.seed)
            if held is not None:
                log.info("morph: boundary %d epoch %d: %s outranks the seed held; taken", s.boundary, s.epoch, peer[-8:])
        self.metrics.served.labels(protocol="morph", result="ack").inc()
        return make_ack(None, self.index, self.trainer.version)

    # ------------------------------------------------------------------ entering an epoch

    def due(self) -> bool:
        """Head: its version says the next epoch has begun."""
        return self.enabled and self.trainer.version >= (self.epoch + 1) * self.every

    async def admit(self, epoch: int, mb: int):
        """A fwd of ``epoch`` reached this stage (in another epoch): None when this stage is now in
        ``epoch`` (it was the next one: entered), else the reply that refuses it: ``busy`` while the
        seeds of the next epoch are on their way, ``wrong-epoch`` (with our epoch) for any other."""
        if self.enabled and epoch == self.epoch + 1:
            if await self.enter(epoch):
                return None
            if epoch == self.epoch + 1:
                first = self._waiting_since.setdefault(epoch, time.monotonic())
                if time.monotonic() - first > self.options.seed_wait:
                    self.behind(epoch)  # the seeds are not coming: catch up from a replica instead
                return make_reject(Reason.BUSY, f"waiting for the morph seeds of epoch {epoch}", mb=mb, retry_ms=500)
        if epoch > self.epoch:
            self.behind(epoch)
        return make_reject(Reason.WRONG_EPOCH, f"microbatch of morph epoch {epoch}; this stage is in epoch {self.epoch}",
                           mb=mb, epoch=self.epoch)

    def missing_seeds(self, epoch: int) -> list[int]:
        return [b for b in self.boundaries() if b is not None and (b, epoch) not in self._seeds]

    async def enter(self, epoch: int) -> bool:
        """Enter ``epoch`` (ours + 1): fold both sides with its seeds on the compute thread, then drop
        every microbatch in flight here. True when this stage is in ``epoch`` afterwards; False when
        a seed is missing (try again later) or ``epoch`` is further ahead (a re-sync is started)."""
        if not self.enabled:
            return epoch == 0
        async with self._lock:
            if self.epoch >= epoch:
                return self.epoch == epoch
            if epoch > self.epoch + 1:
                self.behind(epoch)
                return False
            if self.missing_seeds(epoch):
                return False
            t_in, t_out = (None if b is None else self._seeds[(b, epoch)][1] for b in self.boundaries())
            t0 = time.perf_counter()
            try:
                await self.worker.submit("ctl", self.trainer.fold, epoch, t_in, t_out)
            finally:
                del t_in, t_out
            self.last_cost_s = time.perf_counter() - t0
            self._epoch_began = time.monotonic()
            self._forget(epoch)
            self.drop_all("morph-epoch", Reason.WRONG_EPOCH)
            self.morphs += 1
            self.metrics.morph_epoch.set(epoch)
            self.metrics.morph_seconds.set(self.last_cost_s)
            self.metrics.morphs.inc()
            log.info("morph: entered epoch %d at version %d in %.3f s", epoch, self.trainer.version, self.last_cost_s)
            return True

    def _forget(self, epoch: int) -> None:
        """Drop the seeds (and dealer records) of ``epoch`` and before, except a seed this node
        dealt for ``epoch`` itself that not every replica across its boundary has taken yet
        (``_redeal`` pushes it on, then drops it)."""
        for e in [e for e in self._waiting_since if e <= epoch]:
            del self._waiting_since[e]
        keep = {k for k in self._dealt if k[1] == epoch and not self._delivered(k)}
        for key in [k for k in self._seeds if k[1] <= epoch and k not in keep]:
            del self._seeds[key]
        for key in [k for k in self._dealt if k[1] <= epoch and k not in keep]:
            del self._dealt[key]

    def adopted(self, epoch: int) -> None:
        """This stage took a replica's state of ``epoch`` (a join or a re-sync)."""
        self._forget(epoch)
        self._epoch_began = time.monotonic()
        self.metrics.morph_epoch.set(epoch)

    def behind(self, epoch: int) -> None:
        """A neighbour is in ``epoch``: enter it when it is the next one and the seeds are here,
        else catch up by downloading the stage's state from a replica (in the current basis)."""
        if not self.enabled or epoch <= self.epoch:
            return
        if epoch == self.epoch + 1 and not self.missing_seeds(epoch):
            self.tasks.spawn(self.enter(epoch))
            return
        now = time.monotonic()
        if (self._resync_task is None or self._resync_task.done()) and now - self._last_resync > self.options.seed_wait:
            self._last_resync = now
            log.warning("morph: a neighbour is in epoch %d, this stage in %d without the seeds to follow: "
                        "downloading the stage's state again", epoch, self.epoch)  # (from a replica, if any)
            self._resync_task = self.tasks.spawn(self.resync())
