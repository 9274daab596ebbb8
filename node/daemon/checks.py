"""The start-up of `swarm-node run`, up to the stage it will hold: every check that can fail because
of the operator fails here with one line naming what is wrong and how to fix it (``CliError``),
before anything is left running (``start_up`` stops what it started on the way out).

Its own module because it is a straight line run once, before the event loop, and none of it is
needed once the node serves. The calls into p2pd and the DHT that might hang (a stuck p2pd, a
DHT process that does not answer) are bounded here: ``visible_maddrs`` and ``replicate_p2p``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from node.base import CliError
from node.ops import announce_line, check_port_free, check_signed, load_manifest_arg
from node.ops import config as node_config

log = logging.getLogger("swarm_node.daemon")

REPLICATE_TIMEOUT_S = 30.0  # the node's own connection to the DHT's p2pd (``replicate_p2p``)
MADDRS_TIMEOUT_S = 15.0  # the addresses p2pd listens on, read once at start-up


@dataclass
class StartUp:
    """What the checks hand to the node: the run, the stage it holds, the running DHT."""

    manifest: Any
    index: int  # the stage this node holds
    device: Any  # torch.device
    dht: Any  # node.net's SwarmDHT, running
    membership: Any  # node.net.Membership over ``dht``
    metrics: Any  # node.ops.NodeMetrics
    server: Any  # node.ops.MetricsServer, or None with --metrics-port -1
    peer_id: str
    maddrs: list[str]
    checkpoint: tuple | None = None  # (step, tensors, meta) to resume from


def preflight(cfg: node_config.NodeConfig):
    """The checks that need no network: manifest and its signature, stage number, attack
    permission, identity key, listen ports, device. Returns ``(manifest, device)``."""
    import torch

    from node.net import check_identity
    from node.ops import resolve_device

    manifest = load_manifest_arg(cfg.manifest)
    check_signed(manifest, cfg.manifest, cfg.allow_unsigned, cfg.organiser)
    if cfg.stage != "auto" and int(cfg.stage) >= manifest.n_stages:
        raise CliError(f"--stage {cfg.stage}: the manifest has {manifest.n_stages} stages (0..{manifest.n_stages - 1})")
    if cfg.attack:
        from security import AttackNotAllowed, check_attack_allowed

        try:
            check_attack_allowed(cfg.attack, manifest.sentinel.allow_attacks, cfg.allow_attacks)
        except (AttackNotAllowed, ValueError) as e:
            raise CliError(str(e)) from None
    if cfg.identity:
        check_identity(cfg.identity)  # CliError: missing, world-readable, not a key
    for host, port in node_config.tcp_ports(cfg.host_maddrs):
        check_port_free(host, port, "listen", "--host-maddrs")
    try:
        device = torch.device(resolve_device(cfg.device))
    except ValueError as e:
        raise CliError(str(e)) from None
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    return manifest, device


def start_metrics(cfg: node_config.NodeConfig, manifest):
    """The node's metrics and, unless ``--metrics-port -1``, their HTTP server (started)."""
    from node.ops import MetricsServer, NodeMetrics, PortInUse

    metrics = NodeMetrics(run=manifest.run.id, peer_labels=cfg.peer_labels)
    if cfg.metrics_port < 0:
        return metrics, None
    if cfg.metrics_port:
        check_port_free(cfg.metrics_host, cfg.metrics_port, "metrics", "--metrics-port")
    try:
        server = MetricsServer(metrics, cfg.metrics_host, cfg.metrics_port)
    except PortInUse:
        raise CliError(
            f"metrics port {cfg.metrics_port} on {cfg.metrics_host} is already in use; "
            "choose another with --metrics-port (0: any free port, -1: no metrics)"
        ) from None
    server.start()
    announce_line(f"metrics at {server.url}/metrics (health {server.url}/healthz, ready {server.url}/readyz)")
    return metrics, server


def check_identity_offline(cfg: node_config.NodeConfig) -> None:
    """With ``--identity`` and initial peers: a throwaway daemon asks the swarm whether the key's
    peer id is online already (two nodes with one key would fight over one DHT identity)."""
    from node.net import anonymous_identity_in_use, p2p_options

    if not (cfg.identity and cfg.initial_peers):
        return
    in_use = asyncio.run(anonymous_identity_in_use(
        cfg.identity, cfg.initial_peers, timeout=5.0, startup_timeout=cfg.bootstrap_timeout,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"] if cfg.local else ["/ip4/0.0.0.0/tcp/0"],
        **p2p_options(cfg.local)))
    # None: the check's daemon did not start (e.g. no initial peer answered it); the join that
    # follows retries and, if it fails too, says why in the same one line as without --identity
    if in_use:
        raise CliError(
            f"identity {cfg.identity} is already online in this swarm (another node runs with this key); "
            "stop that node first, or give this one its own key: swarm-node keygen NEWKEY"
        )


def start_dht_or_fail(cfg: node_config.NodeConfig, identity: str, forgeries, manifest=None):
    """The DHT and its p2pd, bootstrapped from ``--initial-peers`` with retries; one line if not.
    With ``manifest``, its validator knows the run's keys (``RunScope``)."""
    from node.net import BootstrapError, IdentityInUse, RunScope, start_dht, start_failure_line

    scope = RunScope.of(manifest) if manifest is not None else None
    try:
        return start_dht(cfg.initial_peers, cfg.host_maddrs, cfg.announce_maddrs, identity, local=cfg.local,
                         retries=cfg.bootstrap_retries, timeout=cfg.bootstrap_timeout, forgeries=forgeries,
                         scope=scope)
    except (BootstrapError, IdentityInUse) as e:
        raise CliError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - p2pd refused to start: say why in one line
        raise CliError(start_failure_line(e, cfg.host_maddrs)) from None


async def _visible_maddrs(dht, node) -> list:
    """In the DHT's process: the addresses its p2pd listens on (shipped there by name, as every
    ``run_coroutine`` function: module level)."""
    return await node.get_visible_maddrs()


def visible_maddrs(dht, timeout: float = MADDRS_TIMEOUT_S) -> list[str]:
    """The addresses p2pd listens on (``hivemind.DHT.get_visible_maddrs``, which waits without a
    bound), or one line naming the call when the DHT does not answer within ``timeout``."""
    from node.net import dht_result

    try:
        return [str(a) for a in dht_result(dht.run_coroutine(_visible_maddrs, return_future=True), timeout,
                                           "address read")]
    except TimeoutError:
        raise CliError(f"the DHT did not report its addresses within {timeout:.0f} s (get_visible_maddrs): "
                       "its p2pd is stuck; restart the node") from None


def join_swarm_manifest(membership, manifest) -> None:
    """The swarm's manifest: ours, or refuse naming the differing fields; publish it if first."""
    from node.net import ManifestMismatch
    from stages import manifest_hash

    try:
        had_manifest = membership.check_and_publish_manifest()
    except (ManifestMismatch, TimeoutError) as e:
        raise CliError(str(e)) from None
    log.info("%s manifest %s of run %s", "joined swarm with" if had_manifest else "published",
             manifest_hash(manifest)[:12], manifest.run.id)


def choose_stage_and_checkpoint(cfg: node_config.NodeConfig, manifest, membership):
    """The stage: forced (``--stage N``), our checkpoint's, or the least served one (``auto``).
    Returns ``(index, checkpoint)``, the checkpoint ``(step, tensors, meta)`` or None."""
    from node.net import choose_stage
    from node.base import CheckpointError, load_latest_checkpoint
    from stages import manifest_hash

    found = None
    if cfg.checkpoint_dir:
        try:
            found = load_latest_checkpoint(cfg.checkpoint_dir)
        except CheckpointError as e:
            raise CliError(f"--checkpoint-dir {cfg.checkpoint_dir}: {e}") from None
    if found is not None:
        ck_step, _, ck_meta = found
        if ck_meta.get("manifest_hash") != manifest_hash(manifest) or ck_meta.get("kind") != "node":
            raise CliError(
                f"--checkpoint-dir {cfg.checkpoint_dir}: its newest checkpoint (step {ck_step}) belongs to another "
                "run or manifest; use an empty directory for this run"
            )
        ck_stage = int(ck_meta.get("stage", -1))
        if cfg.stage != "auto" and int(cfg.stage) != ck_stage:
            raise CliError(
                f"--stage {cfg.stage}: the checkpoint in {cfg.checkpoint_dir} is of stage {ck_stage}; "
                f"use --stage {ck_stage} (or auto) or another --checkpoint-dir"
            )
        return ck_stage, found
    if cfg.stage == "auto":
        try:
            index = choose_stage(membership.peers(), manifest.n_stages)
        except TimeoutError as e:
            raise CliError(f"--stage auto: {e}; name a stage with --stage N, or check --initial-peers") from None
        log.info("--stage auto: chose stage %d of %d", index, manifest.n_stages)
        return index, None
    return int(cfg.stage), None


def check_memory(manifest, index: int, device) -> None:
    """The stage must fit in the device's free memory: the numbers in the error if it does not."""
    from node.ops import available_device_bytes, estimate_stage_memory, fmt_bytes

    need = estimate_stage_memory(manifest, index)
    free = available_device_bytes(str(device))
    if need.total_bytes > free:
        raise CliError(
            f"stage {index} needs about {fmt_bytes(need.total_bytes)} ({need.params:,} parameters: "
            f"{fmt_bytes(need.param_bytes)} with optimizer state, + {fmt_bytes(need.activation_bytes)} "
            f"activations) but {device} has {fmt_bytes(free)} free; use a bigger device or a smaller stage"
        )


@contextmanager
def start_up(cfg: node_config.NodeConfig) -> Iterator[StartUp]:
    """Run every start-up check in order and yield what the node needs; on the way out (the
    node's exit or a failed check) stop the DHT and p2pd, the metrics server, and remove the
    throwaway identity."""
    from node.net import ForgeryCounter, Membership, ephemeral_identity, stop_dht

    manifest, device = preflight(cfg)
    metrics, server = start_metrics(cfg, manifest)
    dht = None
    # every node signs its DHT records with its libp2p key: one without --identity gets a fresh key
    # for this run only, in a private temporary directory removed at exit
    identity = cfg.identity or str(ephemeral_identity())
    forgeries = ForgeryCounter()
    try:
        check_identity_offline(cfg)
        dht = start_dht_or_fail(cfg, identity, forgeries, manifest)
        peer_id = dht.peer_id.to_base58()
        maddrs = visible_maddrs(dht)
        membership = Membership(dht, manifest, ttl=max(4 * cfg.announce_every, 10.0))
        metrics.attach_forgeries(lambda: {
            **{(kind, "rate" if kind == "unread" else "signature"): n for kind, n in forgeries.snapshot().items()},
            **{(kind, "binding"): n for kind, n in membership.forged.items()},
        })
        join_swarm_manifest(membership, manifest)
        index, checkpoint = choose_stage_and_checkpoint(cfg, manifest, membership)
        check_memory(manifest, index, device)
        yield StartUp(manifest, index, device, dht, membership, metrics, server, peer_id, maddrs, checkpoint)
    finally:
        t_stop = time.monotonic()
        if dht is not None:
            stop_dht(dht)
        if server is not None:
            server.close()
        if not cfg.identity:
            shutil.rmtree(os.path.dirname(identity), ignore_errors=True)
        log.info("p2p daemon and DHT stopped in %.1f s", time.monotonic() - t_stop)


async def _listen_maddr(dht, node):
    """In the DHT's process: the control address of its p2pd."""
    return node.p2p.daemon_listen_maddr


async def replicate_p2p(dht, timeout: float = REPLICATE_TIMEOUT_S):
    """The node's own connection to the DHT's p2pd, for the stream transport, bounded by
    ``timeout``: one ``CliError`` line naming the call when it does not come.

    ``hivemind.DHT.replicate_p2p`` asks the DHT's process for p2pd's control address with a
    blocking call on the event loop's thread, which no ``asyncio`` timeout can interrupt; so the
    same two steps are made here, each awaited: the address from the DHT's process, then the
    replica's connection to p2pd (``P2P.replicate``, which identifies itself to p2pd)."""
    from hivemind.p2p import P2P

    async def both():
        maddr = await dht.run_coroutine(_listen_maddr, return_future=True)
        return await P2P.replicate(maddr)

    try:
        return await asyncio.wait_for(both(), timeout)
    except asyncio.TimeoutError:
        raise CliError(f"the DHT's p2p daemon did not give this node a connection within {timeout:g} s "
                       "(replicate_p2p): p2pd is stuck or overloaded; restart the node") from None
    except Exception as e:  # noqa: BLE001 - p2pd gone or refusing: say so in one line
        raise CliError(f"could not connect to the DHT's p2p daemon (replicate_p2p): {e!r}; "
                       "restart the node") from None


__all__ = ["MADDRS_TIMEOUT_S", "REPLICATE_TIMEOUT_S", "StartUp", "check_memory", "choose_stage_and_checkpoint",
           "preflight", "replicate_p2p", "start_up", "visible_maddrs"]
