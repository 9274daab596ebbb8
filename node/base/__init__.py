"""node/base/: the floor every other room of ``node`` stands on — the errors (``CliError``,
``CheckpointError``), the checkpoint file format, the directory a new key goes into, the Linux process table and parent-death
signal, and logging setup. It imports no other room of ``node``.

The names other rooms may use, each module imported on first use of one of its names (the
checkpoint format needs torch; importing this package does not)."""

from node import lazy_face

# name -> the module that defines it; loaded on first use
_EXPORTS = {
    "CheckpointError": "node.base.errors",
    "CliError": "node.base.errors",
    "checkpoint_path": "node.base.checkpoint",
    "flatten_module": "node.base.checkpoint",
    "flatten_optimizer": "node.base.checkpoint",
    "list_checkpoints": "node.base.checkpoint",
    "load_latest_checkpoint": "node.base.checkpoint",
    "read_checkpoint": "node.base.checkpoint",
    "restore_module": "node.base.checkpoint",
    "restore_optimizer": "node.base.checkpoint",
    "save_checkpoint": "node.base.checkpoint",
    "ensure_key_directory": "node.base.files",
    "children_of": "node.base.procs",
    "processes": "node.base.procs",
    "set_parent_death_signal": "node.base.procs",
    "read_json_log": "node.base.logs",
    "setup_logging": "node.base.logs",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_face(__name__, _EXPORTS, globals())
