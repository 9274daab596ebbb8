"""Start-up helpers shared by the commands that start a daemon (`run`, `bootstrap`): pre-flight
checks that fail with one line and the fix, the event-loop runner, and a fast exit."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import sys

from node.base import CliError


def fast_exit(code: int) -> None:
    """Leave now. Everything the node owns (p2pd, DHT, threads, files) is closed explicitly
    before this; the interpreter's own teardown of torch and hivemind would add seconds to every
    SIGTERM on a loaded machine, for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_and_exit(command, *args) -> int:
    """Run a long-lived command (``run``, ``bootstrap``) and leave with its exit status: an
    operator mistake (``CliError``) is one line ``swarm-node: error: ...`` and status 2."""
    try:
        code = command(*args)
    except CliError as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        code = 2
    fast_exit(code)
    return code  # not reached


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Bind-test ``host:port`` (TCP); a taken port is an operator error naming the flag to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CliError(
                    f"{what} port {port} on {host} is already in use (another swarm-node?); "
                    f"stop that process or choose another port with {flag}"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise CliError(f"{what} address {host} is not an address of this machine; fix {flag}") from None
            raise CliError(f"cannot listen on {host}:{port} for {what}: {e.strerror}; fix {flag}") from None


def uvloop_runner():
    """An ``asyncio.Runner`` on uvloop (plain asyncio where uvloop is unavailable)."""
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.Runner()


def announce_line(text: str) -> None:
    """One line for humans and launchers on stdout (``swarm-node: ...``)."""
    print(f"swarm-node: {text}", flush=True)


def load_manifest_arg(path: str, flag: str = "--manifest"):
    """The manifest ``path`` names (a file or a shipped run), or one ``CliError`` line naming the
    flag and what is wrong with it."""
    from stages import ManifestError, load_manifest

    try:
        return load_manifest(path)
    except ManifestError as e:
        raise CliError(f"{flag} {path}: {e}") from None


def check_signed(manifest, name: str, allow_unsigned: bool, organiser: str = "") -> None:
    """The first check of a run (``name``: the ``--manifest`` given): the manifest is the
    organisers' (signed by ``run.organiser``), or unsigned and allowed (a swarm of this machine
    only, ``--allow-unsigned``, on ``run`` and ``bootstrap`` alike). ``organiser``: a pinned organiser
    key fingerprint (``--organiser``): the manifest must be signed by that key, since a manifest
    file names its own organiser and so cannot vouch for it. One line with the fix if not."""
    from security import manifest_signature_problem, organiser_fingerprint

    if organiser:
        signer = organiser_fingerprint(manifest.run.organiser) if manifest.run.organiser else None
        if signer != organiser:
            said = f"signed by organiser {signer}" if signer else "not signed"
            raise CliError(f"--manifest {name} is {said}, not by the pinned --organiser {organiser}: this is another "
                           "run's manifest, or a forgery; get the manifest from the run's organisers")
    if manifest.run.organiser:
        problem = manifest_signature_problem(manifest)
        if problem is not None:
            raise CliError(f"--manifest {name}: {problem}; get the signed manifest from the run's organisers")
        return
    if not allow_unsigned:
        raise CliError(
            f"--manifest {name} is not signed: a public run's manifest carries its organisers' signature "
            "(swarm-node manifest sign); for a swarm on this machine only, pass --local --allow-unsigned"
        )
