"""Failures of stage code that the runtime survives: a forward, a backward, the head's forward, or
a replica-averaging attempt that raised. The microbatch is dropped (or the step goes on without
averaging) and the node keeps serving, so one bug could otherwise print one line per microbatch
forever, or hide behind one line with no traceback.

Each failure is counted (``NodeMetrics.compute_failure``: ``swarm_node_compute_failures_total``
by direction and exception class). Its *kind* is the direction, the exception class and the
innermost frame of its traceback (the file and line that raised). The first failure of each kind
is logged with its traceback; later ones of a known kind give at most one summary line per kind
every ``summary_every_s`` seconds, with how many there were since the last line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

SUMMARY_EVERY_S = 60.0
# distinct kinds remembered; past this, every new kind of a direction is counted and summarised as
# one kind (``other``): bounded memory whatever raises
MAX_KINDS = 256

# direction -> what failed, for the log lines
WHAT = {"fwd": "forward", "bwd": "backward", "head": "head forward", "average": "replica averaging"}


@dataclass
class _Kind:
    where: str  # "file.py:line" of the innermost frame
    last_line: float  # monotonic time of the last log line about this kind
    total: int = 1
    unreported: int = 0  # failures since that line


def kind_of(direction: str, exc: BaseException) -> tuple[str, str, str]:
    """``(direction, exception class, "path:line" of the innermost frame)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return direction, type(exc).__name__, where


class FailureLog:
    """Logs and counts the failures of stage code (see the module's docstring). Thread-safe: the
    averaging failures come from the compute thread."""

    def __init__(self, metrics, logger: logging.Logger, *, clock: Callable[[], float] = time.monotonic,
                 summary_every_s: float = SUMMARY_EVERY_S):
        self.metrics, self.log, self.clock = metrics, logger, clock
        self.summary_every_s = summary_every_s
        self.kinds: dict[tuple[str, str, str], _Kind] = {}
        self._lock = threading.Lock()

    def record(self, direction: str, exc: BaseException, subject: str = "") -> None:
        """One failure of ``direction`` (``fwd``, ``bwd``, ``head``, ``average``) with ``exc``;
        ``subject`` says what it was working on (``"mb 1f2e"``, ``"step 40"``)."""
        self.metrics.compute_failure(direction, type(exc).__name__)
        key = kind_of(direction, exc)
        what = WHAT.get(direction, direction)
        on = f" of {subject}" if subject else ""
        now = self.clock()
        with self._lock:
            if key not in self.kinds and len(self.kinds) >= MAX_KINDS:
                key = (direction, "other", "?")  # one kind for every further new one of this direction
            kind = self.kinds.get(key)
            if kind is None:
                self.kinds[key] = _Kind(_short(key[2]), now)
                summary = None
            else:
                kind.total += 1
                kind.unreported += 1
                if now - kind.last_line < self.summary_every_s:
                    return
                summary = (kind.unreported, now - kind.last_line, kind.total, kind.where)
                kind.unreported, kind.last_line = 0, now
        if summary is None:
            self.log.error("%s%s failed: %r (the first failure of this kind, at %s; the next ones are counted "
                           "in swarm_node_compute_failures_total and summarised at most every %.0f s)",
                           what, on, exc, _short(key[2]), self.summary_every_s, exc_info=(type(exc), exc, exc.__traceback__))
        else:
            count, since, total, where = summary
            self.log.error("%s failed %d more times in the last %.0f s with %s at %s (%d in all); the last%s: %r",
                           what, count, since, key[1], where, total, on, exc)


def _short(where: str) -> str:
    """``/a/b/node/runtime/trainer.py:12`` -> ``runtime/trainer.py:12``."""
    path, _, line = where.rpartition(":")
    if not path:
        return where
    parts = path.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{line}"
