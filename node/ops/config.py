"""Node configuration: command-line flags > ``SWARM_NODE_*`` environment > TOML file > defaults.

One typed dataclass, ``NodeConfig``, describes a node. Every field has a flag (``--checkpoint-dir``),
an environment variable (``SWARM_NODE_CHECKPOINT_DIR``) and a key in the optional TOML config file
given by ``--config`` (``checkpoint_dir = "..."``). The first source that sets a field wins, in the
order flags, environment, file, defaults; so a config file can be shared by a fleet while one
machine overrides a setting with an environment variable, and a flag overrides both for one run.

Values are typed: a wrong type in any source is an operator mistake and raises
``node.base.CliError`` naming the field and the source (``SWARM_NODE_METRICS_PORT: expected an
integer, got 'abc'``). Unknown keys in the file are errors too, so a typo never silently drops a
setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from node.base import CliError

ENV_PREFIX = "SWARM_NODE_"


@dataclass
class NodeConfig:
    """Everything one `swarm-node run` process needs besides the run manifest itself."""

    manifest: str = "default"  # shipped name (default, test) or a TOML path
    stage: str = "auto"  # "auto" or a stage index
    initial_peers: list[str] = field(default_factory=list)
    identity: str = ""  # libp2p private key file (0600); empty: a fresh identity per start
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    local: bool = False  # loopback only: no NAT port mapping, no relay, no AutoNAT
    metrics_port: int = 9100  # 0: any free port (printed); -1: no metrics server
    metrics_host: str = "127.0.0.1"
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: manifest train.checkpoint_every
    steps: int = 0  # exit cleanly after this many optimizer steps of this node; 0: run until stopped
    max_inflight: int = 0  # microbatches a head keeps in flight; 0: manifest train.max_inflight
    queue_size: int = 8  # inbound fwd/bwd requests waiting for compute before answering busy
    context_ttl: float = 120.0  # seconds an in-flight microbatch context may live
    request_timeout: float = 20.0  # seconds for one fwd/bwd request to be acknowledged
    announce_every: float = 5.0  # seconds between DHT announcements (records live 4x as long)
    drain_timeout: float = 10.0  # seconds SIGTERM waits for in-flight work before leaving
    bootstrap_retries: int = 4  # attempts to reach --initial-peers before giving up
    bootstrap_timeout: float = 15.0  # seconds per bootstrap attempt
    torch_threads: int = 0  # torch intra-op threads; 0: torch's default
    data_shard: int = -1  # head data shard; -1: derived from the peer id
    num_shards: int = 16
    peer_labels: bool = False  # per-peer labels on metrics (cardinality grows with the swarm)
    attack: str = ""  # testing only: corrupt what this node sends (needs allow_attacks)
    allow_attacks: bool = False
    allow_unsigned: bool = False  # LOCAL ONLY: accept a manifest without an organiser signature
    organiser: str = ""  # pin: the run's organiser key fingerprint (16 hex digits); "" = the manifest's own
    seed: int = 0  # local randomness (microbatch ids, routing ties); 0: from the OS
    averaging: bool = True  # background sparse averaging with the other replicas of our stage
    verify_state: bool = True  # take a replica's downloaded weights only when another replica's agree
    json_log: str = ""  # append one JSON object per optimizer step (step, time, tokens, loss, look-ahead) here
    verdict_log: str = ""  # append one JSON object per verifier verdict (peer, direction, distances, fences passed) here

    def stage_index(self) -> int | None:
        """``None`` for ``auto``, else the forced stage index."""
        return None if self.stage == "auto" else int(self.stage)


# field name -> help text for the flag
_HELP = {
    "manifest": "run manifest: a shipped name (default, test) or a TOML file",
    "stage": "pipeline stage to hold: 'auto' (the stage with the least announced capacity) or an index",
    "initial_peers": "multiaddr(s) of peers already in the swarm (e.g. a `swarm-node bootstrap` peer)",
    "identity": "libp2p identity key file (created with `swarm-node keygen`, mode 0600); keeps the peer id",
    "device": "auto, cpu, cuda or cuda:N (bf16 autocast on CUDA)",
    "host_maddrs": "multiaddr(s) to listen on (default /ip4/0.0.0.0/tcp/0)",
    "announce_maddrs": "multiaddr(s) other peers should dial (public address behind a port forward)",
    "local": "loopback-only swarm: listen on 127.0.0.1, no NAT port mapping, relay or AutoNAT",
    "metrics_port": "Prometheus /metrics, /healthz, /readyz port (0: any free port; -1: off)",
    "metrics_host": "address the metrics server binds (0.0.0.0 to let Prometheus on another host scrape)",
    "checkpoint_dir": "directory for checkpoints; a restart resumes from the newest valid one",
    "checkpoint_every": "optimizer steps between checkpoints (0: the manifest's train.checkpoint_every)",
    "steps": "leave cleanly after this many optimizer steps (0: run until stopped)",
    "max_inflight": "microbatches a head keeps in flight (0: the manifest's train.max_inflight)",
    "queue_size": "inbound requests queued for compute before answering 'busy'",
    "context_ttl": "seconds an in-flight microbatch may wait for its gradient before it is dropped",
    "request_timeout": "seconds a peer has to acknowledge a fwd/bwd request",
    "announce_every": "seconds between DHT announcements",
    "drain_timeout": "seconds SIGTERM/SIGINT waits for in-flight work before leaving",
    "bootstrap_retries": "attempts to reach --initial-peers before giving up",
    "bootstrap_timeout": "seconds per bootstrap attempt",
    "torch_threads": "torch intra-op threads (0: torch's default)",
    "data_shard": "data shard a head draws from (-1: derived from the peer id)",
    "num_shards": "number of data shards the training stream is cut into",
    "peer_labels": "label metrics by peer id (off by default: cardinality grows with the swarm)",
    "attack": "TESTING ONLY: corrupt what this node sends with the named attack, NAME or NAME:key=value,... "
              "(needs --allow-attacks)",
    "allow_attacks": "TESTING ONLY: permit --attack",
    "verify_state": "download a joining replica's weights from up to 3 replicas and take them only when a majority agrees (parameter distance and norm ratio) (--no-verify-state: the first replica whose version and epoch agree with the signed records, weights unchecked)",
    "allow_unsigned": "LOCAL SWARMS ONLY: accept an unsigned manifest (refused unless every listen, announce and "
                      "initial-peer address is loopback)",
    "organiser": "pin the run's organiser: the fingerprint of its key (16 hex digits, as `swarm-node manifest "
                 "verify` and the run's organisers print it); a manifest signed by any other key is refused",
    "seed": "local random seed for microbatch ids and routing ties (0: from the OS)",
    "averaging": "average a slice of the weights with the other replicas of this stage (AsyncMesh)",
    "json_log": "append one JSON object per optimizer step (step, time, tokens, loss on the tail, look-ahead) to this file",
    "verdict_log": "append one JSON object per verifier verdict (time, peer, direction, version, verdict, score, "
                   "every distance and those over their fences) to this file",
}

_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}


def _default(name: str) -> Any:
    f = _FIELDS[name]
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _kind(name: str) -> type:
    return type(_default(name))


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per ``NodeConfig`` field. Every default is ``None`` (unset),
    so ``resolve_config`` can tell a flag given on the command line from one left alone."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"TOML file of settings (keys as below, e.g. checkpoint_dir); env {ENV_PREFIX}CONFIG")
    for name in _FIELDS:
        flag = "--" + name.replace("_", "-")
        kind = _kind(name)
        default = _default(name)
        shown = default if default not in ("", []) else "unset"
        help_text = f"{_HELP.get(name, '')} [default {shown}; env {env_name(name)}]"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is list:
            parser.add_argument(flag, dest=name, nargs="+", default=None, metavar="MADDR", help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text,
                                type=str if kind is str else None)


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` from ``source`` (a flag, an env variable or the file) to the field's type."""
    kind = _kind(name)
    where = source
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise CliError(f"{where}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise CliError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise CliError(f"{where}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise CliError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise CliError(f"{where}: expected a number, got {value!r}")
    if kind is list:
        if isinstance(value, str):  # env: comma or whitespace separated
            return [v for v in value.replace(",", " ").split() if v]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise CliError(f"{where}: expected a list of strings, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and name == "stage":
        return str(value)
    if not isinstance(value, str):
        raise CliError(f"{where}: expected a string, got {value!r}")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file of ``NodeConfig`` keys (flat, or under a ``[node]`` table)."""
    p = Path(path).expanduser()
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"--config {path}: no such file") from None
    except OSError as e:
        raise CliError(f"--config {path}: cannot read it ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"--config {path}: not valid TOML ({e})") from None
    if set(data) == {"node"} and isinstance(data["node"], dict):
        data = data["node"]
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            raise CliError(f"--config {path}: unknown key {key!r}; known: {', '.join(sorted(_FIELDS))}")
        out[name] = _coerce(name, value, f"{p}: {key}")
    return out


def resolve_config(args: argparse.Namespace | Mapping[str, Any] | None = None,
                   env: Mapping[str, str] | None = None) -> NodeConfig:
    """Merge flags (``args``; ``None`` values mean unset), environment and config file into a
    validated ``NodeConfig``."""
    flags = dict(vars(args) if isinstance(args, argparse.Namespace) else (args or {}))
    env = os.environ if env is None else env
    config_path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    from_file = load_config_file(config_path) if config_path else {}
    values: dict[str, Any] = {}
    for name in _FIELDS:
        flag = "--" + name.replace("_", "-")
        if flags.get(name) is not None:
            values[name] = _coerce(name, flags[name], flag)
        elif env_name(name) in env:
            values[name] = _coerce(name, env[env_name(name)], env_name(name))
        elif name in from_file:
            values[name] = from_file[name]
        else:
            values[name] = _default(name)
    cfg = NodeConfig(**values)
    validate_config(cfg)
    return cfg


def validate_config(cfg: NodeConfig) -> None:
    """Range checks that do not need the manifest or the network."""
    if cfg.stage != "auto":
        try:
            if int(cfg.stage) < 0:
                raise ValueError
        except ValueError:
            raise CliError(f"--stage: expected 'auto' or a stage index >= 0, got {cfg.stage!r}") from None
        cfg.stage = str(int(cfg.stage))
    if not -1 <= cfg.metrics_port <= 65535:
        raise CliError(f"--metrics-port: expected 0..65535 (or -1 for off), got {cfg.metrics_port}")
    for name in ("queue_size", "bootstrap_retries", "num_shards"):
        if getattr(cfg, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')}: must be positive, got {getattr(cfg, name)}")
    for name in ("checkpoint_every", "steps", "max_inflight", "torch_threads"):
        if getattr(cfg, name) < 0:
            raise CliError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(cfg, name)}")
    for name in ("context_ttl", "request_timeout", "announce_every", "drain_timeout", "bootstrap_timeout"):
        if not getattr(cfg, name) > 0:
            raise CliError(f"--{name.replace('_', '-')}: must be > 0 seconds, got {getattr(cfg, name)}")
    if cfg.data_shard >= cfg.num_shards:
        raise CliError(f"--data-shard: {cfg.data_shard} is not below --num-shards {cfg.num_shards}")
    if not cfg.host_maddrs:
        raise CliError("--host-maddrs: at least one listen multiaddr is needed, e.g. /ip4/0.0.0.0/tcp/31337")
    for m in cfg.host_maddrs + cfg.announce_maddrs + cfg.initial_peers:
        if not m.startswith("/"):
            raise CliError(f"multiaddr {m!r} must start with '/', e.g. /ip4/203.0.113.7/tcp/31337/p2p/Qm...")
    if cfg.local:
        cfg.host_maddrs = [m.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/") for m in cfg.host_maddrs]
    if cfg.allow_unsigned:
        check_local_only(cfg.host_maddrs, cfg.initial_peers, cfg.announce_maddrs)
    cfg.organiser = check_fingerprint(cfg.organiser)


def check_local_only(host_maddrs: list[str], initial_peers: list[str], announce_maddrs: list[str]) -> None:
    """``--allow-unsigned`` (``run`` and ``bootstrap``): every address the node listens on or dials
    is loopback and it announces none; one ``CliError`` naming the first that is not."""
    public = [m for m in list(host_maddrs) + list(initial_peers) if not is_loopback(m)] + list(announce_maddrs)
    if public:
        raise CliError(f"--allow-unsigned is for a swarm on this machine only, but {public[0]} is not a loopback "
                       "address: every --host-maddrs and --initial-peers must be on 127.0.0.1 (or --local), with "
                       "no --announce-maddrs; a public node runs a signed manifest (swarm-node manifest sign)")


def check_fingerprint(value: str) -> str:
    """An ``--organiser`` pin, normalised (lower case); "" stays "" (no pin)."""
    pin = value.strip().lower()
    if pin and (len(pin) != 16 or any(c not in "0123456789abcdef" for c in pin)):
        raise CliError(f"--organiser {value!r}: an organiser fingerprint is 16 hex digits (swarm-node manifest "
                       "verify RUN.toml prints it)")
    return pin


def is_loopback(maddr: str) -> bool:
    """Whether a multiaddr listens on a loopback address only (``/ip4/127.x``, ``/ip6/::1``)."""
    parts = maddr.strip("/").split("/")
    return len(parts) >= 2 and ((parts[0] == "ip4" and parts[1].startswith("127.")) or
                                (parts[0] == "ip6" and parts[1] == "::1"))


def tcp_ports(maddrs: list[str]) -> list[tuple[str, int]]:
    """``(host, port)`` of every ``/ip4|ip6/HOST/tcp/PORT`` multiaddr with a fixed (non-zero) port."""
    out = []
    for m in maddrs:
        parts = m.strip("/").split("/")
        for i in range(len(parts) - 3):
            if parts[i] in ("ip4", "ip6") and parts[i + 2] == "tcp":
                try:
                    port = int(parts[i + 3])
                except ValueError:
                    raise CliError(f"multiaddr {m!r}: tcp port {parts[i + 3]!r} is not a number") from None
                if port:
                    out.append((parts[i + 1], port))
    return out
