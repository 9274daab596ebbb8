"""In-process stage runtimes for tests: test doubles (a recording verifier, router records) and
the helpers that build, link, start, drive and stop ``StageRuntime``s over ``helpers.memnet``."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from node.net import Router
from node.ops import NodeMetrics
from node.runtime import RuntimeOptions, StageRuntime
from stages import build_optimizer, build_stage
from tests.helpers.memnet import MemTransport, Net  # noqa: F401 - re-exported for the runtime tests


@dataclass
class Verdict:
    accept: bool
    reason: str = "ok"
    score: float = 0.0


@dataclass
class RecordingVerifier:
    """Counts what it is shown; rejects senders listed in ``reject``."""

    reject: set = field(default_factory=set)
    seen: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def verify(self, sender, direction, tensor, *, step=None, ids=None, mb=None):
        assert threading.current_thread() is not threading.main_thread()  # off the event loop
        assert ids is not None and tuple(ids.shape) == tuple(tensor.shape[:2]) and isinstance(mb, int)
        with self.lock:
            self.seen.append((sender, direction, tuple(tensor.shape)))
        if sender in self.reject:
            return Verdict(False, "test-reject", 9.0)
        return Verdict(bool(torch.isfinite(tensor).all()), "ok")


async def establish(rt, *peers) -> None:
    """Make ``peers`` established replicas at ``rt`` (``Guard.established``): each sends it
    enough tensors that its verifier accepts (``rt``'s verifier must accept them)."""
    need = max(rt.guard.sentinel.warmup, rt.guard.sentinel.flags_to_ban)
    for peer in peers:
        for i in range(need):
            await rt.guard.verify(peer, "grad", torch.zeros(1, 4, 2), i, torch.zeros(1, 4, dtype=torch.long), i)
    assert all(rt.guard.established(p) for p in peers)


@dataclass
class Rec:
    peer_id: str
    stage: int
    state: str = "online"
    throughput: float = 0.0
    queue: int = 0
    version: int = 0
    maddrs: list = field(default_factory=list)


def make_runtime(manifest, index, peer, net, *, verifier=None, batches=None, seed=0, **opts):
    torch.manual_seed(seed)
    stage = build_stage(manifest, index)
    opt = build_optimizer(manifest, stage)
    options = RuntimeOptions(**{"probe_after": 0.3, "forward_deadline": 3.0, "request_timeout": 2.0, **opts})
    rt = StageRuntime(
        manifest, index, stage, opt, transport=MemTransport(net, peer), router=Router(peer, rng=random.Random(1)),
        metrics=NodeMetrics(), verifier=verifier or RecordingVerifier(), peer_id=peer, options=options,
        batches=batches, rng=random.Random(seed + index),
    )
    return rt


def link(runtimes):
    recs = [Rec(rt.peer_id, rt.index) for rt in runtimes]
    for rt in runtimes:
        rt.router.update(recs)


def head_batches(manifest):
    from stages import Batches, load_corpus

    corpus = load_corpus(manifest.data)
    return Batches(corpus.train, manifest.data.batch_size, manifest.model.seq_len, seed=manifest.run.seed)


async def start_all(runtimes):
    for rt in runtimes:
        await rt.start()
        rt.set_state("online")


async def stop_all(runtimes):
    for rt in runtimes:
        await rt.stop()


def value(rt, name, **labels):
    from node.ops import metric_sum, parse_metrics

    return metric_sum(parse_metrics(rt.metrics.render().decode()), name, **labels)


async def train_until(rts, steps, timeout=60.0, drain=False):
    """Link and start ``rts`` (head first), drive the head to ``steps`` optimizer steps with nothing
    left in flight, optionally drain every stage, and stop them all."""
    head = rts[0]
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: head.version >= steps and head.inflight == 0, timeout=timeout)
        await asyncio.wait_for(drive, 5)
        if drain:
            for rt in rts:
                assert await rt.drain(5.0)
    finally:
        await stop_all(rts)


async def wait_for(cond, timeout=30.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(step)
    return False


# ---------------------------------------------------------------- tests


