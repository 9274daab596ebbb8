"""node/ops/: operations — the CLI, configuration, doctor, status, metrics, logs, the local
swarm and demo, bootstrap peer, checkpoints, resources and the single-process reference trainer.

The names other rooms may use, each module imported on first use of one of its names."""

from node import lazy_face

# name -> the module that defines it; loaded on first use, so importing this package
# imports nothing heavy (hivemind, py-libp2p) until a name that needs it is used
_EXPORTS = {
    "announce_line": "node.ops.startup",
    "check_port_free": "node.ops.startup",
    "check_signed": "node.ops.startup",
    "fast_exit": "node.ops.startup",
    "uvloop_runner": "node.ops.startup",
    "CheckpointError": "node.ops.checkpoint",
    "CliError": "node.ops.errors",
    "LocalSwarm": "node.ops.local_swarm",
    "AVERAGING_OUTCOMES": "node.ops.metrics",
    "MetricsServer": "node.ops.metrics",
    "NodeMetrics": "node.ops.metrics",
    "PortInUse": "node.ops.metrics",
    "available_device_bytes": "node.ops.resources",
    "estimate_stage_memory": "node.ops.resources",
    "flatten_module": "node.ops.checkpoint",
    "flatten_optimizer": "node.ops.checkpoint",
    "fmt_bytes": "node.ops.resources",
    "load_latest_checkpoint": "node.ops.checkpoint",
    "main": "node.ops.cli",
    "metric_sum": "node.ops.local_swarm",
    "parse_metrics": "node.ops.local_swarm",
    "processes": "node.ops.procs",
    "set_parent_death_signal": "node.ops.procs",
    "resolve_device": "node.ops.resources",
    "restore_module": "node.ops.checkpoint",
    "list_checkpoints": "node.ops.checkpoint",
    "read_checkpoint": "node.ops.checkpoint",
    "read_json_log": "node.ops.logs",
    "restore_optimizer": "node.ops.checkpoint",
    "save_checkpoint": "node.ops.checkpoint",
    "train": "node.ops.train_local",
    "write_manifest": "node.ops.local_swarm",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_face(__name__, _EXPORTS, globals())
