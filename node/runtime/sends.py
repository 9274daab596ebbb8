"""Outbound traffic of a stage: a forward to some replica of the next stage (retried elsewhere on
busy or failure, given up at a deadline), and a gradient or a skip back along the recorded route
(retried a few times on the same peer, since the route is fixed)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from node.net import PeerBusy, PeerRejected, PeerUnreachable
from node.runtime.guard import Guard
from node.runtime.options import Context, RuntimeOptions
from protocol import BWD, FWD, Reason, make_bwd, make_fwd

log = logging.getLogger("swarm_node.runtime")


@dataclass(frozen=True)
class Skip:
    """Why a microbatch is dropped, as its ``skip`` upstream says it (``docs/PROTOCOL.md``, bwd):
    the reason code, a human-readable detail, and for a verifier's refusal whose output it was
    (``refused``: ``own`` when the next stage refused what this stage sent, ``relayed`` when this
    stage passes on a refusal from further down) and the refusing verifier's ``score``."""

    why: str  # for logs and metrics here
    reason: Reason | None = None  # None: drop without telling upstream
    detail: str = ""
    score: float | None = None
    refused: str | None = None


class Sender:
    """Sends of one stage (``index``): ``fwd`` to the next stage, ``bwd`` to the previous one."""

    def __init__(self, index: int, run_id: str, mhash: str, options: RuntimeOptions, *, transport, router, metrics,
                 guard: Guard, version: Callable[[], int], suspect: Callable[[str], None], morph,
                 attacks: dict | None = None):
        self.index, self.run_id, self.mhash, self.options = index, run_id, mhash, options
        self.transport, self.router, self.metrics, self.guard = transport, router, metrics, guard
        self.version, self.suspect = version, suspect
        self.morph = morph  # morph.MorphEpochs: the epoch frames carry, and what a wrong-epoch reject means
        # security.attacks.Attack per direction ("act": what we send forward, "grad": back), applied
        # to what we send (verifier tests only, ``--attack``); one instance each, so stateful
        # attacks (delayed) never replay an activation as a gradient
        self.attacks = attacks or {}
        self.stopping = False

    async def send_fwd(self, ctx: Context, code: torch.Tensor, is_live: Callable[[int], bool],
                       horizon_s: float | None = None) -> Skip | None:
        """Send ``code`` to a replica of the next stage: retry elsewhere on busy/failure, give up at
        the deadline. Returns None when a replica accepted it (or the microbatch was dropped
        meanwhile, ``is_live`` false), else the ``Skip`` the caller drops it with."""
        if "act" in self.attacks:
            code = self.attacks["act"](code, self.version(), ids=ctx.ids_wire).contiguous()
        extra = {} if horizon_s is None else {"horizon_s": round(float(horizon_s), 6)}
        frames = make_fwd(self.run_id, self.mhash, ctx.mb, self.index, self.version(), ctx.route, code,
                          ctx.ids_wire, epoch=self.morph.frame_epoch(ctx.epoch), **extra)
        deadline = time.monotonic() + self.options.forward_deadline
        tried: set[str] = set()
        backoff = 0.02
        while time.monotonic() < deadline and is_live(ctx.mb) and not self.stopping:
            peer = self.router.choose(self.index + 1, exclude=tried)
            if peer is None and self.guard.banned_by_next_stage():
                # the next stage has banned us for what we send: our output is refused there, say so
                # upstream now (it stops routing work to us) rather than at the deadline
                return Skip("banned-downstream", Reason.REJECTED_BY_VERIFIER, "banned by the next stage",
                            refused="own")
            if peer is None:
                tried.clear()
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            t0 = time.monotonic()
            ctx.next_peer = peer
            self.router.on_sent(peer)
            try:
                reply = await self.transport.request(peer, FWD, frames, timeout=self.options.request_timeout)
            except PeerBusy:
                self.router.on_done(peer)
                self.router.on_busy(peer)
                self.metrics.request("fwd", "busy", peer)
                tried.add(peer)
                continue
            except PeerRejected as e:
                self.router.on_done(peer)
                self.metrics.request("fwd", e.reason, peer)
                if e.reason == Reason.REJECTED_BY_VERIFIER.value:
                    # our own output was refused: do not push it elsewhere, tell upstream to skip it
                    # (and that it was our output, so upstream can stop routing work to a poisoner)
                    return Skip("rejected-downstream", Reason.REJECTED_BY_VERIFIER, e.detail, score=e.score,
                                refused="own")
                if e.reason == Reason.WRONG_EPOCH.value:
                    if e.epoch is not None and e.epoch > ctx.epoch:
                        # the next stage is in a later basis: this microbatch cannot go on; this
                        # stage follows (the fold drops what it has in flight) or re-syncs
                        self.morph.behind(e.epoch)
                        return Skip("morph-epoch", Reason.WRONG_EPOCH, e.detail)
                    tried.add(peer)  # that replica is behind and catching up: another one
                    continue
                log.warning("fwd mb %x rejected by %s: %s", ctx.mb, peer[-8:], e)
                if e.reason == Reason.BANNED.value:
                    self.guard.note_banned()
                self.router.ban(peer, 30.0, e.reason)
                self.metrics.bans.labels(cause=e.reason).inc()
                tried.add(peer)
                continue
            except (asyncio.TimeoutError, PeerUnreachable, ConnectionError, OSError) as e:
                # one broken stream is not a dead peer: try another replica, and let a health
                # probe decide whether to ban this one and drop what we sent it
                self.router.on_done(peer)
                self.router.on_busy(peer)
                self.metrics.request("fwd", "failed", peer)
                log.info("fwd mb %x to %s failed: %r; probing it", ctx.mb, peer[-8:], e)
                self.suspect(peer)
                tried.add(peer)
                continue
            rtt = time.monotonic() - t0
            self.metrics.request_seconds.labels(protocol="fwd").observe(rtt)
            self.metrics.observe_neighbour_rtt(self.index + 1, "fwd", rtt)
            self.metrics.request("fwd", "ack", peer)
            self.router.on_ack(peer, rtt, reply.header.get("queue"))
            ctx.sent_at = time.monotonic()
            self.guard.note_accepted()
            return None
        if is_live(ctx.mb):
            return Skip("no-next-hop", Reason.BUSY)
        return None

    async def send_bwd(self, mb: int, route: tuple[str, ...], grad: torch.Tensor | None = None,
                       skip: Skip | None = None, epoch: int | None = None,
                       ids: torch.Tensor | None = None) -> bool:
        """Gradient (or skip) to the stage before us on ``route``; a few retries on busy, then give up
        (upstream's TTL or probe frees its context)."""
        if self.index == 0 or len(route) < self.index:
            return False
        peer = route[self.index - 1]
        if grad is not None and "grad" in self.attacks:
            grad = self.attacks["grad"](grad, self.version(), ids=ids).contiguous()
        if skip is not None:
            frames = make_bwd(self.run_id, self.mhash, mb, self.index, self.version(), route, None,
                              skip=skip.reason, detail=skip.detail or skip.why, score=skip.score,
                              refused=skip.refused, epoch=self.morph.frame_epoch(epoch))
        else:
            frames = make_bwd(self.run_id, self.mhash, mb, self.index, self.version(), route, grad,
                              epoch=self.morph.frame_epoch(epoch))
        for attempt in range(6):
            t0 = time.monotonic()
            try:
                await self.transport.request(peer, BWD, frames, timeout=self.options.request_timeout)
            except PeerBusy:
                self.metrics.request("bwd", "busy", peer)
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            except PeerRejected as e:
                self.metrics.request("bwd", e.reason, peer)
                log.debug("bwd mb %x rejected by %s: %s", mb, peer[-8:], e)
                if e.reason == Reason.BANNED.value:
                    self.guard.note_banned()
                return False
            except (PeerUnreachable, ConnectionError, OSError) as e:
                self.metrics.request("bwd", "failed", peer)
                if attempt < 2:  # a broken stream: the route is fixed, so retry the same peer
                    log.debug("bwd mb %x to %s failed: %r; retrying", mb, peer[-8:], e)
                    await asyncio.sleep(0.05 * 2**attempt)
                    continue
                log.info("bwd mb %x to %s failed: %r", mb, peer[-8:], e)
                return False
            except asyncio.TimeoutError:
                self.metrics.request("bwd", "timeout", peer)
                log.info("bwd mb %x to %s timed out", mb, peer[-8:])
                return False
            if grad is not None:  # a tensor of ours was accepted (an acked skip says nothing)
                self.guard.note_accepted()
            rtt = time.monotonic() - t0
            self.metrics.request_seconds.labels(protocol="bwd").observe(rtt)
            self.metrics.observe_neighbour_rtt(self.index - 1, "bwd", rtt)
            self.metrics.request("bwd", "skip" if grad is None else "ack", peer)
            return True
        return False
