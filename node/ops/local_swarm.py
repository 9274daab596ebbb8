"""``LocalSwarm``: a loopback swarm of separate processes, shared by `swarm-node demo`,
``scripts/bench_swarm.py`` and the multi-process tests.

Every node is a real ``swarm-node run`` process on loopback (its own p2pd, its own metrics port),
started in its own process group so that stopping the swarm, or killing one node with ``kill -9``,
never leaves a p2pd behind. Each process writes ``NAME.out`` (the one-line announcements: metrics
URL, peer id, ``online``) and ``NAME.err`` (logs) in the swarm's work dir.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from node.base import processes, set_parent_death_signal

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


_HANDED_OUT: set[int] = set()


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that is free now, for a node to bind a little later: below the
    kernel's ephemeral range (outgoing connections take their local ports there, and on a busy
    loopback one took a node's metrics port before the node bound it) and never one this process
    handed out before (two nodes of one swarm were given the same port)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(min(10000, low - 1000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no luck below the range: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _HANDED_OUT.add(port)
    return port


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{labels}': value}`` (labels as printed)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels) -> float:
    """Sum of a family's samples whose labels include ``labels``."""
    total = 0.0
    for key, v in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def write_manifest(manifest, path: str | Path) -> Path:
    """Write a ``Manifest`` as a TOML file ``load_manifest`` reads back to an equal manifest (for
    launching swarms on a variant of a shipped run: ``m.replace(sentinel={"enabled": False})``)."""
    from stages import load_manifest, manifest_toml

    path = Path(path)
    path.write_text(manifest_toml(manifest))
    if load_manifest(path) != manifest:
        raise ValueError(f"{path}: the written manifest does not read back equal")
    return path


@dataclass
class NodeProc:
    name: str
    proc: subprocess.Popen
    out: Path
    err: Path
    stage: int | None = None
    metrics_port: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        try:
            return self.out.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def logs(self) -> str:
        try:
            return self.err.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def held_stage(self) -> int | None:
        """The stage it was started with, or (``--stage auto``) the one its output says it holds."""
        if self.stage is not None:
            return self.stage
        m = re.search(r" holds stage (\d+)/", self.output())
        return int(m.group(1)) if m else None


class LocalSwarm:
    """A loopback swarm of separate processes: one bootstrap peer and any number of stage nodes."""

    def __init__(self, manifest: str = "default", workdir: str | Path | None = None,
                 python: str = sys.executable, announce_every: float = 1.0, torch_threads: int = 1,
                 env: dict | None = None, node_args: list[str] | None = None):
        self.manifest = str(manifest)
        from stages import load_manifest

        # an unsigned manifest runs on this machine only, with the flag that says so
        self._unsigned = [] if load_manifest(self.manifest).run.organiser else ["--allow-unsigned"]
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="swarm-node-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.announce_every = announce_every
        self.torch_threads = torch_threads
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.node_args = list(node_args or [])
        self.bootstrap: NodeProc | None = None
        self.initial_peers: list[str] = []
        self.nodes: list[NodeProc] = []
        self._count = 0

    # ---- processes

    def _spawn(self, name: str, argv: list[str]) -> NodeProc:
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        cmd = [self.python, "-m", "node.cli", *argv]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            # its own session (a signal to ours never reaches it; we stop it in order), and SIGTERM
            # when this launcher dies however it dies, so a killed test or benchmark leaves no node
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True, preexec_fn=_die_with_launcher)
        return NodeProc(name, proc, out, err, args=argv)

    def start_bootstrap(self, timeout: float = 60.0, publish_manifest: bool = True) -> list[str]:
        argv = ["bootstrap", "--local"]
        if publish_manifest:
            argv += ["--manifest", self.manifest, *self._unsigned]
        self.bootstrap = self._spawn("bootstrap", argv)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [ln for ln in self.bootstrap.output().splitlines() if ln.startswith("/")]
            if lines and (not publish_manifest or "published the manifest" in self.bootstrap.output()):
                self.initial_peers = lines
                return lines
            if self.bootstrap.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"bootstrap did not come up:\n{self.bootstrap.output()}\n{self.bootstrap.logs()[-3000:]}")

    def start_node(self, stage: int | str, name: str | None = None, *, identity: str | None = None,
                   checkpoint_dir: str | None = None, extra: list[str] | None = None,
                   metrics_port: int | None = None, log_level: str = "INFO") -> NodeProc:
        self._count += 1
        name = name or f"stage{stage}-{self._count}"
        port = metrics_port or free_port()
        argv = ["--log-level", log_level, "run", "--local", *self._unsigned, "--manifest", self.manifest,
                "--stage", str(stage),
                "--metrics-port", str(port), "--announce-every", str(self.announce_every),
                "--torch-threads", str(self.torch_threads)]
        if self.initial_peers:
            argv += ["--initial-peers", *self.initial_peers]
        if identity:
            argv += ["--identity", identity]
        if checkpoint_dir:
            argv += ["--checkpoint-dir", checkpoint_dir]
        argv += self.node_args + list(extra or [])
        node = self._spawn(name, argv)
        node.stage = int(stage) if str(stage).isdigit() else None
        node.metrics_port = port
        self.nodes.append(node)
        return node

    def wait_ready(self, nodes: list[NodeProc] | None = None, timeout: float = 120.0) -> None:
        """Poll ``/readyz`` of ``nodes`` (default: all) until every one is online."""
        pending = list(nodes if nodes is not None else self.nodes)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for n in list(pending):
                if n.proc.poll() is not None:
                    raise RuntimeError(f"{n.name} exited with {n.proc.returncode}:\n{n.output()}\n{n.logs()[-4000:]}")
                if self.ready(n):
                    pending.remove(n)
            if pending:
                time.sleep(0.2)
        if pending:
            names = ", ".join(n.name for n in pending)
            tails = "\n".join(f"--- {n.name}\n{n.logs()[-3000:]}" for n in pending)
            raise TimeoutError(f"not ready after {timeout:.0f} s: {names}\n{tails}")

    # ---- observation

    def ready(self, node: NodeProc) -> bool:
        """Whether ``node`` answers ``/readyz`` with 200 (online) now."""
        return self.get(node, "/readyz")[0] == 200

    def get(self, node: NodeProc, path: str, timeout: float = 3.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(node.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, TimeoutError):
            return 0, ""

    def metrics(self, node: NodeProc) -> dict[str, float]:
        status, text = self.get(node, "/metrics")
        return parse_metrics(text) if status == 200 else {}

    def value(self, node: NodeProc, name: str, **labels) -> float:
        return metric_sum(self.metrics(node), name, **labels)

    def alive(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.proc.poll() is None]

    # ---- stopping

    def stop(self, node: NodeProc, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal ``node`` and wait for it; returns its exit status (None if it did not exit)."""
        if node.proc.poll() is None:
            try:
                node.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            return node.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, node: NodeProc) -> None:
        """``kill -9`` the node's whole process group (the node, its DHT child and its p2pd)."""
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.proc.wait(10)

    def _reap_group(self, node: NodeProc) -> None:
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every process in pipeline order, wait, SIGKILL what is left: the heads first
        (each drains its in-flight microbatches while the stages they pass through still serve),
        then every other node at once, then the bootstrap. ``timeout`` bounds each of the two
        waves. Stopped all at once, a head's drain would wait ``--drain-timeout`` for replies
        from stages already gone."""
        codes: dict[str, int | None] = {n.name: None for n in self.nodes}
        heads = [n for n in self.nodes if n.held_stage() == 0]
        for wave in (heads, [n for n in self.nodes if n not in heads]):
            for n in wave:
                if n.proc.poll() is None:
                    n.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for n in wave:
                try:
                    codes[n.name] = n.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[n.name] = None
        procs = [*self.nodes, *([self.bootstrap] if self.bootstrap else [])]
        if self.bootstrap is not None:
            codes["bootstrap"] = self.stop(self.bootstrap, timeout=max(5.0, timeout))
        for n in procs:
            self._reap_group(n)
            if n.proc.poll() is None:
                n.proc.wait(5)
        if self._own_dir and all(c == 0 for c in codes.values()):
            shutil.rmtree(self.workdir, ignore_errors=True)  # keep the logs of anything that failed
        return codes

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _die_with_launcher() -> None:
    set_parent_death_signal(signal.SIGTERM)


def p2pd_pids_of(pids: list[int]) -> list[int]:
    """Running p2pd processes whose session is one of ``pids`` (our nodes are session leaders)."""
    return [p.pid for p in processes() if p.name == b"p2pd" and p.session in pids and p.alive]
