"""Child-process checks: no p2pd daemon may outlive the test that started it."""

from __future__ import annotations

import time

import psutil


def p2pd_descendants() -> list[psutil.Process]:
    """p2pd processes started (directly or through a DHT child process) by this test process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "p2pd" and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_p2pd_left(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while p2pd_descendants() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert p2pd_descendants() == [], "a p2pd daemon outlived its test"
