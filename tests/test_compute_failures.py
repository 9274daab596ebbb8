"""Failures of stage code the runtime survives (node/runtime/failures.py): each kind (direction,
exception class, the line that raised) is logged with its traceback once, every failure is
counted in ``swarm_node_compute_failures_total``, and later ones of a known kind give at most one
summary line per interval."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from node.ops import NodeMetrics, metric_sum, parse_metrics
from node.runtime.failures import MAX_KINDS, FailureLog
from protocol import BWD, FWD, make_ack, make_fwd
from tests.helpers.memnet import MemTransport, Net
from tests.helpers.runtime import head_batches, link, make_runtime, start_all, stop_all, value, wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]



def _tracebacks(caplog, direction_word: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and r.getMessage().startswith(direction_word)]


def _broken_forward(fwd):
    raise ValueError(f"a bug in the stage's forward (mb {fwd.mb})")


def _other_broken_forward(fwd):
    raise TypeError("another bug")


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.mark.asyncio
async def test_a_failing_forward_is_logged_once_per_kind_with_its_traceback_and_counted(test_manifest, caplog):
    m = test_manifest
    net = Net()
    body = make_runtime(m, 1, "body", net)
    upstream = MemTransport(net, "x")
    skips = []

    async def on_bwd(frame, peer):
        skips.append(frame.header)
        return make_ack(frame.header["mb"], 0, 0)

    await upstream.serve(BWD, on_bwd)
    await start_all([body])
    clock = body.pipeline.failures.clock = _Clock()
    c = torch.randn(m.data.batch_size, m.model.seq_len, m.k)
    ids = torch.randint(0, 256, (m.data.batch_size, m.model.seq_len), dtype=torch.int32)

    async def send(mb):
        await upstream.request("body", FWD, make_fwd(m.run.id, body.mhash, mb, 0, 0, ["x"], c, ids), timeout=5)

    def failures(**labels):
        return value(body, "swarm_node_compute_failures_total", **labels)

    caplog.set_level(logging.INFO, logger="swarm_node.runtime")
    try:
        body.trainer.compute_fwd = _broken_forward
        for mb in range(1, 6):
            await send(mb)
        assert await wait_for(lambda: failures(direction="fwd") == 5 and len(skips) == 5, timeout=20)
        assert failures(direction="fwd", error="ValueError") == 5
        assert value(body, "swarm_node_microbatches_total", outcome="failed") == 5
        assert all(h.get("skip") == "internal" for h in skips)  # upstream was told to skip each one
        first = _tracebacks(caplog, "forward")
        assert len(first) == 1, [r.getMessage() for r in first]
        assert "mb 1" in first[0].getMessage() and "_broken_forward" in caplog.text  # the traceback's frame
        # within the interval: no line at all for the 4 repeats
        assert sum("forward" in r.getMessage() for r in caplog.records) == 1

        # a second kind: its own traceback, its own label
        body.trainer.compute_fwd = _other_broken_forward
        await send(6)
        assert await wait_for(lambda: failures(direction="fwd", error="TypeError") == 1, timeout=20)
        assert await wait_for(lambda: len(_tracebacks(caplog, "forward")) == 2, timeout=5)
        assert isinstance(_tracebacks(caplog, "forward")[1].exc_info[1], TypeError)

        # a minute on, the next repeat of the first kind gives one summary line with the count
        clock.t += 61
        body.trainer.compute_fwd = _broken_forward
        await send(7)
        await send(8)
        assert await wait_for(lambda: failures(direction="fwd", error="ValueError") == 7, timeout=20)
        summaries = [r.getMessage() for r in caplog.records if "more times" in r.getMessage()]
        assert len(summaries) == 1 and "failed 5 more times in the last 61 s with ValueError" in summaries[0]
        assert "(6 in all)" in summaries[0]
        assert len(_tracebacks(caplog, "forward")) == 2
        assert body.state == "online"  # the stage serves on
    finally:
        await stop_all([body])


class _BrokenAverager:
    calls = 0

    def maybe_average(self, step):
        self.calls += 1
        raise KeyError("a bug in averaging")

    def state_replaced(self):
        pass


@pytest.mark.asyncio
async def test_backward_head_and_averaging_failures_are_counted_with_one_traceback_each(test_manifest, caplog):
    m = test_manifest
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m))
    body = make_runtime(m, 1, "body", net)
    tail = make_runtime(m, 2, "tail", net)
    rts = [head, body, tail]

    def broken_backward(ctx, grad):
        raise RuntimeError("a bug in the stage's backward")

    body.trainer.compute_bwd = broken_backward
    tail.trainer.averager = averager = _BrokenAverager()
    caplog.set_level(logging.INFO, logger="swarm_node.runtime")
    link(rts)
    await start_all(rts)
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: value(body, "swarm_node_compute_failures_total", direction="bwd") >= 3
                              and averager.calls >= 3, timeout=60)
        assert value(body, "swarm_node_compute_failures_total", direction="bwd", error="RuntimeError") >= 3
        assert value(tail, "swarm_node_compute_failures_total", direction="average", error="KeyError") == averager.calls
        assert len(_tracebacks(caplog, "backward")) == 1
        assert len(_tracebacks(caplog, "replica averaging")) == 1
        assert head.version == 0 and tail.version >= 3  # the tail steps on; nothing reaches the head
    finally:
        head.pipeline.stopping = True
        await asyncio.wait_for(drive, 5)
        await stop_all(rts)

    # the head's own forward
    caplog.clear()
    net = Net()
    head = make_runtime(m, 0, "head", net, batches=head_batches(m))
    body = make_runtime(m, 1, "body", net)

    def broken_head(ids):
        raise IndexError("a bug in the head's forward")

    head.trainer.compute_head = broken_head
    link([head, body])
    await start_all([head, body])
    drive = asyncio.ensure_future(head.drive())
    try:
        assert await wait_for(lambda: value(head, "swarm_node_compute_failures_total", direction="head") >= 3,
                              timeout=30)
        assert len(_tracebacks(caplog, "head forward")) == 1
        head.pipeline.stopping = True
        await asyncio.wait_for(drive, 5)
        # each failure freed its slot: nothing left in flight once the last ones came back
        assert await wait_for(lambda: head.pipeline.inflight == 0 and not head.pipeline.pending, timeout=10)
        assert not head.pipeline.contexts
    finally:
        head.pipeline.stopping = True
        await asyncio.wait_for(drive, 5)
        await stop_all([head, body])


def _raise(exc):
    try:
        raise exc
    except Exception as e:  # noqa: BLE001
        return e


def test_failure_log_bounds_its_kinds_and_the_error_labels(caplog):
    metrics = NodeMetrics()
    clock = _Clock()
    flog = FailureLog(metrics, logging.getLogger("swarm_node.test"), clock=clock, summary_every_s=60)
    caplog.set_level(logging.INFO, logger="swarm_node.test")
    # 30 exception classes: the first 20 get a label of their own, the rest count as "other"
    classes = [type(f"Bug{i}", (Exception,), {}) for i in range(30)]
    for cls in classes:
        flog.record("fwd", _raise(cls("x")))
    text = metrics.render().decode()
    assert 'error="Bug19"' in text and 'error="Bug20"' not in text
    parsed = parse_metrics(text)
    assert metric_sum(parsed, "swarm_node_compute_failures_total", direction="fwd", error="other") == 10
    assert metric_sum(parsed, "swarm_node_compute_failures_total", direction="fwd") == 30
    # every class is its own kind (all raised at the same line): one traceback each
    assert sum(1 for r in caplog.records if r.exc_info) == 30

    # a repeat within the interval is silent; after it, one summary with the count since the last line
    caplog.clear()
    e = _raise(classes[0]("again"))
    flog.record("fwd", e)
    flog.record("fwd", e)
    assert caplog.records == []
    clock.t += 60
    flog.record("fwd", e)
    flog.record("fwd", e)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "failed 3 more times in the last 60 s with Bug0" in lines[0], lines
    assert "(4 in all)" in lines[0]

    # past MAX_KINDS, new kinds of a direction share one, so memory stays bounded
    flog.kinds.clear()
    extra = [type(f"More{i}", (Exception,), {}) for i in range(MAX_KINDS + 5)]
    caplog.clear()
    for cls in extra:
        flog.record("bwd", _raise(cls("y")))
    assert len(flog.kinds) == MAX_KINDS + 1
    assert sum(1 for r in caplog.records if r.exc_info) == MAX_KINDS + 1
