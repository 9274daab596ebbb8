"""The compute thread and the task set: where a stage's torch work and background coroutines run.

All torch work of a stage runs in ONE thread (``ComputeWorker``), never on the event loop; it takes
control jobs first, then gradients, then forwards, so work already paid for downstream is finished
before new work starts and a stage's memory (stored inputs) drains first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

log = logging.getLogger("swarm_node.runtime")


class QueueFull(Exception):
    """The compute queue for this kind of job is at its bound."""


class ComputeWorker:
    """One thread for all torch work. Jobs are ``fn(*args)``; results come back as asyncio futures
    of the loop that submitted them.

    Priority: ``ctl`` (state snapshots, checkpoints) > ``bwd`` > ``fwd``. ``bound`` limits how many
    jobs of a kind may wait (``None``: unbounded); ``submit`` raises ``QueueFull`` beyond it.
    """

    KINDS = ("ctl", "bwd", "fwd")

    def __init__(self, name: str = "compute"):
        self._cv = threading.Condition()
        self._queues: dict[str, collections.deque] = {k: collections.deque() for k in self.KINDS}
        self._stopped = False
        self.busy_s = 0.0  # seconds spent in jobs so far
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def depth(self, kind: str) -> int:
        return len(self._queues[kind])

    def submit(self, kind: str, fn: Callable, *args, bound: int | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the compute worker is stopped")
            if bound is not None and len(self._queues[kind]) >= bound:
                raise QueueFull(kind)
            self._queues[kind].append((fut, fn, args))
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not any(self._queues.values()):
                    self._cv.wait()
                if self._stopped:
                    pending = [j for q in self._queues.values() for j in q]
                    for q in self._queues.values():
                        q.clear()
                    break
                kind = next(k for k in self.KINDS if self._queues[k])
                fut, fn, args = self._queues[kind].popleft()
            t0 = time.perf_counter()
            try:
                result, ok = fn(*args), True
            except BaseException as e:  # noqa: BLE001 - delivered to the awaiting coroutine
                result, ok = e, False
            self.busy_s += time.perf_counter() - t0
            _deliver(fut, ok, result)
        for fut, _, _ in pending:
            _deliver(fut, False, RuntimeError("the compute worker stopped"))

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _deliver(fut: asyncio.Future, ok: bool, value: Any) -> None:
    """Resolve ``fut`` on its own loop (from the worker thread)."""
    def resolve():
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    with contextlib.suppress(RuntimeError):  # the loop is already closed
        fut.get_loop().call_soon_threadsafe(resolve)


class Tasks:
    """The background coroutines of one stage: spawned, logged when they fail, cancelled together."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception(), exc_info=task.exception())

    async def cancel(self) -> None:
        await cancel_all(list(self._tasks))


async def cancel_all(tasks: list, timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout`` s. (Python 3.11's ``wait_for`` can
    swallow a cancellation that races with its result, so loops also check a stop flag, and
    nothing here waits unboundedly on a task that ignored its cancel.)"""
    for t in tasks:
        t.cancel()
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            log.warning("task %r did not stop within %.0f s", t.get_coro(), timeout)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved, so asyncio does not log it again


def pin_torch_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Give the one thread of ``pool`` its own torch intra-op thread count ``n``, leaving every
    other thread's as it was. The verifier's many small ops gain nothing from more threads, and
    with OpenMP workers spinning on cores the compute worker needs they were 20x slower on a
    shared CPU (docs/SENTINEL.md). torch keeps the count per thread but seeds each thread's from
    the last ``set_num_threads`` anywhere, so the caller's count is set back afterwards."""
    if n <= 0:
        return
    own = torch.get_num_threads()

    def pin():
        torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the next line
        torch.set_num_threads(n)

    pool.submit(pin).result()
    torch.set_num_threads(own)
