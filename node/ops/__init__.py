"""node/ops/: operations — the subcommands' bodies (configuration, doctor, status, the local
swarm and demo, bootstrap peer, manifest signing, the single-process reference trainer), the
metrics exporter, start-up checks and resources. Above ``node.net`` and ``node.runtime``, below
``node.daemon`` and ``node.cli``.

The names other rooms may use, each module imported on first use of one of its names."""

from node import lazy_face

# name -> the module that defines it; loaded on first use, so importing this package
# imports nothing heavy (hivemind, py-libp2p) until a name that needs it is used
_EXPORTS = {
    "announce_line": "node.ops.startup",
    "check_port_free": "node.ops.startup",
    "check_signed": "node.ops.startup",
    "fast_exit": "node.ops.startup",
    "load_manifest_arg": "node.ops.startup",
    "run_and_exit": "node.ops.startup",
    "sign_manifest": "node.ops.manifest_cmd",
    "uvloop_runner": "node.ops.startup",
    "LocalSwarm": "node.ops.local_swarm",
    "AVERAGING_OUTCOMES": "node.ops.metrics",
    "MetricsServer": "node.ops.metrics",
    "NodeMetrics": "node.ops.metrics",
    "PortInUse": "node.ops.metrics",
    "available_device_bytes": "node.ops.resources",
    "estimate_stage_memory": "node.ops.resources",
    "fmt_bytes": "node.ops.resources",
    "metric_sum": "node.ops.local_swarm",
    "parse_metrics": "node.ops.local_swarm",
    "resolve_device": "node.ops.resources",
    "train": "node.ops.train_local",
    "write_manifest": "node.ops.local_swarm",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_face(__name__, _EXPORTS, globals())
