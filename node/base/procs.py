"""The Linux process table, read from /proc: what the node and its launcher need to find their own
child processes (the DHT's p2pd) and to prove none outlived its owner."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    pid: int
    name: bytes  # the kernel's comm, e.g. b"p2pd"
    state: bytes  # b"R", b"S", ... b"Z" for a zombie
    ppid: int
    session: int

    @property
    def alive(self) -> bool:
        return self.state != b"Z"


def processes() -> Iterator[Proc]:
    """Every process in /proc (those that exit while we read are skipped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may contain spaces and ')', so split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3:
            yield Proc(int(entry), stat[stat.find(b"(") + 1: stat.rfind(b")")], fields[0], int(fields[1]),
                       int(fields[3]))


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (e.g. a DHT process's ``p2pd``)."""
    return [p.pid for p in processes() if p.ppid == pid]


def set_parent_death_signal(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when the thread that started it exits (for a child,
    call it between fork and exec, e.g. as ``preexec_fn``). Elsewhere a no-op: a crashed parent
    may then leave its children behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
