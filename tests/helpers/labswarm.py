"""``LabSwarm``: ``LocalSwarm``'s processes, each in its own namespace of a :class:`~tests.helpers.netlab.Lab`.

The nodes run as on the internet, not as a loopback swarm: no ``--local``, listening on all
addresses of their namespace (port 31337), NAT traversal and relays as a public node has them, so
the manifest must be signed: the swarm signs its manifest with a fresh organiser key. Metrics are
served on each node's own 127.0.0.1:9100 and read from a thread inside its namespace.

    with Lab() as lab, LabSwarm(lab, "test") as sw:
        sw.start_bootstrap(lab.add_node("boot"))
        head = sw.start_node(0, lab.add_node("a", Link(up_mbit=10, delay_ms=15)))
        sw.start_node(1, lab.add_node("home", nat=True))
        ...
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from node.ops.local_swarm import LocalSwarm, NodeProc, _die_with_launcher
from tests.helpers.netlab import Lab, LabNode

P2P_PORT = 31337
METRICS_PORT = 9100


def signed_manifest(manifest, path: str | Path) -> Path:
    """``manifest`` signed by a fresh organiser key, written to ``path`` (the key is thrown away)."""
    from node.ops import write_manifest
    from node.ops.manifest_cmd import sign_manifest
    from security import OrganiserKey

    return write_manifest(sign_manifest(manifest, OrganiserKey.generate()), path)


class LabSwarm(LocalSwarm):
    def __init__(self, lab: Lab, manifest="test", workdir: str | Path | None = None, **kwargs):
        from stages import load_manifest

        m = load_manifest(manifest) if not hasattr(manifest, "run") else manifest
        self.lab = lab
        self.placement: dict[str, LabNode] = {}
        super().__init__("test", workdir=workdir, **kwargs)
        self.manifest = str(signed_manifest(m, self.workdir / "manifest-signed.toml"))
        self._unsigned = []
        self._spawn_in: LabNode | None = None

    def _spawn(self, name: str, argv: list[str]) -> NodeProc:
        where = self._spawn_in
        if where is None:
            raise RuntimeError("LabSwarm starts processes through start_bootstrap / start_node")
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        cmd = self.lab.command(where, [self.python, "-m", "node.cli", *argv])
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True, preexec_fn=_die_with_launcher)
        where.procs.append(proc)  # the lab kills it too, should the swarm not be closed
        self.placement[name] = where
        return NodeProc(name, proc, out, err, args=argv)

    def start_bootstrap(self, where: LabNode, timeout: float = 60.0, publish_manifest: bool = True,
                        extra: list[str] | None = None) -> list[str]:
        argv = ["bootstrap", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{P2P_PORT}", *(extra or [])]
        if publish_manifest:
            argv += ["--manifest", self.manifest]
        self._spawn_in = where
        try:
            self.bootstrap = self._spawn("bootstrap", argv)
        finally:
            self._spawn_in = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.bootstrap.output()
            lines = [ln for ln in out.splitlines() if ln.startswith("/ip4/") and where.ip in ln]
            if lines and (not publish_manifest or "published the manifest" in out):
                self.initial_peers = lines[:1]
                return self.initial_peers
            if self.bootstrap.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"bootstrap did not come up:\n{self.bootstrap.output()}\n{self.bootstrap.logs()[-3000:]}")

    def start_node(self, stage, where: LabNode, name: str | None = None, *, extra: list[str] | None = None,
                   log_level: str = "INFO", **kwargs) -> NodeProc:  # type: ignore[override]
        self._count += 1
        name = name or f"stage{stage}-{self._count}"
        argv = ["--log-level", log_level, "run", "--manifest", self.manifest, "--stage", str(stage),
                "--host-maddrs", f"/ip4/0.0.0.0/tcp/{P2P_PORT}",
                "--metrics-port", str(METRICS_PORT), "--announce-every", str(self.announce_every),
                "--torch-threads", str(self.torch_threads)]
        if self.initial_peers:
            argv += ["--initial-peers", *self.initial_peers]
        for flag, key in (("--identity", "identity"), ("--checkpoint-dir", "checkpoint_dir")):
            if kwargs.get(key):
                argv += [flag, kwargs[key]]
        argv += self.node_args + list(extra or [])
        self._spawn_in = where
        try:
            node = self._spawn(name, argv)
        finally:
            self._spawn_in = None
        node.stage = int(stage) if str(stage).isdigit() else None
        node.metrics_port = METRICS_PORT
        self.nodes.append(node)
        return node

    def where(self, node: NodeProc) -> LabNode:
        return self.placement[node.name]

    def get(self, node: NodeProc, path: str, timeout: float = 3.0) -> tuple[int, str]:
        def fetch():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}{path}", timeout=timeout) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode(errors="replace")
            except (urllib.error.URLError, OSError, TimeoutError):
                return 0, ""

        return self.lab.call(self.placement[node.name], fetch)
